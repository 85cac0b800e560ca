"""The subgroup-matrix (matrix-unit) GEMM schedule.

What the scheduler decides runs everywhere: contractions with an f16 operand go to the matrix
template on a device with f16 subgroup matrices, f32 ones stay SIMT, and every tile the autotuner
may try renders. The numbers run on the device's matrix units where it has them (Dawn on an NVIDIA
GPU: benches/results/h200_gemm_fusion_tests_dawn.log), and elsewhere (lavapipe in CI) on the same
template with its subgroup-matrix operations emulated in plain WGSL (LFM2JIT_MATRIX_UNITS=emulate).
"""
from __future__ import annotations

import re
import types
from dataclasses import replace

import numpy as np
import pytest

from numerics import rel_err
from lfm2jit import ComputeEngine, grad, library
from lfm2jit.cli import MATRIX_UNITS
from lfm2jit.codegen.render import render
from lfm2jit.engine import target_of
from lfm2jit.schedule import EMULATED_MATRIX_CONFIGS, EMULATED_SUBGROUP, Target
from lfm2jit.tune.heuristics import H200_WAVE, narrow_matrix_tiles, tail_columns
from lfm2jit.tune.tiles import MatrixTiles, TileConfig
from lfm2jit.tune.candidates import K_GROUPS, MATRIX, VEC4_STAGED, matrix as matrix_candidates

LINEAR = library.get("linear").without({"r"})
PRODUCTS = {   # the three products of a linear layer in --f16 mode: activations f16, weights and their grads f32
    "y": LINEAR.variant("f16", {"w"}),
    "d_x": grad(LINEAR, ["x"]).variant("f16", {"w"}).kernels[0],
    "d_w": grad(LINEAR, ["w"]).variant("f16", {"d_w"}).kernels[0],
}


@pytest.mark.parametrize("out", PRODUCTS)
def test_f16_contractions_go_to_the_matrix_units(out):
    spec = PRODUCTS[out].specialize({"T": 100, "K": 64, "N": 48}, 64, target=MATRIX_UNITS)
    assert spec.template == "matmul_matrix"
    wgsl = render(spec)
    assert "subgroupMatrixMultiplyAccumulate" in wgsl and "enable chromium_experimental_subgroup_matrix;" in wgsl
    assert PRODUCTS[out].specialize({"T": 100, "K": 64, "N": 48}, 64).template == "matmul"   # portable target


@pytest.mark.parametrize("K,direct", [(8, False), (16, True), (64, True)])
def test_whole_fragments_are_stored_only_into_rows_a_fragment_wide(K, direct):
    """dW [N, K] in f32: interior tiles store whole 16-wide fragments, which rows narrower than a
    fragment cannot take (the shader compiler refuses the stride); split-K's workspace likewise."""
    for tiles in (None, MatrixTiles(64, 64, 2, 2, 32, split=2)):
        wgsl = render(PRODUCTS["d_w"].specialize({"T": 64, "K": K, "N": 48}, 64, frozenset(), tiles, MATRIX_UNITS))
        assert ("subgroupMatrixStore<row_major>(&" + ("ws_" if tiles else "d_w_") in wgsl) == direct, tiles


def test_outputs_sized_by_the_sequence_are_stored_element_by_element():
    """An f32 output with T rows (logits of a short chunk) may be smaller than one fragment, which
    Dawn refuses as a destination of whole-fragment stores: T = 5 logits failed that way on the H200."""
    logits = LINEAR.variant("f16", {"w", "y"})           # f16 x, f32 weight and f32 output [T, N]
    spec = logits.specialize({"T": 256, "K": 64, "N": 256}, 256, frozenset(), None, MATRIX_UNITS)
    assert spec.template == "matmul_matrix" and spec.params.c.dtype == "f32" and not spec.params.direct_store
    assert "subgroupMatrixStore<row_major>(&y_" not in render(spec)


def test_f16_results_of_f32_operands_go_to_the_matrix_units(matrix_engine, rng):
    """The LM head's dh = dlogits @ E in --f16 mode: f32 operands, an f16 result. The result keeps no
    more than f16 precision, so the product runs on the matrix units with its operands rounded to f16
    as they are staged (as PyTorch's autocast rounds them to bf16): against float64 on those values."""
    xent_dh = library.get("xent_dh").variant("f16", {"g", "E"})
    assert xent_dh.specialize({"T": 100, "C": 256, "D": 64}, 64, target=MATRIX_UNITS).template == "matmul_matrix"
    assert library.get("xent_dh").specialize({"T": 100, "C": 256, "D": 64}, 64,
                                             target=MATRIX_UNITS).template == "matmul"      # f32 mode: f32
    g = rng.standard_normal((100, 256)).astype(np.float32)
    E = rng.standard_normal((256, 64)).astype(np.float32)
    e = matrix_engine
    got = e.run(xent_dh, bucket=64, g=e.tensor(g), E=e.tensor(E))["dh"]
    assert got.dtype == "f16"
    want = g.astype(np.float16).astype(np.float64) @ E.astype(np.float16).astype(np.float64)
    assert rel_err(got.numpy(), want) < 2e-3


