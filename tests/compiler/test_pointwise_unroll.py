"""Elementwise kernels compute several elements per invocation in large spaces
(schedule/pointwise.py). Each element's arithmetic is the same code, so the unrolled kernels must
give bit-identical results to one element an invocation, match float64, and leave the rows past a
sequence's real length unwritten, at sizes that end inside a workgroup and inside a row."""
from __future__ import annotations

import numpy as np
import pytest

from lfm2jit import compile_source
from lfm2jit.runtime.tensor import Tensor
from lfm2jit.tune import heuristics

SOURCE = """
kernel gate(a: f32[T, C], b: f32[T, C], w: f32[C]) -> (y: f32[T, C], z: f32[T, C]) {
    y = a / (1.0 + exp(-a)) * b
    z = y * w + a
}
kernel mix(x: f32[R, C], w: f32[C]) -> (y: f32[R, C]) {
    y = x * w - x
}
kernel late(x: f32[B?, T, C]) -> (y: f32[B?, T, C]) {
    y = x * 2.0 + 1.0
}
"""
MOD = compile_source(SOURCE)   # tests that set the constants compile afresh: specs are cached per kernel
SENTINEL = 7.25


def _padded_out(engine, rows, bucket_rows, cols):
    """An output tensor of ``rows`` real rows in a buffer of ``bucket_rows``, filled with SENTINEL."""
    full = engine.tensor(np.full((bucket_rows, cols), SENTINEL, np.float32))
    return full, Tensor(engine.ctx, full.buffer, (rows, cols), "f32", capacity=bucket_rows * cols, base=full)


@pytest.mark.parametrize("rows,cols,bucket", [(1, 1, 1), (5, 300, 8), (37, 64, 64), (16, 1024, 16),
                                               (130, 33, 4), (3, 2000, 64)])
def test_unrolled_elements_are_bitwise_one_a_time_and_stop_at_the_real_length(engine, rng, monkeypatch,
                                                                               rows, cols, bucket):
    a = rng.standard_normal((rows, cols)).astype(np.float32)
    b = rng.standard_normal((rows, cols)).astype(np.float32)
    w = rng.standard_normal(cols).astype(np.float32)
    padded = -(-rows // bucket) * bucket
    results = []
    for per in (heuristics.PER_INVOCATION, 1):
        monkeypatch.setattr(heuristics, "UNROLL_MIN_ELEMENTS", 0)
        monkeypatch.setattr(heuristics, "PER_INVOCATION", per)
        (fy, y), (fz, z) = _padded_out(engine, rows, padded, cols), _padded_out(engine, rows, padded, cols)
        gate = compile_source(SOURCE).gate
        assert gate.specialize({"T": padded, "C": cols}, bucket).params.per_invocation == per
        engine.run(gate, bucket=bucket, a=engine.tensor(a), b=engine.tensor(b), w=engine.tensor(w),
                   out={"y": y, "z": z})
        results.append((fy.numpy(), fz.numpy()))
    for unrolled, single in zip(*results):
        np.testing.assert_array_equal(unrolled, single)
        np.testing.assert_array_equal(unrolled[rows:], SENTINEL)        # padded rows never written
    a64, b64 = a.astype(np.float64), b.astype(np.float64)
    y64 = a64 / (1.0 + np.exp(-a64)) * b64
    np.testing.assert_allclose(results[0][0][:rows], y64, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(results[0][1][:rows], y64 * w + a64, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("rows,cols", [(3, 5), (40, 100), (257, 31)])
def test_unrolled_accumulation_without_a_sequence_axis(engine, rng, monkeypatch, rows, cols):
    x = rng.standard_normal((rows, cols)).astype(np.float32)
    w = rng.standard_normal(cols).astype(np.float32)
    acc0 = rng.standard_normal((rows, cols)).astype(np.float32)
    got = []
    for per in (heuristics.PER_INVOCATION, 1):
        monkeypatch.setattr(heuristics, "UNROLL_MIN_ELEMENTS", 0)
        monkeypatch.setattr(heuristics, "PER_INVOCATION", per)
        acc = engine.tensor(acc0)
        engine.run(compile_source(SOURCE).mix, x=engine.tensor(x), w=engine.tensor(w), out={"y": acc}, accumulate={"y"})
        got.append(acc.numpy())
    np.testing.assert_array_equal(got[0], got[1])
    np.testing.assert_allclose(got[0], acc0 + (x.astype(np.float64) * w - x), rtol=1e-6, atol=1e-6)


def test_which_spaces_unroll(monkeypatch):
    n = heuristics.UNROLL_MIN_ELEMENTS
    assert heuristics.PER_INVOCATION == 4
    assert MOD.gate.specialize({"T": n // 64, "C": 64}, 1).params.per_invocation == 4
    assert MOD.gate.specialize({"T": n // 64 - 1, "C": 64}, 1).params.per_invocation == 1   # few workgroups
    assert MOD.mix.specialize({"R": n // 64, "C": 64}, 1).params.per_invocation == 4
    # T after a batch axis: a later element may lie on an earlier row, so no early stop is safe
    assert MOD.late.specialize({"B": 2, "T": n // 64, "C": 64}, 1).params.per_invocation == 1
