"""Derived backward kernels on the GPU against closed-form numpy float64 gradients.

engine.run(grad(kernel), ...) runs every kernel of the partitioned backward pass; the results are
compared with analytic gradients on odd sizes, lengths off the bucket, T = 1, accumulation into
existing gradient tensors, and inputs whose padded rows hold NaN.
"""
from __future__ import annotations

import numpy as np
import pytest

from numerics import rel_err
from lfm2jit import Tensor, compile_source, grad

# f32 sums of at most a few hundred terms against float64: 1e-4 normwise leaves a wide margin.
TOL = 1e-4

SRC = """
kernel rms(x: f32[T, D], w: f32[D], eps: f32) -> (y: f32[T, D], inv: f32[T]) {
    inv = rsqrt(mean(x * x, D) + eps)
    y = x * inv * w
}
kernel linear(x: f32[T, K], w: f32[N, K]) -> (y: f32[T, N]) {
    y = sum(x * w, K)
}
kernel linear_kn(x: f32[T, K], w: f32[K, N]) -> (y: f32[T, N]) {
    y = sum(x * w, K)
}
kernel bmm(a: f32[H, M, E], b: f32[H, S, E]) -> (c: f32[H, M, S]) {
    c = sum(a * b, E)
}
"""
MOD = compile_source(SRC, "<test_autodiff_kernels>")


def f32(rng, *shape, scale=1.0):
    return (rng.standard_normal(shape) * scale).astype(np.float32)


def f64(x):
    return np.asarray(x, dtype=np.float64)


def upload(engine, **arrays):
    return {n: engine.tensor(a) for n, a in arrays.items()}


def numpy_all(outs):
    return {n: t.numpy() for n, t in outs.items()}


