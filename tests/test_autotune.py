"""The matmul autotuner: tries every candidate once per (adapter, shape), keeps the fastest on
disk, survives failing candidates, and never changes results."""
from __future__ import annotations

import json
import math

import numpy as np
import pytest

from lfm2jit import ComputeEngine, grad, library
from lfm2jit.schedule.contraction import CANDIDATES, TileConfig
from conftest import rel_err


def test_tile_configs_that_cannot_tile_are_rejected():
    for bad in (dict(bm=64, bn=64, bk=16, tm=3, tn=4), dict(bm=256, bn=256, bk=16, tm=4, tn=4),
                dict(bm=128, bn=128, bk=32, tm=8, tn=8)):
        try:
            TileConfig(**bad)
        except ValueError:
            continue
        raise AssertionError(f"{bad} was accepted")


def test_autotuned_matmul_is_correct_and_cached(ctx, tmp_path, monkeypatch, rng):
    monkeypatch.setenv("LFM2JIT_AUTOTUNE", "1")
    monkeypatch.setenv("LFM2JIT_CACHE_DIR", str(tmp_path))
    eng = ComputeEngine(ctx)
    x = rng.standard_normal((70, 40)).astype(np.float32)
    w = rng.standard_normal((90, 40)).astype(np.float32)
    y = eng.run("linear", bucket=16, x=eng.tensor(x), w=eng.tensor(w))["y"].numpy()
    assert rel_err(y, x.astype(np.float64) @ w.T) < 1e-5
    assert eng.tuner.trials == len(CANDIDATES)
    saved = json.loads((tmp_path / "autotune.json").read_text())
    (entry,) = saved.values()
    assert TileConfig(**entry["tiles"]) in CANDIDATES
    assert len(entry["seconds"]) == len(CANDIDATES)
    # a second engine reads the choice from disk and benchmarks nothing
    again = ComputeEngine(ctx)
    again.run("linear", bucket=16, x=again.tensor(x), w=again.tensor(w))["y"].numpy()
    assert again.tuner.trials == 0


def test_a_failing_candidate_scores_infinity(ctx, tmp_path, monkeypatch):
    monkeypatch.setenv("LFM2JIT_AUTOTUNE", "1")
    monkeypatch.setenv("LFM2JIT_CACHE_DIR", str(tmp_path))
    bad = TileConfig(bm=64, bn=64, bk=16, tm=4, tn=4)
    real_plan = __import__("lfm2jit.schedule.contraction", fromlist=["plan"]).plan

    def plan(ir, sizes, accumulate, tiles=None):      # this candidate's shader fails to build
        ctx = real_plan(ir, sizes, accumulate, tiles)
        if tiles == bad:
            ctx[1]["threads"] = 0
        return ctx
    monkeypatch.setattr("lfm2jit.schedule.contraction.plan", plan)
    monkeypatch.setattr("lfm2jit.autotune.CANDIDATES", CANDIDATES[1:] + (bad,))
    eng = ComputeEngine(ctx)
    tiles = eng.tuner.tiles(library.get("linear"), {"T": 8, "K": 8, "N": 8}, 1, frozenset())
    assert tiles != bad
    (entry,) = eng.tuner.best.values()
    assert math.isinf(entry["seconds"][str(bad.__dict__)])


def test_every_candidate_computes_the_same_product(engine, rng):
    """The autotuner may pick any candidate, so each must be right, ragged edges included, for the
    three products of a linear layer (x W^T, dY W, dY^T X), with scalar and vec4 device reads
    (vec4 needs the contiguous axis a multiple of 4: K = 36 and 8 have it, 33 and 7 do not)."""
    lin = library.get("linear")
    dx_k, dw_k = grad(lin, ["x"]).kernels[0], grad(lin, ["w"]).kernels[0]
    modes = set()
    for T, K, N in [(70, 33, 90), (129, 7, 130), (70, 36, 92), (129, 8, 132)]:
        x = rng.standard_normal((T, K)).astype(np.float32)
        w = rng.standard_normal((N, K)).astype(np.float32)
        dy = rng.standard_normal((T, N)).astype(np.float32)
        want = {"y": x.astype(np.float64) @ w.T, "d_x": dy.astype(np.float64) @ w, "d_w": dy.T.astype(np.float64) @ x}
        args = {"x": engine.tensor(x), "w": engine.tensor(w), "d_y": engine.tensor(dy)}
        for tiles in CANDIDATES:
            for kernel, out in ((lin, "y"), (dx_k, "d_x"), (dw_k, "d_w")):
                given = {n: args[n] for n in (t.name for t in kernel.ir.inputs)}
                got = engine.run(kernel, bucket=16, tiles=tiles, **given)[out].numpy()
                assert rel_err(got, want[out]) < 1e-5, (tiles, out, T, K, N)
                spec = kernel.specialize({"T": T, "K": K, "N": N}, 16, frozenset(), tiles)
                modes |= {spec.context["a"]["vec"], spec.context["b"]["vec"]}
    assert modes == {None, "k", "m"}


def test_f16_operands_read_as_vectors(ctx, engine, rng):
    """f16 storage (mixed precision) reads vec4<f16> and widens: exact products of f16 inputs in
    f32, so only the f16 output's rounding (2**-11 relative) separates it from float64."""
    if not ctx.has_f16:
        pytest.skip("adapter has no shader-f16")
    lin = library.get("linear").variant("f16")
    VEC_TILES = TileConfig(64, 128, 16, 8, 8, vec=True)
    T, K, N = 70, 36, 92
    x = rng.standard_normal((T, K)).astype(np.float16)
    w = rng.standard_normal((N, K)).astype(np.float16)
    spec = lin.specialize({"T": T, "K": K, "N": N}, 16, frozenset(), VEC_TILES)
    assert spec.context["a"]["vec"] == spec.context["b"]["vec"] == "k"
    got = engine.run(lin, bucket=16, tiles=VEC_TILES, x=engine.tensor(x), w=engine.tensor(w))["y"].numpy()
    assert rel_err(got.astype(np.float64), x.astype(np.float64) @ w.T.astype(np.float64)) < 2 ** -11