def test_f32_contractions_stay_simt_on_a_device_with_matrix_units():
    assert LINEAR.specialize({"T": 100, "K": 64, "N": 48}, 64, target=MATRIX_UNITS).template == "matmul"


@pytest.mark.parametrize("tiles", MATRIX + VEC4_STAGED + K_GROUPS + tuple(narrow_matrix_tiles(thin, 8) for thin in "mn"))
def test_every_matrix_candidate_renders(tiles):
    for k in PRODUCTS.values():
        wgsl = render(k.specialize({"T": 70, "K": 96, "N": 40}, 16, frozenset(), tiles, MATRIX_UNITS))
        assert wgsl.count("subgroupMatrixLoad") >= 2


@pytest.mark.parametrize("tiles", [MatrixTiles(128, 128, 2, 2, 32, prefetch=False), MatrixTiles(128, 128, 2, 4, 32),
                                   MatrixTiles(128, 64, 2, 2, 32, stages=2)])
def test_k_steps_inside_both_operands_are_fetched_without_masks(tiles):
    """Each fetch of a k-step (matrix and SIMT templates) is one workgroup-uniform choice: unmasked loads
    when the step lies inside both operands, masked ones at the edges (per-load masks cost the H200
    40% of the matrix GEMM's rate)."""
    simt = {f"{out} (f32, SIMT)": k.kernels[0].specialize({"T": 256, "K": 320, "N": 256}, 16)
            for out, k in (("y", LINEAR), ("d_x", grad(LINEAR, ["x"])), ("d_w", grad(LINEAR, ["w"])))}
    specs = {out: k.specialize({"T": 256, "K": 320, "N": 256}, 16, frozenset(), tiles, MATRIX_UNITS)
             for out, k in PRODUCTS.items()}
    for out, spec in {**specs, **simt}.items():
        wgsl = render(spec)
        branches = wgsl.split("if (interior && k0 + BK <= k_end) {")[1:]
        assert branches, out
        for branch in branches:
            unmasked, masked = branch.split("} else {", 1)
            loads = re.findall(r"\br[ab]\d+ = ", unmasked)     # one register load per fetched share
            assert "ra0 = " in unmasked and "rb0 = " in unmasked and "gk < k_end" not in unmasked, out
            assert masked.split("workgroupBarrier")[0].count("gk < k_end") == len(loads), out


@pytest.mark.parametrize("sizes,want", [
    # T = 2048 LFM2-350M shapes: y = x W^T reads both operands along K, dX one, dW neither
    ({"T": 2048, "K": 1024, "N": 4608}, {"y": (128, 128, 2, 2, False), "d_x": (128, 128, 2, 2, False),
                                         "d_w": (128, 128, 2, 2, False)}),
    ({"T": 4096, "K": 4096, "N": 4096}, {"y": (128, 128, 2, 2, False), "d_x": (128, 128, 2, 2, False),
                                         "d_w": (128, 128, 2, 2, False)}),
    ({"T": 512, "K": 1024, "N": 1024}, {"y": (64, 64, 2, 2, True), "d_x": (64, 64, 2, 2, True),
                                        "d_w": (64, 64, 2, 2, True)}),
    # T = 512: dW sums too few tokens for 128x256 tiles; y is just over a wave of 128x128 tiles
    ({"T": 512, "K": 1024, "N": 4608}, {"y": (256, 128, 4, 2, False), "d_x": (64, 64, 2, 2, True),
                                        "d_w": (64, 64, 2, 2, True)}),
    # LoRA's rank-8 products: y = x A^T and dA = dU^T X are one fragment thin; dX = dU A is not
    ({"T": 2048, "K": 2048, "N": 8}, {"y": (128, 16, 4, 1, True), "d_x": (128, 128, 2, 2, False),
                                      "d_w": (16, 128, 1, 4, True)}),
])
def test_matrix_tiles_follow_operand_layout_and_grid(sizes, want):
    for out, k in PRODUCTS.items():
        t = k.specialize(sizes, 64, target=MATRIX_UNITS).params.tiles
        assert (t.wm, t.wn, t.sg_m, t.sg_n, t.prefetch) == want[out], out


