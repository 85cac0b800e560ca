"""Intrinsic declarations: operations whose kernel is a hand-written, parameterised template.

An intrinsic is called from the DSL like a function and may return several tensors
(``o, lse = causal_attention(q, k, v)``). Here it is declared as the IR sees it: its operands, how
output types follow from operand types, and its gradient rule, which is itself a call of other
intrinsics, so backward kernels still come from differentiating the IR. How each is launched
(its template and tiles) lives with the schedules (schedule/attention.py, schedule/scatter.py).

    o, lse = causal_attention(q, k, v)     q: [T, H, E]   k, v: [T, G, E]   (G divides H)
        o: [T, H, E] (q's dtype), lse: [T, H] f32, the log-sum-exp of each query's scaled scores;
        every operand may carry a leading batch axis ([B, S, H, E]: B sequences stored back to back)
    o, lse = causal_attention(q, k, v, starts)     starts: i32[T] (or [B, T])
        sequences concatenated in one row: starts[t] is where row t's sequence starts (nondecreasing,
        starts[t] <= t), and query t sees keys starts[t]..t only; no gradient reaches starts
    Its backward: dq = causal_attention_bwd_dq(q, k, v, o, lse, dO[, starts]) and
        dk, dv = causal_attention_bwd_dkdv(q, k, v, stats, dO[, starts]), stats: f32[T, 2, H] the lse
        and D = sum(dO * O, E) of each query stacked (plain IR before the call), so that dk/dv binds
        8 storage buffers with starts, WebGPU's default limit
    dE = embedding_grad(g, order, bounds, rows)     g: [T, D]   order, rows: i32[T]   bounds: i32[T, 2]
        the embedding table's gradient as a deterministic scatter-add (only ever added into)
    y = dropout(x, key)     x: float [T, D]   key: i32[4]
        x with elements zeroed or scaled by a mask drawn from key, the same mask for every call with
        that key (so the gradient is dropout(dy, key)); schedule/dropout.py states the generator
    values, indices = topk(x, K)     x: float [T, E] (any value, e.g. scores + bias)   K: an axis name or an integer, K <= E
        values [T, K] (x's dtype) in descending order, indices i32[T, K]; equal values: lower index
        first; NaN ranks above +inf, -0 equals +0 (schedule/topk.py). The gradient flows through the
        picked values only: dx[t, e] = sum over j of dvalues[t, j] where indices[t, j] == e
    order, offsets = bucket_sort(ids, V)     ids: i32 or u32 [N...]   V: an axis name or an integer
        order [N...] i32: the flat positions grouped by key, stable (by position within a key);
        offsets i32[V + 1]: exclusive prefix sums of the per-key counts, so key v's positions are
        order[offsets[v] : offsets[v + 1]]. A key outside [0, V) goes after every key in range, in
        position order (order[offsets[V]:] holds them); deterministic (schedule/sort.py)
    rows = segment_sum(g, order, offsets)     g: float [N..., D...]   order: i32[N...]   offsets: i32[V + 1]
        rows [V, D...]: row v sums g's rows at order[offsets[v] : offsets[v + 1]] in that order (zero
        for an empty key), so repeated runs are bit-identical; gather's adjoint in its table is
        segment_sum(dy, bucket_sort(ids, V)) (ir/grad.py)
    y = grouped_matmul(x, w, ends)     x: float [S, K]   w: float [E, N, K]   ends: i32[E]
        a mixture of experts' products: y[s] = x[s] w[e]^T for the rows s of expert e, ends[e-1] <= s
        < ends[e] (ends[-1] = 0: rows sorted by expert, ends the running sum of the experts' row
        counts, on the device); y: [S, N], f32 if x or w is; rows past ends[E-1] are left as they were
        (schedule/grouped.py). Its gradient is grouped_matmul_dx and grouped_matmul_dw
    y = grouped_matmul_scaled(x, w, ends, scale)     scale: float [S]
        the same with y[s] *= scale[s] in the epilogue (each slot's combine weight); its gradient
        takes g = grouped_matmul_dx(dy, w, ends) once: dx = g * scale, d scale = sum(g * x, K)
    dx = grouped_matmul_dx(dy, w, ends)     dy: [S, N] -> dx: [S, K], dx[s] = dy[s] w[e]
    dw = grouped_matmul_dw(dy, x, ends)     dy: [S, N], x: [S, K] -> dw: [E, N, K], dw[e] the sum over
        e's rows of dy[s]^T x[s], in row order (deterministic); an empty expert's is zero

An intrinsic with axis arguments (topk's K, bucket_sort's V) carries them as its INTRINSIC node's
shape, so the kernel sizes them like any axis and the planner finds them without its outputs.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

from .graph import GraphBuilder
from .nodes import SEQ_AXIS, KernelIR, Node, TensorArg
from .ops import FLOAT_DTYPES, Op
from .shapes import minus_one, plus_one


class IntrinsicError(ValueError):
    """Operands that an intrinsic cannot take; the message says which and what was expected."""


@dataclass(frozen=True)
class Intrinsic:
    name: str
    params: tuple[str, ...]
    outputs: tuple[str, ...]
    # operand (dtype, shape)s -> output (dtype, shape)s; raises IntrinsicError
    infer: Callable[[list[tuple[str, tuple[str, ...]]]], list[tuple[str, tuple[str, ...]]]]
    # (GraphBuilder, INTRINSIC node, its PROJ nodes by output index, adjoint per output or None)
    # -> adjoint per operand or None, built from other intrinsic calls; None when not differentiable
    grad: Callable | None = None
    differentiable_outputs: tuple[str, ...] = field(default=())
    # outputs the template only adds into (a scatter): callers must pass them and accumulate
    adds_only: bool = False
    # trailing arguments that name or size an axis (topk's K); infer then takes them as a second argument
    axes: tuple[str, ...] = ()
    # operands may be any value of the kernel, not only its inputs (partition computes them first)
    computed_operands: bool = False
    # operands the planner computes in its GEMM's operand fetch when they are prologues
    # (ir.partition.is_prologue: a weight decoded from a packed format), never stored whole
    prologue: tuple[str, ...] = ()
    # how many trailing params a call may leave out (causal_attention's starts)
    optional: int = 0


REGISTRY: dict[str, Intrinsic] = {}


def register(intrinsic: Intrinsic) -> Intrinsic:
    if intrinsic.name in REGISTRY:
        raise RuntimeError(f"intrinsic {intrinsic.name!r} registered twice")
    REGISTRY[intrinsic.name] = intrinsic
    return intrinsic


def get(name: str) -> Intrinsic | None:
    return REGISTRY.get(name)


def names() -> list[str]:
    return sorted(REGISTRY)


def call_nodes(intrinsic: Intrinsic, operands: list[Node], axes: tuple[str, ...] = ()) -> list[Node]:
    """The IR of one call: an INTRINSIC node over the operands (its shape: the axis arguments) and
    one PROJ node per output."""
    types = [(n.dtype, n.shape) for n in operands]
    results = intrinsic.infer(types, tuple(axes)) if intrinsic.axes else intrinsic.infer(types)
    call = Node(Op.INTRINSIC, tuple(operands), tuple(axes), "tuple", intrinsic.name)
    return [Node(Op.PROJ, (call,), shape, dtype, i) for i, (dtype, shape) in enumerate(results)]


def kernel_ir(name: str, intrinsic: str, inputs: list[TensorArg], outputs: list[str],
              axes: tuple[str, ...] = ()) -> KernelIR:
    """A kernel whose body is ``outputs... = intrinsic(inputs..., axes...)``, built without DSL source."""
    intr = get(intrinsic)
    if intr is None:
        raise IntrinsicError(f"no intrinsic named {intrinsic!r}; known: {', '.join(names())}")
    operands = [Node(Op.INPUT, (), t.shape, t.dtype, t.name) for t in inputs]
    projs = call_nodes(intr, operands, axes)
    if len(outputs) != len(projs):
        raise IntrinsicError(f"{intrinsic} returns {len(projs)} values ({', '.join(intr.outputs)}), "
                             f"got {len(outputs)} names")
    results = dict(zip(outputs, projs))
    fixed = {a: int(a) for p in projs for a in p.shape if a.isdigit()}
    return KernelIR(name, tuple(inputs), (), tuple(TensorArg(n, p.dtype, p.shape) for n, p in results.items()),
                    results, fixed_dims=fixed)


# ---- causal_attention and its backward kernels ----

ATTENTION = "causal_attention"
ATTENTION_DQ = "causal_attention_bwd_dq"
ATTENTION_DKDV = "causal_attention_bwd_dkdv"
ATTENTION_DQ_PARAMS = ("q", "k", "v", "o", "lse", "do")
ATTENTION_DKDV_PARAMS = ("q", "k", "v", "stats", "do")
STATS_AXIS = "2"        # stats [B?, T, 2, H]: lse at 0, D = dO . O at 1
STARTS = "starts"       # the optional last operand of all three: i32[B?, T], each row's sequence start


def _check_attention(name: str, operands, params: tuple[str, ...]) -> tuple[tuple[str, ...], tuple[str, ...]]:
    """Validate q/k/v (and o, lse or stats, do for the backward), and starts where given; returns q's and k's
    shapes."""
    if len(operands) not in (len(params), len(params) + 1):
        raise IntrinsicError(f"{name} takes {len(params)} operands ({', '.join(params)}) and optionally "
                             f"{STARTS}, got {len(operands)}")
    by = dict(zip(params + (STARTS,), operands))
    for p, (dtype, shape) in by.items():
        if p != STARTS and dtype not in FLOAT_DTYPES:
            raise IntrinsicError(f"{name}: {p} must be a float tensor, got {dtype}")
    (_, q), (_, k), (_, v) = by["q"], by["k"], by["v"]
    if len(q) not in (3, 4):
        raise IntrinsicError(f"{name}: q must be [T, H, E] or [B, T, H, E], got [{', '.join(q)}]")
    if len(k) != len(q) or len(v) != len(q):
        want = "[T, G, E]" if len(q) == 3 else "[B, T, G, E]"
        raise IntrinsicError(f"{name}: k and v must be {want} like q, got [{', '.join(k)}] and [{', '.join(v)}]")
    if k != v:
        raise IntrinsicError(f"{name}: k and v must have the same shape, got [{', '.join(k)}] and [{', '.join(v)}]")
    if k[:-3] != q[:-3]:
        raise IntrinsicError(f"{name}: q and k must share the batch axis, got {q[0]} and {k[0]}")
    if k[-3] != q[-3]:
        raise IntrinsicError(f"{name}: q and k must share the sequence axis, got {q[-3]} and {k[-3]}")
    if k[-1] != q[-1]:
        raise IntrinsicError(f"{name}: q and k must share the head-dim axis, got {q[-1]} and {k[-1]}")
    for p, want in (("o", q), ("do", q), ("lse", q[:-1]), ("stats", q[:-2] + (STATS_AXIS, q[-2]))):
        if p in by and by[p][1] != want:
            raise IntrinsicError(f"{name}: {p} must be [{', '.join(want)}], got [{', '.join(by[p][1])}]")
    if STARTS in by and (by[STARTS][0] != "i32" or by[STARTS][1] != q[:-2]):
        raise IntrinsicError(f"{name}: {STARTS} must be i32[{', '.join(q[:-2])}] (each row's sequence start), "
                             f"got {by[STARTS][0]}[{', '.join(by[STARTS][1])}]")
    return q, k


def _infer_attention(operands):
    q, _ = _check_attention(ATTENTION, operands, ("q", "k", "v"))
    return [(operands[0][0], q), ("f32", q[:-1])]


def _infer_dq(operands):
    q, _ = _check_attention(ATTENTION_DQ, operands, ATTENTION_DQ_PARAMS)
    return [(operands[0][0], q)]


def _infer_dkdv(operands):
    _, k = _check_attention(ATTENTION_DKDV, operands, ATTENTION_DKDV_PARAMS)
    return [(operands[1][0], k), (operands[2][0], k)]


def _grad_attention(b: GraphBuilder, call: Node, projs: dict[int, Node], outs: list) -> list:
    """Adjoints of (q, k, v): the dq and dkdv calls over the forward's saved o and lse (dkdv's as
    stats: lse and D = sum(dO * O, E) stacked, one binding for both)."""
    d_o, d_lse = outs
    if d_lse is not None:
        raise IntrinsicError(f"{ATTENTION}: lse is not differentiable (it is saved for the backward); "
                             "take a cotangent for o only")
    q, k, v, *starts = call.srcs
    (o_type, o_shape), (l_type, l_shape) = _infer_attention([(n.dtype, n.shape) for n in call.srcs])
    o = projs.get(0) or b.node(Op.PROJ, (call,), o_shape, o_type, 0)
    lse = projs.get(1) or b.node(Op.PROJ, (call,), l_shape, l_type, 1)
    e = q.shape[-1]
    d = b.sum(b.mul(b.cast(d_o, "f32"), b.cast(o, "f32")), e)                       # (.., T, H) D = dO . O
    stats_shape = l_shape[:-1] + (STATS_AXIS,) + l_shape[-1:]
    stats = b.add(*(b.node(Op.EMBED, (x,), stats_shape, "f32", (STATS_AXIS, i)) for i, x in enumerate((lse, d))))
    dq_call = b.node(Op.INTRINSIC, (q, k, v, o, lse, d_o, *starts), (), "tuple", ATTENTION_DQ)
    dkdv_call = b.node(Op.INTRINSIC, (q, k, v, stats, d_o, *starts), (), "tuple", ATTENTION_DKDV)
    dq = b.node(Op.PROJ, (dq_call,), q.shape, q.dtype, 0)
    dk = b.node(Op.PROJ, (dkdv_call,), k.shape, k.dtype, 0)
    dv = b.node(Op.PROJ, (dkdv_call,), v.shape, v.dtype, 1)
    return [dq, dk, dv, *(None for _ in starts)]     # positions get no gradient


register(Intrinsic(ATTENTION, ("q", "k", "v", STARTS), ("o", "lse"), _infer_attention, grad=_grad_attention,
                   differentiable_outputs=("o",), optional=1))
register(Intrinsic(ATTENTION_DQ, ATTENTION_DQ_PARAMS + (STARTS,), ("dq",), _infer_dq, optional=1))
register(Intrinsic(ATTENTION_DKDV, ATTENTION_DKDV_PARAMS + (STARTS,), ("dk", "dv"), _infer_dkdv, optional=1))


# ---- embedding_grad ----

EMBEDDING_GRAD = "embedding_grad"


def _infer_embedding_grad(operands):
    if len(operands) != 4:
        raise IntrinsicError(f"{EMBEDDING_GRAD} takes 4 operands (g, order, bounds, rows), got {len(operands)}")
    (gd, g), (od, order), (bd, bounds), (rd, rows) = operands
    if len(g) != 2 or gd not in FLOAT_DTYPES:
        raise IntrinsicError(f"{EMBEDDING_GRAD}: g must be a float [T, D], got {gd}[{', '.join(g)}]")
    if (od, order) != ("i32", g[:1]) or (rd, rows) != ("i32", g[:1]):
        raise IntrinsicError(f"{EMBEDDING_GRAD}: order and rows must be i32[{g[0]}]")
    if bd != "i32" or len(bounds) != 2 or bounds[0] != g[0]:
        raise IntrinsicError(f"{EMBEDDING_GRAD}: bounds must be i32[{g[0]}, 2], got {bd}[{', '.join(bounds)}]")
    return [(gd, ("V", g[1]))]


register(Intrinsic(EMBEDDING_GRAD, ("g", "order", "bounds", "rows"), ("dE",), _infer_embedding_grad,
                   adds_only=True))


# ---- dropout ----

DROPOUT = "dropout"


def _infer_dropout(operands):
    if len(operands) != 2:
        raise IntrinsicError(f"{DROPOUT} takes 2 operands (x, key), got {len(operands)}")
    (xd, x), (kd, key) = operands
    if xd not in FLOAT_DTYPES or len(x) != 2:
        raise IntrinsicError(f"{DROPOUT}: x must be a float [T, D], got {xd}[{', '.join(x)}]")
    if kd != "i32" or key != ("4",):
        raise IntrinsicError(f"{DROPOUT}: key must be i32[4] (two seed words, the drop threshold, the scale's "
                             f"bits), got {kd}[{', '.join(key)}]")
    return [(xd, x)]


def _grad_dropout(b: GraphBuilder, call: Node, projs: dict[int, Node], outs: list) -> list:
    """y = x * m for the key's mask m, so dx = dy * m: the same call on dy; the key has no adjoint."""
    x, key = call.srcs
    grad_call = b.node(Op.INTRINSIC, (outs[0], key), (), "tuple", DROPOUT)
    return [b.node(Op.PROJ, (grad_call,), x.shape, x.dtype, 0), None]


