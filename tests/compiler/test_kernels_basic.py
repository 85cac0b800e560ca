"""The first shipped kernels against numpy float64, on odd sizes and lengths off the bucket."""
from __future__ import annotations

import numpy as np
import pytest

from lfm2jit import Tensor
from numerics import rel_err

# f32 kernels over at most a few thousand terms: 1e-5 normwise leaves a 10x margin over the
# worst errors seen (about 1e-6 for softmax's log-sum-exp at D=1000).
TOL = 1e-5
SHAPES = [(1, 1), (5, 3), (13, 97), (70, 1000), (64, 64)]


def _f64(*xs):
    return [x.astype(np.float64) for x in xs]


@pytest.mark.parametrize("T,D", SHAPES)
@pytest.mark.parametrize("bucket", [1, 16, 64])
def test_rmsnorm(engine, rng, T, D, bucket):
    x = rng.standard_normal((T, D)).astype(np.float32) * 3
    w = rng.standard_normal(D).astype(np.float32)
    y = engine.run("rmsnorm", bucket=bucket, x=engine.tensor(x), w=engine.tensor(w), eps=1e-6)["y"].numpy()
    x64, w64 = _f64(x, w)
    want = x64 / np.sqrt((x64 ** 2).mean(-1, keepdims=True) + 1e-6) * w64
    assert rel_err(y, want) < TOL


@pytest.mark.parametrize("T,D", SHAPES)
def test_softmax_and_lse(engine, rng, T, D):
    x = (rng.standard_normal((T, D)) * 10).astype(np.float32)
    out = engine.run("softmax", bucket=16, x=engine.tensor(x))
    (x64,) = _f64(x)
    m = x64.max(-1, keepdims=True)
    e = np.exp(x64 - m)
    assert rel_err(out["y"].numpy(), e / e.sum(-1, keepdims=True)) < TOL
    assert rel_err(out["lse"].numpy(), (m + np.log(e.sum(-1, keepdims=True)))[:, 0]) < TOL


@pytest.mark.parametrize("T,D", SHAPES)
def test_silu_mul(engine, rng, T, D):
    a = (rng.standard_normal((T, D)) * 4).astype(np.float32)
    b = rng.standard_normal((T, D)).astype(np.float32)
    y = engine.run("silu_mul", bucket=64, a=engine.tensor(a), b=engine.tensor(b))["y"].numpy()
    a64, b64 = _f64(a, b)
    assert rel_err(y, a64 / (1 + np.exp(-a64)) * b64) < TOL


def test_silu_extremes(engine):
    """Large |a| must give the limits (0 and a*b), not NaN from exp overflow."""
    a = np.array([[-200.0, -88.0, 0.0, 88.0, 200.0]], np.float32)
    b = np.ones_like(a)
    y = engine.run("silu_mul", a=engine.tensor(a), b=engine.tensor(b))["y"].numpy()
    assert np.all(np.isfinite(y))
    np.testing.assert_allclose(y, [[0.0, 0.0, 0.0, 88.0, 200.0]], atol=1e-30, rtol=1e-6)


@pytest.mark.parametrize("T,D", SHAPES)
def test_scale_add_scale_add(engine, rng, T, D):
    x = rng.standard_normal((T, D)).astype(np.float32)
    z = rng.standard_normal((T, D)).astype(np.float32)
    x64, z64 = _f64(x, z)
    tx, tz = engine.tensor(x), engine.tensor(z)
    got = engine.run("scale_add", bucket=16, x=tx, z=tz, alpha=0.5, beta=-2.0)["y"].numpy()
    assert rel_err(got, 0.5 * x64 - 2.0 * z64) < TOL
    assert rel_err(engine.run("scale", bucket=16, x=tx, alpha=3.0)["y"].numpy(), 3.0 * x64) < TOL
    assert rel_err(engine.run("add", bucket=16, x=tx, z=tz)["y"].numpy(), x64 + z64) < TOL


def test_scalars_change_without_recompiling(engine, rng):
    x = engine.tensor(rng.standard_normal((4, 8)).astype(np.float32))
    engine.run("scale", bucket=4, x=x, alpha=1.0)["y"].numpy()
    misses = engine.stats.misses
    for alpha in (2.0, -0.25, 1e3):
        got = engine.run("scale", bucket=4, x=x, alpha=alpha)["y"].numpy()
        assert rel_err(got, alpha * x.numpy().astype(np.float64)) < TOL
    assert engine.stats.misses == misses


@pytest.mark.parametrize("kernel", ["rmsnorm", "softmax", "silu_mul", "add"])
def test_padded_rows_never_change_real_rows(ctx, engine, rng, kernel):
    """Inputs whose padded rows hold NaN give the same real rows as clean inputs."""
    T, D, bucket = 50, 33, 64
    clean = {n: rng.standard_normal((T, D)).astype(np.float32) for n in ("x", "a", "b", "z")}
    w = engine.tensor(rng.standard_normal(D).astype(np.float32))

    def args(poisoned: bool):
        out = {}
        for n, arr in clean.items():
            full = np.full((bucket, D), np.nan, np.float32)
            full[:T] = arr
            t = engine.tensor(full if poisoned else arr)
            out[n] = Tensor(ctx, t.buffer, (T, D), "f32", capacity=t.capacity) if poisoned else t
            out[n]._keep = t   # the view must not outlive the buffer's owner
        return out

    k = engine.compile(kernel, {"T": T, "D": D, "F": D}, bucket).spec
    names = set(k.inputs)
    extra = {"w": w, "eps": 1e-5} if kernel == "rmsnorm" else {}
    results = []
    for poisoned in (False, True):
        a = {n: v for n, v in args(poisoned).items() if n in names}
        out = engine.run(kernel, bucket=bucket, **a, **extra)
        results.append({n: t.numpy() for n, t in out.items()})
    for name in results[0]:
        assert np.all(np.isfinite(results[1][name]))
        np.testing.assert_array_equal(results[0][name], results[1][name])