@pytest.mark.parametrize("sizes,want", [
    # T = 512: 512x1024x4608 (w2's y, w1's dX) is a grid of 32 tiles with K long: 64x64 tiles, K split
    # over 2; 512x4608x1024 (w1's y, w2's dX) is 144 tiles of 128x128, just over a wave: 256x128 tiles
    ({"T": 512, "K": 4608, "N": 1024}, {"y": MatrixTiles(64, 64, 2, 2, 32, split=2),
                                        "d_x": MatrixTiles(256, 128, 4, 2, 32, prefetch=False)}),
    ({"T": 512, "K": 1024, "N": 4608}, {"y": MatrixTiles(256, 128, 4, 2, 32, prefetch=False),
                                        "d_x": MatrixTiles(64, 64, 2, 2, 32, split=2)}),
    # exactly a wave (128 tiles) keeps 128x128 tiles; so does a one-k-step contraction (LoRA's up-projection)
    ({"T": 2048, "K": 1024, "N": 1024}, {"y": MatrixTiles(128, 128, 2, 4, 32), "d_x": MatrixTiles(128, 128, 2, 4, 32)}),
    # ... and splits K over 2 where it sums 4096 or more (T = 2048's w2 y and w1/w3 dX), not at 3072
    ({"T": 2048, "K": 4608, "N": 1024}, {"y": MatrixTiles(128, 128, 2, 2, 32, split=2, prefetch=False),
                                         "d_x": MatrixTiles(128, 128, 2, 2, 32, prefetch=False)}),
    ({"T": 2048, "K": 1024, "N": 4608}, {"d_x": MatrixTiles(128, 128, 2, 2, 32, split=2, prefetch=False)}),
    ({"T": 2048, "K": 1024, "N": 3072}, {"d_x": MatrixTiles(128, 128, 2, 4, 32)}),
    ({"T": 512, "K": 16, "N": 4608}, {"y": MatrixTiles(128, 128, 2, 2, 32, prefetch=False)}),
    # dW at T = 2048: 288 tiles, a last wave of 24 of the H200's 264: K split over 8 in the columns
    # holding those 24; 4096^3's last wave is 88% full, and the GPU busy, unsplit
    ({"T": 2048, "K": 1024, "N": 4608}, {"d_w": MatrixTiles(128, 128, 2, 2, 32, split=8, tail=1, prefetch=False)}),
    ({"T": 2048, "K": 4608, "N": 1024}, {"d_w": MatrixTiles(128, 128, 2, 2, 32, split=8, tail=3, prefetch=False)}),
    ({"T": 4096, "K": 4096, "N": 4096}, {"d_w": MatrixTiles(128, 128, 2, 2, 32, prefetch=False)}),
    ({"T": 2048, "K": 1024, "N": 3072}, {"d_w": MatrixTiles(128, 128, 2, 2, 32, prefetch=False)}),   # 192: one wave
])
def test_short_sequences_take_tiles_that_fill_the_gpu(sizes, want):
    for out, tiles in want.items():
        assert PRODUCTS[out].specialize(sizes, 64, target=MATRIX_UNITS).params.tiles == tiles, out


def test_tiles_picked_for_the_h200_fall_back_where_they_do_not_fit():
    """y at T = 512's 512x4608x1024 takes 256x128 tiles (38 KB of workgroup memory) on the H200's
    48 KiB; a device with 32 KiB (lavapipe) gets the small tiles instead of an error."""
    sizes = {"T": 512, "K": 1024, "N": 4608}
    assert PRODUCTS["y"].specialize(sizes, 64, target=MATRIX_UNITS).params.tiles.wm == 256
    small = replace(MATRIX_UNITS, workgroup_bytes=32768)
    assert PRODUCTS["y"].specialize(sizes, 64, target=small).params.tiles == MatrixTiles(64, 64, 2, 2, 32)
    tiny = replace(MATRIX_UNITS, workgroup_bytes=12288)      # 64x64 tiles take 14 KiB: the next fallback fits
    assert PRODUCTS["y"].specialize(sizes, 64, target=tiny).params.tiles == MatrixTiles(32, 64, 1, 2, 32)


