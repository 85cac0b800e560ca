"""The grouped expert GEMM (schedule/grouped.py): grouped_matmul, its scale epilogue, and the dx / dw
intrinsics its gradient rule builds, against numpy float64 on random expert splits (empty experts,
one expert holding every row, rows past the last expert, lengths inside a bucket), with f16
weights, accumulation, weights bound in pieces, and on the matrix templates."""
from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest

from lfm2jit import compile_source, grad
from lfm2jit.dsl.errors import DslError
from lfm2jit.schedule import EMULATED_MATRIX_CONFIGS, EMULATED_SUBGROUP, Target
from lfm2jit.tune import candidates, heuristics
from lfm2jit.tune.tiles import MatrixTiles, TileConfig

from test_binding_limits import lowered

SOURCE = """
kernel gmm(x: f32[S, K], w: f32[E, N, K], ends: i32[E]) -> (y: f32[S, N]) {
    y = grouped_matmul(x, w, ends)
}
kernel gmm_scaled(x: f32[S, K], w: f32[E, N, K], ends: i32[E], scale: f32[S]) -> (y: f32[S, N]) {
    y = grouped_matmul_scaled(x, w, ends, scale)
}
kernel gmm_bucketed(x: f32[T, K], w: f32[E, N, K], ends: i32[E], scale: f32[T]) -> (y: f32[T, N]) {
    y = grouped_matmul_scaled(x, w, ends, scale)
}
kernel gmm_dx(dy: f32[S, N], w: f32[E, N, K], ends: i32[E]) -> (dx: f32[S, K]) {
    dx = grouped_matmul_dx(dy, w, ends)
}
kernel gmm_dw(dy: f32[S, N], x: f32[S, K], ends: i32[E]) -> (dw: f32[E, N, K]) {
    dw = grouped_matmul_dw(dy, x, ends)
}
kernel gmm_half(x: f32[S, K], w: f16[E, N, K], ends: i32[E]) -> (y: f32[S, N]) {
    y = grouped_matmul(x, w, ends)
}
kernel gmm_dw_half(dy: f16[S, N], x: f16[S, K], ends: i32[E]) -> (dw: f16[E, N, K]) {
    dw = grouped_matmul_dw(dy, x, ends)
}
"""
K_ = compile_source(SOURCE, "grouped.lk")
SENTINEL = 7.25     # what rows no expert owns hold before the call, and still hold after it


def _ends(rng, rows: int, experts: int, kind: str = "random") -> np.ndarray:
    """Where each expert's rows end: a random split of up to ``rows`` rows (the rows of experts
    made empty go unowned), or every row in one expert."""
    if kind == "one":
        counts = np.zeros(experts, np.int64)
        counts[rng.integers(experts)] = rows
    else:
        counts = rng.multinomial(rows, rng.dirichlet(np.ones(experts)))
        counts[rng.random(experts) < 0.3] = 0
    return np.cumsum(counts).astype(np.int32)


def _ranges(ends):
    starts = np.concatenate([[0], ends[:-1]])
    return [slice(int(a), int(b)) for a, b in zip(starts, ends)]


def _reference(x, w, ends, scale=None):
    """y[s] = x[s] w[e]^T (times scale[s]) in float64 on every expert's rows; NaN elsewhere."""
    y = np.full((x.shape[0], w.shape[1]), np.nan)
    for e, r in enumerate(_ranges(ends)):
        y[r] = x[r].astype(np.float64) @ w[e].astype(np.float64).T
        if scale is not None:
            y[r] *= scale[r, None]
    return y


def _close(got, want, tol=2e-5):
    """Within ``tol`` of the largest reference value, where the reference is defined."""
    keep = ~np.isnan(want)
    err = np.abs(got[keep] - want[keep]).max(initial=0.0)
    assert err <= tol * max(1.0, np.abs(want[keep]).max(initial=0.0)), err


