"""The tiles a caller may choose for each schedule with knobs: the vocabulary the planners (schedule/),
their default choices (heuristics.py) and the autotuner share. Each class refuses tiles its
template cannot run; rules that depend on the device or the problem are the planners'.

Layer: imports nothing from lfm2jit; schedule, heuristics and the autotuner import it.
"""
from __future__ import annotations

from dataclasses import dataclass

COLUMN_SPLITS = (1, 2, 4, 8, 16, 32)      # the slices a column reduction's template can combine


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

    @property
    def label(self) -> str:
        return (f"{self.bm}x{self.bn}/bk{self.bk}/{self.tm}x{self.tn}" + ("/vec4" if self.vec else "")
                + (f"/split{self.split}" if self.split > 1 else "") + ("/double" if self.double else ""))

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


@dataclass(frozen=True)
class MatrixTiles:
    """Tiles of the subgroup-matrix (matrix-unit) GEMM: a WM x WN workgroup tile, SG_M x SG_N
    subgroups each owning a (WM/SG_M) x (WN/SG_N) block of accumulator fragments, K staged through
    workgroup memory BK at a time (as f16) in ``stages`` buffers (2: the next k-step is stored
    while this one is multiplied, one barrier per step), workgroups walking the output in bands of
    ``group`` tile rows (so neighbours share operand tiles in L2), and split-K as the SIMT tiles
    have it, in every tile or (``tail`` > 0) only in the last ``tail`` tile columns: the tiles that
    would otherwise run in a last, mostly idle wave of workgroups. ``prefetch``: with one stage,
    the next k-step is fetched into registers while this one is multiplied; without, at the top of
    each step, which holds fewer registers (what large tiles' accumulators leave room for).
    ``sg_k``: groups of SG_M x SG_N subgroups that share each staged k-step, each multiplying its
    own BK / sg_k of it into its own accumulators, the groups' sums added in the epilogue: more
    subgroups a tile (to hide latency where the grid is small) without smaller blocks."""
    wm: int = 128
    wn: int = 128
    sg_m: int = 2
    sg_n: int = 2
    bk: int = 32
    split: int = 1
    stages: int = 1
    group: int = 8
    prefetch: bool = True
    tail: int = 0
    vec4: bool = False
    sg_k: int = 1

    def __post_init__(self):
        if min(self.wm, self.wn, self.sg_m, self.sg_n, self.bk, self.group) < 1 or self.split not in (1, 2, 4, 8):
            raise ValueError(f"{self}: sizes must be positive and split 1, 2, 4 or 8")
        if self.sg_k not in (1, 2, 4):
            raise ValueError(f"{self}: sg_k (subgroup groups sharing a k-step) must be 1, 2 or 4")
        if self.tail < 0 or (self.tail and self.split == 1):
            raise ValueError(f"{self}: tail (the tile columns whose K is split) must be 0, or positive with split > 1")
        if self.stages not in (1, 2):
            raise ValueError(f"{self}: stages must be 1 or 2")
        if self.stages == 2 and not self.prefetch:
            raise ValueError(f"{self}: two stages always prefetch (the next k-step is stored while this one is multiplied)")

    @property
    def label(self) -> str:
        return (f"{self.wm}x{self.wn}/sg{self.sg_m}x{self.sg_n}" + (f"x{self.sg_k}" if self.sg_k > 1 else "") + f"/bk{self.bk}" + (f"/split{self.split}" if self.split > 1 else "")
                + (f"/tail{self.tail}" if self.tail else "") + f"/s{self.stages}" + (f"/g{self.group}" if self.group > 1 else "")
                + ("" if self.prefetch else "/noprefetch") + ("/v4" if self.vec4 else ""))

    def problem(self, frag, subgroup: int, workgroup_bytes: int, n: int | None = None) -> str | None:
        """The first rule these tiles break for fragments ``frag`` (a schedule.spec.MatrixConfig), this
        subgroup size and (given) an output N wide, or None."""
        if n is not None and self.tail >= -(-n // self.wn):
            return f"tail {self.tail} must be fewer than the {-(-n // self.wn)} tile columns of N = {n}"
        if self.wm % (self.sg_m * frag.m) or self.wn % (self.sg_n * frag.n):
            return f"WM / SG_M and WN / SG_N must be multiples of the {frag.m}x{frag.n} fragment"
        if self.bk % frag.k or self.bk % 4:
            return f"BK must be a multiple of the fragment's K {frag.k} and of 4"
        if (self.bk // frag.k) % self.sg_k:
            return f"BK = {self.bk} must hold {self.sg_k} (sg_k) groups' fragments of K {frag.k}"
        if self.vec4 and (frag.m % 4 or frag.n % 4 or frag.k % 4):
            return f"vec4 staging needs fragments ({frag.m}x{frag.n}, k {frag.k}) that start on whole vec4s"
        threads = self.subgroups * subgroup
        if (self.wm * self.bk) % (4 * threads) or (self.wn * self.bk) % (4 * threads):
            return f"each of the {threads} invocations must fetch the same number of vec4s of each tile"
        if threads > 256:
            return f"{self.subgroups} subgroups of {subgroup} exceed 256 invocations"
        if self.workgroup_bytes(frag) > workgroup_bytes:
            return f"{self.workgroup_bytes(frag)} bytes of workgroup memory, the device allows {workgroup_bytes}"
        return None

    @property
    def subgroups(self) -> int:
        """Subgroups a workgroup: SG_M x SG_N blocks of the tile, sg_k of each."""
        return self.sg_m * self.sg_n * self.sg_k

    def staged(self, rows: int, by_k: bool) -> tuple[int, int]:
        """(row stride, f16 elements) of one stage of an operand's workgroup tile: [rows][BK] when
        the operand is read along K, [BK][rows] when its rows are contiguous (so staging never
        transposes). Rows are padded by 8 f16 (16 bytes, as NVIDIA's cooperative-matrix sample skews
        its uvec4 tiles) so the fragment loads' rows start in different banks."""
        stride = (rows if by_k else self.bk) + 8
        return stride, stride * (self.bk if by_k else rows)

    @property
    def unit(self) -> int:
        """f16 elements per element of the workgroup tiles' arrays (offsets and strides count these)."""
        return 4 if self.vec4 else 1

    def workgroup_bytes(self, frag) -> int:
        """The most workgroup memory these tiles take (either staging layout)."""
        tiles = sum(max(self.staged(rows, by_k)[1] for by_k in (False, True)) for rows in (self.wm, self.wn))
        return 2 * self.stages * tiles + 4 * self.subgroups * frag.m * frag.n


@dataclass(frozen=True)
class AttentionTiles:
    """Block sizes of one attention kernel; schedule/attention.py's ``tiles_problem`` states the rules
    they must keep.

    rows: rows a workgroup owns (queries; keys for dkdv); tile: rows streamed per step (keys;
    queries for dkdv); row_threads: invocations per owned row; threads = rows * row_threads.
    """
    rows: int
    tile: int
    row_threads: int

    @property
    def threads(self) -> int:
        return self.rows * self.row_threads


@dataclass(frozen=True)
class MatrixAttentionTiles:
    """Block sizes of the matrix-unit attention kernels: ``rows`` owned rows per workgroup
    (queries; keys for dkdv), one subgroup per fragment height of them; ``tile`` rows streamed per
    step (keys; queries for dkdv). ``vec4``: the head-dim tiles (q, k, v, dO) are typed
    array<vec4<f16>>, staged one fetched vec4 a store, fragments loaded in vec4 units (as
    MatrixTiles.vec4); P and dS, stored a score at a time, stay f16. ``double``: the streamed tiles
    double-buffered (k and v; dkdv's q, dO and their lse and D): each step stores the next step's tiles
    into the other buffer after its first barrier, so no barrier opens or closes a step; the forward then
    keeps o in fragments that P v accumulates into, rescaled through workgroup memory only in a step
    where some row's maximum outgrew the one its sums use by RESCALE_SLACK. ``shuffle`` (the forward,
    on a device with subgroups): a row's invocations, all in one subgroup, meet on its maximum and its
    sum by subgroup shuffles instead of through workgroup memory, one barrier fewer a key tile.
    ``pair``: a workgroup takes two blocks, j and its mirror n - 1 - j, so that under the causal mask
    each streams about the same tiles (half the workgroups, none twice as long as the average)."""
    rows: int
    tile: int
    vec4: bool = False
    double: bool = False
    shuffle: bool = False
    pair: bool = False


@dataclass(frozen=True)
class ColumnTiles:
    """How a column reduction spreads over the GPU: its reduced loop cut into ``split`` slices,
    each summed by its own workgroups (heuristics.column_split picks it; tests and the autotuner
    may give it)."""
    split: int = 1

    def __post_init__(self):
        if self.split not in COLUMN_SPLITS:
            raise ValueError(f"ColumnTiles.split must be one of {COLUMN_SPLITS}, got {self.split!r}")
