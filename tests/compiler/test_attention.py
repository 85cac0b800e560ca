"""Causal grouped-query attention intrinsics (forward, dq, dk/dv) against numpy float64."""
from __future__ import annotations

import re

import numpy as np
import pytest

from lfm2jit import Tensor
from lfm2jit.codegen.render import render
from lfm2jit.driver import Kernel, grad
from lfm2jit.ir.intrinsics import IntrinsicError, kernel_ir
from lfm2jit.schedule.attention import WORKGROUP_BYTES, choose_tiles, workgroup_words
from lfm2jit.ir.grad import AutodiffError
from lfm2jit.ir.nodes import TensorArg
from numerics import rel_err

# f32 throughout, sums of at most T*E = 4096 terms of O(1) values: the errors seen are about 5e-7
# normwise; 1e-4 leaves room for other summation orders (other tiles, other GPUs).
TOL = 1e-4
H = 4


def attention_kernel(axes=("T", "H", "G", "E")) -> Kernel:
    t, h, g, e = axes
    inputs = [TensorArg("q", "f32", (t, h, e)), TensorArg("k", "f32", (t, g, e)), TensorArg("v", "f32", (t, g, e))]
    return Kernel(kernel_ir("attn", "causal_attention", inputs, ["o", "lse"]))


def attention_parts(kernel: Kernel) -> list[Kernel]:
    """fwd, dq and dk/dv: ``kernel`` and its backward's parts that run an attention template (not
    the plain kernel stacking lse and D for dk/dv)."""
    return [kernel, *(k for k in grad(kernel, cotangents=["o"]).kernels if k.ir.structure.kind == "intrinsic")]


@pytest.fixture(scope="module")
def attn() -> Kernel:
    return attention_kernel()


@pytest.fixture(scope="module")
def attn_bwd(attn):
    return grad(attn, cotangents=["o"])