def _sized(rng):
    return (int(rng.integers(1, 9)), int(rng.integers(1, 150)), int(rng.choice([4, 12, 33, 64])),
            int(rng.choice([8, 20, 40, 67])))


@pytest.mark.parametrize("seed", range(10))
def test_forward_matches_numpy_and_leaves_unowned_rows_alone(engine, seed):
    rng = np.random.default_rng(seed)
    E, S, K, N = _sized(rng)
    owned = int(rng.integers(0, S + 1)) if seed % 3 else S        # rows past ends[-1]: padding no expert owns
    ends = _ends(rng, owned, E, "one" if seed in (4, 7) else "random")
    x = rng.standard_normal((S, K)).astype(np.float32)
    w = rng.standard_normal((E, N, K)).astype(np.float32)
    scaled = seed % 2 == 1
    scale = rng.random(S).astype(np.float32) if scaled else None
    y = engine.tensor(np.full((S, N), SENTINEL, np.float32))
    args = dict(x=engine.tensor(x), w=engine.tensor(w), ends=engine.tensor(ends))
    if scaled:
        args["scale"] = engine.tensor(scale)
    got = engine.run(K_.gmm_scaled if scaled else K_.gmm, out={"y": y}, **args)["y"].numpy()
    want = _reference(x, w, ends, scale)
    _close(got, want)
    assert (got[int(ends[-1]):] == SENTINEL).all()


def test_accumulate_adds_on_owned_rows_only(engine):
    rng = np.random.default_rng(10)
    E, S, K, N = 5, 77, 24, 36
    ends = _ends(rng, 70, E)
    x = rng.standard_normal((S, K)).astype(np.float32)
    w = rng.standard_normal((E, N, K)).astype(np.float32)
    scale = rng.random(S).astype(np.float32)
    old = rng.standard_normal((S, N)).astype(np.float32)
    y = engine.tensor(old)
    engine.run(K_.gmm_scaled, x=engine.tensor(x), w=engine.tensor(w), ends=engine.tensor(ends),
               scale=engine.tensor(scale), out={"y": y}, accumulate={"y"})
    got = y.numpy()
    want = _reference(x, w, ends, scale) + old
    _close(got, want)
    assert (got[70:] == old[70:]).all()


def test_a_bucketed_length_runs_the_real_rows_and_one_pipeline_serves_the_bucket(engine):
    rng = np.random.default_rng(11)
    E, K, N = 3, 16, 24
    w = rng.standard_normal((E, N, K)).astype(np.float32)
    for T in (37, 50):                       # both in the 64 bucket: the second compiles nothing
        ends = _ends(rng, T - 3, E)
        x = rng.standard_normal((T, K)).astype(np.float32)
        scale = rng.random(T).astype(np.float32)
        misses = engine.stats.misses
        got = engine.run(K_.gmm_bucketed, bucket=64, x=engine.tensor(x), w=engine.tensor(w),
                         ends=engine.tensor(ends), scale=engine.tensor(scale))["y"].numpy()
        assert got.shape == (T, N)
        _close(got, _reference(x, w, ends, scale))
    assert engine.stats.misses == misses


def test_ends_past_the_rows_or_going_back_are_clamped(engine):
    """Bad routing data cannot reach outside the tensors: ends are clamped to the rows there are,
    and an end below the one before leaves that expert empty."""
    rng = np.random.default_rng(12)
    E, S, K, N = 4, 40, 8, 12
    x = rng.standard_normal((S, K)).astype(np.float32)
    w = rng.standard_normal((E, N, K)).astype(np.float32)
    ends = np.array([10, 5, 30, 99], np.int32)          # expert 1 empty, expert 3 up to S
    got = engine.run(K_.gmm, x=engine.tensor(x), w=engine.tensor(w), ends=engine.tensor(ends))["y"].numpy()
    _close(got, _reference(x, w, np.array([10, 10, 30, 40], np.int32)))