register(Intrinsic(DROPOUT, ("x", "key"), ("y",), _infer_dropout, grad=_grad_dropout, differentiable_outputs=("y",)))


# ---- topk ----

TOPK = "topk"


def _infer_topk(operands, axes):
    if len(operands) != 1 or len(axes) != 1:
        raise IntrinsicError(f"{TOPK} takes a tensor and an axis (x, K), got {len(operands)} tensors and "
                             f"{len(axes)} axes")
    ((xd, x),), (k,) = operands, axes
    if xd not in FLOAT_DTYPES:
        raise IntrinsicError(f"{TOPK}: x must be a float tensor [T, E], got {xd}[{', '.join(x)}]")
    if len(x) != 2:
        raise IntrinsicError(f"{TOPK}: x must be [T, E] (rows, then the axis to pick from), got "
                             f"{xd}[{', '.join(x)}] with {len(x)} axes")
    if k in x:
        raise IntrinsicError(f"{TOPK}: K = {k} is already an axis of x [{', '.join(x)}]; name a new axis for the "
                             "k picked per row")
    if k.isdigit() and x[1].isdigit() and int(k) > int(x[1]):
        raise IntrinsicError(f"{TOPK}: K = {k} is larger than x's last axis E = {x[1]}; expected K <= E")
    return [(xd, (x[0], k)), ("i32", (x[0], k))]


