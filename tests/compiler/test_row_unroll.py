"""Row reductions take several workgroup strides per loop trip (schedule/reduce.py strided_unroll)
so their loads issue together. The unrolled pass adds in the same order as one stride a trip, so
it must give bit-identical results to ROW_UNROLL = 1, and what float64 numpy gives, at every row
length (whole strides of 1, 2, 3, 4, 8 and 16, and lengths no stride divides)."""
from __future__ import annotations

import numpy as np
import pytest

from lfm2jit import compile_source
from lfm2jit.schedule import reduce
from lfm2jit.schedule.code import Const, SeqLen
from lfm2jit.schedule.reduce import strided_unroll
from lfm2jit.tune import heuristics

# two phases (a sum, then a max of what the sum scales) and an element output after them
SOURCE = """kernel k(x: f32[R, C], w: f32[C]) -> (y: f32[R, C], s: f32[R], m: f32[R]) {
    s = sum(x * x, C)
    m = max(abs(x) * w / (s + 1.0), C)
    y = x * w / (m + 1.0)
}"""


def _meaning(x, w):
    s = (x * x).sum(1)
    m = (np.abs(x) * w / (s[:, None] + 1.0)).max(1)
    return {"s": s, "m": m, "y": x * w / (m[:, None] + 1.0)}


@pytest.mark.parametrize("cols", [32, 256, 512, 768, 1024, 2048, 4096, 300, 1000])
def test_unrolled_rows_are_bitwise_the_single_stride_ones_and_match_float64(engine, rng, cols, monkeypatch):
    rows = int(rng.integers(1, 40))
    x = rng.standard_normal((rows, cols)).astype(np.float32)
    w = rng.standard_normal(cols).astype(np.float32)
    results = []
    for most in (heuristics.ROW_UNROLL, 1):
        monkeypatch.setattr(heuristics, "ROW_UNROLL", most)
        (kernel,) = list(compile_source(SOURCE))
        got = engine.run(kernel, x=engine.tensor(x), w=engine.tensor(w))
        results.append({k: v.numpy() for k, v in got.items()})
    for name, want in _meaning(x.astype(np.float64), w.astype(np.float64)).items():
        np.testing.assert_array_equal(results[0][name], results[1][name], err_msg=f"{name} C={cols}")
        np.testing.assert_allclose(results[0][name], want, rtol=1e-5, atol=1e-5, err_msg=f"{name} C={cols}")


def test_strided_unroll_takes_whole_strides_only():
    assert heuristics.ROW_UNROLL == 4
    assert [strided_unroll(Const(256 * k), 256) for k in (1, 2, 3, 4, 8, 16)] == [1, 2, 1, 4, 4, 4]
    assert strided_unroll(Const(300), 256) == 1 and strided_unroll(Const(64), 32) == 2
    assert strided_unroll(SeqLen(), 256) == 1      # a length known only at run time