@pytest.mark.parametrize("seed", range(3))
def test_f16_weights_match_numpy_on_their_f16_values(engine, seed):
    rng = np.random.default_rng(20 + seed)
    E, S, K, N = _sized(rng)
    ends = _ends(rng, S, E)
    x = rng.standard_normal((S, K)).astype(np.float32)
    w = rng.standard_normal((E, N, K)).astype(np.float16)
    got = engine.run(K_.gmm_half, x=engine.tensor(x), w=engine.tensor(w), ends=engine.tensor(ends))["y"].numpy()
    # on the matrix units (a device's, not lavapipe's SIMT) x is rounded to f16 as it is staged
    staged = x.astype(np.float16).astype(np.float32) if engine.target.matrix_configs else x
    _close(got, _reference(staged, w, ends))


def test_f16_activations_and_weights_on_the_portable_template(engine):
    """x and w stored as f16 (the kernel's f16 variant), y kept f32, read and widened by the SIMT template."""
    rng = np.random.default_rng(25)
    E, S, K, N = 5, 99, 36, 44
    ends = _ends(rng, S, E)
    x = rng.standard_normal((S, K)).astype(np.float16)
    w = rng.standard_normal((E, N, K)).astype(np.float16)
    assert K_.gmm.kernels[0].specialize({"S": S, "K": K, "N": N, "E": E}, target=engine.target).template == "matmul"
    got = engine.run(K_.gmm, f16=("x", "w"), x=engine.tensor(x), w=engine.tensor(w), ends=engine.tensor(ends))["y"]
    assert got.dtype == "f32"
    _close(got.numpy(), _reference(x, w, ends))


def _grads(x, w, ends, dy, scale=None):
    """dx, dw and (scaled) d scale in float64, expert by expert."""
    x64, w64, dy64 = (a.astype(np.float64) for a in (x, w, dy))
    dx = np.full(x.shape, np.nan)
    ds = np.full(x.shape[0], np.nan)
    dw = np.zeros(w.shape)
    for e, r in enumerate(_ranges(ends)):
        g = dy64[r] @ w64[e]
        s = scale[r, None].astype(np.float64) if scale is not None else 1.0
        dx[r] = g * s
        dw[e] = (dy64[r] * s).T @ x64[r]
        ds[r] = (g * x64[r]).sum(1)
    return dx, dw, ds


@pytest.mark.parametrize("seed", range(8))
def test_gradients_match_numpy(engine, seed):
    """The backward that grad() builds from the rule: dx and dw as grouped calls, d scale from the
    unscaled dx; an empty expert's dw is zero."""
    rng = np.random.default_rng(30 + seed)
    E, S, K, N = _sized(rng)
    scaled = seed % 2 == 0
    ends = _ends(rng, S if seed < 4 else int(rng.integers(0, S + 1)), E, "one" if seed in (3, 6) else "random")
    x = rng.standard_normal((S, K)).astype(np.float32)
    w = rng.standard_normal((E, N, K)).astype(np.float32)
    dy = rng.standard_normal((S, N)).astype(np.float32)
    scale = rng.random(S).astype(np.float32) if scaled else None
    kernel = K_.gmm_scaled if scaled else K_.gmm
    bwd = grad(kernel)
    args = dict(x=engine.tensor(x), w=engine.tensor(w), ends=engine.tensor(ends), d_y=engine.tensor(dy))
    if scaled:
        args["scale"] = engine.tensor(scale)
    got = engine.run(bwd, **{k: v for k, v in args.items() if k in bwd.inputs})
    dx, dw, ds = _grads(x, w, ends, dy, scale)
    _close(got["d_x"].numpy(), dx)
    _close(got["d_w"].numpy(), dw)
    assert "d_ends" not in got
    if scaled:
        _close(got["d_scale"].numpy(), ds)
    else:
        assert "d_scale" not in got
    for e, r in enumerate(_ranges(ends)):
        if r.start == r.stop:
            assert (got["d_w"].numpy()[e] == 0).all()


