"""Contraction schedule: ``out[.., m, n] = sum_k a[.., m, k] * b[.., n, k]`` as a tiled GEMM.

The operands' axis order is free (x @ W^T, dY^T X and dY W are all the same template with other
strides). One workgroup computes a BM x BN tile; each invocation a TM x TN micro-tile held in
named accumulators; K advances BK at a time through workgroup memory. Edges are masked, and an
axis that is T runs only to the real length, so padded rows never enter a sum.
"""
from __future__ import annotations

from dataclasses import dataclass

from ..ir.nodes import SEQ_AXIS, KernelIR
from ..ir.ops import Op
from ..ir.partition import gemm_axes
from .code import Index
from .spec import EntryPoint, Plan, Scratch, extent, strides


@dataclass(frozen=True)
class TileConfig:
    bm: int = 64
    bn: int = 64
    bk: int = 16
    tm: int = 4
    tn: int = 4
    vec: bool = False      # contiguous micro-tiles read as vec4 from workgroup memory
    split: int = 1         # K is cut into this many slices summed by a second pass (split-K)
    double: bool = False   # two workgroup tiles: k-step i+1 is stored while i is multiplied, one barrier a step

    @property
    def threads(self) -> int:
        return (self.bm // self.tm) * (self.bn // self.tn)

    def __post_init__(self):
        """Reject shapes the template cannot tile exactly (they would compute garbage, not fail)."""
        if self.bm % self.tm or self.bn % self.tn:
            raise ValueError(f"{self}: the tile must split evenly into micro-tiles")
        if not 1 <= self.threads <= 256 or (self.bm * self.bk) % self.threads or (self.bn * self.bk) % self.threads:
            raise ValueError(f"{self}: {self.threads} invocations must be 1..256 and load each tile evenly")
        if self.vec and (self.tm % 4 or self.tn % 4):
            raise ValueError(f"{self}: vec4 reads need micro-tiles that are multiples of 4")
        if 4 * self.bk * (self.bm + self.bn) * (2 if self.double else 1) > 16384:
            raise ValueError(f"{self}: needs more than 16 KiB of workgroup memory")
        if self.split not in (1, 2, 4, 8):
            raise ValueError(f"{self}: split must be 1, 2, 4 or 8")


REDUCE_THREADS = 256
DEFAULT_TILES = TileConfig()
LARGE_TILES = TileConfig(bm=128, bn=128, bk=8, tm=8, tn=8)
LONG_K = 2048        # contractions at least this long split K over 2 (with SMALL_OUTPUT tiles or more)
SHORT_K = 1024       # small outputs (< SMALL_OUTPUT 64x128 tiles) split K over 4 from this long
SMALL_OUTPUT = 128


def choose_tiles(m: int, n: int, k: int) -> TileConfig:
    """64x128 tiles (8x8 per invocation, k-step 16); K split over 4 for small outputs (fewer than
    SMALL_OUTPUT tiles) with K >= SHORT_K, over 2 for K >= LONG_K and at most 1024 tiles; 64x64
    tiles (4x4, k-step 8) for small outputs with short K, where 64x128 tiles would leave a big GPU
    idle.

    Read from what the autotuner measured on a warm H200 for every matmul of LFM2-350M train steps
    (benches/results/h200_tune_log_*.json). At 8 x 512, split-K beat unsplit tiles in 11 of the 12
    products with K >= 3072 and lost in all 8 with K <= 1024 and at least 128 tiles. At 1 x 512 and
    1 x 2048, splitting K = 2048 won in 5 of 6 products (by 5-11%; lost 4% at 3072 x 1024), and
    splitting small outputs over 4 beat 64x64 tiles from K = 1024 (in 2 of 3, by 6-30%)."""
    groups = -(-m // 64) * -(-n // 128)
    if groups < SMALL_OUTPUT and k >= SHORT_K:
        return TileConfig(64, 128, 16, 8, 8, vec=True, split=4)
    if k >= LONG_K and groups <= 1024:
        return TileConfig(64, 128, 16, 8, 8, vec=True, split=2)
    if groups >= SMALL_OUTPUT:
        return TileConfig(64, 128, 16, 8, 8, vec=True)
    return TileConfig(64, 64, 8, 4, 4, vec=True)


@dataclass(frozen=True)
class Operand:
    """A GEMM operand as the template reads it: strides along its row axis (M or N), K and the batch
    axis; whether K is its contiguous axis; how it is read from memory ("k" or "m" contiguous vec4s,
    or None: scalars); how many reads each invocation makes per k-step."""
    tensor: str
    dtype: str
    sm: int
    sk: int
    sb: int
    vec: str | None = None
    loads: int = 0

    @property
    def k_fast(self) -> bool:
        return self.sk == 1

    @property
    def convert(self) -> bool:
        return self.dtype != "f32"


@dataclass(frozen=True)
class Output:
    tensor: str
    dtype: str
    sm: int
    sn: int
    sb: int
    accumulate: bool

    @property
    def convert(self) -> bool:
        return self.dtype != "f32"


@dataclass(frozen=True)
class MatmulParams:
    tiles: TileConfig
    m_ext: Index
    n_ext: Index
    k_ext: Index
    a: Operand
    b: Operand
    c: Output
    axes: tuple[str, str, str, str | None]     # (m, n, k, batch) axis names, for the comments
    m_pad: int                                 # split-K workspace layout [batch, split, m_pad, n_size]
    n_size: int
    batches: int
    reduce_threads: int

    @property
    def threads(self) -> int:
        return self.tiles.threads


def vector_reads(tiles: TileConfig, op: Operand, row_axis: str, k: str, sizes: dict[str, int],
                 rows: int) -> str | None:
    """Whether an operand's tile can be read from device memory as vec4s, and along which axis:
    "k" when k is contiguous, "m" when the tile's rows are, or None (scalar reads). Either needs a
    float operand, a vec4 workgroup tile, a contiguous axis whose size is a known multiple of 4 (so a
    vec4 is wholly inside or wholly outside the operand), the other strides multiples of 4, and
    every invocation fetching the same number of vec4s. f16 operands are read as vec4<f16>."""
    if not tiles.vec or op.dtype not in ("f32", "f16") or (rows * tiles.bk // 4) % tiles.threads or op.sb % 4:
        return None
    if op.sk == 1 and k != SEQ_AXIS and sizes[k] % 4 == 0 and op.sm % 4 == 0 and tiles.bk % 4 == 0:
        return "k"
    if op.sm == 1 and row_axis != SEQ_AXIS and sizes[row_axis] % 4 == 0 and op.sk % 4 == 0:
        return "m"
    return None


def plan(ir: KernelIR, sizes: dict[str, int], accumulate: frozenset[str], tiles: TileConfig | None = None) -> Plan:
    out = ir.outputs[0]
    node = ir.results[out.name]
    if node.op == Op.CAST:                 # a contraction stored in another dtype
        node = node.srcs[0]
    axes = gemm_axes(node, out.shape)
    m_axis, n_axis, k, bt = axes["m"], axes["n"], axes["k"], axes["batch"]
    a, b = node.srcs[0].srcs
    if n_axis in a.shape:                      # A is the operand that carries M
        a, b = b, a
    tiles = tiles or choose_tiles(sizes[m_axis], sizes[n_axis], sizes[k])
    sc = strides(out.shape, sizes)

    def operand(x, row_axis: str, rows: int, vectors: bool = True) -> Operand:
        st = strides(x.shape, sizes)
        op = Operand(x.arg, x.dtype, st[row_axis], st[k], st[bt] if bt else 0)
        vec = vector_reads(tiles, op, row_axis, k, sizes, rows) if vectors else None
        return Operand(op.tensor, op.dtype, op.sm, op.sk, op.sb, vec, rows * tiles.bk // (4 if vec else 1) // tiles.threads)

    ops = operand(a, m_axis, tiles.bm), operand(b, n_axis, tiles.bn)
    if a.arg == b.arg and ops[0].vec != ops[1].vec:     # one binding has one element type
        ops = operand(a, m_axis, tiles.bm, False), operand(b, n_axis, tiles.bn, False)
    batches = sizes[bt] if bt else 1
    params = MatmulParams(
        tiles, extent(m_axis, sizes), extent(n_axis, sizes), extent(k, sizes), ops[0], ops[1],
        Output(out.name, out.dtype, sc[m_axis], sc[n_axis], sc[bt] if bt else 0, out.name in accumulate),
        (m_axis, n_axis, k, bt), sizes[m_axis], sizes[n_axis], batches, REDUCE_THREADS)
    vectors = tuple((op.tensor, 4) for op in dict.fromkeys(ops) if op.vec)
    grid = (-(-sizes[n_axis] // tiles.bn), -(-sizes[m_axis] // tiles.bm), batches * tiles.split)
    if tiles.split == 1:
        return Plan("matmul", params, (EntryPoint("main", grid),), vectors=vectors)
    # pass 1 writes each K slice's partial tile to a workspace [batch, split, M, N]; pass 2
    # ("reduce", one invocation per output element) sums the slices into the output
    elements = batches * sizes[m_axis] * sizes[n_axis]
    return Plan("matmul", params, (EntryPoint("main", grid), EntryPoint("reduce", -(-elements // REDUCE_THREADS))),
                (Scratch("ws", "f32", tiles.split * elements),), vectors)