def poisoned(ctx, engine, arr: np.ndarray, bucket: int) -> Tensor:
    """A [T, ...] tensor whose buffer holds NaN in the rows from T up to the bucketed length."""
    t = arr.shape[0]
    rows = -(-t // bucket) * bucket
    full = np.full((rows,) + arr.shape[1:], np.nan, np.float32)
    full[:t] = arr
    owner = engine.tensor(full)
    view = Tensor(ctx, owner.buffer, arr.shape, "f32", capacity=owner.capacity)
    view._keep = owner          # the view must not outlive the buffer's owner
    return view


# ---- closed forms ----

def rms_backward(x, w, dy, eps):
    x, w, dy = f64(x), f64(w), f64(dy)
    r = 1.0 / np.sqrt((x * x).mean(-1, keepdims=True) + eps)
    gw = dy * w
    d_x = r * gw - x * r ** 3 * (gw * x).mean(-1, keepdims=True)
    d_w = (dy * x * r).sum(0)
    return d_x, d_w


def sigmoid(a):
    return 1.0 / (1.0 + np.exp(-a))


# ---- rmsnorm ----

@pytest.mark.parametrize("T,D,bucket", [(1, 3, 1), (5, 70, 16), (37, 33, 64), (64, 64, 64)])
def test_rmsnorm_backward_reuses_inv(engine, rng, T, D, bucket):
    x, w, dy = f32(rng, T, D, scale=2.0), f32(rng, D), f32(rng, T, D)
    eps = 1e-5
    k = MOD.rms
    fwd = engine.run(k, bucket=bucket, x=engine.tensor(x), w=engine.tensor(w), eps=eps)
    bwd = grad(k, cotangents=["y"])
    assert "inv" in bwd.inputs and "d_inv" not in bwd.inputs
    got = numpy_all(engine.run(bwd, bucket=bucket, x=engine.tensor(x), w=engine.tensor(w), inv=fwd["inv"],
                               d_y=engine.tensor(dy), eps=eps))
    d_x, d_w = rms_backward(x, w, dy, eps)
    assert sorted(got) == ["d_w", "d_x"]
    assert rel_err(got["d_x"], d_x) < TOL
    assert rel_err(got["d_w"], d_w) < TOL


def test_rmsnorm_backward_with_both_cotangents(engine, rng):
    T, D, eps = 9, 20, 1e-5
    x, w, dy, dinv = f32(rng, T, D), f32(rng, D), f32(rng, T, D), f32(rng, T)
    k = MOD.rms
    fwd = engine.run(k, bucket=16, x=engine.tensor(x), w=engine.tensor(w), eps=eps)
    got = numpy_all(engine.run(grad(k), bucket=16, x=engine.tensor(x), w=engine.tensor(w), inv=fwd["inv"],
                               d_y=engine.tensor(dy), d_inv=engine.tensor(dinv), eps=eps))
    d_x, d_w = rms_backward(x, w, dy, eps)
    x64 = f64(x)
    r = 1.0 / np.sqrt((x64 * x64).mean(-1) + eps)
    d_x += (f64(dinv) * -r ** 3)[:, None] * x64 / D     # d inv / d x = -r^3 x / D
    assert rel_err(got["d_x"], d_x) < TOL
    assert rel_err(got["d_w"], d_w) < TOL


# ---- shipped elementwise and softmax kernels ----

@pytest.mark.parametrize("T,D", [(1, 1), (13, 97), (37, 64)])
def test_softmax_backward(engine, rng, T, D):
    x, dy, dlse = f32(rng, T, D, scale=3.0), f32(rng, T, D), f32(rng, T)
    y = engine.run("softmax", bucket=16, x=engine.tensor(x))["y"]
    y64 = y.numpy().astype(np.float64)
    want_y = y64 * (f64(dy) - (f64(dy) * y64).sum(-1, keepdims=True))
    from lfm2jit.ops.library import get
    k = get("softmax")
    args = {n: v for n, v in dict(x=engine.tensor(x), y=y, d_y=engine.tensor(dy)).items()}
    bwd = grad(k, cotangents=["y"])
    got = engine.run(bwd, bucket=16, **{n: v for n, v in args.items() if n in bwd.inputs})["d_x"].numpy()
    assert rel_err(got, want_y) < TOL
    # with the log-sum-exp's cotangent as well: d lse / d x = softmax(x)
    fwd = engine.run(k, bucket=16, x=engine.tensor(x))
    args = dict(x=engine.tensor(x), y=fwd["y"], lse=fwd["lse"], d_y=engine.tensor(dy), d_lse=engine.tensor(dlse))
    bwd = grad(k)
    got = engine.run(bwd, bucket=16, **{n: v for n, v in args.items() if n in bwd.inputs})["d_x"].numpy()
    assert rel_err(got, want_y + f64(dlse)[:, None] * y64) < TOL


@pytest.mark.parametrize("T,F", [(1, 3), (37, 70)])
def test_silu_mul_backward(engine, rng, T, F):
    from lfm2jit.ops.library import get
    a, b, dy = f32(rng, T, F, scale=3.0), f32(rng, T, F), f32(rng, T, F)
    got = numpy_all(engine.run(grad(get("silu_mul")), bucket=16, **upload(engine, a=a, b=b, d_y=dy)))
    a64, b64, dy64 = f64(a), f64(b), f64(dy)
    s = sigmoid(a64)
    assert rel_err(got["d_a"], dy64 * b64 * (s + a64 * s * (1 - s))) < TOL
    assert rel_err(got["d_b"], dy64 * a64 * s) < TOL


def test_scale_add_backward(engine, rng):
    from lfm2jit.ops.library import get
    T, D = 37, 45
    dy = f32(rng, T, D)
    bwd = grad(get("scale_add"))
    args = {n: v for n, v in upload(engine, x=f32(rng, T, D), z=f32(rng, T, D), d_y=dy).items() if n in bwd.inputs}
    got = numpy_all(engine.run(bwd, bucket=16, alpha=0.5, beta=-2.0, **args))
    assert rel_err(got["d_x"], 0.5 * f64(dy)) < TOL
    assert rel_err(got["d_z"], -2.0 * f64(dy)) < TOL


# ---- contractions ----

LINEAR_SHAPES = [(1, 70, 45, 1), (1, 16, 8, 16), (37, 70, 45, 16), (37, 1, 3, 64), (5, 3, 1, 16),
                 (64, 64, 64, 64), (20, 130, 67, 16)]


@pytest.mark.parametrize("T,K,N,bucket", LINEAR_SHAPES)
def test_linear_backward(engine, rng, T, K, N, bucket):
    x, w, dy = f32(rng, T, K), f32(rng, N, K), f32(rng, T, N)
    got = numpy_all(engine.run(grad(MOD.linear), bucket=bucket, **upload(engine, x=x, w=w, d_y=dy)))
    assert rel_err(got["d_x"], f64(dy) @ f64(w)) < TOL
    assert rel_err(got["d_w"], f64(dy).T @ f64(x)) < TOL


@pytest.mark.parametrize("T,K,N,bucket", [(1, 5, 3, 1), (37, 70, 45, 16)])
def test_linear_kn_backward(engine, rng, T, K, N, bucket):
    """Weight stored [K, N]: its gradient comes out of autodiff over [N, K] and must land transposed."""
    x, w, dy = f32(rng, T, K), f32(rng, K, N), f32(rng, T, N)
    got = numpy_all(engine.run(grad(MOD.linear_kn), bucket=bucket, **upload(engine, x=x, w=w, d_y=dy)))
    assert rel_err(got["d_x"], f64(dy) @ f64(w).T) < TOL
    assert rel_err(got["d_w"], f64(x).T @ f64(dy)) < TOL


@pytest.mark.parametrize("H,M,S,E", [(2, 5, 7, 3), (3, 1, 70, 45)])
def test_batched_contraction_backward(engine, rng, H, M, S, E):
    a, b, dc = f32(rng, H, M, E), f32(rng, H, S, E), f32(rng, H, M, S)
    got = numpy_all(engine.run(grad(MOD.bmm), **upload(engine, a=a, b=b, d_c=dc)))
    assert rel_err(got["d_a"], np.einsum("hms,hse->hme", f64(dc), f64(b))) < TOL
    assert rel_err(got["d_b"], np.einsum("hms,hme->hse", f64(dc), f64(a))) < TOL


# ---- accumulation ----

def test_accumulate_into_existing_gradients(engine, rng):
    T, K, N = 37, 70, 45
    x, w, dy = f32(rng, T, K), f32(rng, N, K), f32(rng, T, N)
    existing = f32(rng, N, K)
    acc = engine.tensor(existing)
    got = engine.run(grad(MOD.linear), bucket=16, out={"d_w": acc}, accumulate={"d_w"},
                     **upload(engine, x=x, w=w, d_y=dy))
    assert got["d_w"] is acc
    assert rel_err(acc.numpy(), f64(existing) + f64(dy).T @ f64(x)) < TOL
    assert rel_err(got["d_x"].numpy(), f64(dy) @ f64(w)) < TOL       # not accumulated: freshly written
    # twice more into the same tensor: a gradient-accumulation window of three
    for _ in range(2):
        engine.run(grad(MOD.linear), bucket=16, out={"d_w": acc}, accumulate={"d_w"},
                   **upload(engine, x=x, w=w, d_y=dy))
    assert rel_err(acc.numpy(), f64(existing) + 3 * (f64(dy).T @ f64(x))) < TOL


def test_accumulate_rmsnorm_weight_gradient(engine, rng):
    """The column-reduction schedule (d_w summed over T) accumulates too; d_x is overwritten."""
    T, D, eps = 37, 33, 1e-5
    x, w, dy = f32(rng, T, D), f32(rng, D), f32(rng, T, D)
    existing_w, existing_x = f32(rng, D), f32(rng, T, D)
    k = MOD.rms
    inv = engine.run(k, bucket=64, x=engine.tensor(x), w=engine.tensor(w), eps=eps)["inv"]
    acc_w, out_x = engine.tensor(existing_w), engine.tensor(existing_x)
    engine.run(grad(k, cotangents=["y"]), bucket=64, out={"d_w": acc_w, "d_x": out_x}, accumulate={"d_w"},
               x=engine.tensor(x), w=engine.tensor(w), inv=inv, d_y=engine.tensor(dy), eps=eps)
    d_x, d_w = rms_backward(x, w, dy, eps)
    assert rel_err(acc_w.numpy(), f64(existing_w) + d_w) < TOL
    assert rel_err(out_x.numpy(), d_x) < TOL


# ---- padded rows ----

def test_padded_rows_never_enter_linear_gradients(ctx, engine, rng):
    T, K, N, bucket = 37, 70, 45, 64
    x, w, dy = f32(rng, T, K), f32(rng, N, K), f32(rng, T, N)
    bwd = grad(MOD.linear)
    clean = numpy_all(engine.run(bwd, bucket=bucket, **upload(engine, x=x, w=w, d_y=dy)))
    dirty = numpy_all(engine.run(bwd, bucket=bucket, x=poisoned(ctx, engine, x, bucket), w=engine.tensor(w),
                                 d_y=poisoned(ctx, engine, dy, bucket)))
    for name in ("d_x", "d_w"):
        assert np.all(np.isfinite(dirty[name])), name
        np.testing.assert_array_equal(dirty[name], clean[name])
    assert rel_err(clean["d_w"], f64(dy).T @ f64(x)) < TOL


def test_padded_rows_never_enter_rmsnorm_gradients(ctx, engine, rng):
    T, D, bucket, eps = 37, 33, 64, 1e-5
    x, w, dy = f32(rng, T, D), f32(rng, D), f32(rng, T, D)
    k = MOD.rms
    inv = engine.run(k, bucket=bucket, x=engine.tensor(x), w=engine.tensor(w), eps=eps)["inv"].numpy()
    bwd = grad(k, cotangents=["y"])
    clean = numpy_all(engine.run(bwd, bucket=bucket, eps=eps, **upload(engine, x=x, w=w, inv=inv, d_y=dy)))
    dirty = numpy_all(engine.run(bwd, bucket=bucket, eps=eps, w=engine.tensor(w),
                                 x=poisoned(ctx, engine, x, bucket), inv=poisoned(ctx, engine, inv, bucket),
                                 d_y=poisoned(ctx, engine, dy, bucket)))
    for name in ("d_x", "d_w"):
        assert np.all(np.isfinite(dirty[name])), name
        np.testing.assert_array_equal(dirty[name], clean[name])
    d_x, d_w = rms_backward(x, w, dy, eps)
    assert rel_err(clean["d_w"], d_w) < TOL and rel_err(clean["d_x"], d_x) < TOL


# ---- graphs autodiff has to reshape ----

BCAST = compile_source("""
kernel bcast_out(a: f32[T, D], w: f32[D]) -> (y: f32[T, D], z: f32[T, D]) {
    z = exp(w)
    y = a * z
}
kernel rowsum(a: f32[T, D]) -> (y: f32[T]) {
    y = sum(a, D)
}
""", "<test_autodiff_kernels>")


def test_output_wider_than_its_value(engine, rng):
    """z = exp(w) is declared [T, D]; its saved copy must not stand in for the [D] value."""
    T, D = 37, 20
    a, w, dy, dz = f32(rng, T, D), f32(rng, D), f32(rng, T, D), f32(rng, T, D)
    bwd = grad(BCAST.bcast_out)
    got = numpy_all(engine.run(bwd, bucket=16, **{n: v for n, v in upload(engine, a=a, w=w, d_y=dy, d_z=dz).items()
                                                  if n in bwd.inputs}))
    ew = np.exp(f64(w))
    assert rel_err(got["d_a"], f64(dy) * ew) < TOL
    assert rel_err(got["d_w"], ((f64(dy) * f64(a)).sum(0) + f64(dz).sum(0)) * ew) < TOL


def test_gradient_broadcast_over_a_reduced_axis(engine, rng):
    """d_a of a row sum is d_y broadcast over D; D is no input's axis, so it is passed as dims."""
    T, D = 37, 20
    dy = f32(rng, T)
    got = engine.run(grad(BCAST.rowsum), bucket=16, dims={"D": D}, d_y=engine.tensor(dy))["d_a"].numpy()
    assert got.shape == (T, D)
    assert rel_err(got, np.repeat(f64(dy)[:, None], D, axis=1)) < TOL
