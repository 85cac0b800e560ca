"""Intrinsic declarations: operations whose kernel is a hand-written, parameterised template.

An intrinsic is called from the DSL like a function and may return several tensors
(``o, lse = causal_attention(q, k, v)``). Here it is declared as the IR sees it: its operands, how
output types follow from operand types, and its gradient rule, which is itself a call of other
intrinsics, so backward kernels still come from differentiating the IR. How each is launched
(its template and tiles) lives with the schedules (schedule/attention.py, schedule/scatter.py).

    o, lse = causal_attention(q, k, v)     q: [T, H, E]   k, v: [T, G, E]   (G divides H)
        o: [T, H, E] (q's dtype), lse: [T, H] f32, the log-sum-exp of each query's scaled scores;
        every operand may carry a leading batch axis ([B, S, H, E]: B sequences stored back to back)
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
ATTENTION_BWD_PARAMS = ("q", "k", "v", "o", "lse", "do")


def _check_attention(name: str, operands, params: tuple[str, ...]) -> tuple[tuple[str, ...], tuple[str, ...]]:
    """Validate q/k/v (and o, lse, do for the backward); returns q's and k's shapes."""
    if len(operands) != len(params):
        raise IntrinsicError(f"{name} takes {len(params)} operands ({', '.join(params)}), got {len(operands)}")
    by = dict(zip(params, operands))
    for p, (dtype, shape) in by.items():
        if dtype not in FLOAT_DTYPES:
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
    for p, want in (("o", q), ("do", q), ("lse", q[:-1])):
        if p in by and by[p][1] != want:
            raise IntrinsicError(f"{name}: {p} must be [{', '.join(want)}], got [{', '.join(by[p][1])}]")
    return q, k


def _infer_attention(operands):
    q, _ = _check_attention(ATTENTION, operands, ("q", "k", "v"))
    return [(operands[0][0], q), ("f32", q[:-1])]


def _infer_dq(operands):
    q, _ = _check_attention(ATTENTION_DQ, operands, ATTENTION_BWD_PARAMS)
    return [(operands[0][0], q)]


def _infer_dkdv(operands):
    _, k = _check_attention(ATTENTION_DKDV, operands, ATTENTION_BWD_PARAMS)
    return [(operands[1][0], k), (operands[2][0], k)]


def _grad_attention(b: GraphBuilder, call: Node, projs: dict[int, Node], outs: list) -> list:
    """Adjoints of (q, k, v): the dq and dkdv calls over the forward's saved o and lse."""
    d_o, d_lse = outs
    if d_lse is not None:
        raise IntrinsicError(f"{ATTENTION}: lse is not differentiable (it is saved for the backward); "
                             "take a cotangent for o only")
    q, k, v = call.srcs
    (o_type, o_shape), (l_type, l_shape) = _infer_attention([(n.dtype, n.shape) for n in call.srcs])
    o = projs.get(0) or b.node(Op.PROJ, (call,), o_shape, o_type, 0)
    lse = projs.get(1) or b.node(Op.PROJ, (call,), l_shape, l_type, 1)
    operands = (q, k, v, o, lse, d_o)
    dq_call = b.node(Op.INTRINSIC, operands, (), "tuple", ATTENTION_DQ)
    dkdv_call = b.node(Op.INTRINSIC, operands, (), "tuple", ATTENTION_DKDV)
    dq = b.node(Op.PROJ, (dq_call,), q.shape, q.dtype, 0)
    dk = b.node(Op.PROJ, (dkdv_call,), k.shape, k.dtype, 0)
    dv = b.node(Op.PROJ, (dkdv_call,), v.shape, v.dtype, 1)
    return [dq, dk, dv]


register(Intrinsic(ATTENTION, ("q", "k", "v"), ("o", "lse"), _infer_attention, grad=_grad_attention,
                   differentiable_outputs=("o",)))
register(Intrinsic(ATTENTION_DQ, ATTENTION_BWD_PARAMS, ("dq",), _infer_dq))
register(Intrinsic(ATTENTION_DKDV, ATTENTION_BWD_PARAMS, ("dk", "dv"), _infer_dkdv))


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
