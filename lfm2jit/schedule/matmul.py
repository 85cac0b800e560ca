"""Contraction schedule: ``out[.., m, n] = sum_k a[.., m, k] * b[.., n, k]`` as a tiled GEMM.

The operands' axis order is free (x @ W^T, dY^T X and dY W are all the same template with other
strides). Two templates, one planner:

* ``matmul`` (SIMT, portable): one workgroup computes a BM x BN tile; each invocation a TM x TN
  micro-tile held in named accumulators; K advances BK at a time through workgroup memory.
* ``matmul_matrix`` (the matrix units, where the device has f16 subgroup matrices and an operand is
  stored as f16): subgroups multiply 16x16 fragments of f16 tiles staged in workgroup memory into
  f32 accumulators.

Both mask the edges, run an axis that is T only to the real length (padded rows never enter a
sum), and share the epilogue: accumulate, f16 or f32 output, split-K with a deterministic reduce.
The matrix template can also split K in the last tile columns only (``MatrixTiles.tail``), so the
tiles that would run in a last, mostly idle wave of workgroups are spread over more of them.
"""
from __future__ import annotations

from dataclasses import dataclass, field, replace

from ..ir.nodes import SEQ_AXIS, KernelIR, toposort
from ..ir.ops import Op
from ..ir.partition import find_contraction, gemm_axes
from .code import COMPUTE_TYPE, Index, Let, Value, Var
from .lower import Lowerer
from .layout import extent, strides
from .spec import EntryPoint, MatrixConfig, Plan, Scratch


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


REDUCE_THREADS = 256
MAX_WORKGROUPS = 65535    # WebGPU's maxComputeWorkgroupsPerDimension (its default limit)
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
class Term:
    """One more contraction summed into the same output (y = x W^T + u B^T): a phase of the K
    loop that runs after the first, over its own K with its own operands."""
    a: Operand
    b: Operand
    k_ext: Index
    k: str


@dataclass(frozen=True)
class GemmParams:
    """What both GEMM templates are given besides their tiles: extents, operands, output, split-K
    layout, the further terms of the sum, and the epilogue: ``lets`` computing the stored value
    (``result``) from the sum (bound as ``dot``) and values at the output element (gm, gn, batch);
    no lets and no result store the sum itself. ``also``: further outputs of the same shape stored
    from the same sum, each with its value (None: the sum itself), computed by the same lets."""
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
    more: tuple[Term, ...] = field(default=(), kw_only=True)
    epilogue: tuple[Let, ...] = field(default=(), kw_only=True)
    result: Value | None = field(default=None, kw_only=True)
    also: tuple[tuple[Output, Value | None], ...] = field(default=(), kw_only=True)

    @property
    def split_n0(self) -> int:      # split-K's workspace holds every column (see MatrixParams)
        return 0

    @property
    def terms(self) -> tuple[Term, ...]:
        """Every phase of the K loop, the first one's operands first."""
        return (Term(self.a, self.b, self.k_ext, self.axes[2]),) + self.more


