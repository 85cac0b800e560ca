"""Contraction schedule: ``out[.., m, n] = sum_k a[.., m, k] * b[.., n, k]`` as a tiled GEMM.

The operands' axis order is free (x @ W^T, dY^T X and dY W are all the same template with other
strides). One workgroup computes a BM x BN tile; each invocation a TM x TN micro-tile held in
named accumulators; K advances BK at a time through workgroup memory. Edges are masked, and an
axis that is T runs only to the real length, so padded rows never enter a sum.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass

from ..codegen.wgsl import COMPUTE_TYPE
from ..ir.nodes import SEQ_AXIS, KernelIR
from ..ir.ops import Op
from ..ir.partition import is_contraction
from .spec import buffer_var, extent, schedule_error, strides


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
CANDIDATES = (DEFAULT_TILES, LARGE_TILES, TileConfig(128, 64, 16, 8, 4), TileConfig(64, 128, 16, 4, 8),
              TileConfig(32, 32, 16, 2, 2), TileConfig(128, 128, 8, 8, 8, vec=True),
              TileConfig(64, 64, 16, 4, 4, vec=True), TileConfig(128, 128, 16, 8, 8, vec=True),
              TileConfig(128, 64, 16, 8, 8, vec=True), TileConfig(64, 128, 16, 8, 8, vec=True),
              TileConfig(64, 64, 16, 8, 8, vec=True), TileConfig(64, 64, 8, 4, 4, vec=True),
              TileConfig(64, 64, 8, 4, 4, vec=True, split=2), TileConfig(64, 64, 8, 4, 4, vec=True, split=4),
              TileConfig(64, 128, 16, 8, 8, vec=True, split=2), TileConfig(64, 128, 16, 8, 8, vec=True, split=4),
              TileConfig(64, 128, 8, 8, 8, vec=True), TileConfig(64, 128, 8, 8, 8, vec=True, double=True),
              TileConfig(128, 128, 8, 8, 8, vec=True, double=True), TileConfig(64, 64, 16, 4, 4, vec=True, double=True),
              TileConfig(128, 64, 8, 8, 8, vec=True, double=True))


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


def vector_reads(tiles: TileConfig, dtype: str, op: dict, row_axis: str, k: str, sizes: dict[str, int],
                 rows: int) -> str | None:
    """Whether an operand's tile can be read from device memory as vec4s, and along which axis:
    "k" when k is contiguous, "m" when the tile's rows are, or None (scalar reads). Either needs a
    float operand, a vec4 workgroup tile, a contiguous axis whose size is a known multiple of 4 (so a
    vec4 is wholly inside or wholly outside the operand), the other strides multiples of 4, and
    every invocation fetching the same number of vec4s. f16 operands are read as vec4<f16>."""
    if not tiles.vec or dtype not in ("f32", "f16") or (rows * tiles.bk // 4) % tiles.threads or op["sb"] % 4:
        return None
    if op["sk"] == 1 and k != SEQ_AXIS and sizes[k] % 4 == 0 and op["sm"] % 4 == 0 and tiles.bk % 4 == 0:
        return "k"
    if op["sm"] == 1 and row_axis != SEQ_AXIS and sizes[row_axis] % 4 == 0 and op["sk"] % 4 == 0:
        return "m"
    return None


def plan(ir: KernelIR, sizes: dict[str, int], accumulate: frozenset[str], tiles: TileConfig | None = None):
    if len(ir.outputs) != 1:
        raise schedule_error(ir, "a contraction kernel has several outputs", "one output per contraction kernel")
    out = ir.outputs[0]
    node = ir.results[out.name]
    if node.op == Op.CAST and node.srcs[0].op == Op.SUM:
        node = node.srcs[0]
    if not is_contraction(node):
        raise schedule_error(ir, f"output {out.name!r} is not a plain contraction",
                             f"{out.name} = sum(a * b, K) with a and b kernel inputs")
    a, b = node.srcs[0].srcs
    if a.op != Op.INPUT or b.op != Op.INPUT:
        raise schedule_error(ir, "contraction operands must be kernel inputs",
                             "compute elementwise operands in a separate kernel")
    k = node.arg
    batch = [x for x in a.shape if x in b.shape and x != k]
    if len(batch) > 1:
        raise schedule_error(ir, f"contraction with batch axes {batch}", "at most one batch axis")
    out_free = [x for x in out.shape if x not in batch]
    if len(out_free) != 2 or set(out_free) != (set(a.shape) ^ set(b.shape)):
        raise schedule_error(ir, f"contraction output [{', '.join(out.shape)}] does not match its operands",
                             "one free axis from each operand")
    n_axis = out_free[-1]
    m_axis = out_free[0]
    if n_axis in a.shape:                      # A is the operand that carries M
        a, b = b, a
    tiles = tiles or choose_tiles(sizes[m_axis], sizes[n_axis], sizes[k])
    sc = strides(out.shape, sizes)
    bt = batch[0] if batch else None

    def operand(x, row_axis: str, rows: int, vectors: bool = True) -> dict:
        st = strides(x.shape, sizes)
        op = {"name": buffer_var(x.arg), "ctype": COMPUTE_TYPE[x.dtype], "convert": COMPUTE_TYPE[x.dtype] != x.dtype,
              "sm": st[row_axis], "sk": st[k], "sb": st[bt] if bt else 0, "k_fast": st[k] == 1}
        op["vec"] = vector_reads(tiles, x.dtype, op, row_axis, k, sizes, rows) if vectors else None
        op["loads"] = rows * tiles.bk // (4 if op["vec"] else 1) // tiles.threads
        return op

    ops = operand(a, m_axis, tiles.bm), operand(b, n_axis, tiles.bn)
    if a.arg == b.arg and ops[0]["vec"] != ops[1]["vec"]:     # one binding has one element type
        ops = operand(a, m_axis, tiles.bm, False), operand(b, n_axis, tiles.bn, False)

    ctx = {
        "tiles": asdict(tiles),
        "threads": tiles.threads,
        "m_ext": extent(m_axis, sizes), "n_ext": extent(n_axis, sizes), "k_ext": extent(k, sizes),
        "a": ops[0],
        "b": ops[1],
        "c": {"name": buffer_var(out.name), "sm": sc[m_axis], "sn": sc[n_axis], "sb": sc[bt] if bt else 0,
              "convert": out.dtype != "f32", "elem": out.dtype, "accumulate": out.name in accumulate},
        "axes": {"m": m_axis, "n": n_axis, "k": k, "batch": bt},
    }
    ctx["vec4_bindings"] = {x.arg: f"vec4<{x.dtype}>" for x, op in ((a, ctx["a"]), (b, ctx["b"])) if op["vec"]}
    batches = sizes[bt] if bt else 1
    if tiles.split > 1:
        # pass 1 writes each K slice's partial tile to a workspace [batch, split, M, N]; pass 2
        # ("reduce", one invocation per output element) sums the slices into the output
        ctx.update(m_pad=sizes[m_axis], n_size=sizes[n_axis], workspace=batches * tiles.split * sizes[m_axis] * sizes[n_axis],
                   entry_points=["main", "reduce"], extra_bindings=[{"name": "ws_", "elem": "f32"}],
                   reduce_threads=REDUCE_THREADS)
        ctx["reduce_workgroups"] = -(-batches * sizes[m_axis] * sizes[n_axis] // REDUCE_THREADS)
    groups = (-(-sizes[n_axis] // tiles.bn), -(-sizes[m_axis] // tiles.bm), batches * tiles.split)
    return "matmul", ctx, groups
