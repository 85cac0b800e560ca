"""Causal grouped-query attention as intrinsics: flash-style forward and backward kernels.

    o, lse = causal_attention(q, k, v)        q: [T, H, E]   k, v: [T, G, E]   (G divides H)
    o: [T, H, E] (q's dtype)   lse: [T, H] f32, log-sum-exp of each query's scaled scores

Every operand may carry a leading batch axis ([B, S, H, E] and so on): B independent sequences of
S positions stored one after another (packed rows), run by one dispatch (workgroup z is the
sequence), so short packed sequences fill a big GPU. Sequence b's rows start at b * S.

Roles are positional; the axis names are the caller's. Query head h reads kv head h // (H/G);
scores are q.k / sqrt(E); query t sees keys 0..t. No T x T matrix ever reaches device memory:
the forward keeps a running max and sum per query (online softmax) and saves lse, and the two
backward kernels (FlashAttention-2) recompute probabilities from lse:

    P = exp(S - lse)   D_i = sum_e dO*O   dS = P * (dO V^T - D)
    dQ = dS K / sqrt(E)      (causal_attention_bwd_dq:   a workgroup per query block and head)
    dK = dS^T Q / sqrt(E), dV = P^T dO
                             (causal_attention_bwd_dkdv: a workgroup per key block, kv head and
                              query head of its group; a second pass sums the group's partials
                              in a fixed order, no atomics)

Thread layout (the same in all three kernels): a workgroup owns a block of rows (queries, or keys
for dk/dv); each row is served by ``row_threads`` adjacent invocations. The row being dotted
against the streamed tiles (q; q and dO; k and v) lives whole in named registers, and each of the
row's invocations takes every row_threads-th row of the tile for its dot products, so the dots
are straight-line code over E. Accumulators (o, dq, dk, dv) are split by interleaved columns:
invocation ``part`` owns columns part, part + row_threads, ... (EPT = E / row_threads of them).
Scores of one tile pass through workgroup memory; tiles read with a different row per lane have
their rows padded by one word, so lanes hit different banks.

Block sizes (AttentionTiles) come from ``choose_tiles(mode, E)`` unless the caller passes tiles
(``engine.run(..., tiles=...)``, the autotuner); ``tiles_problem`` holds the rules any tiles must
keep, and ``attention_candidates`` lists the few the autotuner benchmarks.
"""
from __future__ import annotations

import math
from dataclasses import asdict, dataclass

from ..codegen.wgsl import COMPUTE_TYPE
from ..ir.autodiff import AutodiffError, GraphBuilder
from ..ir.nodes import Node
from ..ir.ops import FLOAT_DTYPES, Op
from ..schedule.contraction import REDUCE_THREADS
from ..schedule.spec import buffer_var, extent, strides
from . import Intrinsic, IntrinsicCall, IntrinsicError, register

WORKGROUP_BYTES = 16384      # portable maxComputeWorkgroupStorageSize
MAX_THREADS = 256            # portable maxComputeInvocationsPerWorkgroup
MAX_HEAD_DIM = 128
TARGET_THREADS = 128         # invocations per workgroup to aim for
SLICE_COLUMNS = 16           # accumulator columns per invocation to aim for (E / row_threads)
MIN_THREADS = 64             # fewest invocations per workgroup an autotuning candidate has
MAX_CANDIDATES = 8           # autotuning candidates per (mode, head dim)

FWD = "causal_attention"
BWD_DQ = "causal_attention_bwd_dq"
BWD_DKDV = "causal_attention_bwd_dkdv"
TEMPLATES = ("attention_fwd", "attention_bwd")   # their contexts carry "mode" and "head_dim"


# ---- shapes ----

def _check(name: str, operands, params: tuple[str, ...]) -> tuple[tuple[str, ...], tuple[str, ...]]:
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


