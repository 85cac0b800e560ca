"""A subgroup size other than 32 (Intel 8 to 32, AMD 64, Apple 32) never changes a result.

Only the subgroup-matrix templates depend on a subgroup size (the SIMT ones use no subgroups). They
run here emulated in plain WGSL (LFM2JIT_MATRIX_UNITS=emulate, as on lavapipe in CI), planned for a
Target whose subgroup_size is 8, 16, 32 or 64 instead of the emulation's nominal 32. In emulation a
"subgroup" is that many consecutive invocations; each holds m*n/SIZE elements of a result fragment
and sums each element's products in the same order (k ascending) whatever SIZE is, so:

* the GEMM (all three products of a linear layer, with and without split-K) plans at every size and
  is bit-identical across sizes (checked at 16, 32, 64, and 8 for one product); so are attention's
  backward kernels (dq, dk, dv) given the same o and lse: their only per-row reduction,
  D = dO . o, is whole in every invocation of the row;
* attention's forward splits each query row's softmax sum l over the subgroup's SIZE/16 invocations
  per row (ROW_THREADS; templates/attention_fwd_matrix.wgsl.j2), adding the shares at the end: its
  reduction order, so o and lse, may differ in the last bits of f32 (o, stored as f16, by one f16
  ulp where that rounding flips); checked within that, and all against numpy float64;
* a size smaller than a fragment's 16 rows (8) cannot hold attention's matrix tiles: the planner
  keeps attention on the portable SIMT templates (which use no subgroups; tests/compiler/
  test_attention.py checks them), and refuses matrix tiles given explicitly, naming the subgroup size.
"""
from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest

from numerics import rel_err
from lfm2jit import ComputeEngine, grad, library
from lfm2jit.codegen.render import render
from lfm2jit.ir.intrinsics import IntrinsicError
from lfm2jit.schedule import EMULATED_SUBGROUP
from lfm2jit.tune.tiles import MatrixAttentionTiles, MatrixTiles
from test_attention import _inputs, attention_kernel, reference

SIZES = (16, 32, 64)       # what the matrix templates are checked at; 8 (Intel's smallest) where it plans
LINEAR = library.get("linear").without({"r"})
PRODUCTS = {   # a linear layer's three products in --f16 mode (as tests/compiler/test_matrix_units.py)
    "y": LINEAR.variant("f16", {"w"}),
    "d_x": grad(LINEAR, ["x"]).variant("f16", {"w"}).kernels[0],
    "d_w": grad(LINEAR, ["w"]).variant("f16", {"d_w"}).kernels[0],
}
# Small tiles: lavapipe's compile time grows with the fragment elements each invocation holds
# (m*n/SIZE), several seconds a shader at the planner's 64x64 tiles and a subgroup of 8 or 16.
SMALL = MatrixTiles(16, 16, 1, 1, 16)
SPLIT = MatrixTiles(32, 32, 2, 1, 16, split=2)
GEMM_CASES = [("y", SMALL, 0), ("d_x", SMALL, 1), ("d_w", SMALL, 2), ("y", SPLIT, 3), ("d_w", SPLIT, 4)]
ATTN_TOL = 4e-3     # as tests/compiler/test_attention_matrix.py: f16 P and o, f32 accumulation


@pytest.fixture(scope="module")
def engines(matrix_engine):
    """An emulated matrix-unit engine per subgroup size (8 too), on matrix_engine's device (its limits:
    the matrix templates' tiles want more than the default 16 KiB of workgroup memory).
    Emulated even where the device has matrix units: their subgroup size is the hardware's."""
    ctx = matrix_engine.ctx
    mp = pytest.MonkeyPatch()
    mp.setenv("LFM2JIT_MATRIX_UNITS", "emulate")
    try:
        out = {}
        for size in (8, *SIZES):
            e = ComputeEngine(ctx)
            assert e.target.emulated and e.target.subgroup_size == EMULATED_SUBGROUP
            e.target = replace(e.target, subgroup_size=size)
            out[size] = e
        return out
    finally:
        mp.undo()


def f16_ulps(a, b) -> float:
    """The largest difference of two f16 arrays in units in the last place of the larger value."""
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    ulp = np.spacing(np.maximum(np.abs(a), np.abs(b)).astype(np.float16)).astype(np.float64)
    return float((np.abs(a - b) / ulp).max(initial=0.0))


