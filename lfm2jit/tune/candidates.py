"""The tiles the autotuner tries for each schedule with knobs: the matmul and attention templates,
and the slices of a long narrow column reduction."""
from __future__ import annotations

import math
from dataclasses import replace

from ..schedule.attention import MATRIX_TEMPLATES, choose_tiles, tiles_problem
from .heuristics import (GROUPED_TILES, JUST_OVER_A_WAVE_TILES, LARGE_MATRIX_TILES, MATRIX_ATTENTION_CANDIDATES,
                         MATRIX_TILES, NARROW, SMALL_MATRIX_SPLIT_TILES, SMALL_MATRIX_TILES, TAIL_BASE_TILES,
                         TARGET_THREADS, WAVE_SPLIT_TILES, narrow_matrix_tiles, narrow_simt_tiles, tail_columns)
from .tiles import COLUMN_SPLITS, AttentionTiles, ColumnTiles, MatrixTiles, TileConfig

MIN_THREADS = 64             # fewest invocations per workgroup an attention candidate has
MAX_CANDIDATES = 8           # attention candidates per (mode, head dim)

MATMUL = (TileConfig(), TileConfig(bm=128, bn=128, bk=8, tm=8, tn=8), TileConfig(128, 64, 16, 8, 4),
          TileConfig(64, 128, 16, 4, 8), TileConfig(32, 32, 16, 2, 2), TileConfig(128, 128, 8, 8, 8, vec=True),
          TileConfig(64, 64, 16, 4, 4, vec=True), TileConfig(128, 128, 16, 8, 8, vec=True),
          TileConfig(128, 64, 16, 8, 8, vec=True), TileConfig(64, 128, 16, 8, 8, vec=True),
          TileConfig(64, 64, 16, 8, 8, vec=True), TileConfig(64, 64, 8, 4, 4, vec=True),
          TileConfig(64, 64, 8, 4, 4, vec=True, split=2), TileConfig(64, 64, 8, 4, 4, vec=True, split=4),
          TileConfig(64, 128, 16, 8, 8, vec=True, split=2), TileConfig(64, 128, 16, 8, 8, vec=True, split=4),
          TileConfig(64, 128, 8, 8, 8, vec=True), TileConfig(64, 128, 8, 8, 8, vec=True, double=True),
          TileConfig(128, 128, 8, 8, 8, vec=True, double=True), TileConfig(64, 64, 16, 4, 4, vec=True, double=True),
          TileConfig(128, 64, 8, 8, 8, vec=True, double=True))


def attention(mode: str, e: int) -> tuple[AttentionTiles, ...]:
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


MATRIX = (MatrixTiles(128, 128, 2, 2, 32), MatrixTiles(128, 128, 2, 2, 32, stages=2),
          MatrixTiles(128, 128, 2, 2, 32, group=1), MatrixTiles(64, 64, 2, 2, 32), MatrixTiles(128, 64, 2, 2, 32),
          MatrixTiles(64, 128, 2, 2, 32), MatrixTiles(128, 128, 2, 4, 32), MatrixTiles(128, 128, 4, 2, 32),
          MatrixTiles(64, 64, 2, 2, 32, split=2), MatrixTiles(64, 64, 2, 2, 32, split=4),
          MatrixTiles(128, 128, 2, 2, 64), MatrixTiles(64, 64, 2, 2, 64, stages=2), MatrixTiles(256, 128, 4, 2, 32),
          *(replace(t, prefetch=False) for t in (
              MatrixTiles(128, 128, 2, 2, 32), MatrixTiles(128, 128, 2, 4, 32), MatrixTiles(64, 64, 2, 2, 32),
              MatrixTiles(128, 64, 2, 2, 32), MatrixTiles(256, 128, 4, 2, 32), MatrixTiles(128, 256, 2, 4, 32),
              MatrixTiles(128, 128, 2, 2, 64), MatrixTiles(64, 64, 2, 2, 32, split=2),
              MatrixTiles(128, 128, 2, 2, 32, split=2))),
          # more workgroups for short-T products (T = 512: 4 to 36 tiles of 128x128)
          MatrixTiles(64, 64, 2, 2, 32, split=8), MatrixTiles(128, 64, 2, 2, 32, split=2),
          MatrixTiles(64, 128, 2, 2, 32, split=2), MatrixTiles(32, 64, 1, 2, 32))
# the heuristics' picks and two stages with vec4-typed workgroup tiles (unmeasured: the GPU decides)
VEC4_STAGED = tuple(replace(t, vec4=True) for t in (
    MATRIX_TILES, LARGE_MATRIX_TILES, SMALL_MATRIX_TILES, SMALL_MATRIX_SPLIT_TILES, JUST_OVER_A_WAVE_TILES,
    WAVE_SPLIT_TILES, MatrixTiles(128, 128, 2, 2, 32, stages=2)))