def _infer_fwd(operands):
    q, _ = _check(FWD, operands, ("q", "k", "v"))
    return [(operands[0][0], q), ("f32", q[:-1])]


def _infer_dq(operands):
    q, _ = _check(BWD_DQ, operands, BWD_PARAMS)
    return [(operands[0][0], q)]


def _infer_dkdv(operands):
    _, k = _check(BWD_DKDV, operands, BWD_PARAMS)
    return [(operands[1][0], k), (operands[2][0], k)]


BWD_PARAMS = ("q", "k", "v", "o", "lse", "do")


# ---- gradient rule ----

def _grad(b: GraphBuilder, call: Node, projs: dict[int, Node], outs: list) -> list:
    """Adjoints of (q, k, v): the dq and dkdv calls over the forward's saved o and lse."""
    d_o, d_lse = outs
    if d_lse is not None:
        raise AutodiffError(f"{FWD}: lse is not differentiable (it is saved for the backward); "
                            "take a cotangent for o only")
    q, k, v = call.srcs
    (o_type, o_shape), (l_type, l_shape) = _infer_fwd([(n.dtype, n.shape) for n in call.srcs])
    o = projs.get(0) or b.node(Op.PROJ, (call,), o_shape, o_type, 0)
    lse = projs.get(1) or b.node(Op.PROJ, (call,), l_shape, l_type, 1)
    operands = (q, k, v, o, lse, d_o)
    dq_call = b.node(Op.INTRINSIC, operands, (), "tuple", BWD_DQ)
    dkdv_call = b.node(Op.INTRINSIC, operands, (), "tuple", BWD_DKDV)
    dq = b.node(Op.PROJ, (dq_call,), q.shape, q.dtype, 0)
    dk = b.node(Op.PROJ, (dkdv_call,), k.shape, k.dtype, 0)
    dv = b.node(Op.PROJ, (dkdv_call,), v.shape, v.dtype, 1)
    return [dq, dk, dv]


# ---- tiling ----

@dataclass(frozen=True)
class AttentionTiles:
    """Block sizes of one attention kernel; ``tiles_problem`` states the rules they must keep.

    rows: rows a workgroup owns (queries; keys for dkdv); tile: rows streamed per step (keys;
    queries for dkdv); row_threads: invocations per owned row; threads = rows * row_threads.
    """
    rows: int
    tile: int
    row_threads: int

    @property
    def threads(self) -> int:
        return self.rows * self.row_threads


def _row_threads(e: int) -> int:
    """Invocations per row: enough that each owns about SLICE_COLUMNS accumulator columns (at most 8)."""
    s = 1
    while s < 8 and e % (2 * s) == 0 and e // (2 * s) >= SLICE_COLUMNS:
        s *= 2
    return s


def workgroup_words(mode: str, t: AttentionTiles, e: int) -> int:
    """f32 words of workgroup memory the template declares for ``mode`` (fwd, dq, dkdv)."""
    if mode == "fwd":      # k tile [tile][E+1], v tile [tile][E], scores [rows][tile+1]
        return t.tile * (e + 1) + t.tile * e + t.rows * (t.tile + 1)
    if mode == "dq":       # k, v tiles [tile][E+1], dS [rows][tile+1]
        return 2 * t.tile * (e + 1) + t.rows * (t.tile + 1)
    # q, dO tiles [tile][E+1], P and dS [rows][tile+1], lse [tile], D partial sums [threads]
    return 2 * t.tile * (e + 1) + 2 * t.rows * (t.tile + 1) + t.tile + t.threads