def _grad_topk(b: GraphBuilder, call: Node, projs: dict[int, Node], outs: list) -> list:
    """values[t, j] = x[t, indices[t, j]], so dx[t, e] = sum over j of dvalues[t, j] where indices[t, j] == e:
    an equality with index(E), a where and a sum over K, differentiated and scheduled as any IR."""
    d_values, d_indices = outs
    if d_indices is not None:
        raise IntrinsicError(f"{TOPK}: indices are integers and take no cotangent; take one for values only")
    (x,) = call.srcs
    (k,) = call.shape
    rows, e = x.shape
    indices = projs.get(1) or b.node(Op.PROJ, (call,), (rows, k), "i32", 1)
    hit = b.node(Op.EQ, (indices, b.node(Op.INDEX, (), (e,), "i32", e)), (rows, k, e), "i32")
    picked = b.node(Op.WHERE, (hit, d_values, b.const(0)), (rows, k, e), d_values.dtype)
    return [b.node(Op.SUM, (picked,), (rows, e), d_values.dtype, k)]


register(Intrinsic(TOPK, ("x",), ("values", "indices"), _infer_topk, grad=_grad_topk,
                   differentiable_outputs=("values",), axes=("K",), computed_operands=True))


# ---- bucket_sort and segment_sum (gather's adjoint) ----

