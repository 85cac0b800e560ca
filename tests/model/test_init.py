"""The random initialisation's draws (lfm2jit/model/checkpoint.py normal): seeded, independent of
the thread count, each chunk of a large tensor from its own stream, and normal(0, std) in law."""
import numpy as np
import pytest

from lfm2jit.model import checkpoint
from lfm2jit.model.checkpoint import NORMAL_CHUNK, normal


def test_small_tensor_is_drawn_from_the_generator_itself():
    rng, ref = np.random.default_rng(5), np.random.default_rng(5)
    got = normal(rng, (3, 7), 0.5)
    assert np.array_equal(got, ref.standard_normal((3, 7), dtype=np.float32) * np.float32(0.5))
    # the generator moved on as a plain draw moves it: the next tensor's values continue the stream
    assert np.array_equal(normal(rng, (4,), 1.0), ref.standard_normal(4, dtype=np.float32))

@pytest.mark.parametrize("f16", [False, True])
def test_large_tensor_depends_on_the_seed_not_the_threads(monkeypatch, f16):
    shape = (3, NORMAL_CHUNK // 2 + 5)          # two chunks, the last one short
    many = normal(np.random.default_rng(11), shape, 0.02, f16)
    monkeypatch.setattr(checkpoint.os, "cpu_count", lambda: 1)
    one = normal(np.random.default_rng(11), shape, 0.02, f16)
    assert many.dtype == (np.float16 if f16 else np.float32) and many.shape == shape
    assert np.array_equal(many, one)
    assert not np.array_equal(many, normal(np.random.default_rng(12), shape, 0.02, f16))
    flat = many.reshape(-1).astype(np.float64)
    # no chunk repeats another's stream
    assert not np.array_equal(flat[:1000], flat[NORMAL_CHUNK:NORMAL_CHUNK + 1000])
    # normal(0, 0.02) in law: mean and std within a few standard errors, and the tails of a normal
    n = flat.size
    assert abs(flat.mean()) < 5 * 0.02 / np.sqrt(n)
    assert abs(flat.std() / 0.02 - 1) < 5 / np.sqrt(2 * n) + (1e-3 if f16 else 0)
    assert abs(np.mean(np.abs(flat) > 2 * 0.02) - 0.0455) < 0.002
