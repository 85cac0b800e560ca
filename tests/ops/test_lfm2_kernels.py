"""LFM2's kernel set (conv, RoPE, embedding, per-head norm, linear, SwiGLU) vs PyTorch float64,
forward and backward; f16 storage variants vs numpy."""
from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from lfm2jit import grad, library
from lfm2jit.ops.embedding import slots
from numerics import rel_err

TOL = 1e-4          # f32 kernels: measured errors are ~1e-7; 1e-4 is the bar
SHAPES_T = [(1, 1), (37, 16), (64, 64)]    # (T, bucket): a single position, off-bucket, full bucket


def t64(a, grad=False):
    return torch.tensor(np.asarray(a, np.float64), requires_grad=grad)


def run_backward(engine, kernel, bucket, cotangents, wrt=None, **args):
    bwd = grad(kernel, wrt=wrt, cotangents=list(cotangents))
    tensors = {k: engine.tensor(v) for k, v in args.items()}
    tensors.update({f"d_{k}": engine.tensor(v) for k, v in cotangents.items()})
    return {k: v.numpy() for k, v in engine.run(bwd, bucket=bucket, **tensors).items()}


@pytest.mark.parametrize("T,bucket", SHAPES_T)
@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("taps", [1, 2, 3, 4, 6])
def test_short_conv_matches_torch(engine, rng, T, bucket, bias, taps):
    """Any kernel length (conv_L_cache) is a specialization of the one kernel; no bias = b left out."""
    D = 20
    bcx = rng.standard_normal((T, 3, D)).astype(np.float32)
    w = rng.standard_normal((D, taps)).astype(np.float32)
    b = rng.standard_normal(D).astype(np.float32)
    kernel = library.get("short_conv")
    args = {"bcx": bcx, "w": w, **({"b": b} if bias else {})}
    y = engine.run(kernel, bucket=bucket, **{k: engine.tensor(v) for k, v in args.items()})["y"].numpy()

    tb, tw, tbias = t64(bcx, True), t64(w, True), t64(b, True)
    B, C, x = tb[:, 0], tb[:, 1], tb[:, 2]        # in_proj's chunk order
    conv = F.conv1d((B * x).T[None], tw[:, None, :], tbias if bias else None, padding=taps - 1,
                    groups=D)[0, :, :T].T
    ref = C * conv
    assert rel_err(y, ref.detach().numpy()) < TOL
    dy = rng.standard_normal((T, D)).astype(np.float32)
    ref.backward(t64(dy))
    got = run_backward(engine, kernel, bucket, {"y": dy}, **args)
    assert rel_err(got["d_bcx"], tb.grad.numpy()) < TOL
    assert rel_err(got["d_w"], tw.grad.numpy()) < TOL
    if bias:
        assert rel_err(got["d_b"], tbias.grad.numpy()) < TOL


def test_packed_short_conv_runs_every_sequence_on_its_own(engine, rng):
    """B sequences in one dispatch ([B, T, 3, D]): each convolves only within itself."""
    B, T, D, taps = 3, 16, 8, 3
    bcx = rng.standard_normal((B, T, 3, D)).astype(np.float32)
    w = rng.standard_normal((D, taps)).astype(np.float32)
    kernel = library.get("short_conv")
    dy = rng.standard_normal((B, T, D)).astype(np.float32)
    y = engine.run(kernel, bucket=16, bcx=engine.tensor(bcx), w=engine.tensor(w))["y"].numpy()
    got = run_backward(engine, kernel, 16, {"y": dy}, bcx=bcx, w=w)
    assert y.shape == (B, T, D) and got["d_bcx"].shape == (B, T, 3, D)
    d_w = np.zeros_like(w, dtype=np.float64)
    for i in range(B):
        one = engine.run(kernel, bucket=16, bcx=engine.tensor(bcx[i]), w=engine.tensor(w))["y"].numpy()
        assert rel_err(y[i], one) < TOL
        alone = run_backward(engine, kernel, 16, {"y": dy[i]}, bcx=bcx[i], w=w)
        assert rel_err(got["d_bcx"][i], alone["d_bcx"]) < TOL
        d_w += alone["d_w"]
    assert rel_err(got["d_w"], d_w) < TOL
    with pytest.raises(ValueError, match="fill whole buckets"):     # sequences 13 rows apart, not 16
        engine.run(kernel, bucket=16, bcx=engine.tensor(bcx[:, :13]), w=engine.tensor(w))