BUCKET_SORT = "bucket_sort"
SEGMENT_SUM = "segment_sum"


def _infer_bucket_sort(operands, axes):
    if len(operands) != 1 or len(axes) != 1:
        raise IntrinsicError(f"{BUCKET_SORT} takes integer keys and an axis (ids, V), got {len(operands)} tensors "
                             f"and {len(axes)} axes")
    ((idd, ids),), (v,) = operands, axes
    if idd not in ("i32", "u32") or not ids:
        raise IntrinsicError(f"{BUCKET_SORT}: ids must be an i32 or u32 tensor, got {idd}[{', '.join(ids)}]")
    if v == SEQ_AXIS:
        raise IntrinsicError(f"{BUCKET_SORT}: V = {v} is the sequence axis, whose size is bucketed; expected an axis "
                             "of fixed meaning (the number of keys)")
    if v in ids:
        raise IntrinsicError(f"{BUCKET_SORT}: V = {v} is an axis of ids [{', '.join(ids)}]; expected the number of "
                             "keys as an axis of its own")
    return [("i32", ids), ("i32", (plus_one(v),))]


def _infer_segment_sum(operands):
    if len(operands) != 3:
        raise IntrinsicError(f"{SEGMENT_SUM} takes 3 operands (g, order, offsets), got {len(operands)}")
    (gd, g), (od, order), (fd, offsets) = operands
    if gd not in FLOAT_DTYPES:
        raise IntrinsicError(f"{SEGMENT_SUM}: g must be a float tensor, got {gd}[{', '.join(g)}]")
    if od != "i32" or not order or g[:len(order)] != order:
        raise IntrinsicError(f"{SEGMENT_SUM}: order must be i32 over g's leading axes, got {od}[{', '.join(order)}] "
                             f"for g [{', '.join(g)}]")
    v = minus_one(offsets[0]) if fd == "i32" and len(offsets) == 1 else None
    if v is None:
        raise IntrinsicError(f"{SEGMENT_SUM}: offsets must be i32[V + 1] (bucket_sort's), got {fd}[{', '.join(offsets)}]")
    return [(gd, (v,) + g[len(order):])]


