"""Causal grouped-query attention: the flash-style templates that run the attention intrinsics.

    o, lse = causal_attention(q, k, v)        q: [T, H, E]   k, v: [T, G, E]   (G divides H)
    o: [T, H, E] (q's dtype)   lse: [T, H] f32, log-sum-exp of each query's scaled scores

Every operand may carry a leading batch axis ([B, S, H, E] and so on): B independent sequences of
S positions stored one after another (packed rows), run by one dispatch (workgroup z is the
sequence), so short packed sequences fill a big GPU. Sequence b's rows start at b * S.

Roles are positional; the axis names are the caller's. Query head h reads kv head h // (H/G);
scores are q.k / sqrt(E); query t sees keys 0..t. With the optional operand ``starts`` (i32 per
row, nondecreasing: sequences concatenated in one row) query t sees keys starts[t]..t: a query
block's key loop starts at the tile holding starts[q0] (its first query's start), and a key block's
query loop in dk/dv ends with the sequence of its last key (a binary search over starts), so a
concatenated row does the work of its sequences, not of the whole row (the SIMT and the matrix
templates alike). No T x T matrix ever reaches device memory:
the forward keeps a running max and sum per query (online softmax) and saves lse, and the two
backward kernels (FlashAttention-2) recompute probabilities from lse:

    P = exp(S - lse)   D_i = sum_e dO*O   dS = P * (dO V^T - D)
    dQ = dS K / sqrt(E)      (causal_attention_bwd_dq:   a workgroup per query block and head; D
                              from its rows of o and dO)
    dK = dS^T Q / sqrt(E), dV = P^T dO
                             (causal_attention_bwd_dkdv: a workgroup per key block, kv head and
                              query head of its group; a second pass sums the group's partials
                              in a fixed order, no atomics. lse and D come stacked in one
                              tensor, stats [T, 2, H], computed before it by plain IR: with
                              starts it binds q, k, v, stats, dO, starts, dk, dv, within WebGPU's
                              default 8 storage buffers)

Thread layout (the same in all three kernels): a workgroup owns a block of rows (queries, or keys
for dk/dv); each row is served by ``row_threads`` adjacent invocations. The row being dotted
against the streamed tiles (q; q and dO; k and v) lives whole in named registers, and each of the
row's invocations takes every row_threads-th row of the tile for its dot products, so the dots
are straight-line code over E. Accumulators (o, dq, dk, dv) are split by interleaved columns:
invocation ``part`` owns columns part, part + row_threads, ... (EPT = E / row_threads of them).
Scores of one tile pass through workgroup memory; tiles read with a different row per lane have
their rows padded by one word, so lanes hit different banks.

On a target with f16 subgroup matrices, the three kernels run on the matrix units instead where
q, k, v (and dO) are f16 (templates attention_fwd_matrix, attention_dq_matrix and
attention_dkdv_matrix; MatrixAttentionTiles): a subgroup per 16 owned rows multiplies S, P v, dO
v^T, dS k, P^T dO and dS^T q as fragments from f16 tiles in workgroup memory; softmax statistics,
D and o stay f32 (o rescaled, then P v added, per key tile), P and dS are rounded to f16 for
their products, dq, dk and dv accumulate in f32 fragments across the tiles, and the grouped heads'
partial dk, dv meet in the same workspace and fixed-order second pass. Their workgroup tiles have
padded rows (``matrix_strides``: a fragment's rows in different banks) and they read q, k, v, dO
and o as vec4s.

Block sizes (AttentionTiles, MatrixAttentionTiles) come from tune/heuristics.py unless the caller
passes tiles (``engine.run(..., tiles=...)``, the autotuner); ``tiles_problem`` and
``matrix_tiles_problem`` hold the rules any tiles must keep; the autotuner's candidates are in
tune/candidates.py.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, replace

from ..ir.intrinsics import ATTENTION_DKDV_PARAMS, ATTENTION_DQ_PARAMS, STATS_AXIS, IntrinsicError
from ..tune import heuristics
from ..tune.tiles import AttentionTiles, MatrixAttentionTiles
from .code import Index
from .layout import extent, strides
from .matmul import REDUCE_THREADS
from .spec import EntryPoint, IntrinsicCall, MatrixConfig, Plan, Scratch

WORKGROUP_BYTES = 16384      # portable maxComputeWorkgroupStorageSize
MAX_THREADS = 256            # portable maxComputeInvocationsPerWorkgroup
MAX_HEAD_DIM = 128


# ---- tiling ----

def workgroup_words(mode: str, t: AttentionTiles, e: int) -> int:
    """f32 words of workgroup memory the template declares for ``mode`` (fwd, dq, dkdv)."""
    if mode == "fwd":      # k tile [tile][E+1], v tile [tile][E], scores [rows][tile+1]
        return t.tile * (e + 1) + t.tile * e + t.rows * (t.tile + 1)
    if mode == "dq":       # k, v tiles [tile][E+1], dS [rows][tile+1]
        return 2 * t.tile * (e + 1) + t.rows * (t.tile + 1)
    # q, dO tiles [tile][E+1], P and dS [rows][tile+1], lse and D [tile]
    return 2 * t.tile * (e + 1) + 2 * t.rows * (t.tile + 1) + 2 * t.tile


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
    """The ``mode`` template's default tiles at head dim ``e`` (heuristics.attention_tiles, keeping
    its rules: workgroup memory within the portable 16 KiB)."""
    tiles = heuristics.attention_tiles(e, lambda t: tiles_problem(mode, t, e) is None)
    if tiles is not None:
        return tiles
    raise IntrinsicError(f"no attention tiling for head dim {e} fits {WORKGROUP_BYTES} bytes")



# ---- plans ----

@dataclass(frozen=True)
class Strides:
    t: int
    h: int
    e: int = 0


@dataclass(frozen=True)
class AttnTensor:
    """A tensor as the templates see it: storage type and strides by role (sequence, head, column).
    A batch axis needs no stride of its own: sequences are stored back to back, T rows apart."""
    tensor: str
    dtype: str
    strides: Strides
    accumulate: bool = False
    vec: bool = False             # the matrix templates read it as vec4s (see _vector_reads)

    @property
    def convert(self) -> bool:
        return self.dtype != "f32"


@dataclass(frozen=True)
class AttentionParams:
    mode: str                     # fwd, dq, dkdv
    tiles: AttentionTiles
    head_dim: int
    heads: int
    kv_heads: int
    t_ext: Index                  # the real sequence length (of each packed sequence)
    scale: float                  # 1 / sqrt(head_dim)
    q: AttnTensor
    k: AttnTensor
    v: AttnTensor
    o: AttnTensor | None = None
    lse: AttnTensor | None = None
    stats: AttnTensor | None = None    # dkdv: lse (stats.strides.e = 0) and D (e = 1) of each query and head
    do: AttnTensor | None = None
    dq: AttnTensor | None = None
    dk: AttnTensor | None = None
    dv: AttnTensor | None = None
    starts: AttnTensor | None = None   # i32 per row: where its sequence starts (concatenated sequences)
    split: int = 1                # dkdv: workgroups per (key block, kv head), partials summed by "reduce"
    batch: int = 1
    t_pad: int = 0
    workspace: int = 0
    reduce_threads: int = REDUCE_THREADS

    @property
    def threads(self) -> int:
        return self.tiles.threads

    @property
    def row_threads(self) -> int:  # invocations per owned row
        return self.tiles.row_threads

    @property
    def ept(self) -> int:         # accumulator columns per invocation
        return self.head_dim // self.row_threads

    @property
    def group(self) -> int:       # query heads per kv head
        return self.heads // self.kv_heads

    @property
    def smem_bytes(self) -> int:
        return 4 * workgroup_words(self.mode, self.tiles, self.head_dim)


def _tensor(arg, sizes: dict[str, int], roles: int, accumulate=frozenset()) -> AttnTensor:
    st = strides(arg.shape, sizes)
    axes = arg.shape[-roles:]
    return AttnTensor(arg.name, arg.dtype, Strides(*(st[a] for a in axes)), arg.name in accumulate)


def _sizes(call: IntrinsicCall) -> tuple[int, int, int, int, int]:
    """(batch, T, H, G, E) of a call."""
    q, k = call.operands[0], call.operands[1]
    t, h, e = (call.sizes[a] for a in q.shape[-3:])
    g = call.sizes[k.shape[-2]]
    batch = call.sizes[q.shape[0]] if len(q.shape) == 4 else 1
    if h % g:
        raise IntrinsicError(f"{call.name}: the {h} query heads ({q.shape[-2]}) must split evenly over "
                             f"the {g} kv heads ({k.shape[-2]})")
    if e > MAX_HEAD_DIM:
        raise IntrinsicError(f"{call.name}: head dim {q.shape[-1]}={e} is over the supported {MAX_HEAD_DIM}")
    return batch, t, h, g, e


ROLES = {"q": 3, "k": 3, "v": 3, "o": 3, "do": 3, "lse": 2, "dq": 3, "dk": 3, "dv": 3}


def _stats(arg, sizes: dict[str, int]) -> AttnTensor:
    """stats [B?, T, 2, H] as the templates see it: strides t and h, and e stepping from lse to D."""
    st = strides(arg.shape, sizes)
    t, two, h = arg.shape[-3:]
    assert two == STATS_AXIS, arg.shape
    return AttnTensor(arg.name, arg.dtype, Strides(st[t], st[h], st[two]))


def _starts(call: IntrinsicCall, params: tuple[str, ...]) -> AttnTensor | None:
    """The call's optional starts operand (after its fixed ones): one i32 per row, no head axis."""
    if len(call.operands) <= len(params):
        return None
    arg = call.operands[len(params)]
    return AttnTensor(arg.name, arg.dtype, Strides(strides(arg.shape, call.sizes)[arg.shape[-1]], 0))


