"""causal_attention with its optional ``starts`` operand (sequences concatenated in one row: query t
sees keys starts[t]..t) against a numpy float64 segment-masked causal softmax, forward and backward,
on the SIMT templates and (f16) the matrix templates."""
from __future__ import annotations

import numpy as np
import pytest

from lfm2jit.driver import Kernel, grad
from lfm2jit.ir.intrinsics import kernel_ir
from lfm2jit.ir.nodes import TensorArg
from numerics import rel_err

TOL = 1e-4
H = 4


@pytest.fixture(scope="module")
def raised(raised_ctx):
    """The adapter's raised limits: there the dk/dv kernel with starts runs a group's query heads in
    parallel (its workspace a ninth binding; one after another within WebGPU's default 8, see
    test_default_limits_fit_dkdv)."""
    from lfm2jit import ComputeEngine
    return ComputeEngine(raised_ctx)


def starts_of(lengths) -> np.ndarray:
    """i32 [sum(lengths)]: each row's sequence start."""
    return np.concatenate([np.full(n, sum(lengths[:i]), np.int32) for i, n in enumerate(lengths)])


def reference(q, k, v, do, starts):
    """o, lse, dq, dk, dv in float64: the causal softmax masked to each row's own sequence."""
    q, k, v, do = (np.asarray(x, np.float64) for x in (q, k, v, do))
    T, nh, E = q.shape
    group = nh // k.shape[1]
    scale = 1.0 / np.sqrt(E)
    t = np.arange(T)
    allowed = (t[None, :] <= t[:, None]) & (t[None, :] >= starts[:, None])
    o, lse, dq = np.zeros_like(q), np.zeros((T, nh)), np.zeros_like(q)
    dk, dv = np.zeros_like(k), np.zeros_like(v)
    for h in range(nh):
        kh, vh = k[:, h // group], v[:, h // group]
        s = np.where(allowed, q[:, h] @ kh.T * scale, -np.inf)
        m = s.max(1, keepdims=True)
        lse[:, h] = (m + np.log(np.exp(s - m).sum(1, keepdims=True)))[:, 0]
        p = np.exp(s - lse[:, h:h + 1])
        o[:, h] = p @ vh
        ds = p * (do[:, h] @ vh.T - (do[:, h] * o[:, h]).sum(1, keepdims=True))
        dq[:, h] = ds @ kh * scale
        dk[:, h // group] += ds.T @ q[:, h] * scale
        dv[:, h // group] += p.T @ do[:, h]
    return o, lse, dq, dk, dv


def attention_kernel(dtype="f32") -> Kernel:
    inputs = [TensorArg("q", dtype, ("T", "H", "E")), TensorArg("k", dtype, ("T", "G", "E")),
              TensorArg("v", dtype, ("T", "G", "E")), TensorArg("starts", "i32", ("T",))]
    return Kernel(kernel_ir("attn_starts", "causal_attention", inputs, ["o", "lse"]))


@pytest.fixture(scope="module")
def attn():
    return attention_kernel()


@pytest.fixture(scope="module")
def attn_bwd(attn):
    return grad(attn, cotangents=["o"])


def run(engine, fwd, bwd, q, k, v, do, starts, bucket, tiles=None):
    t = {n: engine.tensor(x) for n, x in (("q", q), ("k", k), ("v", v), ("d_o", do))}
    st = engine.tensor(starts, "i32")
    kw = {} if tiles is None else {"tiles": tiles}
    out = engine.run(fwd, bucket=bucket, q=t["q"], k=t["k"], v=t["v"], starts=st, **kw)
    args = dict(q=t["q"], k=t["k"], v=t["v"], o=out["o"], lse=out["lse"], d_o=t["d_o"], starts=st)
    if tiles is None:
        g = engine.run(bwd, bucket=bucket, **args)
    else:                 # tiles are chosen per kernel: dq, stats (no tiles) and dk/dv one by one
        g = {}
        for part in bwd.kernels:
            kw = {"tiles": tiles} if part.ir.structure.kind == "intrinsic" else {}
            g.update(engine.run(part, bucket=bucket, **kw, **{a.name: {**args, **g}[a.name] for a in part.ir.inputs}))
    return [out["o"].numpy(), out["lse"].numpy(), g["d_q"].numpy(), g["d_k"].numpy(), g["d_v"].numpy()]


def check(got, want, tol=TOL):
    scale = np.abs(want[4]).max()
    for name, g, w in zip(("o", "lse", "dq", "dk", "dv"), got, want):
        g = np.asarray(g, np.float64)
        assert np.all(np.isfinite(g)), name
        err = max(rel_err(g, w), np.abs(g - w).max() / scale) if np.abs(w).max() > 1e-6 * scale else \
            np.abs(g - w).max() / scale
        assert err < tol, f"{name}: error {err:.2e}"


def inputs(rng, T, G, E):
    q, do = (rng.standard_normal((T, H, E)).astype(np.float32) for _ in range(2))
    k, v = (rng.standard_normal((T, G, E)).astype(np.float32) for _ in range(2))
    return q, k, v, do


# lengths with 1s, starts off the 16- and 32-row tiles, a sequence spanning several tiles, one alone
@pytest.mark.parametrize("lengths", [[1], [5, 1, 9], [1, 1, 1, 1], [37, 1, 20, 3, 70, 2], [150]])
@pytest.mark.parametrize("G", [1, 2])
def test_starts_match_segment_masked_reference(raised, rng, attn, attn_bwd, lengths, G):
    q, k, v, do = inputs(rng, sum(lengths), G, 16)
    starts = starts_of(lengths)
    check(run(raised, attn, attn_bwd, q, k, v, do, starts, bucket=64), reference(q, k, v, do, starts))


def test_each_sequence_equals_it_alone(raised, rng, attn, attn_bwd):
    """Concatenated sequences give each sequence's own attention (the plain kernel on it alone)."""
    from lfm2jit.ir.intrinsics import kernel_ir as kir
    plain = Kernel(kir("attn_plain", "causal_attention", [TensorArg("q", "f32", ("T", "H", "E")),
                                                          TensorArg("k", "f32", ("T", "G", "E")),
                                                          TensorArg("v", "f32", ("T", "G", "E"))], ["o", "lse"]))
    lengths = [19, 1, 44, 7]
    q, k, v, do = inputs(rng, sum(lengths), 2, 32)
    got = run(raised, attn, attn_bwd, q, k, v, do, starts_of(lengths), bucket=64)
    at = 0
    for n in lengths:
        want = reference(q[at:at + n], k[at:at + n], v[at:at + n], do[at:at + n], np.zeros(n, np.int32))
        o = raised.run(plain, bucket=64, **{x: raised.tensor(a[at:at + n]) for x, a in (("q", q), ("k", k), ("v", v))})
        np.testing.assert_allclose(got[0][at:at + n], o["o"].numpy(), rtol=0, atol=1e-5)
        check([g[at:at + n] for g in got], want)
        at += n


def test_other_tiles(raised, rng, attn, attn_bwd):
    """Tiles other than the default: smaller query blocks and key tiles, so starts cross more tiles."""
    from lfm2jit.tune.tiles import AttentionTiles
    lengths = [3, 30, 1, 17, 9]
    q, k, v, do = inputs(rng, sum(lengths), 2, 16)
    starts = starts_of(lengths)
    check(run(raised, attn, attn_bwd, q, k, v, do, starts, bucket=16, tiles=AttentionTiles(8, 8, 2)),
          reference(q, k, v, do, starts))


def test_starts_type_rule():
    from lfm2jit import compile_source, DslError
    with pytest.raises(DslError, match="starts must be i32"):
        compile_source("kernel a(q: f32[T, H, E], k: f32[T, G, E], v: f32[T, G, E], s: f32[T]) -> "
                       "(o: f32[T, H, E], lse: f32[T, H]) {\n    o, lse = causal_attention(q, k, v, s)\n}\n", "a.lk")
    m = compile_source("kernel a(q: f32[T, H, E], k: f32[T, G, E], v: f32[T, G, E], s: i32[T]) -> "
                       "(o: f32[T, H, E], lse: f32[T, H]) {\n    o, lse = causal_attention(q, k, v, s)\n}\n", "a.lk")
    bwd = grad(m.a, cotangents=["o"])
    assert "d_s" not in bwd.outputs
    with pytest.raises(DslError, match=r"takes 3 to 4 operands \(q, k, v, starts\), got 2 arguments"):
        compile_source("kernel a(q: f32[T, H, E], k: f32[T, G, E]) -> (o: f32[T, H, E], lse: f32[T, H]) {\n"
                       "    o, lse = causal_attention(q, k)\n}\n", "a.lk")
    with pytest.raises(DslError, match=r"starts must be i32\[T\]"):
        compile_source("kernel a(q: f32[T, H, E], k: f32[T, G, E], v: f32[T, G, E], s: i32[T, H]) -> "
                       "(o: f32[T, H, E], lse: f32[T, H]) {\n    o, lse = causal_attention(q, k, v, s)\n}\n", "a.lk")


@pytest.mark.parametrize("lengths", [[20, 1, 43], [5, 70, 1, 1, 33, 40]])
def test_matrix_templates_mask_starts(matrix_engine, rng, lengths):
    """f16 operands: the three kernels with starts run on the matrix templates (emulated on lavapipe)
    with the same mask and loop bounds, within f16 rounding of float64 on the same f16 inputs."""
    fwd = attention_kernel("f16")
    bwd = grad(fwd, cotangents=["o"])
    q, k, v, do = (x.astype(np.float16) for x in inputs(rng, sum(lengths), 2, 16))
    starts = starts_of(lengths)
    dims = {"T": sum(lengths), "H": H, "G": 2, "E": 16}
    assert fwd.specialize(dims, 64, target=matrix_engine.target).template == "attention_fwd_matrix"
    assert [k.specialize(dims, 64, target=matrix_engine.target).template for k in bwd.kernels
            if k.ir.structure.kind == "intrinsic"] == ["attention_dq_matrix", "attention_dkdv_matrix"]
    got = run(matrix_engine, fwd, bwd, q, k, v, do, starts, bucket=64)
    check(got, reference(q, k, v, do, starts), tol=1e-2)


def test_default_limits_fit_dkdv(engine, rng, attn, attn_bwd):
    """Under WebGPU's default 8 storage bindings all three kernels with starts fit: dk/dv reads lse and
    D stacked in one tensor (q, k, v, stats, dO, starts, dk, dv), and gives the masked gradients."""
    assert engine.target.storage_buffers == 8
    dims = {"T": 40, "H": H, "G": 2, "E": 16}
    dkdv = attn_bwd.kernels[-1].specialize(dims, 64, target=engine.target)
    assert len(dkdv.bindings) == 8
    lengths = [5, 1, 30, 4]
    q, k, v, do = inputs(rng, sum(lengths), 2, 16)
    starts = starts_of(lengths)
    check(run(engine, attn, attn_bwd, q, k, v, do, starts, bucket=64), reference(q, k, v, do, starts))
