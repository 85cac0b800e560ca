"""Padded positions never change results: every kernel reads rows at or past the real length only
under a mask. Inputs here carry NaN in their padded rows (as a pooled buffer left over from a longer
sequence would carry stale values); any unmasked read of them shows up as a NaN or a changed number.

A bug this caught: a column reduction over (B, T) of a [B?, T, ...] kernel looped over the padded
T (an inner axis of the flattened loop) and summed stale rows into the conv weight's gradient."""
from __future__ import annotations

import numpy as np
import pytest

from lfm2jit import Tensor, compile_source, grad, library
from lfm2jit.schedule.layout import bucketed

T, BUCKET = 11, 8


def poisoned(engine, arr: np.ndarray, bucket: int = BUCKET) -> Tensor:
    """``arr`` (T leading) in a buffer of bucketed(T) rows whose rows past T hold NaN; the tensor
    may address all of them (its capacity), as a pooled activation can."""
    t_pad = bucketed(arr.shape[0], bucket)
    full = np.full((t_pad,) + arr.shape[1:], np.nan, arr.dtype)
    full[:arr.shape[0]] = arr
    base = engine.tensor(full)
    return Tensor(engine.ctx, base.buffer, arr.shape, base.dtype, capacity=base.capacity, base=base)


def run_both(engine, kernel, arrays: dict, **scalars) -> tuple[dict, dict]:
    clean = engine.run(kernel, bucket=BUCKET, **{n: engine.tensor(a) for n, a in arrays.items()}, **scalars)
    dirty = engine.run(kernel, bucket=BUCKET, **{n: poisoned(engine, a) for n, a in arrays.items()}, **scalars)
    return {n: t.numpy() for n, t in clean.items()}, {n: t.numpy() for n, t in dirty.items()}


SOURCES = {
    "column_sum_over_T": "kernel k(x: f32[T, D]) -> (y: f32[D]) { y = sum(x * x, T) }",
    "mean_over_T": "kernel k(x: f32[T, D]) -> (y: f32[T, D]) { y = x - mean(x, T) }",
    "shift_ahead": "kernel k(x: f32[T, D]) -> (y: f32[T, D]) { y = x[T + 2, :] * x + max(x, T) }",
    "window_ahead": "kernel k(x: f32[T, D], w: f32[L]) -> (y: f32[T, D]) { y = sum(w * x[T + L, :], L) }",
    "flip_T": "kernel k(x: f32[T, D]) -> (y: f32[T, D]) { y = flip(x, T) * 2.0 }",
}


@pytest.mark.parametrize("name", SOURCES)
def test_padded_rows_never_reach_a_result(engine, rng, name):
    (kernel,) = list(compile_source(SOURCES[name]))
    arrays = {"x": rng.standard_normal((T, 5)).astype(np.float32)}
    if "w: f32[L]" in SOURCES[name]:
        arrays["w"] = rng.standard_normal(3).astype(np.float32)
    clean, dirty = run_both(engine, kernel, arrays)
    for n in clean:
        assert np.isfinite(dirty[n]).all() and np.array_equal(clean[n], dirty[n]), n
    bwd = grad(kernel)
    cot = {f"d_{o}": rng.standard_normal(clean[o].shape).astype(np.float32) for o in clean}
    needed = {n: a for n, a in {**arrays, **clean, **cot}.items() if n in bwd.inputs}
    gc, gd = run_both(engine, bwd, needed)
    for n in gc:
        assert np.isfinite(gd[n]).all() and np.array_equal(gc[n], gd[n]), n


def test_conv_weight_gradient_ignores_padded_rows(engine, rng):
    """short_conv's [B?, T, ...] layout: its weight gradient sums over B and T."""
    kernel = grad(library.get("short_conv"), ["bcx", "w"])
    arrays = {"bcx": rng.standard_normal((T, 3, 6)).astype(np.float32),
              "d_y": rng.standard_normal((T, 6)).astype(np.float32)}
    w = engine.tensor(rng.standard_normal((6, 3)).astype(np.float32))
    clean = engine.run(kernel, bucket=BUCKET, w=w, **{n: engine.tensor(a) for n, a in arrays.items()})
    dirty = engine.run(kernel, bucket=BUCKET, w=w, **{n: poisoned(engine, a) for n, a in arrays.items()})
    for n in ("d_bcx", "d_w"):
        got = dirty[n].numpy()
        assert np.isfinite(got).all() and np.array_equal(clean[n].numpy(), got), n
