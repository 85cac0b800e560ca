"""Column reductions split over slices of their loop (lfm2jit/schedule/reduce.py, ColumnTiles):
every split gives what float64 numpy gives, for sums and maxima, over T (to its real length, with
poisoned padding) and over several axes at once, with what follows the reduction (scaling, outer
values) and accumulation into existing contents; the planner splits only what is long and narrow,
refuses a split it cannot make, and the autotuner tries every split of what it splits."""
from __future__ import annotations

import json

import numpy as np
import pytest

from lfm2jit import ComputeEngine, Tensor, compile_source
from lfm2jit.tune.heuristics import COLUMN_BUSY, COLUMN_SLICE, column_split
from lfm2jit.tune.tiles import COLUMN_SPLITS, ColumnTiles
from lfm2jit.schedule.layout import bucketed
from lfm2jit.tune.candidates import for_spec

BUCKET = 16

# name: (source, numpy meaning over float64 inputs)
CASES = {
    "sum_over_T": ("kernel k(x: f32[T, D]) -> (y: f32[D]) { y = sum(x * x, T) }",
                   lambda a: {"y": (a["x"] ** 2).sum(0)}),
    "max_over_T": ("kernel k(x: f32[T, D]) -> (y: f32[D]) { y = max(x, T) }",
                   lambda a: {"y": a["x"].max(0)}),
    "sum_over_T_and_heads_then_scaled": (
        "kernel k(x: f32[T, H, E], g: f32[T, H, E], c: f32[E]) -> (dw: f32[E]) { dw = sum(sum(x * g, H), T) * 0.5 + c }",
        lambda a: {"dw": (a["x"] * a["g"]).sum((0, 1)) * 0.5 + a["c"]}),
    "two_outputs_of_one_sum": (
        "kernel k(x: f32[T, D]) -> (s: f32[D], q: f32[D]) {\n s = sum(x, T)\n q = s * s\n}",
        lambda a: {"s": a["x"].sum(0), "q": a["x"].sum(0) ** 2}),
}


def _inputs(rng, name: str, t: int) -> dict[str, np.ndarray]:
    if name == "sum_over_T_and_heads_then_scaled":
        return {"x": rng.standard_normal((t, 3, 8)).astype(np.float32),
                "g": rng.standard_normal((t, 3, 8)).astype(np.float32),
                "c": rng.standard_normal(8).astype(np.float32)}
    return {"x": rng.standard_normal((t, 6)).astype(np.float32)}


def _poisoned(engine, arr: np.ndarray) -> Tensor:
    """``arr`` in a buffer of bucketed rows whose rows past the real length hold NaN."""
    full = np.full((bucketed(arr.shape[0], BUCKET),) + arr.shape[1:], np.nan, arr.dtype)
    full[:arr.shape[0]] = arr
    base = engine.tensor(full)
    return Tensor(engine.ctx, base.buffer, arr.shape, base.dtype, capacity=base.capacity, base=base)


@pytest.mark.parametrize("name", CASES)
def test_every_split_matches_float64(engine, rng, name):
    source, meaning = CASES[name]
    (kernel,) = list(compile_source(source))
    for trial, t in enumerate((1, 5, 37, 200, 333)):
        arrays = _inputs(rng, name, t)
        want = meaning({n: a.astype(np.float64) for n, a in arrays.items()})
        for split in (1, 2, 4, 8, 32):
            args = {n: (_poisoned(engine, a) if a.shape[0] == t and a.ndim > 1 else engine.tensor(a))
                    for n, a in arrays.items()}
            spec = kernel.specialize({"T": t, **{a: s for a, s in zip("HE", (3, 8))}, "D": 6}, BUCKET,
                                     tiles=ColumnTiles(split))
            assert len(spec.entry_points) == (1 if split == 1 else 2)
            got = engine.run(kernel, bucket=BUCKET, tiles=ColumnTiles(split), **args)
            for out, w in want.items():
                np.testing.assert_allclose(got[out].numpy(), w, rtol=2e-5, atol=2e-5,
                                           err_msg=f"{name} T={t} split={split} {out}")