def reference(q, k, v, do):
    """o, lse, dq, dk, dv in float64, from the definitions (query head h reads kv head h // (H/G))."""
    q, k, v, do = (np.asarray(x, np.float64) for x in (q, k, v, do))
    T, nh, E = q.shape
    group = nh // k.shape[1]
    scale = 1.0 / np.sqrt(E)
    causal = np.tril(np.ones((T, T), bool))
    o, lse, dq = np.zeros_like(q), np.zeros((T, nh)), np.zeros_like(q)
    dk, dv = np.zeros_like(k), np.zeros_like(v)
    for h in range(nh):
        kh, vh = k[:, h // group], v[:, h // group]
        s = np.where(causal, q[:, h] @ kh.T * scale, -np.inf)           # (T, T) scores
        m = s.max(1, keepdims=True)
        lse[:, h] = (m + np.log(np.exp(s - m).sum(1, keepdims=True)))[:, 0]
        p = np.exp(s - lse[:, h:h + 1])                                # softmax rows
        o[:, h] = p @ vh
        dp = do[:, h] @ vh.T                                           # dP = dO V^T
        ds = p * (dp - (do[:, h] * o[:, h]).sum(1, keepdims=True))     # dS = P * (dP - rowsum(dO*O))
        dq[:, h] = ds @ kh * scale
        dk[:, h // group] += ds.T @ q[:, h] * scale                    # GQA: sum over the group's heads
        dv[:, h // group] += p.T @ do[:, h]
    return o, lse, dq, dk, dv


def _inputs(rng, T, G, E, dtype=np.float32):
    q, do = (rng.standard_normal((T, H, E)).astype(dtype) for _ in range(2))
    k, v = (rng.standard_normal((T, G, E)).astype(dtype) for _ in range(2))
    return q, k, v, do


def _run(engine, fwd, bwd, q, k, v, do, bucket):
    t = {n: engine.tensor(x) for n, x in (("q", q), ("k", k), ("v", v), ("d_o", do))}
    out = engine.run(fwd, bucket=bucket, q=t["q"], k=t["k"], v=t["v"])
    g = engine.run(bwd, bucket=bucket, q=t["q"], k=t["k"], v=t["v"], o=out["o"], lse=out["lse"], d_o=t["d_o"])
    return [out["o"].numpy(), out["lse"].numpy(), g["d_q"].numpy(), g["d_k"].numpy(), g["d_v"].numpy()]


def _check(got, want, tol):
    names = ("o", "lse", "dq", "dk", "dv")
    scale = np.abs(want[4]).max()   # dv = P^T dO is never all zero
    for name, g, w in zip(names, got, want):
        assert np.all(np.isfinite(g)), name
        if np.abs(w).max() > 1e-6 * scale:
            err = rel_err(g, w)
        else:   # one key: softmax is constant, so dq = dk = 0 exactly; bound against dv's size
            err = np.abs(np.asarray(g, np.float64) - w).max() / scale
        assert err < tol, f"{name}: error {err:.2e}"


# T = 37 is off its bucket of 16 (48 rows); the others share bucket 64 (one pipeline per G, E).
@pytest.mark.parametrize("E", [16, 64])
@pytest.mark.parametrize("G", [1, 2, 4])
@pytest.mark.parametrize("T", [1, 5, 37, 64])
def test_attention_matches_reference(engine, rng, attn, attn_bwd, T, G, E):
    q, k, v, do = _inputs(rng, T, G, E)
    got = _run(engine, attn, attn_bwd, q, k, v, do, bucket=16 if T == 37 else 64)
    _check(got, reference(q, k, v, do), TOL)


@pytest.mark.parametrize("T,G,E", [(150, 2, 32), (70, 1, 80), (19, 4, 8)])
def test_several_blocks_and_odd_head_dims(engine, rng, attn, attn_bwd, T, G, E):
    """Several query and key blocks per head; head dims that split unevenly into 16-column slices."""
    q, k, v, do = _inputs(rng, T, G, E)
    _check(_run(engine, attn, attn_bwd, q, k, v, do, bucket=64), reference(q, k, v, do), TOL)


def test_padded_rows_never_read_nor_written(ctx, engine, rng, attn, attn_bwd):
    """Rows >= T of every input hold NaN, and rows >= T of every output hold a sentinel: the real
    rows match a clean run exactly and the sentinels survive."""
    T, G, E, bucket = 37, 2, 16, 64
    q, k, v, do = _inputs(rng, T, G, E)

    def view(arr, fill):
        full = np.full((bucket,) + arr.shape[1:], fill, arr.dtype)
        full[:len(arr)] = arr
        owner = engine.tensor(full)
        t = Tensor(ctx, owner.buffer, arr.shape, "f32", capacity=owner.capacity)
        t._keep = owner   # the view must not outlive the buffer's owner
        return t

    def padded(t: Tensor) -> np.ndarray:
        return t._keep.numpy()[T:]

    clean = _run(engine, attn, attn_bwd, q, k, v, do, bucket)
    sentinel = 7.0
    out = {"o": view(np.zeros((T, H, E), np.float32), sentinel), "lse": view(np.zeros((T, H), np.float32), sentinel)}
    engine.run(attn, bucket=bucket, out=out, q=view(q, np.nan), k=view(k, np.nan), v=view(v, np.nan))
    grads = {n: view(np.zeros(s, np.float32), sentinel) for n, s in (("d_q", q.shape), ("d_k", k.shape),
                                                                      ("d_v", v.shape))}
    saved = {n: view(out[n].numpy(), np.nan) for n in ("o", "lse")}
    engine.run(attn_bwd, bucket=bucket, out=grads, q=view(q, np.nan), k=view(k, np.nan), v=view(v, np.nan),
               d_o=view(do, np.nan), **saved)
    poisoned = [out["o"], out["lse"], grads["d_q"], grads["d_k"], grads["d_v"]]
    for want, t in zip(clean, poisoned):
        np.testing.assert_array_equal(t.numpy(), want)
        assert np.all(padded(t) == sentinel)


def test_f16_storage(engine, rng, attn):
    """The f16 variant (f16 tensors, f32 arithmetic) against float64 on the same f16 inputs.

    Every stored value is rounded once to f16 (unit roundoff u = 2**-11 = 4.9e-4); the backward
    also reads o and lse as stored, and an lse off by u*|lse| scales each probability by
    exp(u*|lse|) ~ 1 + u*|lse|. With |lse| < 5 here, errors stay below (1 + 5) * u = 3e-3 (seen:
    about 1e-3); 4e-3 checks that nothing is worse than storage rounding.
    """
    fwd = attn.variant("f16")
    bwd = grad(fwd, cotangents=["o"])
    assert [t.dtype for t in fwd.ir.inputs] == ["f16"] * 3
    for T, G, E in [(37, 2, 64), (64, 4, 16)]:
        q, k, v, do = _inputs(rng, T, G, E, np.float16)
        got = _run(engine, fwd, bwd, q, k, v, do, bucket=16)
        assert all(g.dtype == np.float16 for g in got)
        _check(got, reference(q, k, v, do), 4e-3)


def test_backward_accumulates_and_is_deterministic(engine, rng, attn, attn_bwd):
    T, G, E = 37, 2, 16
    q, k, v, do = _inputs(rng, T, G, E)
    first = _run(engine, attn, attn_bwd, q, k, v, do, bucket=16)
    again = _run(engine, attn, attn_bwd, q, k, v, do, bucket=16)
    for a, b in zip(first, again):
        np.testing.assert_array_equal(a, b)   # fixed summation order, no atomics
    t = {n: engine.tensor(x) for n, x in (("q", q), ("k", k), ("v", v), ("d_o", do))}
    prior = {n: rng.standard_normal(x.shape).astype(np.float32) for n, x in (("d_q", q), ("d_k", k), ("d_v", v))}
    out = {n: engine.tensor(x) for n, x in prior.items()}
    fwd = engine.run(attn, bucket=16, q=t["q"], k=t["k"], v=t["v"])
    engine.run(attn_bwd, bucket=16, out=out, accumulate=("d_q", "d_k", "d_v"), q=t["q"], k=t["k"], v=t["v"],
               o=fwd["o"], lse=fwd["lse"], d_o=t["d_o"])
    for n, want in zip(("d_q", "d_k", "d_v"), first[2:]):
        assert rel_err(out[n].numpy(), prior[n].astype(np.float64) + want) < TOL


def test_sequence_axis_with_another_name(engine, rng):
    """Roles are positional: [S, N, D] works too; S is not bucketed, so its size is baked in."""
    kernel = attention_kernel(("S", "N", "M", "D"))
    q, k, v, do = _inputs(rng, 9, 2, 16)
    out = engine.run(kernel, q=engine.tensor(q), k=engine.tensor(k), v=engine.tensor(v))
    o, lse = reference(q, k, v, do)[:2]
    assert rel_err(out["o"].numpy(), o) < TOL and rel_err(out["lse"].numpy(), lse) < TOL


def test_packed_sequences_in_one_dispatch(engine, rng):
    """The shipped attention kernel with its optional batch axis: B sequences of S rows, stored back
    to back, each attending only within itself, in one dispatch (workgroup z is the sequence)."""
    from lfm2jit import library
    fwd = library.get("attention")
    bwd = grad(fwd, cotangents=["o"])
    B, S, G, E = 3, 48, 2, 16
    seqs = [_inputs(rng, S, G, E) for _ in range(B)]
    q, k, v, do = (np.stack(x) for x in zip(*seqs))            # [B, S, ...]
    got = _run(engine, fwd, bwd, q, k, v, do, bucket=16)
    assert got[0].shape == (B, S, H, E) and got[3].shape == (B, S, G, E)
    for b in range(B):
        _check([x[b] for x in got], reference(*seqs[b]), TOL)


def test_backward_structure(attn, attn_bwd):
    """The gradient rule: one dq call reading the saved o and lse, a plain kernel stacking lse and
    D = dO . O (stats), and one dk/dv call reading stats in place of o and lse (a binding fewer)."""
    assert [k.name for k in attn_bwd.kernels] == ["attn_bwd_d_q", "attn_bwd_tmp0", "attn_bwd_d_k_d_v"]
    stats = attn_bwd.kernels[1].ir.outputs[0]
    assert (stats.dtype, stats.shape) == ("f32", ("T", "2", "H"))
    assert [t.name for t in attn_bwd.kernels[2].ir.inputs] == ["q", "k", "v", "d_o", stats.name]
    assert attn_bwd.inputs == ["q", "k", "v", "o", "lse", "d_o"]
    assert attn_bwd.outputs == ["d_q", "d_k", "d_v"]
    only_q = grad(attn, wrt=["q"], cotangents=["o"])
    assert [k.name for k in only_q.kernels] == ["attn_bwd"]
    with pytest.raises(AutodiffError, match="lse is not differentiable"):
        grad(attn)


def test_bad_operands_are_named():
    q = TensorArg("q", "f32", ("T", "H", "E"))
    with pytest.raises(IntrinsicError, match="same shape"):
        kernel_ir("a", "causal_attention", [q, TensorArg("k", "f32", ("T", "G", "E")),
                                            TensorArg("v", "f32", ("T", "G", "F"))], ["o", "lse"])
    with pytest.raises(IntrinsicError, match="batch axis"):
        kernel_ir("a", "causal_attention", [TensorArg("q", "f32", ("B", "T", "H", "E")),
                                            TensorArg("k", "f32", ("C", "T", "G", "E")),
                                            TensorArg("v", "f32", ("C", "T", "G", "E"))], ["o", "lse"])
    with pytest.raises(IntrinsicError, match="sequence axis"):
        kernel_ir("a", "causal_attention", [q, TensorArg("k", "f32", ("S", "G", "E")),
                                            TensorArg("v", "f32", ("S", "G", "E"))], ["o", "lse"])
    with pytest.raises(IntrinsicError, match="split evenly"):
        attention_kernel().specialize({"T": 8, "H": 4, "G": 3, "E": 16})
    with pytest.raises(IntrinsicError, match="over the supported"):
        attention_kernel().specialize({"T": 8, "H": 4, "G": 2, "E": 256})


@pytest.mark.parametrize("E", [1, 8, 24, 64, 80, 96, 128])
def test_workgroup_memory_fits_and_wgsl_validates(ctx, attn, attn_bwd, E):
    """Every kernel declares at most 16 KiB of workgroup memory, as the tiling computes it, and
    the device's shader compiler accepts it (f32 and f16 storage)."""
    for mode in ("fwd", "dq", "dkdv"):
        assert 4 * workgroup_words(mode, choose_tiles(mode, E), E) <= WORKGROUP_BYTES
    dims = {"T": 40, "H": 4, "G": 2, "E": E}
    kernels = [*attention_parts(attn), *attention_parts(attn.variant("f16"))]
    for kernel in kernels:
        spec = kernel.specialize(dims, 16)
        wgsl = render(spec)
        words = sum(int(n) for n in re.findall(r"var<workgroup> \w+: array<f32, (\d+)>", wgsl))
        assert 4 * words == spec.params.smem_bytes <= WORKGROUP_BYTES
        ctx.device.create_shader_module(code=wgsl)