def _params(call: IntrinsicCall, mode: str, params: tuple[str, ...], outputs: tuple[str, ...]) -> AttentionParams:
    batch, t, h, g, e = _sizes(call)
    tiles = call.tiles or choose_tiles(mode, e)
    check_tiles(call.name, mode, tiles, e)
    tensors = {p: _stats(a, call.sizes) if p == "stats" else _tensor(a, call.sizes, ROLES[p])
               for p, a in zip(params, call.operands)}
    tensors["starts"] = _starts(call, params)
    for p, a in zip(outputs, call.outputs):
        tensors[p] = _tensor(a, call.sizes, ROLES[p], call.accumulate) if a is not None else None
    return AttentionParams(mode, tiles, e, h, g, extent(call.operands[0].shape[-3], call.sizes), 1.0 / math.sqrt(e),
                           batch=batch, **tensors)


# ---- the three kernels on the matrix units ----

MATRIX_TEMPLATES = {"fwd": "attention_fwd_matrix", "dq": "attention_dq_matrix", "dkdv": "attention_dkdv_matrix"}


# Padding of the matrix templates' workgroup tiles, so that a fragment's rows (or columns) fall in
# different banks: f16 rows 16 bytes longer (row starts an odd number of 16-byte units apart, what a
# fragment load reading 8 rows of 16 bytes at once needs), f32 columns 4 words longer (a fragment
# store's lanes, two columns apart, land 8 banks apart).
F16_PAD = 8
F32_PAD = 4