# tiles of two subgroup groups sharing each k-step: twice the subgroups a tile at the same block per
# subgroup; 0.78-1.07x the planner's picks on 22 of 24 LFM2-350M products, so candidates only (h100_ab_kgroups.log)
K_GROUPS = tuple(replace(t, sg_k=2) for t in (
    LARGE_MATRIX_TILES, SMALL_MATRIX_TILES, MatrixTiles(128, 64, 2, 2, 32), MatrixTiles(128, 128, 2, 2, 64, prefetch=False)))


def matrix(params) -> tuple[MatrixTiles, ...]:
    """MATRIX, VEC4_STAGED and K_GROUPS and, where the grid of 128x128 tiles ends in a partial wave, those tiles
    with K split in the tail's columns (or one more) over 2, 4 or 8; for an output at most NARROW
    thin, tiles one fragment thin at every split, two half as long along the other side, and SIMT
    tiles 8 thin (heuristics.narrow_simt_tiles). Last, the planner's pick with the other staging (f16
    or vec4), where it is not among them."""
    twin = (replace(params.tiles, vec4=not params.tiles.vec4),)
    if min(params.m_pad, params.n_size) > NARROW:
        tail = tail_columns(params.m_pad, params.n_size)
        cols = -(-params.n_size // TAIL_BASE_TILES.wn)
        tails = tuple(replace(TAIL_BASE_TILES, split=s, tail=t) for t in (tail, tail + 1) if tail and t < cols
                      for s in (2, 4, 8))
        return tuple(dict.fromkeys(MATRIX + VEC4_STAGED + K_GROUPS + tails + twin))
    thin = "m" if params.m_pad <= params.n_size else "n"
    short = tuple(MatrixTiles(16, 64, 1, 4, bk, split=s) if thin == "m" else MatrixTiles(64, 16, 4, 1, bk, split=s)
                  for bk, s in ((32, 4), (64, 8)))     # half as long: faster on LoRA's dY B and dB (h200_lora_mtiles.json)
    return tuple(dict.fromkeys(tuple(narrow_matrix_tiles(thin, s) for s in (1, 2, 4, 8)) + short
                               + (MatrixTiles(64, 64, 2, 2, 32),) + twin
                               + tuple(narrow_simt_tiles(thin, s) for s in (1, 4, 8))))


def grouped(params, matrix_units: bool) -> tuple:
    """A grouped GEMM's: the planner's pick, then the candidates of its template that sum each
    output whole (no split-K) and stage f16 as the grouped GEMMs do (not vec4), on the matrix units
    the experts' 96-row tiles among them."""
    pool = tuple(GROUPED_TILES.values()) + MATRIX + K_GROUPS if matrix_units else MATMUL
    return tuple(dict.fromkeys((params.tiles,) + tuple(t for t in pool if t.split == 1 and not getattr(t, "vec4", False))))


def attention_variants(pick, mode: str) -> tuple:
    """The matrix attention pick with its other staging, double-buffered the other way, (the forward's)
    rows meeting by subgroup shuffles with and without double buffering, and paired blocks alone and with
    every other change."""
    fwd = mode == "fwd"
    shuffle = (replace(pick, shuffle=not pick.shuffle), replace(pick, shuffle=not pick.shuffle, double=True)) if fwd else ()
    return (replace(pick, vec4=not pick.vec4), replace(pick, double=not pick.double), *shuffle,
            replace(pick, pair=not pick.pair), replace(pick, pair=True, double=True, shuffle=fwd))


def for_spec(spec) -> tuple:
    """The tiles worth trying for an (untuned) specialization; empty where its template has no knobs."""
    if spec.template in ("matmul", "matmul_matrix") and spec.params.group is not None:
        return grouped(spec.params, spec.template == "matmul_matrix")
    if spec.template == "matmul":
        return MATMUL
    if spec.template == "matmul_matrix":
        return matrix(spec.params)
    if spec.template in ("attention_fwd", "attention_bwd"):
        return attention(spec.params.mode, spec.params.head_dim)
    if spec.template in MATRIX_TEMPLATES.values():   # the planner's pick, the other candidates, then the
        pick = spec.params.tiles                         # pick's variants (one that does not fit scores inf)
        return (pick, *(t for t in MATRIX_ATTENTION_CANDIDATES if t != pick), *attention_variants(pick, spec.params.mode))
    if spec.template == "colreduce" and spec.params.split > 1:   # only what the planner found long and narrow
        return (ColumnTiles(spec.params.split), *(ColumnTiles(s) for s in COLUMN_SPLITS if s != spec.params.split))
    return ()