register(Intrinsic(BUCKET_SORT, ("ids",), ("order", "offsets"), _infer_bucket_sort, axes=("V",)))
register(Intrinsic(SEGMENT_SUM, ("g", "order", "offsets"), ("rows",), _infer_segment_sum))
# ---- grouped_matmul: the experts of a mixture of experts, over each expert's rows ----

GROUPED_MATMUL = "grouped_matmul"
GROUPED_MATMUL_SCALED = "grouped_matmul_scaled"
GROUPED_MATMUL_DX = "grouped_matmul_dx"
GROUPED_MATMUL_DW = "grouped_matmul_dw"
GROUPED_PARAMS = ("x", "w", "ends")
GROUPED_SCALED_PARAMS = ("x", "w", "ends", "scale")
GROUPED_DX_PARAMS = ("dy", "w", "ends")
GROUPED_DW_PARAMS = ("dy", "x", "ends")


def _shape(dtype: str, shape) -> str:
    return f"{dtype}[{', '.join(shape)}]"


def _check_rows(name: str, operand: str, value, ndim: int, want: str):
    """A float tensor of ``ndim`` axes (the rows first), else an IntrinsicError naming it."""
    dtype, shape = value
    if dtype not in FLOAT_DTYPES or len(shape) != ndim:
        raise IntrinsicError(f"{name}: {operand} must be a float {want}, got {_shape(dtype, shape)}")
    return shape