@dataclass(frozen=True)
class MatmulParams(GemmParams):
    tiles: TileConfig

    @property
    def threads(self) -> int:
        return self.tiles.threads


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
    each step, which holds fewer registers (and on the H200 ran 128x128 tiles 1.1-1.25x faster:
    the accumulators leave little room)."""
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

    def __post_init__(self):
        if min(self.wm, self.wn, self.sg_m, self.sg_n, self.bk, self.group) < 1 or self.split not in (1, 2, 4, 8):
            raise ValueError(f"{self}: sizes must be positive and split 1, 2, 4 or 8")
        if self.tail < 0 or (self.tail and self.split == 1):
            raise ValueError(f"{self}: tail (the tile columns whose K is split) must be 0, or positive with split > 1")
        if self.stages not in (1, 2):
            raise ValueError(f"{self}: stages must be 1 or 2")
        if self.stages == 2 and not self.prefetch:
            raise ValueError(f"{self}: two stages always prefetch (the next k-step is stored while this one is multiplied)")

    @property
    def label(self) -> str:
        return (f"{self.wm}x{self.wn}/sg{self.sg_m}x{self.sg_n}/bk{self.bk}" + (f"/split{self.split}" if self.split > 1 else "")
                + (f"/tail{self.tail}" if self.tail else "") + f"/s{self.stages}" + (f"/g{self.group}" if self.group > 1 else "")
                + ("" if self.prefetch else "/noprefetch"))

    def problem(self, frag: MatrixConfig, subgroup: int, workgroup_bytes: int, n: int | None = None) -> str | None:
        """The first rule these tiles break for fragments ``frag``, this subgroup size and (given)
        an output N wide, or None."""
        if n is not None and self.tail >= -(-n // self.wn):
            return f"tail {self.tail} must be fewer than the {-(-n // self.wn)} tile columns of N = {n}"
        if self.wm % (self.sg_m * frag.m) or self.wn % (self.sg_n * frag.n):
            return f"WM / SG_M and WN / SG_N must be multiples of the {frag.m}x{frag.n} fragment"
        if self.bk % frag.k or self.bk % 4:
            return f"BK must be a multiple of the fragment's K {frag.k} and of 4"
        threads = self.sg_m * self.sg_n * subgroup
        if (self.wm * self.bk) % (4 * threads) or (self.wn * self.bk) % (4 * threads):
            return f"each of the {threads} invocations must fetch the same number of vec4s of each tile"
        if self.sg_m * self.sg_n * subgroup > 256:
            return f"{self.sg_m * self.sg_n} subgroups of {subgroup} exceed 256 invocations"
        if self.workgroup_bytes(frag) > workgroup_bytes:
            return f"{self.workgroup_bytes(frag)} bytes of workgroup memory, the device allows {workgroup_bytes}"
        return None

    def staged(self, rows: int, by_k: bool) -> tuple[int, int]:
        """(row stride, f16 elements) of one stage of an operand's workgroup tile: [rows][BK] when
        the operand is read along K, [BK][rows] when its rows are contiguous (so staging never
        transposes). Rows are padded by 8 f16 so the fragment loads' rows start in different banks."""
        stride = (rows if by_k else self.bk) + 8
        return stride, stride * (self.bk if by_k else rows)

    def workgroup_bytes(self, frag) -> int:
        """The most workgroup memory these tiles take (either staging layout)."""
        tiles = sum(max(self.staged(rows, by_k)[1] for by_k in (False, True)) for rows in (self.wm, self.wn))
        return 2 * self.stages * tiles + 4 * self.sg_m * self.sg_n * frag.m * frag.n


@dataclass(frozen=True)
class StageLayout:
    """One phase's workgroup tiles: whether each is staged [k][rows], and its row stride and
    f16 elements per stage."""
    a_by_k: bool
    b_by_k: bool
    a_stride: int
    a_tile: int
    b_stride: int
    b_tile: int