@pytest.mark.parametrize("K,split", [(8192, 8), (2048, 8), (1024, 4), (300, 1), (64, 1)])
def test_thin_outputs_split_k_into_slices_of_256_or_more(K, split):
    params = PRODUCTS["y"].specialize({"T": 2048, "K": K, "N": 8}, 64, target=MATRIX_UNITS).params
    assert (params.tiles.wn, params.tiles.split) == (16, split)
    tried = matrix_candidates(params)                                   # the autotuner tries thin tiles too,
    assert {c.wn for c in tried if isinstance(c, MatrixTiles)} == {16, 64}
    assert {(c.bn, c.split) for c in tried if isinstance(c, TileConfig)} == {(8, 1), (8, 4), (8, 8)}   # and SIMT ones


def test_thin_outputs_split_k_until_the_gpu_is_busy():
    """dW of a rank-8 B [8192, 8]: 64 thin tiles already, so K = T splits over 2 (128 workgroups)."""
    t = PRODUCTS["d_w"].specialize({"T": 2048, "K": 8, "N": 8192}, 64, target=MATRIX_UNITS).params.tiles
    assert (t.wm, t.wn, t.split) == (128, 16, 2)


def test_matrix_tiles_that_do_not_fit_are_refused():
    with pytest.raises(ValueError, match="fragment"):
        PRODUCTS["y"].specialize({"T": 8, "K": 16, "N": 16}, 1, frozenset(), MatrixTiles(48, 64, 2, 2, 32),
                                 MATRIX_UNITS)
    with pytest.raises(ValueError, match="77824 bytes of workgroup memory, the device allows 49152"):
        PRODUCTS["y"].specialize({"T": 8, "K": 16, "N": 16}, 1, frozenset(), MatrixTiles(128, 128, 2, 2, 64, stages=2),
                                 MATRIX_UNITS)        # two stages of BK = 64 do not fit; one does
    with pytest.raises(ValueError, match="stages must be 1 or 2"):
        MatrixTiles(stages=3)
    with pytest.raises(ValueError, match="two stages always prefetch"):
        MatrixTiles(stages=2, prefetch=False)
    with pytest.raises(ValueError, match="need a device with f16 subgroup matrices"):
        PRODUCTS["y"].specialize({"T": 8, "K": 16, "N": 16}, 1, frozenset(), MatrixTiles())
    with pytest.raises(ValueError, match="sg_k .* must be 1, 2 or 4"):
        MatrixTiles(sg_k=3)
    for tiles, problem in ((MatrixTiles(128, 128, 2, 4, 32, sg_k=2), "16 subgroups of 32 exceed 256 invocations"),
                           (MatrixTiles(64, 64, 1, 1, 32, sg_k=4), "BK = 32 must hold 4 .sg_k. groups' fragments")):
        with pytest.raises(ValueError, match=problem):
            PRODUCTS["y"].specialize({"T": 8, "K": 16, "N": 16}, 1, frozenset(), tiles, MATRIX_UNITS)


def test_a_split_tail_must_be_fewer_columns_than_the_grid():
    """tail counts the last tile columns whose K is split: refused without a split, and refused by
    name (before any GPU work) where the output has no more tile columns than that."""
    with pytest.raises(ValueError, match="tail .* must be 0, or positive with split > 1"):
        MatrixTiles(tail=1)
    with pytest.raises(ValueError, match="tail 3 must be fewer than the 3 tile columns of N = 300"):
        PRODUCTS["y"].specialize({"T": 256, "K": 64, "N": 300}, 64, frozenset(), MatrixTiles(split=2, tail=3),
                                 MATRIX_UNITS)
    assert MatrixTiles(split=4, tail=2, prefetch=False).label == "128x128/sg2x2/bk32/split4/tail2/s1/g8/noprefetch"
    with pytest.raises(ValueError, match="need 69120 workgroups in a row, WebGPU allows 65535"):
        PRODUCTS["y"].specialize({"T": 65536, "K": 64, "N": 16384}, 64, frozenset(),
                                 MatrixTiles(128, 128, 2, 2, 32, split=8, tail=1), MATRIX_UNITS)


