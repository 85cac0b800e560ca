"""Contraction schedule: ``out[.., m, n] = sum_k a[.., m, k] * b[.., n, k]`` as a tiled GEMM.

The operands' axis order is free (x @ W^T, dY^T X and dY W are all the same template with other
strides). One workgroup computes a BM x BN tile; each invocation a TM x TN micro-tile held in
named accumulators; K advances BK at a time through workgroup memory. Edges are masked, and an
axis that is T runs only to the real length, so padded rows never enter a sum.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass

from ..codegen.wgsl import COMPUTE_TYPE
from ..ir.nodes import KernelIR
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
        if 4 * self.bk * (self.bm + self.bn) > 16384:
            raise ValueError(f"{self}: needs more than 16 KiB of workgroup memory")


DEFAULT_TILES = TileConfig()
LARGE_TILES = TileConfig(bm=128, bn=128, bk=8, tm=8, tn=8)
CANDIDATES = (DEFAULT_TILES, LARGE_TILES, TileConfig(128, 64, 16, 8, 4), TileConfig(64, 128, 16, 4, 8),
              TileConfig(32, 32, 16, 2, 2), TileConfig(128, 128, 8, 8, 8, vec=True),
              TileConfig(64, 64, 16, 4, 4, vec=True))


def choose_tiles(m: int, n: int) -> TileConfig:
    """128x128 tiles (8x8 per invocation, vec4 reads) when they still give 64+ workgroups, else
    64x64 (4x4, vec4), which keeps more of a big GPU busy: measured on an H200, 128x128 reaches
    16-22 TFLOP/s from 2048x1024 up, while at 512x1024 its 32 workgroups give 4 TFLOP/s against
    8.8 for 64x64 (benches/results/h200_tiles_v2.log)."""
    large = (m // 128) * (n // 128) >= 64
    return TileConfig(128, 128, 8, 8, 8, vec=True) if large else TileConfig(64, 64, 16, 4, 4, vec=True)


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
    tiles = tiles or choose_tiles(sizes[m_axis], sizes[n_axis])
    sa, sb, sc = strides(a.shape, sizes), strides(b.shape, sizes), strides(out.shape, sizes)
    bt = batch[0] if batch else None
    ctx = {
        "tiles": asdict(tiles),
        "threads": tiles.threads,
        "m_ext": extent(m_axis, sizes), "n_ext": extent(n_axis, sizes), "k_ext": extent(k, sizes),
        "a": {"name": buffer_var(a.arg), "ctype": COMPUTE_TYPE[a.dtype], "convert": COMPUTE_TYPE[a.dtype] != a.dtype,
              "sm": sa[m_axis], "sk": sa[k], "sb": sa[bt] if bt else 0, "k_fast": sa[k] == 1},
        "b": {"name": buffer_var(b.arg), "ctype": COMPUTE_TYPE[b.dtype], "convert": COMPUTE_TYPE[b.dtype] != b.dtype,
              "sm": sb[n_axis], "sk": sb[k], "sb": sb[bt] if bt else 0, "k_fast": sb[k] == 1},
        "c": {"name": buffer_var(out.name), "sm": sc[m_axis], "sn": sc[n_axis], "sb": sc[bt] if bt else 0,
              "convert": out.dtype != "f32", "elem": out.dtype, "accumulate": out.name in accumulate},
        "axes": {"m": m_axis, "n": n_axis, "k": k, "batch": bt},
    }
    groups = (-(-sizes[n_axis] // tiles.bn), -(-sizes[m_axis] // tiles.bm), sizes[bt] if bt else 1)
    return "matmul", ctx, groups