def rope_tables(T, R, theta=10000.0):
    inv_freq = 1.0 / (theta ** (np.arange(0, 2 * R, 2) / (2 * R)))
    ang = np.arange(T)[:, None] * inv_freq[None]
    return np.cos(ang).astype(np.float32), np.sin(ang).astype(np.float32)


@pytest.mark.parametrize("T,bucket", SHAPES_T)
def test_rope_matches_rotate_half(engine, rng, T, bucket):
    H, R = 3, 8
    x = rng.standard_normal((T, H, 2 * R)).astype(np.float32)
    c, s = rope_tables(T, R)
    kernel = library.get("rope")
    y = engine.run(kernel, bucket=bucket, x=engine.tensor(x.reshape(T, H, 2, R)), cos=engine.tensor(c),
                   sin=engine.tensor(s))["y"].numpy().reshape(T, H, 2 * R)
    xt = t64(x, True)
    cos2, sin2 = t64(np.concatenate([c, c], -1))[:, None], t64(np.concatenate([s, s], -1))[:, None]
    ref = xt * cos2 + torch.cat([-xt[..., R:], xt[..., :R]], -1) * sin2
    assert rel_err(y, ref.detach().numpy()) < TOL
    dy = rng.standard_normal((T, H, 2 * R)).astype(np.float32)
    ref.backward(t64(dy))
    got = run_backward(engine, kernel, bucket, {"y": dy.reshape(T, H, 2, R)}, wrt=["x"],
                       x=x.reshape(T, H, 2, R), cos=c, sin=s)
    assert rel_err(got["d_x"].reshape(T, H, 2 * R), xt.grad.numpy()) < TOL


@pytest.mark.parametrize("T,bucket", SHAPES_T)
def test_embedding_and_its_scatter_add(engine, rng, T, bucket):
    V, D = 50, 12
    table = rng.standard_normal((V, D)).astype(np.float32)
    ids = rng.integers(0, V, T).astype(np.int32)
    ids[: min(T, 5)] = 7        # repeated tokens must sum
    y = engine.run("embedding", bucket=bucket, table=engine.tensor(table), ids=engine.tensor(ids))["y"].numpy()
    np.testing.assert_array_equal(y, table[ids])
    g = rng.standard_normal((T, D)).astype(np.float32)
    order, bounds, rows = slots(ids)
    start = rng.standard_normal((V, D)).astype(np.float32)      # accumulates onto existing contents
    d_table = engine.tensor(start)
    for _ in range(2):   # deterministic: two runs add exactly the same amounts
        engine.run("embedding_backward", bucket=bucket, dims={"V": V}, g=engine.tensor(g), order=engine.tensor(order),
                   bounds=engine.tensor(bounds), rows=engine.tensor(rows), out={"d_table": d_table},
                   accumulate={"d_table"})
    want = start.astype(np.float64)
    np.add.at(want, ids, 2 * g.astype(np.float64))
    assert rel_err(d_table.numpy(), want) < TOL


def test_embedding_backward_requires_accumulate(engine):
    with pytest.raises(ValueError, match=r"adds into \['d_table'\]"):
        engine.run("embedding_backward", dims={"V": 4}, g=engine.tensor(np.zeros((2, 3), np.float32)),
                   order=engine.tensor(np.zeros(2, np.int32)), bounds=engine.tensor(np.zeros((2, 2), np.int32)),
                   rows=engine.tensor(np.zeros(2, np.int32)))


@pytest.mark.parametrize("T,bucket", SHAPES_T)
def test_head_rmsnorm(engine, rng, T, bucket):
    H, E = 4, 16
    x = rng.standard_normal((T, H, E)).astype(np.float32)
    w = rng.standard_normal(E).astype(np.float32)
    out = engine.run("head_rmsnorm", bucket=bucket, x=engine.tensor(x), w=engine.tensor(w), eps=1e-5)
    xt, wt = t64(x, True), t64(w, True)
    ref = xt * torch.rsqrt((xt * xt).mean(-1, keepdim=True) + 1e-5) * wt
    assert rel_err(out["y"].numpy(), ref.detach().numpy()) < TOL
    dy = rng.standard_normal((T, H, E)).astype(np.float32)
    ref.backward(t64(dy))
    got = run_backward(engine, library.get("head_rmsnorm"), bucket, {"y": dy}, x=x, w=w, inv=out["inv"].numpy())
    assert rel_err(got["d_x"], xt.grad.numpy()) < TOL
    assert rel_err(got["d_w"], wt.grad.numpy()) < TOL