def tiles_problem(mode: str, t: AttentionTiles, e: int) -> str | None:
    """The first rule of the ``mode`` template that ``t`` breaks at head dim ``e``; None if it keeps
    them all. Tiles that break one would compute garbage or fail to build, so they are refused."""
    if not all(isinstance(v, int) and v >= 1 for v in (t.rows, t.tile, t.row_threads)):
        return "rows, tile and row_threads must be positive integers"
    if e % t.row_threads:
        return f"row_threads must divide the head dim {e} (each invocation owns E / row_threads columns)"
    if t.tile % t.row_threads:
        return "row_threads must divide tile (each invocation of a row takes tile / row_threads of its rows)"
    if t.threads > MAX_THREADS:
        return f"rows * row_threads = {t.threads} invocations, expected at most {MAX_THREADS}"
    if mode == "dkdv" and t.threads % t.tile:
        return (f"tile must divide rows * row_threads = {t.threads} "
                "(threads / tile invocations sum each query's D = dO.O)")
    need = 4 * workgroup_words(mode, t, e)
    if need > WORKGROUP_BYTES:
        return f"{need} bytes of workgroup memory, expected at most {WORKGROUP_BYTES}"
    return None


def check_tiles(name: str, mode: str, t: AttentionTiles, e: int) -> None:
    """Raise an IntrinsicError (a ValueError) naming the tiles and the rule they break."""
    problem = tiles_problem(mode, t, e)
    if problem is not None:
        raise IntrinsicError(f"{name}: tiles {t} do not fit the {mode} template at head dim {e}: {problem}")