def _check_ends(name: str, ends, experts: str):
    dtype, shape = ends
    if dtype != "i32" or shape != (experts,):
        raise IntrinsicError(f"{name}: ends must be i32[{experts}] (where each expert's rows end: the running sum "
                             f"of the experts' row counts), got {_shape(dtype, shape)}")


def _wider(*dtypes: str) -> str:
    """f32 where any operand is f32 (a frozen f16 weight keeps f32 activations f32), else f16."""
    return "f32" if "f32" in dtypes else dtypes[0]


def _infer_grouped(name: str, operands, scaled: bool = False, transposed: bool = False):
    """y = x w[e]^T (or x w[e], ``transposed``) for the rows s of each expert e: ends[e-1] <= s < ends[e]."""
    params = GROUPED_DX_PARAMS if transposed else GROUPED_SCALED_PARAMS if scaled else GROUPED_PARAMS
    if len(operands) != len(params):
        raise IntrinsicError(f"{name} takes {len(params)} operands ({', '.join(params)}), got {len(operands)}")
    x_name = params[0]
    s, k = _check_rows(name, x_name, operands[0], 2, "[S, K] (one row per token slot, sorted by expert)")
    e, n, wk = _check_rows(name, "w", operands[1], 3, "[E, N, K] (one [N, K] matrix per expert, as nn.Linear keeps it)")
    contracted = n if transposed else wk
    if contracted != k:
        which = "N (its middle axis)" if transposed else "K (its last axis)"
        raise IntrinsicError(f"{name}: {x_name} [{s}, {k}] and w [{e}, {n}, {wk}] must share the contracted axis: "
                             f"{x_name}'s last axis is {k}, w's {which} is {contracted}")
    _check_ends(name, operands[2], e)
    if scaled:
        sd, sshape = operands[3]
        if sd not in FLOAT_DTYPES or sshape != (s,):
            raise IntrinsicError(f"{name}: scale must be a float [{s}] (each row's combine weight), "
                                 f"got {_shape(sd, sshape)}")
    return [(_wider(operands[0][0], operands[1][0]), (s, wk if transposed else n))]


