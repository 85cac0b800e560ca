"""Default tiles: what a planner takes when the caller gives none, and where the autotuner starts.

Layer: imports only tune/tiles.py; schedule's planners import this module, never the reverse.

Each constant names the measurement it was read from (benches/results/, docs/journal.md). WebGPU
reports no SM count, so the rules that size a grid to fill the GPU (BUSY_GROUPS, H200_WAVE,
COLUMN_BUSY) keep the H200's 132 SMs as "a big GPU": a smaller GPU runs the same grids in more
waves, where an extra K split costs one short reduce pass and a ragged last wave matters less. What
must fit the device is read from the adapter's limits instead: the planners pass ``fits`` (the
template's rules at the device's workgroup memory and subgroup size), and a pick that does not fit
gives way to the first fallback that does. LFM2JIT_AUTOTUNE=1 measures the device where guesses fall short.
"""
from __future__ import annotations

from dataclasses import replace
from typing import Callable

from .tiles import COLUMN_SPLITS, AttentionTiles, MatrixAttentionTiles, MatrixTiles, TileConfig

# ---- SIMT GEMM (the portable template; every pick fits WebGPU's default limits) ----

LONG_K = 2048         # K split over 2 from here: won 5 of 6 at 1x512, 1x2048 (H200: h200_tune_log_1x512_1x2048.json)
SHORT_K = 1024        # small outputs split K over 4 from here: won 2 of 3, by 6-30% (same log)
SMALL_OUTPUT = 128    # fewer 64x128 tiles is a small output; with more, split-K lost all 8 (H200: h200_tune_log_8x512.json)
SPLIT_K_TILES = 1024  # long K splits up to this many 64x128 tiles: won 11 of 12 at 8x512 (same log)
SIMT_TILES = TileConfig(64, 128, 16, 8, 8, vec=True)      # the tuner's usual winner (H200: h200_tune_log_8x512.json)
SIMT_SMALL_TILES = TileConfig(64, 64, 8, 4, 4, vec=True)  # small outputs, short K: more workgroups (same log)