def test_tail_columns_hold_the_last_partial_wave(rng):
    """The fewest last tile columns whose tiles include every tile past the grid's full waves; none
    for a grid under one wave, one ending in a full wave, or one whose excess needs every column."""
    for _ in range(300):
        m, n = (int(v) for v in rng.integers(1, 12000, 2))
        cols, rows = -(-n // 128), -(-m // 128)
        tail, tiles = tail_columns(m, n), cols * rows
        if tail == 0:
            assert tiles < H200_WAVE or tiles % H200_WAVE == 0 or -(-(tiles % H200_WAVE) // rows) >= cols, (m, n)
            continue
        full = tiles // H200_WAVE * H200_WAVE
        assert 0 < tail < cols and (cols - tail) * rows <= full < (cols - tail + 1) * rows, (m, n, tail)
    assert tail_columns(2048, 4608) == 3 and tail_columns(4608, 1024) == 1      # T = 2048: 576 and 288 tiles


def test_autotuning_a_thin_product_tries_simt_and_matrix_tiles(raised_ctx, matrix_engine, tmp_path, monkeypatch, rng):
    """LoRA's dB = dY^T u (an output 8 wide) tuned: the matrix candidates and the SIMT ones 8 thin are
    all timed, the fastest of either kind is kept in autotune.json, and a second engine reads it back
    and computes the same bits."""
    import json
    monkeypatch.setenv("LFM2JIT_AUTOTUNE", "1")
    monkeypatch.setenv("LFM2JIT_CACHE_DIR", str(tmp_path))
    if matrix_engine.target.emulated:
        monkeypatch.setenv("LFM2JIT_MATRIX_UNITS", "emulate")
    dw = PRODUCTS["d_w"]
    u, b, dy = (rng.standard_normal(s).astype(np.float32) for s in ((300, 8), (96, 8), (300, 96)))

    def run(eng):
        args = {"x": eng.tensor(u, "f16"), "w": eng.tensor(b), "d_y": eng.tensor(dy, "f16")}
        return eng.run(dw, bucket=16, **args)["d_w"].numpy()
    tuned = ComputeEngine(raised_ctx)
    got = run(tuned)
    assert rel_err(got, dy.astype(np.float16).astype(np.float64).T @ u.astype(np.float16)) < 2e-3
    (entry,) = json.loads((tmp_path / "autotune.json").read_text()).values()
    assert entry["kind"] in ("MatrixTiles", "TileConfig") and len(entry["seconds"]) == tuned.tuner.trials
    timed = {"'wm'" in k for k, sec in entry["seconds"].items() if sec != float("inf")}    # matrix tiles name wm
    assert timed == {True, False}                                  # both kinds ran
    again = ComputeEngine(raised_ctx)
    np.testing.assert_array_equal(run(again), got)
    assert again.tuner.trials == 0


def test_split_tail_candidates_are_tried_where_the_grid_ends_in_a_partial_wave():
    """The autotuner tries 128x128 tiles with K split in the partial wave's columns (and one more);
    not where the grid fills its waves."""
    tails = {(t.tail, t.split) for t in matrix_candidates(
        PRODUCTS["y"].specialize({"T": 2048, "K": 1024, "N": 4608}, 64, target=MATRIX_UNITS).params) if t.tail}
    assert tails == {(3, 2), (3, 4), (3, 8), (4, 2), (4, 4), (4, 8)}
    assert not any(t.tail for t in matrix_candidates(
        PRODUCTS["y"].specialize({"T": 2048, "K": 1024, "N": 1024}, 64, target=MATRIX_UNITS).params))


def test_emulated_matrix_templates_need_no_subgroup_matrix_feature():
    """LFM2JIT_MATRIX_UNITS=emulate: the same template, its subgroup-matrix operations written out
    (loops over workgroup memory), so no extension is enabled and no builtin is called."""
    emulated = Target(EMULATED_MATRIX_CONFIGS, EMULATED_SUBGROUP, 32768, emulated=True)
    for out, k in PRODUCTS.items():
        spec = k.specialize({"T": 100, "K": 64, "N": 48}, 64, frozenset(), None, emulated)
        assert spec.template == "matmul_matrix" and spec.params.emulated
        assert spec.key != k.specialize({"T": 100, "K": 64, "N": 48}, 64, frozenset(), None,
                                        replace(emulated, emulated=False)).key
        wgsl = render(spec)
        assert "subgroup_matrix" not in wgsl and "subgroupMatrix" not in wgsl and "enable f16;" in wgsl


def test_vec4_staging_needs_vec4_reads_and_is_the_default_only_where_asked(ctx, monkeypatch):
    """vec4-typed tiles take one fetched vec4 a store: refused by name where an operand is read element
    by element (K = 42 is no multiple of 4); LFM2JIT_MATRIX_STAGING=vec4 gives the planner's tiles
    vec4 staging where every operand allows it, and f16 staging elsewhere."""
    with pytest.raises(ValueError, match="stage vec4s; operands read element by element: x, w"):
        PRODUCTS["y"].specialize({"T": 64, "K": 42, "N": 48}, 64, frozenset(), MatrixTiles(64, 64, 2, 2, 32, vec4=True),
                                 MATRIX_UNITS)
    monkeypatch.setenv("LFM2JIT_MATRIX_UNITS", "emulate")
    monkeypatch.setenv("LFM2JIT_MATRIX_STAGING", "vec4")
    staged = ComputeEngine(ctx).target
    assert staged.vec4_staging and not MATRIX_UNITS.vec4_staging
    for k, want in ((42, False), (64, True)):
        for out, kern in PRODUCTS.items():
            assert kern.specialize({"T": 64, "K": k, "N": 48}, 64, target=staged).params.tiles.vec4 == want, (out, k)


def test_matrix_units_setting(ctx, monkeypatch):
    """off: every product on the portable path; emulate: the emulated target, refused by name on a
    device without shader-f16; anything else is an error naming the variable."""
    monkeypatch.setenv("LFM2JIT_MATRIX_UNITS", "off")
    assert ComputeEngine(ctx).target.matrix_configs == ()
    monkeypatch.setenv("LFM2JIT_MATRIX_UNITS", "sometimes")
    with pytest.raises(ValueError, match="LFM2JIT_MATRIX_UNITS='sometimes': expected one of auto, off, emulate"):
        ComputeEngine(ctx)
    no_f16 = types.SimpleNamespace(name="a GPU without f16", features=frozenset({"subgroup"}),
                                   limits={"max-compute-workgroup-storage-size": 16384})
    with pytest.raises(ValueError, match="LFM2JIT_MATRIX_UNITS=emulate: a GPU without f16 has no shader-f16"):
        target_of(no_f16, "emulate")
    assert target_of(no_f16, "auto") == Target(workgroup_bytes=16384, subgroups="subgroup")
    no_subgroups = types.SimpleNamespace(**{**vars(no_f16), "features": frozenset()})
    assert target_of(no_subgroups, "auto") == Target(workgroup_bytes=16384)


# ---- on the matrix units: the device's own, or emulated in plain WGSL where it has none ----

@pytest.fixture
def units(matrix_engine):
    return matrix_engine


def _f16(rng, shape):
    return rng.standard_normal(shape).astype(np.float16)


def _fits(e, tiles) -> bool:
    """Whether the tiles fit this device's workgroup memory (lavapipe has 32 KiB, the H200 48): a
    product with tiles that do not is refused by name, before any GPU work."""
    return tiles is None or not tiles.problem(e.target.matrix("f16", "f32"), e.target.subgroup_size,
                                              e.target.workgroup_bytes)


# ragged edges, a tile smaller than one fragment, deep K, several waves, a thin output
PRODUCT_SHAPES = [(129, 40, 132), (7, 8, 12), (256, 1024, 96), (300, 256, 520), (300, 1040, 8)]
PRODUCT_TILES = [None, MatrixTiles(64, 64, 2, 2, 32, split=2), MatrixTiles(128, 128, 2, 2, 64),
                 MatrixTiles(128, 128, 2, 4, 32, group=1), MatrixTiles(128, 64, 2, 2, 32, stages=2),
                 MatrixTiles(64, 128, 2, 2, 32, group=3, vec4=True), narrow_matrix_tiles("n", 4),
                 narrow_matrix_tiles("m", 8), MatrixTiles(128, 64, 2, 4, 32, prefetch=False, vec4=True),
                 MatrixTiles(64, 64, 2, 2, 32, split=2, prefetch=False, vec4=True),
                 MatrixTiles(64, 64, 2, 2, 32, stages=2, vec4=True),
                 MatrixTiles(256, 128, 4, 2, 32, prefetch=False),
                 MatrixTiles(128, 128, 2, 2, 32, split=2, prefetch=False),
                 MatrixTiles(128, 64, 2, 2, 32, sg_k=2), MatrixTiles(64, 64, 1, 2, 64, sg_k=4, prefetch=False),
                 MatrixTiles(64, 128, 1, 2, 32, sg_k=2, stages=2, vec4=True),
                 MatrixTiles(64, 64, 2, 2, 32, split=2, sg_k=2)]


@pytest.mark.parametrize("tiles,shapes", [(t, (PRODUCT_SHAPES[i % 5], PRODUCT_SHAPES[(i + 2) % 5]))
                                          for i, t in enumerate(PRODUCT_TILES)])
def test_matrix_products_match_float64(units, rng, tiles, shapes):
    """f16 activations (x, dY), f32 weights converted as they are staged; against float64 on the same
    f16-rounded values, for all three products: ragged edges, interior tiles stored whole (f32) or
    without masks (f16), split-K,
    one and two staging buffers, bands of tile rows that do not divide the grid, k-steps
    fetched while the last is multiplied or at the top of their own step (no prefetch), and
    workgroup tiles of f16 or of vec4<f16> (its emulated fragment loads count offsets and strides
    in vec4s, as Dawn's do), and groups of subgroups sharing each k-step (sg_k). Each tiles on two of the
    shapes, every shape under several tiles (the whole cross product costs 2.5x the compiles)."""
    for T, K, N in shapes:
        _product_matches_float64(units, rng, T, K, N, tiles)


def _product_matches_float64(e, rng, T, K, N, tiles):
    x, dy = _f16(rng, (T, K)), _f16(rng, (T, N))
    w = rng.standard_normal((N, K)).astype(np.float32)
    w16 = w.astype(np.float16).astype(np.float64)
    want = {"y": x.astype(np.float64) @ w16.T, "d_x": dy.astype(np.float64) @ w16,
            "d_w": dy.T.astype(np.float64) @ x.astype(np.float64)}
    args = {"x": e.tensor(x), "w": e.tensor(w), "d_y": e.tensor(dy)}
    if not _fits(e, tiles):
        with pytest.raises(ValueError, match=r"do not fit the matrix template: \d+ bytes of workgroup memory"):
            e.run(PRODUCTS["y"], bucket=16, tiles=tiles, x=args["x"], w=args["w"])
        return
    for out, k in PRODUCTS.items():
        assert k.specialize({"T": T, "K": K, "N": N}, 16, frozenset(), tiles, e.target).template == "matmul_matrix"
        got = e.run(k, bucket=16, tiles=tiles, **{n: args[n] for n in k.inputs})[out].numpy()
        assert rel_err(got, want[out]) < (2e-3 if out != "d_w" else 1e-5), (out, T, K, N, tiles)


def _tail_case(rng):
    """A random shape and tiles with K split in a random tail of at least one product's tile columns."""
    wm, wn, sg_m, sg_n = [(64, 64, 2, 2), (32, 64, 1, 2), (64, 32, 2, 1), (128, 64, 2, 2)][rng.integers(4)]
    T, K, N = int(rng.integers(2, 300)), int(rng.integers(wn + 1, 4 * wn)), int(rng.integers(wn + 1, 4 * wn))
    tail = int(rng.integers(1, -(-min(K, N) // wn)))        # fewer than the tile columns of y [T, N] and dX [T, K]
    return (T, K, N), MatrixTiles(wm, wn, sg_m, sg_n, 32, split=int(rng.choice([2, 4, 8])), tail=tail,
                                  group=int(rng.integers(1, 4)), prefetch=bool(rng.integers(2)),
                                  sg_k=int(rng.choice([1, 2])))


@pytest.mark.parametrize("case", range(6))
def test_split_tails_match_float64(units, rng, case):
    """K split only in the last tile columns (the tiles of a last, partial wave): the three products
    and their accumulating forms against float64, on random shapes, tiles, splits and tails; the
    whole-K tiles go straight to C, the tail's slices through the workspace and the reduce."""
    e = units
    (T, K, N), tiles = _tail_case(np.random.default_rng([7, case]))
    x, dy = _f16(rng, (T, K)), _f16(rng, (T, N))
    w = rng.standard_normal((N, K)).astype(np.float32)
    w16 = w.astype(np.float16).astype(np.float64)
    product = {"y": x.astype(np.float64) @ w16.T, "d_x": dy.astype(np.float64) @ w16,
               "d_w": dy.T.astype(np.float64) @ x.astype(np.float64)}
    old = {"y": _f16(rng, (T, N)), "d_x": _f16(rng, (T, K)), "d_w": rng.standard_normal((N, K)).astype(np.float32)}
    args = {"x": e.tensor(x), "w": e.tensor(w), "d_y": e.tensor(dy)}
    for out, k in PRODUCTS.items():
        spec = k.specialize({"T": T, "K": K, "N": N}, 16, frozenset(), tiles, e.target)
        assert spec.params.split_n0 > 0 and [p.name for p in spec.entry_points] == ["main", "reduce"], (out, tiles)
        tol = 2e-3 if out != "d_w" else 1e-5
        got = e.run(k, bucket=16, tiles=tiles, **{n: args[n] for n in k.inputs})[out].numpy()
        assert rel_err(got, product[out]) < tol, (out, T, K, N, tiles)
        c = e.tensor(old[out])
        e.run(k, bucket=16, tiles=tiles, out={out: c}, accumulate={out}, **{n: args[n] for n in k.inputs})
        assert rel_err(c.numpy(), old[out].astype(np.float64) + product[out]) < tol, (out, "accumulate", tiles)


@pytest.mark.parametrize("tiles,frags,on_32k", [
    (MatrixTiles(128, 128, 2, 4, 32), 2, 1),      # a row is 2 fragments: 36 KB in all, over 32 KiB
    (MatrixTiles(64, 128, 2, 2, 32), 4, 4),       # 4 fragments: 31 KB
    (MatrixTiles(128, 128, 2, 2, 32), 1, 1),      # 16 accumulators: one a round
])
def test_the_epilogue_takes_as_many_fragments_a_round_as_workgroup_memory_holds(tiles, frags, on_32k):
    """f16 results go out through workgroup memory, a row of a subgroup's fragments per barrier
    pair where they fit (subgroups of at most 8 accumulators); on 32 KiB (lavapipe) fewer; f32
    results stored whole keep one (edges)."""
    def frags_at(product, target):
        sizes = {"T": 2048, "K": 1024, "N": 4608}
        return PRODUCTS[product].specialize(sizes, 64, frozenset(), tiles, target).params.epilogue_frags
    assert frags_at("y", MATRIX_UNITS) == frags_at("d_x", MATRIX_UNITS) == frags
    assert frags_at("y", replace(MATRIX_UNITS, workgroup_bytes=32768)) == on_32k
    assert frags_at("d_w", MATRIX_UNITS) == 1


@pytest.mark.parametrize("T,K,N", [(70, 36, 44), (300, 96, 8), (150, 136, 140)])
def test_matrix_f16_results_accumulate(units, rng, T, K, N):
    """dX += dY W and y += x W^T in f16 (LoRA adds its up-projection so): C's old values are all read
    before the epilogue stores any; ragged edges, interior tiles (unmasked), several fragments a
    round, and split-K's reduce."""
    e = units
    x, dy = _f16(rng, (T, K)), _f16(rng, (T, N))
    w = rng.standard_normal((N, K)).astype(np.float32)
    w16 = w.astype(np.float16).astype(np.float64)
    old = {"y": _f16(rng, (T, N)), "d_x": _f16(rng, (T, K))}
    product = {"y": x.astype(np.float64) @ w16.T, "d_x": dy.astype(np.float64) @ w16}
    args = {"x": e.tensor(x), "w": e.tensor(w), "d_y": e.tensor(dy)}
    for tiles in (None, MatrixTiles(64, 128, 2, 2, 32), MatrixTiles(64, 64, 2, 2, 32, split=2),
                  MatrixTiles(64, 64, 2, 2, 32, sg_k=2)):
        for out in ("y", "d_x"):
            k = PRODUCTS[out]
            c = e.tensor(old[out])
            e.run(k, bucket=16, tiles=tiles, out={out: c}, accumulate={out}, **{n: args[n] for n in k.inputs})
            want = old[out].astype(np.float64) + product[out]
            assert rel_err(c.numpy(), want) < 2e-3, (out, tiles)


@pytest.mark.parametrize("T,K,N", [(70, 36, 44), (150, 200, 136)])
def test_matrix_weight_gradient_accumulates(units, rng, T, K, N):
    """dW += dY^T X: edge tiles add element by element, interior ones start from the old contents."""
    e = units
    x, dy = _f16(rng, (T, K)), _f16(rng, (T, N))
    base = rng.standard_normal((N, K)).astype(np.float32)
    for tiles in (None, MatrixTiles(64, 64, 2, 2, 32, split=4), MatrixTiles(128, 128, 2, 2, 32, stages=2),
                  MatrixTiles(64, 64, 2, 2, 32, sg_k=2)):
        dw = e.tensor(base)
        if not _fits(e, tiles):
            with pytest.raises(ValueError, match="do not fit the matrix template"):
                e.run(PRODUCTS["d_w"], bucket=16, tiles=tiles, x=e.tensor(x), d_y=e.tensor(dy), out={"d_w": dw},
                      accumulate={"d_w"})
            np.testing.assert_array_equal(dw.numpy(), base)          # nothing half-applied
            continue
        e.run(PRODUCTS["d_w"], bucket=16, tiles=tiles, x=e.tensor(x), d_y=e.tensor(dy), out={"d_w": dw},
              accumulate={"d_w"})
        want = base + dy.T.astype(np.float64) @ x.astype(np.float64)
        assert rel_err(dw.numpy(), want) < 1e-5, tiles