def _infer_grouped_dw(operands):
    name = GROUPED_MATMUL_DW
    if len(operands) != len(GROUPED_DW_PARAMS):
        raise IntrinsicError(f"{name} takes 3 operands ({', '.join(GROUPED_DW_PARAMS)}), got {len(operands)}")
    s, n = _check_rows(name, "dy", operands[0], 2, "[S, N] (the output's gradient, rows sorted by expert)")
    xs, k = _check_rows(name, "x", operands[1], 2, "[S, K] (the layer's input, rows sorted by expert)")
    if xs != s:
        raise IntrinsicError(f"{name}: dy [{s}, {n}] and x [{xs}, {k}] must share the row axis, got {s} and {xs}")
    dtype, ends = operands[2]
    if dtype != "i32" or len(ends) != 1:
        raise IntrinsicError(f"{name}: ends must be i32[E] (where each expert's rows end), got {_shape(dtype, ends)}")
    return [(_wider(operands[0][0], operands[1][0]), (ends[0], n, k))]


def _grad_grouped(b: GraphBuilder, call: Node, projs: dict[int, Node], outs: list) -> list:
    """y[s] = x[s] w[e]^T (times scale[s]): dx[s] = dy[s] w[e] and dw[e] = sum over e's rows of
    dy[s]^T x[s], each a grouped call; with the scale, g = dy w[e] unscaled gives both dx = g * scale
    and d scale[s] = sum_k g[s, k] x[s, k] (= sum_n dy[s, n] y_unscaled[s, n]), and dw takes dy * scale."""
    (dy,) = outs
    x, w, ends = call.srcs[:3]
    scale = call.srcs[3] if len(call.srcs) > 3 else None
    # products below keep the rows first: dy may arrive as a broadcast (of sum(y, S)'s adjoint [N]),
    # which dy * scale would otherwise lay out as [N, S]
    b.order = (x.shape[0],) + w.shape[1:]

    def result(name: str, *srcs: Node) -> Node:
        """The one result of a call of intrinsic ``name``, typed by its own rule."""
        (dtype, shape), = REGISTRY[name].infer([(s.dtype, s.shape) for s in srcs])
        return b.node(Op.PROJ, (b.node(Op.INTRINSIC, srcs, (), "tuple", name),), shape, dtype, 0)

    def dx_call(g):
        return result(GROUPED_MATMUL_DX, g, w, ends)

    def dw_call(g):
        return result(GROUPED_MATMUL_DW, g, x, ends)
    if scale is None:
        return [dx_call(dy), dw_call(dy), None]
    g = dx_call(dy)
    d_x = b.mul(g, scale)
    d_scale = b.sum(b.mul(g, x), x.shape[1])
    return [d_x, dw_call(b.mul(dy, scale)), None, d_scale]


register(Intrinsic(GROUPED_MATMUL, GROUPED_PARAMS, ("y",), lambda ops: _infer_grouped(GROUPED_MATMUL, ops),
                   grad=_grad_grouped, differentiable_outputs=("y",), computed_operands=True, prologue=("w",)))
register(Intrinsic(GROUPED_MATMUL_SCALED, GROUPED_SCALED_PARAMS, ("y",),
                   lambda ops: _infer_grouped(GROUPED_MATMUL_SCALED, ops, scaled=True),
                   grad=_grad_grouped, differentiable_outputs=("y",), computed_operands=True, prologue=("w",)))
register(Intrinsic(GROUPED_MATMUL_DX, GROUPED_DX_PARAMS, ("dx",),
                   lambda ops: _infer_grouped(GROUPED_MATMUL_DX, ops, transposed=True), computed_operands=True,
                   prologue=("w",)))
register(Intrinsic(GROUPED_MATMUL_DW, GROUPED_DW_PARAMS, ("dw",), _infer_grouped_dw))