def matmul_tiles(m: int, n: int, k: int) -> TileConfig:
    """SIMT tiles for an M x N output summed over K: split-K where few tiles meet a long K."""
    groups = -(-m // 64) * -(-n // 128)
    if groups < SMALL_OUTPUT and k >= SHORT_K:
        return replace(SIMT_TILES, split=4)
    if k >= LONG_K and groups <= SPLIT_K_TILES:
        return replace(SIMT_TILES, split=2)
    if groups >= SMALL_OUTPUT:
        return SIMT_TILES
    return SIMT_SMALL_TILES


# ---- the matrix-unit GEMM ----

# Sources: benches/results/h200_*; "same file" is the line above's.
NARROW = 16               # outputs this thin (LoRA ranks, decode rows) take one-fragment-thin tiles (h200_narrow_tiles.log)
NARROW_SLICE = 256        # the shortest share of K a thin output's split leaves a slice (same file)
BUSY_GROUPS = 128         # workgroups that keep the H200's 132 SMs busy (its SM count)
ONE_STEP_K = 32           # K this short (LoRA's up-projections) is one k-step of the tiles' BK
SMALL_MATRIX_GRID = 128   # fewer 128x128 tiles take 64x64 ones (T = 512: h200_tune_log_f16_1x512.json)
LARGE_MATRIX_GRID = 256   # from this many 128x128 tiles, 2x2 subgroups without prefetch (h200_mtiles_unmasked.json)
HUGE_MATRIX_GRID = 1024   # dW shorter than LONG_K takes 128x128 tiles from this many (h200_tune_log_f16_1x512.json)
SPLIT_WAVE_K = 4096       # a wave of 128x128 tiles over this K splits it in 2: 1.25-1.3x (h200_mtiles_wave_split.json)
DW_TAIL_SPLIT = 8         # dW's split tail cuts each tail tile's K in 8: 1.25x at T = 2048 (h200_mtiles_dw_tail.json)
H200_WAVE = 2 * 132       # 128x128 2x2-subgroup workgroups at once: 132 SMs, 2 by registers (h200_mtiles_split_tail.log)
MANY_ACCUMULATORS = 8     # subgroups with more store one a round: 4 a round ran 1.4-1.8x slower (h200_mtiles_epilogue.json)
SMALL_MATRIX_TILES = MatrixTiles(64, 64, 2, 2, 32)      # small grids (h200_tune_log_f16_1x512.json)
SMALL_MATRIX_SPLIT_TILES = replace(SMALL_MATRIX_TILES, split=2)     # small grids, K >= LONG_K: 1.05-1.3x (same file)
JUST_OVER_A_WAVE_TILES = MatrixTiles(256, 128, 4, 2, 32, prefetch=False)   # 1-2 waves, short K: 1.6x y (same file)
MATRIX_TILES = MatrixTiles(128, 128, 2, 4, 32)          # grids under LARGE_MATRIX_GRID (h200_mtiles_unmasked.json)
LARGE_MATRIX_TILES = MatrixTiles(128, 128, 2, 2, 32, prefetch=False)   # 1.1-1.25x prefetching: registers are short (same)
TAIL_BASE_TILES = LARGE_MATRIX_TILES                    # dW over LONG_K: 1.2-1.55x 128x256 at T = 2048 (same file)
WAVE_SPLIT_TILES = replace(LARGE_MATRIX_TILES, split=2)   # at most a wave, K >= SPLIT_WAVE_K (h200_mtiles_wave_split.json)
# the experts' grouped GEMMs over rows, where the dense rules take tall tiles: an expert's last tile row
# wastes less at 96 rows; forward 1.33x / 1.38x a dense GEMM's time, dX 1.46x / 1.29x (gate_up / down)
# against 1.46x / 1.44x and 1.54x / 1.39x at 128 rows (H100: h100_grouped_tiles.log)
GROUPED_FWD_TILES = MatrixTiles(96, 128, 2, 2, 32)
GROUPED_DX_TILES = MatrixTiles(96, 256, 2, 4, 32)
GROUPED_TILES = {2: GROUPED_FWD_TILES, 1: GROUPED_DX_TILES}     # by k_contiguous
# where the pick does not fit the device's workgroup memory or subgroup size: the first of these that does
MATRIX_FALLBACK = (SMALL_MATRIX_TILES, MatrixTiles(32, 64, 1, 2, 32))


def tail_columns(m: int, n: int, tiles: MatrixTiles = TAIL_BASE_TILES, wave: int = H200_WAVE) -> int:
    """How many of the last tile columns hold the tiles of a grid's last, partial wave (0: the grid
    is under one wave or ends in a full one; then a split tail has nothing to fill)."""
    cols, rows = -(-n // tiles.wn), -(-m // tiles.wm)
    waves, over = divmod(cols * rows, wave)
    tail = -(-over // rows)
    return tail if waves and over and tail < cols else 0


def narrow_simt_tiles(thin: str, split: int = 1) -> TileConfig:
    """SIMT tiles 8 across the thin side ("m" or "n": a LoRA rank's), 128 along the other, each
    invocation one row of the long side: the reads of a GEMV, not a fragment's 16 of which 8 are used."""
    return TileConfig(8, 128, 16, 8, 1, split=split) if thin == "m" else TileConfig(128, 8, 16, 1, 8, split=split)


def narrow_matrix_tiles(thin: str, split: int = 1) -> MatrixTiles:
    """One fragment across the thin side ("m" or "n"), 128 along the other in 4 subgroups."""
    return MatrixTiles(16, 128, 1, 4, 32, split=split) if thin == "m" else MatrixTiles(128, 16, 4, 1, 32, split=split)


def matrix_tiles(m: int, n: int, k: int, k_contiguous: int, fits: Callable[[MatrixTiles], bool]) -> MatrixTiles:
    """Tiles for an M x N output summed over K with ``k_contiguous`` operands read along K: the
    H200's pick where it ``fits`` the device, else the first of MATRIX_FALLBACK that does (or the
    last, for the planner to name the rule it breaks)."""
    pick = _h200_matrix_tiles(m, n, k, k_contiguous)
    return next((t for t in (pick, *MATRIX_FALLBACK) if fits(t)), SMALL_MATRIX_TILES)


def grouped_matrix_tiles(m: int, n: int, k: int, k_contiguous: int, fits: Callable[[MatrixTiles], bool]) -> MatrixTiles:
    """Tiles for the experts' grouped GEMMs (``k_contiguous`` 2: the forward, 1: dX, 0: dW): the
    dense rules', unless those take tiles 128 rows tall or more and the experts' pick ``fits``."""
    dense = matrix_tiles(m, n, k, k_contiguous, fits)
    pick = GROUPED_TILES.get(k_contiguous)
    return pick if pick is not None and dense.wm >= 128 and fits(pick) else dense


def _h200_matrix_tiles(m: int, n: int, k: int, k_contiguous: int) -> MatrixTiles:
    """The best tiles the H200 measured for each kind of product (the constants name the files)."""
    if min(m, n) <= NARROW:        # one fragment thin, K split until BUSY_GROUPS run, slices NARROW_SLICE long
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
    if k_contiguous == 0 and k >= LONG_K:      # dW = dY^T X over many tokens
        tail = tail_columns(m, n)
        if tail and tail * -(-m // 128) <= H200_WAVE // 4:      # a last wave at most a quarter full
            return replace(TAIL_BASE_TILES, split=DW_TAIL_SPLIT, tail=tail)
        return TAIL_BASE_TILES
    if k_contiguous == 0 and grid < HUGE_MATRIX_GRID:
        return SMALL_MATRIX_TILES
    if grid < LARGE_MATRIX_GRID and k > ONE_STEP_K:
        return MATRIX_TILES
    return LARGE_MATRIX_TILES


# ---- attention ----

TARGET_THREADS = 128      # invocations per SIMT attention workgroup: a design choice, the autotuner searches around it
SLICE_COLUMNS = 16        # accumulator columns per invocation to aim for (E / row_threads): likewise
MAX_STREAMED = 64         # the longest streamed SIMT tile tried first
# the matrix attention tiles, in the order a kernel falls back through them (and the autotuner tries them)
MATRIX_ATTENTION_CANDIDATES = (MatrixAttentionTiles(64, 64), MatrixAttentionTiles(64, 32), MatrixAttentionTiles(32, 64),
                               MatrixAttentionTiles(32, 32), MatrixAttentionTiles(16, 32), MatrixAttentionTiles(64, 16),
                               MatrixAttentionTiles(32, 16), MatrixAttentionTiles(16, 16))
# each kernel's fastest at T = 2048, H = 16, G = 8, E = 64 (H200, h200_atiles_spill_rounds.json); causal
# blocks paired: fwd 1.21x, dq 1.23x, dkdv 1.16x there (H100, h100_atiles_double.json)
MATRIX_ATTENTION_PREFERRED = {"fwd": (MatrixAttentionTiles(64, 32, pair=True),),
                              "dq": (MatrixAttentionTiles(32, 16, pair=True),),
                              "dkdv": (MatrixAttentionTiles(32, 16, pair=True),)}


def row_threads(e: int) -> int:
    """Invocations per row: enough that each owns about SLICE_COLUMNS accumulator columns (at most 8)."""
    s = 1
    while s < 8 and e % (2 * s) == 0 and e // (2 * s) >= SLICE_COLUMNS:
        s *= 2
    return s


def attention_tiles(e: int, fits: Callable[[AttentionTiles], bool]) -> AttentionTiles | None:
    """SIMT attention tiles at head dim ``e``: rows for about TARGET_THREADS invocations, then the
    longest streamed tile that ``fits`` the template; None if none does."""
    s = row_threads(e)
    rows = max(16, min(64, TARGET_THREADS // s))
    tile = MAX_STREAMED
    while tile > 1:
        if fits(AttentionTiles(rows, tile, s)):
            return AttentionTiles(rows, tile, s)
        tile //= 2
    return None


def matrix_attention_tiles(mode: str, fits: Callable[[MatrixAttentionTiles], bool]) -> MatrixAttentionTiles | None:
    """The ``mode`` (fwd, dq, dkdv) matrix kernel's first preference that ``fits`` the device, then
    the first of MATRIX_ATTENTION_CANDIDATES; None if none does (the kernel stays SIMT)."""
    return next((t for t in (*MATRIX_ATTENTION_PREFERRED[mode], *MATRIX_ATTENTION_CANDIDATES) if fits(t)), None)


# ---- loads in flight ----

PER_INVOCATION = 4             # elements a pointwise invocation computes: SwiGLU and adds 17-29% faster (H200, docs/journal.md)
UNROLL_MIN_ELEMENTS = 1 << 18  # smaller spaces keep one element an invocation: their workgroups are few
ROW_UNROLL = 4                 # the most strides a row pass takes a trip: the gradient norm 8.31 -> 5.88 ms (H200, likewise)


# ---- column reductions ----

COLUMN_BUSY = 256      # workgroups a split column reduction aims for: about 2 per H200 SM, not timed yet
COLUMN_SLICE = 4096    # the fewest iterations of the reduced loop a slice keeps: likewise untimed


def column_split(groups: int, reach: int, phases: int) -> int:
    """Slices for a column reduction of ``groups`` workgroups over a loop of up to ``reach``
    iterations: doubled while the workgroups stay within COLUMN_BUSY and each slice keeps
    COLUMN_SLICE iterations. Only a single reduction splits (a second one would need the first's
    finished result inside its loop)."""
    split = 1
    while (phases == 1 and 2 * split <= COLUMN_SPLITS[-1] and 2 * split * groups <= COLUMN_BUSY
           and reach // (2 * split) >= COLUMN_SLICE):
        split *= 2
    return split