def choose_tiles(mode: str, e: int) -> AttentionTiles:
    """Rows per workgroup for about TARGET_THREADS invocations, then the largest streamed tile
    (at most 64) that keeps the template's rules (workgroup memory within the portable 16 KiB)."""
    s = _row_threads(e)
    rows = max(16, min(64, TARGET_THREADS // s))
    tile = 64
    while tile > 1:
        t = AttentionTiles(rows, tile, s)
        if tiles_problem(mode, t, e) is None:
            return t
        tile //= 2
    raise IntrinsicError(f"no attention tiling for head dim {e} fits {WORKGROUP_BYTES} bytes")


def attention_candidates(mode: str, e: int) -> tuple[AttentionTiles, ...]:
    """What the autotuner tries for ``mode`` at head dim ``e``: choose_tiles' pick first, then the
    valid tiles of a small grid nearest it (row_threads, then threads per workgroup), with at least
    MIN_THREADS invocations, MAX_CANDIDATES in all, so tuning stays quick."""
    default = choose_tiles(mode, e)
    grid = {AttentionTiles(r, t, s) for r in {16, 32, 64, default.rows} for t in {16, 32, 64, default.tile}
            for s in {1, 2, 4, 8, default.row_threads}}
    fits = [t for t in grid if t != default and t.threads >= MIN_THREADS and tiles_problem(mode, t, e) is None]

    def distance(t: AttentionTiles):
        return (abs(math.log2(t.row_threads / default.row_threads)), abs(math.log2(t.threads / TARGET_THREADS)),
                -t.tile, t.rows, t.row_threads)
    return (default, *sorted(fits, key=distance)[:MAX_CANDIDATES - 1])


# ---- plans ----

def _tensor(arg, sizes: dict[str, int], roles: tuple[str, ...], accumulate=frozenset()) -> dict:
    """A binding as the template sees it: name, storage type, strides by role, conversions. A batch
    axis needs no stride of its own: sequences are stored back to back, a sequence length apart."""
    st = strides(arg.shape, sizes)
    return {"name": buffer_var(arg.name), "elem": arg.dtype, "convert": COMPUTE_TYPE[arg.dtype] != arg.dtype,
            "strides": {role: st[axis] for role, axis in zip(roles, arg.shape[-len(roles):])},
            "accumulate": arg.name in accumulate}


def _sizes(call: IntrinsicCall) -> tuple[int, int, int, int, int, str]:
    """(batch, T, H, G, E, T's extent expression) of a call."""
    q, k = call.operands[0], call.operands[1]
    t, h, e = (call.sizes[a] for a in q.shape[-3:])
    g = call.sizes[k.shape[-2]]
    batch = call.sizes[q.shape[0]] if len(q.shape) == 4 else 1
    if h % g:
        raise IntrinsicError(f"{call.name}: the {h} query heads ({q.shape[-2]}) must split evenly over "
                             f"the {g} kv heads ({k.shape[-2]})")
    if e > MAX_HEAD_DIM:
        raise IntrinsicError(f"{call.name}: head dim {q.shape[-1]}={e} is over the supported {MAX_HEAD_DIM}")
    return batch, t, h, g, e, extent(q.shape[-3], call.sizes)


def _context(call: IntrinsicCall, mode: str, params: tuple[str, ...], outputs: tuple[str, ...]):
    batch, t, h, g, e, t_ext = _sizes(call)
    tiles = call.tiles or choose_tiles(mode, e)
    check_tiles(call.name, mode, tiles, e)
    roles = {"q": ("t", "h", "e"), "k": ("t", "h", "e"), "v": ("t", "h", "e"), "o": ("t", "h", "e"),
             "do": ("t", "h", "e"), "lse": ("t", "h"), "dq": ("t", "h", "e"), "dk": ("t", "h", "e"),
             "dv": ("t", "h", "e")}
    tensors = {p: _tensor(a, call.sizes, roles[p]) for p, a in zip(params, call.operands)}
    for p, a in zip(outputs, call.outputs):
        tensors[p] = _tensor(a, call.sizes, roles[p], call.accumulate) if a is not None else None
    ctx = {"mode": mode, "tiles": asdict(tiles), "threads": tiles.threads, "ept": e // tiles.row_threads,
           "head_dim": e, "heads": h, "kv_heads": g, "group": h // g, "t_ext": t_ext,
           "scale": repr(1.0 / math.sqrt(e)), "smem_bytes": 4 * workgroup_words(mode, tiles, e), **tensors}
    blocks = -(-t // tiles.rows)
    return ctx, (blocks, h if mode != "dkdv" else g, batch)


def _plan_fwd(call: IntrinsicCall):
    ctx, groups = _context(call, "fwd", ("q", "k", "v"), ("o", "lse"))
    return "attention_fwd", ctx, groups


def _plan_dq(call: IntrinsicCall):
    ctx, groups = _context(call, "dq", BWD_PARAMS, ("dq",))
    return "attention_bwd", ctx, groups


def _plan_dkdv(call: IntrinsicCall):
    """One workgroup per (key block, kv head, query head of its group), so a group's heads run in
    parallel rather than one after another (a short sequence otherwise leaves most of a big GPU
    idle); their partial dk, dv meet in a workspace and a second pass sums them in a fixed order."""
    ctx, (blocks, kv_heads, batch) = _context(call, "dkdv", BWD_PARAMS, ("dk", "dv"))
    split = ctx["group"]
    ctx.update(split=split, batch=batch)
    if split > 1:
        t_pad = call.sizes[call.operands[0].shape[-3]]
        elements = batch * t_pad * kv_heads * ctx["head_dim"]
        ctx.update(t_pad=t_pad, workspace=2 * split * elements, entry_points=["main", "reduce"],
                   extra_bindings=[{"name": "ws_", "elem": "f32"}], reduce_threads=REDUCE_THREADS,
                   reduce_workgroups=-(-elements // REDUCE_THREADS))
    return "attention_bwd", ctx, (blocks, kv_heads, batch * split)


register(Intrinsic(FWD, ("q", "k", "v"), ("o", "lse"), _infer_fwd, _plan_fwd, grad=_grad,
                   differentiable_outputs=("o",), tiles=AttentionTiles))
register(Intrinsic(BWD_DQ, BWD_PARAMS, ("dq",), _infer_dq, _plan_dq, tiles=AttentionTiles))
register(Intrinsic(BWD_DKDV, BWD_PARAMS, ("dk", "dv"), _infer_dkdv, _plan_dkdv, tiles=AttentionTiles))