def test_dw_accumulates_in_a_fixed_order(engine):
    """dw adds into what is there (an empty expert's stays as it was), and two runs agree bit for bit."""
    rng = np.random.default_rng(40)
    E, S, K, N = 6, 300, 20, 28
    ends = _ends(rng, S, E)
    ends[1] = ends[0]                                   # an empty expert
    ends = np.maximum.accumulate(ends).astype(np.int32)
    dy = rng.standard_normal((S, N)).astype(np.float32)
    x = rng.standard_normal((S, K)).astype(np.float32)
    old = rng.standard_normal((E, N, K)).astype(np.float32)
    runs = []
    for _ in range(2):
        dw = engine.tensor(old)
        engine.run(K_.gmm_dw, dy=engine.tensor(dy), x=engine.tensor(x), ends=engine.tensor(ends),
                   out={"dw": dw}, accumulate={"dw"})
        runs.append(dw.numpy())
    _, want, _ = _grads(x, np.zeros((E, N, K), np.float32), ends, dy)
    _close(runs[0], want + old)
    assert (runs[0][1] == old[1]).all()
    assert np.array_equal(runs[0], runs[1])


@pytest.mark.parametrize("tiles", [TileConfig(32, 32, 16, 2, 2), TileConfig(64, 64, 16, 4, 4, vec=True),
                                   TileConfig(128, 64, 8, 8, 8, vec=True, double=True)])
def test_every_tile_shape_gives_the_same_products(engine, tiles):
    """The caller's tiles (vec4 reads where they line up, two stages) give numpy's numbers; a split
    of K is refused (each output is one sum), and the autotuner tries none that splits it."""
    rng = np.random.default_rng(70)
    E, S, K, N = 6, 190, 48, 72
    ends = _ends(rng, S, E)
    x, dy = rng.standard_normal((S, K)).astype(np.float32), rng.standard_normal((S, N)).astype(np.float32)
    w = rng.standard_normal((E, N, K)).astype(np.float32)
    y = engine.run(K_.gmm, tiles=tiles, x=engine.tensor(x), w=engine.tensor(w), ends=engine.tensor(ends))["y"]
    dw = engine.run(K_.gmm_dw, tiles=tiles, dy=engine.tensor(dy), x=engine.tensor(x), ends=engine.tensor(ends))["dw"]
    _close(y.numpy(), _reference(x, w, ends))
    _close(dw.numpy(), _grads(x, w, ends, dy)[1])
    with pytest.raises(ValueError, match="sums each output whole"):
        K_.gmm.kernels[0].specialize({"S": S, "K": K, "N": N, "E": E}, tiles=replace(tiles, split=2))
    spec = K_.gmm.kernels[0].specialize({"S": S, "K": K, "N": N, "E": E})
    tried = candidates.for_spec(spec)
    assert tried[0] == spec.params.tiles and len(tried) > 1 and all(t.split == 1 for t in tried)


def test_autotuned_grouped_gemms_time_a_routing_and_compute_the_same(ctx, tmp_path, monkeypatch):
    """With LFM2JIT_AUTOTUNE the grouped GEMMs are tuned on a seeded random routing (the tuner's zero
    inputs would route nothing, so every candidate would time an empty grid) and the winner gives
    numpy's numbers on another one."""
    from lfm2jit import ComputeEngine
    monkeypatch.setenv("LFM2JIT_AUTOTUNE", "1")
    monkeypatch.setenv("LFM2JIT_CACHE_DIR", str(tmp_path))
    few = (TileConfig(32, 32, 16, 2, 2), TileConfig(64, 64, 16, 4, 4, vec=True))
    monkeypatch.setattr(candidates, "MATMUL", few + (replace(few[1], split=2),))
    eng = ComputeEngine(ctx)
    rng = np.random.default_rng(71)
    E, S, K, N = 5, 150, 40, 56
    ends = _ends(rng, S, E)
    x, dy = rng.standard_normal((S, K)).astype(np.float32), rng.standard_normal((S, N)).astype(np.float32)
    w = rng.standard_normal((E, N, K)).astype(np.float32)
    y = eng.run(K_.gmm, x=eng.tensor(x), w=eng.tensor(w), ends=eng.tensor(ends))["y"]
    dw = eng.run(K_.gmm_dw, dy=eng.tensor(dy), x=eng.tensor(x), ends=eng.tensor(ends))["dw"]
    _close(y.numpy(), _reference(x, w, ends))
    _close(dw.numpy(), _grads(x, w, ends, dy)[1])
    assert len(eng.tuner.best) == 2 and all(len(b["seconds"]) >= 2 for b in eng.tuner.best.values())
    for b in eng.tuner.best.values():       # no split-K candidate was tried; every one ran
        assert all('"split": 1' in k.replace("'", '"') for k in b["seconds"]) and max(b["seconds"].values()) < float("inf")