@pytest.mark.parametrize("out,tiles,seed", GEMM_CASES, ids=[f"{o}-{'split' if t.split > 1 else 'whole'}-{s}" for o, t, s in GEMM_CASES])
def test_matrix_gemm_is_bit_identical_at_every_subgroup_size(engines, out, tiles, seed):
    """A random shape (ragged edges) for each product, with and without split-K: planned at every
    size, the subgroup size baked into each shader, the same bits at 16, 32 and 64 (and 8 for y
    without split-K), and all against float64 on the same f16-rounded values."""
    rng = np.random.default_rng(seed)
    T, K, N = (int(v) for v in rng.integers(5, 80, 3))
    x = rng.standard_normal((T, K)).astype(np.float16)
    dy = rng.standard_normal((T, N)).astype(np.float16)
    w = rng.standard_normal((N, K)).astype(np.float32)
    w16 = w.astype(np.float16).astype(np.float64)
    want = {"y": x.astype(np.float64) @ w16.T, "d_x": dy.astype(np.float64) @ w16,
            "d_w": dy.T.astype(np.float64) @ x.astype(np.float64)}[out]
    k = PRODUCTS[out]
    sizes = (8, *SIZES) if (out, tiles) == ("y", SMALL) else SIZES
    got, wgsl = {}, set()
    for size in sizes:
        e = engines[size]
        spec = k.specialize({"T": T, "K": K, "N": N}, 16, frozenset(), tiles, e.target)
        assert spec.template == "matmul_matrix" and spec.params.subgroup_size == size, size
        wgsl.add(render(spec))
        args = {"x": e.tensor(x), "w": e.tensor(w), "d_y": e.tensor(dy)}
        got[size] = e.run(k, bucket=16, tiles=tiles, **{n: args[n] for n in k.inputs})[out].numpy()
        assert rel_err(got[size], want) < (2e-3 if out != "d_w" else 1e-5), (T, K, N, size)
    assert len(wgsl) == len(sizes), "the subgroup size is not baked into the shader"
    for size in sizes:
        np.testing.assert_array_equal(got[size], got[EMULATED_SUBGROUP], err_msg=f"{T, K, N} at subgroup {size}")


def _attention(e, fwd, bwd, q, k, v, do, o_lse):
    """o, lse of the forward; dq, dk, dv of the backward given ``o_lse`` (the same for every engine)."""
    t = {n: e.tensor(a) for n, a in (("q", q), ("k", k), ("v", v), ("d_o", do))}
    fw = e.run(fwd, bucket=16, q=t["q"], k=t["k"], v=t["v"])
    o, lse = fw["o"].numpy(), fw["lse"].numpy()
    if o_lse is None:
        o_lse = (o, lse)
    g = e.run(bwd, bucket=16, o=e.tensor(o_lse[0]), lse=e.tensor(o_lse[1]), **t)
    return o, lse, g["d_q"].numpy(), g["d_k"].numpy(), g["d_v"].numpy()


def test_matrix_attention_at_every_subgroup_size(engines, rng):
    """A random shape (ragged T, grouped heads) at 16, 32 and 64: the forward within f32 rounding of
    each other (o within one f16 ulp), the backward, given the same o and lse, bit-identical; all
    against float64."""
    fwd = attention_kernel().variant("f16")
    bwd = grad(fwd, cotangents=["o"])
    T, G, E = int(rng.integers(17, 48)), 2, 16
    q, k, v, do = _inputs(rng, T, G, E, np.float16)
    want = reference(q, k, v, do)
    dims = {"T": T, "H": 4, "G": G, "E": E}
    plans = {size: [kk.specialize(dims, 16, target=engines[size].target) for kk in (fwd, *bwd.kernels)]
             for size in SIZES}
    got = {EMULATED_SUBGROUP: _attention(engines[EMULATED_SUBGROUP], fwd, bwd, q, k, v, do, None)}
    ref = got[EMULATED_SUBGROUP]
    for size in SIZES:
        # every subgroup size plans the templates the emulated one does
        templates = [spec.template for spec in plans[size]]
        assert templates[:2] == ["attention_fwd_matrix", "attention_dq_matrix"], size
        assert templates == [spec.template for spec in plans[EMULATED_SUBGROUP]], size
        assert all(spec.params.subgroup_size == size for spec in plans[size] if spec.template.endswith("_matrix"))
        if size != EMULATED_SUBGROUP:
            got[size] = _attention(engines[size], fwd, bwd, q, k, v, do, ref[:2])
        for name, g, w in zip(("o", "lse", "dq", "dk", "dv"), got[size], want):
            assert rel_err(g, w) < ATTN_TOL, (name, T, size)
        assert f16_ulps(got[size][0], ref[0]) <= 1, size
        assert rel_err(got[size][1], ref[1]) < 1e-6, size
        for name, g, r in zip(("dq", "dk", "dv"), got[size][2:], ref[2:]):
            np.testing.assert_array_equal(g, r, err_msg=f"{name} at subgroup {size}")


def test_attention_at_a_subgroup_smaller_than_a_fragment_stays_portable(engines):
    """8 invocations cannot own a 16-row fragment's rows: attention plans on the portable SIMT
    templates, and matrix tiles given explicitly are refused, naming the subgroup size."""
    fwd = attention_kernel().variant("f16")
    dims = {"T": 20, "H": 4, "G": 2, "E": 32}
    assert [kk.specialize(dims, 16, target=engines[8].target).template
            for kk in (fwd, *grad(fwd, cotangents=["o"]).kernels)] == ["attention_fwd", "attention_bwd", "rowreduce",
                                                                       "attention_bwd"]   # dq, dk/dv's stats, dk/dv
    tiles = MatrixAttentionTiles(rows=32, tile=16)
    assert fwd.specialize(dims, 16, frozenset(), tiles, engines[16].target).template == "attention_fwd_matrix"
    with pytest.raises(IntrinsicError, match=r"the subgroup size \(8\) must be multiples of the fragment height 16"):
        fwd.specialize(dims, 16, frozenset(), tiles, engines[8].target)