@dataclass(frozen=True)
class MatrixParams(GemmParams):
    tiles: MatrixTiles
    frag: MatrixConfig
    subgroup_size: int
    emulated: bool = False          # subgroup-matrix operations written out in plain WGSL (Target.emulated)
    epilogue_frags: int = 1         # accumulator fragments each subgroup puts through workgroup memory at once

    @property
    def threads(self) -> int:
        return self.tiles.sg_m * self.tiles.sg_n * self.subgroup_size

    @property
    def fm(self) -> int:            # accumulator fragments per subgroup along M
        return self.tiles.wm // self.tiles.sg_m // self.frag.m

    @property
    def fn(self) -> int:            # ... and along N
        return self.tiles.wn // self.tiles.sg_n // self.frag.n

    def layout(self, term: Term) -> "StageLayout":
        """How one phase stages its operands: a tile [k][rows] where the operand's rows are
        contiguous in memory, [rows][k] where K is (see MatrixTiles.staged)."""
        a_stride, a_tile = self.tiles.staged(self.tiles.wm, not term.a.k_fast)
        b_stride, b_tile = self.tiles.staged(self.tiles.wn, not term.b.k_fast)
        return StageLayout(not term.a.k_fast, not term.b.k_fast, a_stride, a_tile, b_stride, b_tile)

    @property
    def stage_words(self) -> tuple[int, int]:
        """f16 elements of one stage of As and Bs: room for every phase's layout."""
        layouts = [self.layout(t) for t in self.terms]
        return max(ly.a_tile for ly in layouts), max(ly.b_tile for ly in layouts)

    @property
    def tiles_x(self) -> int:       # tile columns (along N) ...
        return -(-self.n_size // self.tiles.wn)

    @property
    def tiles_y(self) -> int:       # ... and tile rows (along M)
        return -(-self.m_pad // self.tiles.wm)

    @property
    def split_n0(self) -> int:
        """The first output column whose K is split: 0 when every tile splits, the start of the
        tail's tile columns otherwise (split-K's workspace holds the columns from it on)."""
        if self.tiles.split == 1:
            return self.n_size
        return (self.tiles_x - self.tiles.tail) * self.tiles.wn if self.tiles.tail else 0

    @property
    def destinations(self) -> tuple[str, ...]:
        """Where the workgroups' sums go: C ("c"), split-K's workspace ("ws"), or (a split tail)
        C from the tiles that sum all of K and the workspace from the tail's."""
        if self.tiles.split == 1:
            return ("c",)
        return ("c", "ws") if self.tiles.tail else ("ws",)

    @property
    def direct_store(self) -> bool:
        """Whether interior tiles store whole accumulator fragments straight to C (row-major)
        instead of element by element through workgroup memory: f32 outputs with contiguous rows at
        least a fragment wide. Dawn wants every buffer a fragment is stored into to hold one
        fragment at least, so outputs sized by the sequence length (which may be shorter than a
        fragment) keep the element-wise path. Edges go element by element."""
        fragment = self.frag.m * self.frag.n
        return (self.result is None and not self.also and not self.c.convert and self.c.sn == 1 and self.c.sm >= self.frag.n
                and SEQ_AXIS not in self.axes[:2] and self.axes[3] != SEQ_AXIS and self.batches * self.m_pad * self.n_size >= fragment)

    @property
    def direct_store_ws(self) -> bool:
        """The same for split-K's f32 workspace [batch, split, M, N - split_n0]."""
        cols = self.n_size - self.split_n0
        return cols >= self.frag.n and self.tiles.split * self.batches * self.m_pad * cols >= self.frag.m * self.frag.n


MANY_ACCUMULATORS = 8  # a subgroup holding more fragments than this puts them out one a round


def epilogue_frags(p: MatrixParams, workgroup_bytes: int) -> int:
    """How many of a subgroup's accumulator fragments along N go out through workgroup memory per
    round (one barrier pair each): a whole row of them where the device's workgroup memory holds it,
    else the largest divisor that fits. On the H200 two a round ran subgroups of 8 accumulators
    1.0-1.7x faster than one (short K and LoRA's rank-8 up-projections gained most), while four a
    round ran subgroups of 16 (128x128 tiles of 2x2) 1.4-1.8x slower, so those keep one
    (benches/README.md, "The matrix GEMM's epilogue"). Outputs stored straight from the fragments
    use the scratch at edge tiles only, and keep one too."""
    direct = {"c": p.direct_store, "ws": p.direct_store_ws}
    if all(direct[d] for d in p.destinations) or p.fm * p.fn > MANY_ACCUMULATORS:
        return 1
    per_frag = 4 * p.tiles.sg_m * p.tiles.sg_n * p.frag.m * p.frag.n
    room = workgroup_bytes - p.tiles.workgroup_bytes(p.frag)
    return max(d for d in range(1, p.fn + 1) if p.fn % d == 0 and (d - 1) * per_frag <= room)


NARROW = 16            # an output at most this thin along M or N (a LoRA rank, a decode step's rows)
NARROW_SLICE = 256     # the shortest share of K a thin output's split-K leaves each slice
BUSY_GROUPS = 128      # workgroups that keep an H200's 132 SMs busy
ONE_STEP_K = 32        # contractions this short (LoRA's up-projections) run one k-step
SMALL_MATRIX_GRID = 128   # fewer 128x128 tiles than this take 64x64 ones
LARGE_MATRIX_GRID = 256   # from this many 128x128 tiles, 2x2 subgroups without prefetch
HUGE_MATRIX_GRID = 1024   # dW shorter than LONG_K takes 128x128 tiles from this many on
SMALL_MATRIX_TILES = MatrixTiles(64, 64, 2, 2, 32)
SMALL_MATRIX_SPLIT_TILES = MatrixTiles(64, 64, 2, 2, 32, split=2)
JUST_OVER_A_WAVE_TILES = MatrixTiles(256, 128, 4, 2, 32, prefetch=False)
SPLIT_WAVE_K = 4096       # a wave of 128x128 tiles summing this much or more splits K over 2
WAVE_SPLIT_TILES = MatrixTiles(128, 128, 2, 2, 32, split=2, prefetch=False)


DW_TAIL_SPLIT = 8         # dW's split tail: each tail tile's K in 8 slices
H200_WAVE = 2 * 132       # 128x128 workgroups of 2x2 subgroups an H200 runs at once (132 SMs, 2 each by registers)
TAIL_BASE_TILES = MatrixTiles(128, 128, 2, 2, 32, prefetch=False)


def tail_columns(m: int, n: int, tiles: MatrixTiles = TAIL_BASE_TILES, wave: int = H200_WAVE) -> int:
    """How many of the last tile columns hold the tiles of a grid's last, partial wave (0: the grid
    is under one wave or ends in a full one; then a split tail has nothing to fill)."""
    cols, rows = -(-n // tiles.wn), -(-m // tiles.wm)
    waves, over = divmod(cols * rows, wave)
    tail = -(-over // rows)
    return tail if waves and over and tail < cols else 0


def narrow_matrix_tiles(thin: str, split: int = 1) -> MatrixTiles:
    """One fragment across the thin side ("m" or "n"), 128 along the other in 4 subgroups."""
    return MatrixTiles(16, 128, 1, 4, 32, split=split) if thin == "m" else MatrixTiles(128, 16, 4, 1, 32, split=split)


def choose_matrix_tiles(m: int, n: int, k: int, k_contiguous: int) -> MatrixTiles:
    """Tiles by what the H200 measured (benches/README.md, "Matrix units" and "LoRA"; best of each
    product over the candidates at 4096^3, the LFM2-350M shapes at T = 2048 and 4096, and
    LFM2-1.2B's rank-8 products), by the grid of 128x128 tiles:

    * fewer than 128: 64x64 tiles (bigger ones leave SMs idle), K split over 2 for y and dX from
      LONG_K (T = 512's 512x1024x4608: 1.05x y, 1.3x dX; the LM head's dh 1.2x);
    * y = x W^T and dX = dY W (an operand read along K): at most a wave of 128x128 tiles summing
      SPLIT_WAVE_K or more, those tiles with K split over 2, without prefetch (T = 2048's
      2048x1024x4608: 1.25x y, 1.3x dX; at K = 3072 no gain); over a wave but under two
      (BUSY_GROUPS to 2 x BUSY_GROUPS) with K short of LONG_K (and longer than one k-step), 256x128 tiles of 4x2 subgroups
      without prefetch, one wave (T = 512's 512x4608x1024: 1.6x y, 1.2x dX); 128x128 tiles of 2x4
      subgroups below 256 tiles, of 2x2 subgroups without prefetch from 256 (1.1-1.25x the
      prefetching 2x2 at 4096^3 and the T = 4096 shapes: its registers are short);
    * dW = dY^T X (no operand read along K), summed over LONG_K tokens or more: 128x128 tiles of
      2x2 subgroups without prefetch (since the k-steps inside both operands are fetched unmasked:
      1.2x 128x256 at 4096^3, 1.2-1.55x at T = 2048, 0.9x the best, 64x64, at 2048x4608x1024),
      where the grid ends in a wave at most a quarter full with K split over DW_TAIL_SPLIT in the
      tile columns that hold that wave's tiles (T = 2048's 288 tiles of 4608x1024 and 1024x4608:
      1.25x and 1.27x; a split tail made 4096^3's forward 7% slower, with a last wave 88% full); over
      fewer (T = 512, where 128x256 tiles made dW 1.27x slower in the train step) 64x64 tiles, or
      128x128 ones like the other products from 1024 tiles.

    Outputs at most NARROW thin (LoRA's x A^T, dY B and its rank-r weight gradients) take tiles one
    fragment thin (square tiles would compute mostly padding), K split until BUSY_GROUPS
    workgroups run, each slice summing NARROW_SLICE or more. The T = 512 rules are read from the
    autotuner's log of a --f16 step at 1x512 (benches/results/h200_tune_log_f16_1x512.json)."""
    if min(m, n) <= NARROW:
        grid = -(-max(m, n) // 128)
        split = next((s for s in (1, 2, 4) if grid * s >= BUSY_GROUPS), 8)
        while split > 1 and k // split < NARROW_SLICE:
            split //= 2
        return narrow_matrix_tiles("m" if m <= n else "n", split)
    grid = -(-m // 128) * -(-n // 128)
    if grid < SMALL_MATRIX_GRID:
        return SMALL_MATRIX_SPLIT_TILES if k_contiguous and k >= LONG_K else SMALL_MATRIX_TILES
    if k_contiguous and grid <= BUSY_GROUPS and k >= SPLIT_WAVE_K:
        return WAVE_SPLIT_TILES
    if k_contiguous and BUSY_GROUPS < grid < 2 * BUSY_GROUPS and ONE_STEP_K < k < LONG_K:
        return JUST_OVER_A_WAVE_TILES
    if k_contiguous == 0 and k >= LONG_K:
        tail = tail_columns(m, n)
        if tail and tail * -(-m // 128) <= H200_WAVE // 4:      # a last wave at most a quarter full
            return replace(TAIL_BASE_TILES, split=DW_TAIL_SPLIT, tail=tail)
        return TAIL_BASE_TILES
    if k_contiguous == 0 and grid < HUGE_MATRIX_GRID:
        return SMALL_MATRIX_TILES
    if grid < LARGE_MATRIX_GRID and k > ONE_STEP_K:
        return MatrixTiles(128, 128, 2, 4, 32)
    return MatrixTiles(128, 128, 2, 2, 32, prefetch=False)


def contiguity(op: Operand, row_axis: str, k: str, sizes: dict[str, int]) -> str | None:
    """Which axis of an operand vec4 reads can run along: "k" when k is contiguous, "m" when the
    rows are, or None. The contiguous axis' size must be a known multiple of 4 (so a vec4 is wholly
    inside or outside the operand), never T (its extent is the real length), and the other strides
    multiples of 4."""
    if op.dtype not in ("f32", "f16") or op.sb % 4:
        return None
    if op.sk == 1 and k != SEQ_AXIS and sizes[k] % 4 == 0 and op.sm % 4 == 0:
        return "k"
    if op.sm == 1 and row_axis != SEQ_AXIS and sizes[row_axis] % 4 == 0 and op.sk % 4 == 0:
        return "m"
    return None


def vector_reads(tiles: TileConfig, op: Operand, row_axis: str, k: str, sizes: dict[str, int],
                 rows: int) -> str | None:
    """The contiguity the SIMT template reads an operand's tile by (see ``contiguity``), where its
    tiles allow: vec4 workgroup tiles, k-steps of whole vec4s, every invocation fetching the same
    number of vec4s. f16 operands are read as vec4<f16>."""
    if not tiles.vec or (rows * tiles.bk // 4) % tiles.threads:
        return None
    mode = contiguity(op, row_axis, k, sizes)
    return None if mode == "k" and tiles.bk % 4 else mode


def _epilogue(exprs, gemm, axes: dict, sizes: dict[str, int]) -> tuple[tuple[Let, ...], list[Value | None]]:
    """The lets that compute each output's epilogue expression (``gemm.epilogue_of`` its root; None
    where it stores the sum itself) from the sum (``dot``) at output element (gm, gn, batch),
    sharing what they have in common, and each output's stored value (None: the sum)."""
    if all(e is None for e in exprs):
        return (), [None] * len(exprs)
    index_of = {axes["m"]: Var("gm"), axes["n"]: Var("gn")} | ({axes["batch"]: Var("batch")} if axes["batch"] else {})
    lower = Lowerer(sizes, index_of, prefix="ep")
    bound: dict[int, str] = {}
    lower.bind(bound, gemm.acc, "dot")
    lets = tuple(lower.emit([e for e in exprs if e is not None], bound))
    return lets, [None if e is None else lower.ref(e, COMPUTE_TYPE[e.dtype], bound) for e in exprs]


def _operands(term, m_axis: str, n_axis: str):
    """(A, B) of a contraction: A is the operand that carries M."""
    a, b = term.srcs[0].srcs
    return (b, a) if n_axis in a.shape else (a, b)


def plan(ir: KernelIR, sizes: dict[str, int], accumulate: frozenset[str], tiles=None, target=None) -> Plan:
    """SIMT tiles, or the matrix units where the target has f16 subgroup matrices and an operand or
    the result is stored as f16 (f32 operands are converted to f16 as they are staged: a result
    stored as f16 keeps no more precision than that; f32 contractions keep f32). A sum of
    contractions runs its terms as phases of one K loop, the longest first (it picks the tiles)."""
    out = ir.outputs[0]
    root = ir.results[out.name]
    gemm = find_contraction(root, out.shape)      # every output is stored from this sum (partition.py)
    terms = sorted(gemm.terms, key=lambda t: -sizes[t.arg])
    axes = gemm_axes(terms[0], out.shape)
    m_axis, n_axis, k, bt = axes["m"], axes["n"], axes["k"], axes["batch"]
    a, b = _operands(terms[0], m_axis, n_axis)
    frag = target.matrix("f16", "f32") if target is not None and target.subgroup_size else None
    matrix = isinstance(tiles, MatrixTiles) or (tiles is None and frag is not None
                                                 and "f16" in (a.dtype, b.dtype, out.dtype))
    if matrix and frag is None:
        raise ValueError(f"{ir.name}: tiles={tiles!r} need a device with f16 subgroup matrices (the matrix units)")
    if matrix:
        k_contiguous = sum(strides(x.shape, sizes)[k] == 1 for x in (a, b))
        given, tiles = tiles, tiles or choose_matrix_tiles(sizes[m_axis], sizes[n_axis], sizes[k], k_contiguous)
        problem = tiles.problem(frag, target.subgroup_size, target.workgroup_bytes, sizes[n_axis])
        if problem and given is None:        # the H200's pick does not fit this device: the smallest tiles
            tiles = SMALL_MATRIX_TILES
            problem = tiles.problem(frag, target.subgroup_size, target.workgroup_bytes, sizes[n_axis])
        if problem:
            raise ValueError(f"{ir.name}: tiles {tiles} do not fit the matrix template: {problem}")
    else:
        tiles = tiles or choose_tiles(sizes[m_axis], sizes[n_axis], sizes[k])

    def operand(x, row_axis: str, rows: int, kk: str, vectors: bool = True) -> Operand:
        st = strides(x.shape, sizes)
        op = Operand(x.arg, x.dtype, st[row_axis], st[kk], st[bt] if bt else 0)
        if matrix:
            return replace(op, vec=contiguity(op, row_axis, kk, sizes) if vectors else None)
        vec = vector_reads(tiles, op, row_axis, kk, sizes, rows) if vectors else None
        return replace(op, vec=vec, loads=rows * tiles.bk // (4 if vec else 1) // tiles.threads)

    rows = (tiles.wm, tiles.wn) if matrix else (tiles.bm, tiles.bn)
    pairs = [_operands(t, m_axis, n_axis) for t in terms]

    def term_reads(scalar: frozenset = frozenset()):
        """Each term's operands; those named in ``scalar`` read element by element."""
        return [(operand(x, m_axis, rows[0], t.arg, x.arg not in scalar),
                 operand(y, n_axis, rows[1], t.arg, y.arg not in scalar)) for t, (x, y) in zip(terms, pairs)]
    modes: dict[str, set] = {}
    for pair in term_reads():
        for op in pair:
            modes.setdefault(op.tensor, set()).add(op.vec)
    # one binding has one element type: a tensor read two ways, or also read by the epilogue (element
    # by element), is read element by element everywhere
    stored = [gemm.epilogue_of(ir.results[o.name]) for o in ir.outputs]      # None: the output is the sum
    by_epilogue = {n.arg for n in toposort([e for e in stored if e is not None], stop={id(gemm.acc)}) if n.op == Op.INPUT}
    reads = term_reads(frozenset(n for n, seen in modes.items() if len(seen) > 1) | by_epilogue)
    ops = reads[0]
    batches = sizes[bt] if bt else 1
    lets, results = _epilogue(stored, gemm, axes, sizes)

    def output(o) -> Output:
        st = strides(o.shape, sizes)
        return Output(o.name, o.dtype, st[m_axis], st[n_axis], st[bt] if bt else 0, o.name in accumulate)
    common = dict(m_ext=extent(m_axis, sizes), n_ext=extent(n_axis, sizes), k_ext=extent(k, sizes), a=ops[0],
                  b=ops[1], c=output(out),
                  axes=(m_axis, n_axis, k, bt), m_pad=sizes[m_axis], n_size=sizes[n_axis], batches=batches,
                  reduce_threads=REDUCE_THREADS,
                  more=tuple(Term(x, y, extent(t.arg, sizes), t.arg) for t, (x, y) in zip(terms[1:], reads[1:])),
                  epilogue=lets, result=results[0],
                  also=tuple((output(o), r) for o, r in zip(ir.outputs[1:], results[1:])))
    if matrix:
        params = MatrixParams(tiles=tiles, frag=frag, subgroup_size=target.subgroup_size, emulated=target.emulated,
                              **common)
        template, params = "matmul_matrix", replace(params, epilogue_frags=epilogue_frags(params, target.workgroup_bytes))
        tile_m, tile_n = tiles.wm, tiles.wn
    else:
        template, params = "matmul", MatmulParams(tiles=tiles, **common)
        tile_m, tile_n = tiles.bm, tiles.bn
    vectors = tuple(dict.fromkeys((op.tensor, 4) for pair in reads for op in pair if op.vec))
    if matrix and tiles.tail:      # one row of workgroups: the whole-K tiles, then the tail's slices
        head = params.tiles_y * (params.tiles_x - tiles.tail)
        grid = (head + tiles.split * tiles.tail * params.tiles_y, 1, batches)
        if grid[0] > MAX_WORKGROUPS:
            raise ValueError(f"{ir.name}: tiles {tiles} need {grid[0]} workgroups in a row, WebGPU allows "
                             f"{MAX_WORKGROUPS}: take a shorter tail or a smaller split")
    else:
        grid = (-(-sizes[n_axis] // tile_n), -(-sizes[m_axis] // tile_m), batches * tiles.split)
    if tiles.split == 1:
        return Plan(template, params, (EntryPoint("main", grid),), vectors=vectors)
    # pass 1 writes each K slice's partial tile to a workspace [batch, split, M, N - split_n0]; pass 2
    # ("reduce", one invocation per workspace column of each row) sums the slices into the output
    elements = batches * sizes[m_axis] * (sizes[n_axis] - params.split_n0)
    return Plan(template, params, (EntryPoint("main", grid), EntryPoint("reduce", -(-elements // REDUCE_THREADS))),
                (Scratch("ws", "f32", tiles.split * elements),), vectors)
