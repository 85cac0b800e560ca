"""short_conv_segments (ops/kernels/conv.lk): the short convolution over sequences concatenated in
one row, its taps zero before each sequence's start, forward and its grad() backward against numpy."""
from __future__ import annotations

import numpy as np
import pytest

from lfm2jit import grad, library


def reference(bcx, w, b, pos):
    """y and the gradients of sum(y * dy) in bcx, w and b, float64 by the definition."""
    bcx, w, b = (np.asarray(x, np.float64) for x in (bcx, w, b))
    T, _, D = bcx.shape
    L = w.shape[1]
    Bv, C, x = bcx[:, 0], bcx[:, 1], bcx[:, 2]
    bx = Bv * x
    conv = np.tile(b, (T, 1))
    taps = []                                   # (t, s, j): row t reads row s at weight column j
    for t in range(T):
        for j in range(L):
            s = t - (L - 1) + j
            if s >= t - pos[t]:                 # not before row t's sequence start
                conv[t] += w[:, j] * bx[s]
                taps.append((t, s, j))
    return C * conv, conv, bx, taps


@pytest.mark.parametrize("lengths,L,bias", [([5, 1, 9, 2], 3, False), ([1, 1, 1], 3, True), ([40, 1, 30, 2, 7], 4, True)])
def test_matches_numpy(engine, rng, lengths, L, bias):
    T, D = sum(lengths), 16
    pos = np.concatenate([np.arange(n) for n in lengths]).astype(np.int32)
    bcx = rng.standard_normal((T, 3, D)).astype(np.float32)
    w = rng.standard_normal((D, L)).astype(np.float32)
    b = rng.standard_normal(D).astype(np.float32) if bias else np.zeros(D, np.float32)
    dy = rng.standard_normal((T, D)).astype(np.float32)
    kernel = library.get("short_conv_segments")
    args = dict(bcx=engine.tensor(bcx), w=engine.tensor(w), pos=engine.tensor(pos, "i32"))
    if bias:
        args["b"] = engine.tensor(b)
    y = engine.run(kernel, bucket=32, **args)["y"].numpy()
    want, conv, bx, taps = reference(bcx, w, b, pos)
    np.testing.assert_allclose(y, want, rtol=1e-5, atol=1e-5)

    bwd = grad(kernel.without(() if bias else ("b",)), cotangents=["y"])
    g = engine.run(bwd, bucket=32, d_y=engine.tensor(dy), **args)
    dy64 = dy.astype(np.float64)
    d_conv = dy64 * bcx[:, 1]
    d_bcx = np.zeros((T, 3, D))
    d_bcx[:, 1] = dy64 * conv
    d_w, d_bx = np.zeros((D, L)), np.zeros((T, D))
    for t, s, j in taps:
        d_w[:, j] += d_conv[t] * bx[s]
        d_bx[s] += d_conv[t] * w[:, j]
    d_bcx[:, 0] = d_bx * bcx[:, 2]
    d_bcx[:, 2] = d_bx * bcx[:, 0]
    np.testing.assert_allclose(g["d_bcx"].numpy(), d_bcx, rtol=1e-4, atol=1e-4)
    np.testing.assert_allclose(g["d_w"].numpy(), d_w, rtol=1e-4, atol=1e-4)
    if bias:
        np.testing.assert_allclose(g["d_b"].numpy(), d_conv.sum(0), rtol=1e-4, atol=1e-4)


def test_one_sequence_is_short_conv(engine, rng):
    """One sequence (positions 0..T-1) gives the plain short_conv's numbers."""
    T, D, L = 37, 16, 3
    bcx = engine.tensor(rng.standard_normal((T, 3, D)).astype(np.float32))
    w = engine.tensor(rng.standard_normal((D, L)).astype(np.float32))
    plain = engine.run("short_conv", bucket=64, bcx=bcx, w=w)["y"].numpy()
    seg = engine.run("short_conv_segments", bucket=64, bcx=bcx, w=w,
                     pos=engine.tensor(np.arange(T, dtype=np.int32), "i32"))["y"].numpy()
    np.testing.assert_allclose(seg, plain, rtol=1e-6, atol=1e-6)
