"""pytest-benchmark: single kernels at tiny shapes (so they run on lavapipe too).

The full-size numbers (LFM2-350M shapes, GPU timestamps, TFLOP/s and GB/s against the card's
ceilings) come from ``python -m lfm2jit.bench``; these track regressions of the same paths.
"""
from __future__ import annotations

import numpy as np
import pytest
from conftest import run_synced

from lfm2jit import grad
from lfm2jit.ops import library
from lfm2jit.ops.lmhead import lm_head_cross_entropy
from lfm2jit.ops.optim import adamw_step, global_grad_norm

T, D, F = 64, 64, 192
H, G, E = 4, 2, 16


def _t(engine, rng, *shape, scale=1.0):
    return engine.tensor((rng.standard_normal(shape) * scale).astype(np.float32))


@pytest.mark.parametrize("m,n,k", [(64, 64, 64), (64, 192, 64), (64, 64, 192)])
def test_matmul_forward(benchmark, engine, rng, m, n, k):
    x, w = _t(engine, rng, m, k), _t(engine, rng, n, k)
    y = engine.empty((m, n))
    run_synced(benchmark, engine, lambda: engine.run("linear", x=x, w=w, out={"y": y}))
    np.testing.assert_allclose(y.numpy(), x.numpy() @ w.numpy().T, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("wrt", ["x", "w"])
def test_matmul_backward(benchmark, engine, rng, wrt):
    x, w, dy = _t(engine, rng, T, D), _t(engine, rng, F, D), _t(engine, rng, T, F)
    bwd = grad(library.get("linear"), [wrt])
    run_synced(benchmark, engine, lambda: engine.run(bwd, x=x, w=w, d_y=dy))


def test_attention_forward(benchmark, engine, rng):
    q, k, v = _t(engine, rng, T, H, E), _t(engine, rng, T, G, E), _t(engine, rng, T, G, E)
    run_synced(benchmark, engine, lambda: engine.run("attention", q=q, k=k, v=v))


def test_attention_backward(benchmark, engine, rng):
    q, k, v = _t(engine, rng, T, H, E), _t(engine, rng, T, G, E), _t(engine, rng, T, G, E)
    r = engine.run("attention", q=q, k=k, v=v)
    do = _t(engine, rng, T, H, E)
    bwd = grad(library.get("attention"), ["q", "k", "v"], ["o"])
    run_synced(benchmark, engine, lambda: engine.run(bwd, q=q, k=k, v=v, o=r["o"], lse=r["lse"], d_o=do))


def test_short_conv_forward_backward(benchmark, engine, rng):
    bcx, w, dy = _t(engine, rng, T, 3, D), _t(engine, rng, D, 3), _t(engine, rng, T, D)
    bwd = grad(library.get("short_conv"), ["bcx"])

    def both():
        engine.run("short_conv", bcx=bcx, w=w)
        return engine.run(bwd, bcx=bcx, w=w, d_y=dy)
    run_synced(benchmark, engine, both)


def test_rmsnorm_forward_backward(benchmark, engine, rng):
    x, w, dy = _t(engine, rng, T, D), _t(engine, rng, D), _t(engine, rng, T, D)
    bwd = grad(library.get("rmsnorm"), ["x"], ["y"])

    def both():
        r = engine.run("rmsnorm", x=x, w=w, eps=1e-5)
        return engine.run(bwd, x=x, w=w, inv=r["inv"], d_y=dy)
    run_synced(benchmark, engine, both)


def test_lm_head_cross_entropy(benchmark, engine, rng):
    V = 1024
    h, Emb = _t(engine, rng, T, D), _t(engine, rng, V, D, scale=0.02)
    targets = rng.integers(0, V, T).astype(np.int32)
    out = run_synced(benchmark, engine, lambda: lm_head_cross_entropy(engine, h, Emb, targets, normalizer=float(T),
                                                                      chunk=256))
    assert np.isfinite(out.loss_value())


def test_adamw_and_grad_norm(benchmark, engine, rng):
    shapes = [(256, D), (3 * D, D), (D,), (F, D), (D, F)] * 4
    ps = [_t(engine, rng, *s, scale=0.02) for s in shapes]
    gs = [_t(engine, rng, *s, scale=0.01) for s in shapes]
    ms = [engine.zero_(engine.empty(p.shape)) for p in ps]
    vs = [engine.zero_(engine.empty(p.shape)) for p in ps]
    step = [0]

    def one():
        step[0] += 1
        norm, finite = global_grad_norm(engine, gs)
        adamw_step(engine, ps, gs, ms, vs, lr=1e-3, step=step[0], gscale=min(1.0, 1.0 / (norm + 1e-6)))
        return finite
    run_synced(benchmark, engine, one)