@pytest.mark.parametrize("T,bucket", SHAPES_T)
def test_swiglu_mlp(engine, rng, T, bucket):
    """w2(silu(w1 x) * w3 x): three linear kernels and the fused gate, forward and backward."""
    D, F_ = 24, 40
    x = rng.standard_normal((T, D)).astype(np.float32)
    w1, w3 = (rng.standard_normal((F_, D)).astype(np.float32) * 0.2 for _ in range(2))
    w2 = rng.standard_normal((D, F_)).astype(np.float32) * 0.2
    lin, gate = library.get("linear"), library.get("silu_mul")
    tx, t1, t3, t2 = (engine.tensor(a) for a in (x, w1, w3, w2))
    a = engine.run(lin, bucket=bucket, x=tx, w=t1)["y"]
    b = engine.run(lin, bucket=bucket, x=tx, w=t3)["y"]
    h = engine.run(gate, bucket=bucket, a=a, b=b)["y"]
    y = engine.run(lin, bucket=bucket, x=h, w=t2)["y"]

    xt, w1t, w3t, w2t = (t64(v, True) for v in (x, w1, w3, w2))
    ref = (F.silu(xt @ w1t.T) * (xt @ w3t.T)) @ w2t.T
    assert rel_err(y.numpy(), ref.detach().numpy()) < TOL
    dy = rng.standard_normal((T, D)).astype(np.float32)
    ref.backward(t64(dy))
    g2 = engine.run(grad(lin), bucket=bucket, x=h, w=t2, d_y=engine.tensor(dy))
    gg = engine.run(grad(gate), bucket=bucket, a=a, b=b, d_y=g2["d_x"])
    g1 = engine.run(grad(lin), bucket=bucket, x=tx, w=t1, d_y=gg["d_a"])
    g3 = engine.run(grad(lin), bucket=bucket, x=tx, w=t3, d_y=gg["d_b"], out={"d_x": g1["d_x"]},
                    accumulate={"d_x"})
    assert rel_err(g2["d_w"].numpy(), w2t.grad.numpy()) < TOL
    assert rel_err(g1["d_w"].numpy(), w1t.grad.numpy()) < TOL
    assert rel_err(g3["d_w"].numpy(), w3t.grad.numpy()) < TOL
    assert rel_err(g1["d_x"].numpy(), xt.grad.numpy()) < TOL


# f16 storage, f32 arithmetic. Each stored value is rounded once to f16 (relative 2**-11 ~ 4.9e-4)
# and inputs are rounded before the kernel sees them, so a normwise error of ~1e-3 is the honest
# scale; 3e-3 leaves headroom for a few roundings without hiding a real bug (those give O(1)).
F16_TOL = 3e-3


@pytest.mark.parametrize("name", ["linear", "silu_mul", "rmsnorm", "softmax", "short_conv"])
def test_f16_variants(ctx, engine, rng, name):
    if not ctx.has_f16:
        pytest.skip("adapter has no shader-f16")
    kernel = library.get(name)
    k16 = kernel.variant("f16")
    sizes = {"B": 1, "T": 37, "D": 40, "K": 40, "N": 24, "F": 40, "L": 3}
    args = {}
    for t in kernel.ir.inputs:
        shape = tuple(int(a) if a.isdigit() else sizes[a] for a in t.shape)
        args[t.name] = rng.standard_normal(shape).astype(np.float16)
    scalars = {s: 1e-5 for s in kernel.ir.scalars}
    got = engine.run(k16, bucket=16, **{k: engine.tensor(v) for k, v in args.items()}, **scalars)
    want = engine.run(kernel, bucket=16, **{k: engine.tensor(v.astype(np.float32)) for k, v in args.items()},
                      **scalars)
    for out in got:
        assert got[out].dtype == "f16"
        assert rel_err(got[out].numpy(), want[out].numpy()) < F16_TOL