def test_a_split_accumulates_into_existing_contents(engine, rng):
    (kernel,) = list(compile_source(CASES["sum_over_T_and_heads_then_scaled"][0]))
    arrays = _inputs(rng, "sum_over_T_and_heads_then_scaled", 90)
    old = rng.standard_normal(8).astype(np.float32)
    dw = engine.tensor(old)
    engine.run(kernel, bucket=BUCKET, tiles=ColumnTiles(4), out={"dw": dw}, accumulate=frozenset({"dw"}),
               **{n: engine.tensor(a) for n, a in arrays.items()})
    a = {n: v.astype(np.float64) for n, v in arrays.items()}
    np.testing.assert_allclose(dw.numpy(), old + (a["x"] * a["g"]).sum((0, 1)) * 0.5 + a["c"], rtol=2e-5, atol=2e-5)


def test_only_long_narrow_single_reductions_split():
    assert column_split(16, 65536, 1) == COLUMN_BUSY // 16          # a norm weight's gradient at 8x512
    assert column_split(16, 65536, 2) == 1                          # a second reduction needs the first's result
    assert column_split(16, COLUMN_SLICE, 1) == 1                   # too short to cut
    assert column_split(COLUMN_BUSY, 1 << 20, 1) == 1               # enough workgroups already
    assert column_split(1, 1 << 30, 1) == 32                        # at most 32 slices


def test_the_planner_splits_a_norm_weight_gradient_over_many_rows():
    (kernel,) = list(compile_source(CASES["sum_over_T_and_heads_then_scaled"][0]))
    long = kernel.specialize({"T": 4096, "H": 16, "E": 64}, 64)
    assert long.params.split == COLUMN_BUSY // 16 and [e.name for e in long.entry_points] == ["main", "reduce"]
    assert kernel.specialize({"T": 64, "H": 16, "E": 64}, 64).params.split == 1


def test_a_split_it_cannot_make_is_refused_before_gpu_work():
    with pytest.raises(ValueError, match=r"ColumnTiles.split must be one of \(1, 2, 4, 8, 16, 32\), got 3"):
        ColumnTiles(3)
    (kernel,) = list(compile_source("kernel k(x: f32[T, D]) -> (y: f32[D]) { y = sum(x, T) * sum(x * sum(x, T), T) }"))
    spec_kind = kernel.specialize({"T": 8, "D": 4}, 8)
    assert spec_kind.template == "colreduce" and spec_kind.params.split == 1
    with pytest.raises(ValueError, match="only a single reduction .* splits its loop .* 2 reductions"):
        kernel.specialize({"T": 8, "D": 4}, 8, tiles=ColumnTiles(2))


def test_the_autotuner_tries_every_split_of_a_long_narrow_reduction(ctx, tmp_path, monkeypatch, rng):
    """LFM2JIT_AUTOTUNE=1: the planner's split first, then every other; the winner is saved as
    ColumnTiles, read back by a second engine (which times nothing) and gives the same bits."""
    (kernel,) = list(compile_source(CASES["sum_over_T"][0]))
    long, short = kernel.specialize({"T": 8192, "D": 6}, 64), kernel.specialize({"T": 64, "D": 6}, 64)
    options = for_spec(long)
    assert options[0] == ColumnTiles(long.params.split) and sorted(t.split for t in options) == list(COLUMN_SPLITS)
    assert for_spec(short) == ()                       # not long and narrow: nothing to tune
    monkeypatch.setenv("LFM2JIT_AUTOTUNE", "1")
    monkeypatch.setenv("LFM2JIT_CACHE_DIR", str(tmp_path))
    x = rng.standard_normal((8192, 6)).astype(np.float32)
    eng = ComputeEngine(ctx)
    got = eng.run(kernel, bucket=64, x=eng.tensor(x))["y"].numpy()
    np.testing.assert_allclose(got, (x.astype(np.float64) ** 2).sum(0), rtol=2e-5)
    assert eng.tuner.trials == len(COLUMN_SPLITS)
    (entry,) = json.loads((tmp_path / "autotune.json").read_text()).values()
    assert entry["kind"] == "ColumnTiles" and len(entry["seconds"]) == len(COLUMN_SPLITS)
    again = ComputeEngine(ctx)
    np.testing.assert_array_equal(again.run(kernel, bucket=64, x=again.tensor(x))["y"].numpy(), got)
    assert again.tuner.trials == 0