def test_the_tuners_routing_is_a_random_routers():
    """Every row goes to one expert, the same way each time, and the counts spread as a router's
    with no preference do (binomial: the tuner then sees experts ending in partly filled tiles)."""
    from lfm2jit.tune.autotune import routed_ends
    for kernel, dims, rows in ((K_.gmm, {"S": 10, "K": 8, "N": 8, "E": 4}, 10),
                               (K_.gmm_dw, {"S": 8192, "K": 16, "N": 24, "E": 32}, 8192)):
        params = kernel.kernels[0].specialize(dims).params
        ends = routed_ends(params, dims)
        counts = np.diff(np.concatenate([[0], ends]))
        assert ends.dtype == np.int32 and ends[-1] == rows and counts.min() >= 0
        assert np.array_equal(ends, routed_ends(params, dims))
    mean, sd = rows / 32, np.sqrt(rows / 32 * (1 - 1 / 32))
    assert abs(counts.mean() - mean) < 1e-9 and 0.5 * sd < counts.std() < 1.5 * sd
    assert (counts % 128 != 0).sum() > 16           # most experts end in a partly filled 128-row tile


def test_no_dense_compute_the_grid_covers_each_experts_rows_once(engine):
    """The forward's grid has ceil(S / BM) + E tile rows (any split fits), not E * ceil(S / BM)."""
    (part,) = K_.gmm.kernels
    spec = part.specialize({"S": 1000, "K": 64, "N": 64, "E": 8}, target=engine.target)
    (entry,) = spec.entry_points
    tiles = spec.params.tiles
    assert entry.grid[1] == -(-1000 // tiles.bm) + 8
    assert spec.params.group.ends == "ends" and spec.params.group.over == "m"


@pytest.mark.parametrize("source, message", [
    ("kernel k(x: f32[S, K], w: f32[E, N, D], e: i32[E]) -> (y: f32[S, N]) {\n    y = grouped_matmul(x, w, e)\n}",
     "must share the contracted axis: x's last axis is K, w's K (its last axis) is D"),
    ("kernel k(x: f32[S, K], w: f32[N, K], e: i32[E]) -> (y: f32[S, N]) {\n    y = grouped_matmul(x, w, e)\n}",
     "w must be a float [E, N, K]"),
    ("kernel k(x: f32[S, K], w: f32[E, N, K], e: i32[F]) -> (y: f32[S, N]) {\n    y = grouped_matmul(x, w, e)\n}",
     "ends must be i32[E]"),
    ("kernel k(x: f32[S, K], w: f32[E, N, K], e: f32[E]) -> (y: f32[S, N]) {\n    y = grouped_matmul(x, w, e)\n}",
     "got f32[E]"),
    ("kernel k(x: f32[S, K], w: f32[E, N, K], e: i32[E], s: f32[T]) -> (y: f32[S, N]) {\n"
     "    y = grouped_matmul_scaled(x, w, e, s)\n}", "scale must be a float [S]"),
    ("kernel k(d: f32[S, N], x: f32[R, K], e: i32[E]) -> (w: f32[E, N, K]) {\n    w = grouped_matmul_dw(d, x, e)\n}",
     "must share the row axis"),
    ("kernel k(x: f32[S, K], w: f32[E, N, K]) -> (y: f32[S, N]) {\n    y = grouped_matmul(x, w)\n}",
     "takes 3 operands (x, w, ends), got 2"),
])
def test_bad_operands_are_refused_with_what_was_expected(source, message):
    with pytest.raises(DslError) as err:
        compile_source(source, "bad.lk")
    assert message in str(err.value) and "bad.lk:2:" in str(err.value)


def test_weights_larger_than_a_binding_are_bound_in_pieces(ctx, engine, monkeypatch):
    """w [E, N, K] of 4 experts over a 4 KiB binding: pieces, and the same numbers (bit for bit) as
    bound whole, forward and dw (whose output is then pieced too)."""
    rng = np.random.default_rng(50)
    E, S, K, N = 4, 60, 24, 20          # w: 7680 bytes, two pieces
    ends = _ends(rng, 55, E)
    x = rng.standard_normal((S, K)).astype(np.float32)
    w = rng.standard_normal((E, N, K)).astype(np.float32)
    dy = rng.standard_normal((S, N)).astype(np.float32)

    def run(eng):
        y = eng.run(K_.gmm, x=eng.tensor(x), w=eng.tensor(w), ends=eng.tensor(ends))["y"].numpy()
        dw = eng.run(K_.gmm_dw, dy=eng.tensor(dy), x=eng.tensor(x), ends=eng.tensor(ends))["dw"].numpy()
        return y, dw
    whole = run(engine)
    small = lowered(ctx, monkeypatch)
    (part,) = K_.gmm.kernels
    spec = part.specialize({"S": S, "K": K, "N": N, "E": E}, target=small.target)
    assert {b.tensor: b.pieces for b in spec.bindings}["w"] == 2
    pieced = run(small)
    _close(pieced[0], _reference(x, w, ends))
    v = int(ends[-1])
    assert np.array_equal(pieced[0][:v], whole[0][:v]) and np.array_equal(pieced[1], whole[1])


def test_an_output_larger_than_a_binding_takes_the_simt_template_which_stores_pieces():
    """The matrix template stores its output whole: a dW past the binding limit (an 8B model's under
    WebGPU's defaults) is planned on the SIMT template, in pieces, instead of refused."""
    sizes = {"S": 64, "K": 32, "N": 48, "E": 4}                   # dw: 4 * 48 * 32 f16 = 12 KiB
    units = Target(EMULATED_MATRIX_CONFIGS, EMULATED_SUBGROUP, 32768, emulated=True, storage_buffers=10)
    (part,) = K_.gmm_dw_half.kernels
    assert part.specialize(sizes, target=units).template == "matmul_matrix"
    spec = part.specialize(sizes, target=replace(units, binding_bytes=4096))
    assert spec.template == "matmul" and {b.tensor: b.pieces for b in spec.bindings}["dw"] == 3


def test_the_planner_takes_the_experts_own_tiles_where_the_dense_rules_take_tall_ones():
    """Forward and dX over many rows (LFM2-8B-A1B's, 2048 tokens to 4 of 32 experts) take the
    experts' 96-row tiles where the device's workgroup memory holds them (the dense rules' where
    not); a decode step's few rows keep the dense rules' thin tiles."""
    units = Target(EMULATED_MATRIX_CONFIGS, EMULATED_SUBGROUP, 65536, emulated=True, storage_buffers=10)
    small_memory = replace(units, workgroup_bytes=16384)
    fwd, dx = K_.gmm_half.kernels[0], grad(K_.gmm_half, ["x"]).kernels[0]
    big, decode = {"S": 8192, "K": 2048, "N": 3584, "E": 32}, {"S": 4, "K": 2048, "N": 3584, "E": 32}
    for kernel, want in ((fwd, heuristics.GROUPED_FWD_TILES), (dx, heuristics.GROUPED_DX_TILES)):
        assert kernel.specialize(big, target=units).params.tiles == replace(want, split=1, tail=0)
        fallback = kernel.specialize(big, target=small_memory).params.tiles
        assert fallback != want and fallback.workgroup_bytes(small_memory.matrix("f16", "f32")) <= 16384
        thin = kernel.specialize(decode, target=units).params.tiles
        assert min(thin.wm, thin.wn) <= heuristics.NARROW


def test_the_matrix_template_runs_forward_dx_and_dw(matrix_engine):
    eng = matrix_engine
    rng = np.random.default_rng(60)
    E, S, K, N = 5, 150, 64, 96
    ends = _ends(rng, 140, E)
    x = rng.standard_normal((S, K)).astype(np.float16)
    w = rng.standard_normal((E, N, K)).astype(np.float16)
    dy = rng.standard_normal((S, N)).astype(np.float16)
    sizes = {"S": S, "K": K, "N": N, "E": E}
    for kernel in (K_.gmm_half, K_.gmm_dw_half):
        assert kernel.kernels[0].specialize(sizes, target=eng.target).template == "matmul_matrix"
    y = eng.run(K_.gmm_half, x=eng.tensor(x.astype(np.float32)), w=eng.tensor(w), ends=eng.tensor(ends))["y"]
    _close(y.numpy(), _reference(x, w, ends), 1e-5)
    dx = eng.run(K_.gmm_dx, f16=("w",), dy=eng.tensor(dy.astype(np.float32)), w=eng.tensor(w),
                 ends=eng.tensor(ends))["dx"].numpy()
    dw = eng.run(K_.gmm_dw_half, dy=eng.tensor(dy), x=eng.tensor(x), ends=eng.tensor(ends))["dw"].numpy()
    want_dx, want_dw, _ = _grads(x, w, ends, dy)
    _close(dx, want_dx, 1e-5)
    _close(dw, want_dw, 2e-3)           # stored as f16


@pytest.mark.parametrize("tiles", [MatrixTiles(96, 128, 2, 2, 32), MatrixTiles(96, 128, 2, 4, 32), MatrixTiles(64, 128, 2, 4, 32),
                                   MatrixTiles(96, 128, 2, 4, 32, prefetch=False), MatrixTiles(64, 64, 2, 2, 32, stages=2),
                                   MatrixTiles(96, 128, 2, 2, 32, sg_k=2), MatrixTiles(64, 64, 2, 2, 64, sg_k=2, prefetch=False)],
                         ids=lambda t: t.label)
def test_matrix_tiles_of_any_height_give_the_products(matrix_engine, tiles):
    """Tile heights other than a power of two (96: three fragments a subgroup) and other shapes on the
    matrix template (groups of subgroups sharing a k-step among them): forward, dX and dW against
    numpy, experts ending anywhere in a tile."""
    eng = matrix_engine
    rng = np.random.default_rng(61)
    E, S, K, N = 4, 300, 64, 256
    ends = _ends(rng, 290, E)
    x, w, dy = (rng.standard_normal(s).astype(np.float16) for s in ((S, K), (E, N, K), (S, N)))
    y = eng.run(K_.gmm_half, tiles=tiles, x=eng.tensor(x.astype(np.float32)), w=eng.tensor(w), ends=eng.tensor(ends))["y"]
    _close(y.numpy(), _reference(x, w, ends), 1e-5)
    dx = eng.run(K_.gmm_dx, tiles=tiles, f16=("w",), dy=eng.tensor(dy.astype(np.float32)), w=eng.tensor(w),
                 ends=eng.tensor(ends))["dx"].numpy()
    dw = eng.run(K_.gmm_dw_half, tiles=tiles, dy=eng.tensor(dy), x=eng.tensor(x), ends=eng.tensor(ends))["dw"].numpy()
    want_dx, want_dw, _ = _grads(x, w, ends, dy)
    _close(dx, want_dx, 1e-5)
    _close(dw, want_dw, 2e-3)           # stored as f16
