"""The matmul autotuner: tries every candidate once per (adapter, shape), keeps the fastest on
disk, survives failing candidates, and never changes results."""
from __future__ import annotations

import json
import math

import numpy as np

from lfm2jit import ComputeEngine, library
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
    """The autotuner may pick any candidate, so each must be right, ragged edges included."""
    for T, K, N in [(70, 33, 90), (129, 7, 130)]:
        x = rng.standard_normal((T, K)).astype(np.float32)
        w = rng.standard_normal((N, K)).astype(np.float32)
        want = x.astype(np.float64) @ w.T
        for tiles in CANDIDATES:
            got = engine.run("linear", bucket=16, tiles=tiles, x=engine.tensor(x), w=engine.tensor(w))["y"].numpy()
            assert rel_err(got, want) < 1e-5, tiles