def matrix_strides(t: MatrixAttentionTiles, e: int) -> tuple[int, int, int]:
    """Row strides of the matrix templates' workgroup tiles: f16 head-dim rows (q, k, v, dO),
    f16 columns of an owned block ([tile][rows]: P, dS), f32 columns of one ([.][rows]: S, dP, P v, dq,
    dk, dv)."""
    return e + F16_PAD, t.rows + F16_PAD, t.rows + F32_PAD


def matrix_workgroup_bytes(mode: str, t: MatrixAttentionTiles, e: int, threads: int) -> int:
    """fwd: q, k, v and P tiles as f16, one f32 buffer for the scores, then P v, and a word per
    invocation (its share of a row's maximum); dq: q, dO, k, v and dS tiles as f16, the scores (at
    the end dq) and dO v^T as f32; dkdv: k, v, q, dO, P^T and dS^T as f16, S^T (at the end dk, dv)
    and dP^T as f32, and the query tile's lse and D. Rows padded as matrix_strides says. The
    backward's results leave through the scores' buffer a tile's width of columns at a time, so its
    f32 buffers are as wide as the streamed tile, whatever the head dim."""
    rs, cs, acc = matrix_strides(t, e)
    shares = 0 if t.shuffle else threads   # the row maxima's shares (shuffled instead with t.shuffle)
    if mode == "fwd" and t.double:     # k and v twice; the f32 buffer holds scores, o in rounds; two flag words
        return 2 * ((t.rows + 4 * t.tile) * rs + t.tile * cs) + 4 * (t.tile * acc + shares + 2)
    if mode == "fwd":                   # the f32 buffer holds scores, then P v (head-dim wide) every step
        return 2 * ((t.rows + 2 * t.tile) * rs + t.tile * cs) + 4 * (max(t.tile, e) * acc + shares)
    if mode == "dq":                    # double: k and v twice
        return 2 * (2 * (t.rows + (2 if t.double else 1) * t.tile) * rs + t.tile * cs) + 4 * 2 * t.tile * acc
    n = 2 if t.double else 1            # dkdv: q, dO, lse and D of one query tile (double: two)
    return 2 * (2 * (t.rows + n * t.tile) * rs + 2 * t.tile * cs) + 4 * (2 * t.tile * acc + 2 * n * t.tile)


