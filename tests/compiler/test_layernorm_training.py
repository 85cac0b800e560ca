"""A user's own LayerNorm, written in the DSL, differentiated and trained: 30 steps of gradient
descent on x, w and b towards a target, on the GPU and in numpy float64 (whose gradients are
derived by hand here, independently of the compiler), at a length that is not a bucket multiple.

Its backward chains reductions over D (the mean and the variance) with reductions over T (the
gradients of w and b), which no single kernel schedule computes: it runs as several parts."""
from __future__ import annotations

import numpy as np

from numerics import rel_err
from lfm2jit import compile_source, grad

LAYERNORM = """
kernel layernorm(x: f32[T, D], w: f32[D], b: f32[D], eps: f32 = 1e-5) -> (y: f32[T, D]) {
    mu = mean(x, D)
    xc = x - mu
    y = xc * rsqrt(mean(xc * xc, D) + eps) * w + b
}
"""
T, D, BUCKET, STEPS, LR, EPS = 13, 24, 8, 30, 0.05, 1e-5


def reference_step(x, w, b, target):
    """One float64 step: loss 0.5 * |y - target|^2 and its gradients, by hand."""
    mu = x.mean(1, keepdims=True)
    xc = x - mu
    inv = 1.0 / np.sqrt((xc * xc).mean(1, keepdims=True) + EPS)
    xhat = xc * inv
    y = xhat * w + b
    dy = y - target
    dw, db = (dy * xhat).sum(0), dy.sum(0)
    dxhat = dy * w
    dx = inv * (dxhat - dxhat.mean(1, keepdims=True) - xhat * (dxhat * xhat).mean(1, keepdims=True))
    return 0.5 * (dy * dy).sum(), dx, dw, db


def test_dsl_layernorm_trains_as_numpy_does(engine, rng):
    (k,) = list(compile_source(LAYERNORM, "layernorm.lk"))
    bwd = grad(k)
    assert len(bwd.kernels) > 1, "the backward needs several schedules"
    x = rng.standard_normal((T, D))
    w = 1.0 + 0.1 * rng.standard_normal(D)
    b = 0.1 * rng.standard_normal(D)
    target = rng.standard_normal((T, D)) * 0.5 + 0.2
    ours = {"x": x.astype(np.float32), "w": w.astype(np.float32), "b": b.astype(np.float32)}
    ref = {"x": x.copy(), "w": w.copy(), "b": b.copy()}
    losses = []
    for _ in range(STEPS):
        tensors = {n: engine.tensor(v) for n, v in ours.items()}
        y = engine.run(k, bucket=BUCKET, **tensors)["y"].numpy()
        dy = (y - target).astype(np.float32)
        g = engine.run(bwd, bucket=BUCKET, **tensors, d_y=engine.tensor(dy))
        for n in ours:
            ours[n] = ours[n] - LR * g[f"d_{n}"].numpy()
        loss, dx, dw, db = reference_step(ref["x"], ref["w"], ref["b"], target)
        losses.append(loss)
        for n, d in (("x", dx), ("w", dw), ("b", db)):
            ref[n] = ref[n] - LR * d
    assert losses[-1] < 0.5 * losses[0]
    for n in ours:
        assert rel_err(ours[n], ref[n]) < 2e-5, n
