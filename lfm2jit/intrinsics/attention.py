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
                             (causal_attention_bwd_dkdv: a workgroup per key block and kv head,
                              summing over its group's query heads in a fixed order, no atomics)

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
from ..schedule.spec import buffer_var, extent, strides
from . import Intrinsic, IntrinsicCall, IntrinsicError, register

WORKGROUP_BYTES = 16384      # portable maxComputeWorkgroupStorageSize
MAX_THREADS = 256            # portable maxComputeInvocationsPerWorkgroup
MAX_HEAD_DIM = 128
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

    rows: rows a workgroup owns (queries; keys for dkdv), 4 per invocation; tile: rows streamed
    per step (keys; queries for dkdv); groups: invocations sharing 4 owned rows, each taking
    tile / groups streamed rows and E / groups head-dim columns, in vec4 runs.
    threads = rows / 4 * groups.
    """
    rows: int
    tile: int
    groups: int

    @property
    def threads(self) -> int:
        return self.rows // 4 * self.groups


@dataclass(frozen=True)
class Layout:
    """How a kernel's workgroup memory is used at one head dim (see layout())."""
    e_pad: int          # head dim rounded up to whole vec4 runs per invocation
    chunk: int          # head-dim columns per step of the S (and dP) products
    v_rows: int         # streamed rows per step of the row-major products (P v, dS k, P^T dO, dS^T q)
    stage_vec4: int     # the stage array: chunks, row-major chunks and partial sums take turns in it
    smem_bytes: int


def layout(mode: str, t: AttentionTiles, e: int) -> Layout | None:
    """The largest head-dim chunk (16, 8 or 4 columns) and row-major chunk (tile, halved) that fit
    WORKGROUP_BYTES beside the score tiles (P or dS, [tile][rows/4 + 1] vec4s; dkdv keeps both);
    None when nothing fits. Owned and streamed rows are stored with one vec4 of padding per row."""
    unit = 4 * t.groups
    e_pad = -(-e // unit) * unit
    per_chunk_column = (1 if mode == "fwd" else 2) * (t.rows // 4 + 1 + t.tile // 4 + 1)   # q, k (+ dO, v)
    row_major = 2 if mode == "dkdv" else 1                                                # v | k | dO and q
    scores = (2 if mode == "dkdv" else 1) * t.tile * (t.rows // 4 + 1)
    scalars = t.tile + t.threads if mode == "dkdv" else 0                                 # lse, D partial sums
    budget = WORKGROUP_BYTES // 16 - scores - -(-scalars // 4)
    chunk = next((c for c in (16, 8, 4) if e_pad % c == 0 and c * per_chunk_column <= budget), None)
    if chunk is None:
        return None
    v_rows = t.tile
    while v_rows > 1 and row_major * v_rows * e_pad // 4 > budget:
        v_rows //= 2
    stage = max(chunk * per_chunk_column, row_major * v_rows * e_pad // 4, t.threads if mode != "dkdv" else 0)
    if stage > budget or t.tile % v_rows:
        return None
    return Layout(e_pad, chunk, v_rows, stage, 16 * (stage + scores) + 4 * scalars)


def tiles_problem(mode: str, t: AttentionTiles, e: int) -> str | None:
    """The first rule of the ``mode`` template that ``t`` breaks at head dim ``e``; None if it keeps
    them all. Tiles that break one would compute garbage or fail to build, so they are refused."""
    if not all(isinstance(v, int) and v >= 1 for v in (t.rows, t.tile, t.groups)):
        return "rows, tile and groups must be positive integers"
    if t.rows % 4:
        return "rows must be a multiple of 4 (each invocation owns 4 rows)"
    if t.tile % (4 * t.groups):
        return f"tile must be a multiple of 4 * groups = {4 * t.groups} (each invocation takes whole vec4s of it)"
    if t.threads > MAX_THREADS:
        return f"rows / 4 * groups = {t.threads} invocations, expected at most {MAX_THREADS}"
    if mode == "dkdv" and t.threads % t.tile:
        return (f"tile must divide rows / 4 * groups = {t.threads} "
                "(threads / tile invocations sum each query's D = dO.O)")
    if layout(mode, t, e) is None:
        return f"no head-dim chunk fits {WORKGROUP_BYTES} bytes of workgroup memory beside the score tiles"
    return None


def check_tiles(name: str, mode: str, t: AttentionTiles, e: int) -> None:
    """Raise an IntrinsicError (a ValueError) naming the tiles and the rule they break."""
    problem = tiles_problem(mode, t, e)
    if problem is not None:
        raise IntrinsicError(f"{name}: tiles {t} do not fit the {mode} template at head dim {e}: {problem}")


DEFAULT_TILES = {"fwd": AttentionTiles(64, 32, 8), "dq": AttentionTiles(64, 32, 8), "dkdv": AttentionTiles(32, 32, 8)}


def choose_tiles(mode: str, e: int) -> AttentionTiles:
    """DEFAULT_TILES[mode] (128 invocations; 64 for dkdv, whose P and dS tiles both stay in
    workgroup memory), with the streamed tile halved until the layout fits at head dim ``e``."""
    t = DEFAULT_TILES[mode]
    while tiles_problem(mode, t, e) is not None and t.tile > 4 * t.groups:
        t = AttentionTiles(t.rows, t.tile // 2, t.groups)
    if tiles_problem(mode, t, e) is not None:
        raise IntrinsicError(f"no attention tiling for head dim {e} fits {WORKGROUP_BYTES} bytes")
    return t


def attention_candidates(mode: str, e: int) -> tuple[AttentionTiles, ...]:
    """What the autotuner tries for ``mode`` at head dim ``e``: choose_tiles' pick first, then the
    valid tiles of a small grid (rows 16-64, tiles 16-64, 4 or 8 invocations per 4 rows) with at
    least MIN_THREADS invocations, nearest in invocations first, MAX_CANDIDATES in all."""
    default = choose_tiles(mode, e)
    grid = {AttentionTiles(r, t, g) for r in (16, 32, 64) for t in (16, 32, 64) for g in (4, 8)}
    fits = [t for t in grid if t != default and t.threads >= MIN_THREADS and tiles_problem(mode, t, e) is None]
    return (default, *sorted(fits, key=lambda t: (abs(math.log2(t.threads / default.threads)), -t.tile, -t.rows,
                                                  t.groups))[:MAX_CANDIDATES - 1])


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


ROLES = {"lse": ("t", "h")}      # every other tensor is (t, h, e)


def _context(call: IntrinsicCall, mode: str, params: tuple[str, ...], outputs: tuple[str, ...]):
    batch, t, h, g, e, t_ext = _sizes(call)
    tiles = call.tiles or choose_tiles(mode, e)
    check_tiles(call.name, mode, tiles, e)
    lay = layout(mode, tiles, e)
    tensors = {p: _tensor(a, call.sizes, ROLES.get(p, ("t", "h", "e"))) for p, a in zip(params, call.operands)}
    for p, a in zip(outputs, call.outputs):
        tensors[p] = _tensor(a, call.sizes, ROLES.get(p, ("t", "h", "e")), call.accumulate) if a is not None else None
    ctx = {"mode": mode, "tiles": asdict(tiles), "threads": tiles.threads, "head_dim": e, **asdict(lay),
           "re": lay.e_pad // tiles.groups, "rk": tiles.tile // tiles.groups, "heads": h, "kv_heads": g,
           "group": h // g, "t_ext": t_ext, "scale": repr(1.0 / math.sqrt(e)), **tensors}
    blocks = -(-t // tiles.rows)
    return ctx, (blocks, h if mode != "dkdv" else g, batch)


def _plan_fwd(call: IntrinsicCall):
    ctx, groups = _context(call, "fwd", ("q", "k", "v"), ("o", "lse"))
    return "attention_fwd", ctx, groups


def _plan_dq(call: IntrinsicCall):
    ctx, groups = _context(call, "dq", BWD_PARAMS, ("dq",))
    return "attention_bwd", ctx, groups


def _plan_dkdv(call: IntrinsicCall):
    ctx, groups = _context(call, "dkdv", BWD_PARAMS, ("dk", "dv"))
    return "attention_bwd", ctx, groups


register(Intrinsic(FWD, ("q", "k", "v"), ("o", "lse"), _infer_fwd, _plan_fwd, grad=_grad,
                   differentiable_outputs=("o",), tiles=AttentionTiles))
register(Intrinsic(BWD_DQ, BWD_PARAMS, ("dq",), _infer_dq, _plan_dq, tiles=AttentionTiles))
register(Intrinsic(BWD_DKDV, BWD_PARAMS, ("dk", "dv"), _infer_dkdv, _plan_dkdv, tiles=AttentionTiles))