def matrix_tiles_problem(mode: str, t: MatrixAttentionTiles, e: int, target) -> str | None:
    """The first rule of the ``mode`` matrix template that ``t`` breaks on ``target`` (its f16 fragment,
    subgroup size, workgroup memory, subgroup feature), None where it keeps them all."""
    frag, subgroup = target.matrix("f16", "f32"), target.subgroup_size
    if not all(isinstance(v, int) and v >= 1 for v in (t.rows, t.tile)):
        return "rows and tile must be positive integers"
    if t.rows % frag.m or subgroup % frag.m:
        return f"rows ({t.rows}) and the subgroup size ({subgroup}) must be multiples of the fragment height {frag.m}"
    if t.tile % frag.n or t.tile % frag.k or e % frag.n or e % frag.k or e % 4:
        return (f"the key tile ({t.tile}) and the head dim ({e}) must be multiples of the fragment's "
                f"n = {frag.n} and k = {frag.k} (and the head dim of 4: its rows are read as vec4s)")
    if t.vec4 and (frag.n % 4 or frag.k % 4):
        return f"vec4 staging needs fragments (n {frag.n}, k {frag.k}) that start on whole vec4s"
    if t.shuffle and mode != "fwd":
        return "shuffle (a row's maximum and sum by subgroup shuffles) is the forward's; dq and dkdv exchange no maxima"
    if t.shuffle and not target.subgroups:
        return "shuffle needs a device with subgroups (the feature 'subgroups' or 'subgroup')"
    if t.shuffle and subgroup // frag.m > 4:   # WebGPU's smallest subgroup holds 4 invocations, a row's at most
        return f"shuffle needs a row's {subgroup // frag.m} invocations within one subgroup (at most 4)"
    threads = t.rows // frag.m * subgroup
    if threads > MAX_THREADS:
        return f"{t.rows // frag.m} subgroups of {subgroup} invocations, expected at most {MAX_THREADS}"
    if t.tile % (subgroup // frag.m):
        return (f"the streamed tile ({t.tile}) must be a multiple of the {subgroup // frag.m} invocations "
                "serving each row (each takes an equal share of the scores and of the spilled results)")
    need = matrix_workgroup_bytes(mode, t, e, threads)
    if need > target.workgroup_bytes:
        return f"{need} bytes of workgroup memory, the device allows {target.workgroup_bytes}"
    if mode == "fwd" and t.double and not target.emulated:
        return ("double (o kept in fragments) gave wrong forward results on an H100 under Dawn "
                "(benches/results/h100_attention_double_tests_dawn.log); only the emulated matrix units run it")
    return None


@dataclass(frozen=True)
class MatrixAttentionParams(AttentionParams):
    frag: MatrixConfig | None = None
    subgroup_size: int = 32
    emulated: bool = False
    subgroups: str = ""            # Target.subgroups: "subgroups" puts `enable subgroups;` in the WGSL

    @property
    def row_threads(self) -> int:   # a subgroup's invocations over its fragment rows
        return self.subgroup_size // self.frag.m

    @property
    def threads(self) -> int:
        return self.tiles.rows // self.frag.m * self.subgroup_size

    @property
    def smem_bytes(self) -> int:
        return matrix_workgroup_bytes(self.mode, self.tiles, self.head_dim, self.threads)

    @property
    def row_stride(self) -> int:    # f16 head-dim rows in workgroup memory
        return matrix_strides(self.tiles, self.head_dim)[0]

    @property
    def unit(self) -> int:          # f16 per element of the head-dim tiles (their offsets and strides count these)
        return 4 if self.tiles.vec4 else 1

    @property
    def col_stride(self) -> int:    # f16 columns of the owned block
        return matrix_strides(self.tiles, self.head_dim)[1]

    @property
    def acc_stride(self) -> int:    # f32 columns of the owned block
        return matrix_strides(self.tiles, self.head_dim)[2]


def _matrix_params(call: IntrinsicCall, target, mode: str, params: tuple[str, ...],
                   outputs: tuple[str, ...]) -> MatrixAttentionParams | None:
    """The ``mode`` kernel's parameters on the matrix units, or None where it stays SIMT: the target
    has no f16 subgroup matrices, an operand it multiplies is not f16, or no candidate fits (given
    tiles that do not fit are an error)."""
    frag = target.matrix("f16", "f32") if target is not None and target.subgroup_size else None
    given = isinstance(call.tiles, MatrixAttentionTiles)
    if frag is None:
        if given:
            raise IntrinsicError(f"{call.name}: tiles {call.tiles} need a device with f16 subgroup matrices")
        return None
    multiplied = [op for name, op in zip(params, call.operands) if name in ("q", "k", "v", "do")]
    if not given and (call.tiles is not None or any(op.dtype != "f16" for op in multiplied)):
        return None
    e = _sizes(call)[4]

    def problem(t):
        return matrix_tiles_problem(mode, t, e, target)
    if given:
        why = problem(call.tiles)
        if why:
            raise IntrinsicError(f"{call.name}: tiles {call.tiles} do not fit {MATRIX_TEMPLATES[mode]}: {why}")
        tiles = call.tiles
    else:
        tiles = heuristics.matrix_attention_tiles(mode, lambda t: not problem(t))
        if tiles is None:
            return None
        tiles = replace(tiles, vec4=target.vec4_staging)      # LFM2JIT_MATRIX_STAGING
    simt = _params(replace(call, tiles=None), mode, params, outputs)
    fields = {f: getattr(simt, f) for f in AttentionParams.__dataclass_fields__}
    return MatrixAttentionParams(**{**fields, "tiles": tiles, **_vector_reads(simt)}, frag=frag,
                                 subgroup_size=target.subgroup_size, emulated=target.emulated,
                                 subgroups=target.subgroups)


def _read(p: AttentionParams) -> tuple[str, ...]:
    """The tensors the matrix templates fetch tiles of (and, dq, o for D = dO . O)."""
    return ("q", "k", "v") if p.mode == "fwd" else ("q", "k", "v", "do", "o")


def _vector_reads(p: AttentionParams) -> dict[str, AttnTensor]:
    """The read tensors marked ``vec``: the matrix templates read them as vec4s of 4 consecutive head-dim
    columns, a quarter of the loads. Always possible there: the roles fix each tensor's layout to
    [..., T, heads, E], and E is a multiple of 4 (matrix_tiles_problem)."""
    return {n: replace(getattr(p, n), vec=True) for n in _read(p) if getattr(p, n) is not None}


def _vectors(p: AttentionParams) -> tuple[tuple[str, int], ...]:
    """The bindings a plan reads as vec4s."""
    return tuple(dict.fromkeys((getattr(p, n).tensor, 4) for n in _read(p)
                               if getattr(p, n) is not None and getattr(p, n).vec))


def _choose(call: IntrinsicCall, target, mode: str, params: tuple[str, ...], outputs: tuple[str, ...],
            simt_template: str) -> tuple[str, AttentionParams]:
    """The ``mode`` kernel's template and parameters: on the matrix units where the target has them
    and the multiplied operands are f16, else SIMT."""
    p = _matrix_params(call, target, mode, params, outputs)
    if p is not None:
        return MATRIX_TEMPLATES[mode], p
    return simt_template, _params(call, mode, params, outputs)


def _plan_rows(call: IntrinsicCall, target, mode: str, params: tuple[str, ...], outputs: tuple[str, ...],
               simt_template: str) -> Plan:
    """A kernel with a workgroup per block of query rows and head."""
    template, p = _choose(call, target, mode, params, outputs, simt_template)
    blocks = _workgroup_blocks(call.sizes[call.operands[0].shape[-3]], p.tiles)
    return Plan(template, p, (EntryPoint("main", (blocks, p.heads, p.batch)),), vectors=_vectors(p))


def _workgroup_blocks(t_pad: int, tiles) -> int:
    """Workgroups along the owned rows: a block of rows each, or with paired blocks
    (MatrixAttentionTiles.pair) one per pair."""
    blocks = -(-t_pad // tiles.rows)
    return -(-blocks // 2) if getattr(tiles, "pair", False) else blocks


def plan_forward(call: IntrinsicCall, target=None) -> Plan:
    return _plan_rows(call, target, "fwd", ("q", "k", "v"), ("o", "lse"), "attention_fwd")


def plan_dq(call: IntrinsicCall, target=None) -> Plan:
    return _plan_rows(call, target, "dq", ATTENTION_DQ_PARAMS, ("dq",), "attention_bwd")


def plan_dkdv(call: IntrinsicCall, target=None) -> Plan:
    """One workgroup per (key block, kv head, query head of its group), so a group's heads run in
    parallel rather than one after another (a short sequence otherwise leaves most of a big GPU
    idle); their partial dk, dv meet in a workspace and a second pass sums them in a fixed order."""
    template, p = _choose(call, target, "dkdv", ATTENTION_DKDV_PARAMS, ("dk", "dv"), "attention_bwd")
    budget = target.storage_buffers if target is not None else 8
    tensors = len(call.operands) + sum(o is not None for o in call.outputs)
    t_pad = call.sizes[call.operands[0].shape[-3]]
    blocks = _workgroup_blocks(t_pad, p.tiles)
    # the heads of a group in parallel need a workspace binding; without room for it, one after another
    split = p.group if tensors + (p.group > 1) <= budget else 1
    p = replace(p, t_pad=t_pad)
    main = EntryPoint("main", (blocks, p.kv_heads, p.batch * split))
    if split == 1:
        return Plan(template, p, (main,), vectors=_vectors(p))
    elements = p.batch * t_pad * p.kv_heads * p.head_dim
    p = replace(p, split=split, workspace=2 * split * elements)
    return Plan(template, p, (main, EntryPoint("reduce", -(-elements // REDUCE_THREADS))),
                (Scratch("ws", "f32", 2 * split * elements),), vectors=_vectors(p))

