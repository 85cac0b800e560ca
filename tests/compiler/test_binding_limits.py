"""Tensors larger than one storage binding (schedule/pieces.py) and kernels near the device's
binding limits.

A device whose binding limit is lowered to a few KiB (the real adapter binds far more, so the
pieces are legal) forces several pieces per tensor; every kernel must then give exactly what the
same kernel gives bound whole (the same reduction order: bit for bit), and what numpy gives.
"""
from __future__ import annotations

import numpy as np
import pytest

from lfm2jit import ComputeEngine, compile_source, library
from lfm2jit.codegen.render import render
from lfm2jit.ops.embedding import slots
from lfm2jit.runtime import arena
from lfm2jit.schedule import DeviceLimitError
from lfm2jit.schedule.pieces import piece_bytes


LIMIT = 4096


def lowered(ctx, monkeypatch) -> ComputeEngine:
    """An engine for the device with its binding limit lowered to 4 KiB (16 alignments of 256
    bytes). Work on engines planned for the real limit must be done first: the device now says 4 KiB."""
    monkeypatch.setitem(ctx.limits, "max-storage-buffer-binding-size", LIMIT)
    eng = ComputeEngine(ctx)
    assert eng.target.binding_bytes == LIMIT and piece_bytes(eng.target) == LIMIT
    return eng


@pytest.fixture
def small_engine(ctx, monkeypatch):
    return lowered(ctx, monkeypatch)


def _pieced(eng, kernel, dims, bucket=1) -> dict[str, int]:
    """{tensor: pieces} of each binding of the kernel's one part that is bound in pieces."""
    (part,) = kernel.kernels
    spec = part.specialize(dims, bucket, target=eng.target)
    return {b.tensor: b.pieces for b in spec.bindings if b.pieces > 1}


def _embedding(eng, table, ids, g):
    y = eng.run("embedding", table=eng.tensor(table), ids=eng.tensor(ids))["y"].numpy()
    order, bounds, rows = slots(ids)
    d_table = eng.tensor(np.ones(table.shape, np.float32))
    eng.run("embedding_backward", dims={"V": table.shape[0]}, g=eng.tensor(g), order=eng.tensor(order),
            bounds=eng.tensor(bounds), rows=eng.tensor(rows), out={"d_table": d_table}, accumulate={"d_table"})
    return y, d_table.numpy()


@pytest.mark.parametrize("seed", range(6))
def test_gather_and_scatter_over_pieces_match_whole_bindings(ctx, engine, monkeypatch, seed):
    rng = np.random.default_rng(seed)
    D = int(rng.integers(3, 30))
    V = int(rng.integers(LIMIT // (4 * D) + 1, 3 * LIMIT // (4 * D)))       # 2 or 3 pieces
    T = int(rng.integers(1, 50))
    table = rng.standard_normal((V, D)).astype(np.float32)
    ids = rng.integers(0, V, T).astype(np.int32)
    g = rng.standard_normal((T, D)).astype(np.float32)
    whole = _embedding(engine, table, ids, g)
    small = lowered(ctx, monkeypatch)
    assert _pieced(small, library.get("embedding"), {"V": V, "D": D, "T": T})["table"] == -(-V * D * 4 // LIMIT)
    pieces = _embedding(small, table, ids, g)
    np.testing.assert_array_equal(pieces[0], table[ids])
    np.testing.assert_array_equal(pieces[0], whole[0])
    np.testing.assert_array_equal(pieces[1], whole[1])
    want = np.ones((V, D))
    np.add.at(want, ids, g.astype(np.float64))
    np.testing.assert_allclose(pieces[1], want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("seed", range(6))
def test_products_and_row_reductions_over_pieces_match_whole_bindings(ctx, engine, monkeypatch, seed):
    rng = np.random.default_rng(100 + seed)
    T, K = int(rng.integers(1, 40)), int(rng.integers(8, 40))
    N = int(rng.integers(LIMIT // (4 * K) + 1, 3 * LIMIT // (4 * K)))
    x = rng.standard_normal((T, K)).astype(np.float32)
    w = rng.standard_normal((N, K)).astype(np.float32)
    big = rng.standard_normal((max(2, 3 * LIMIT // (4 * N)), N)).astype(np.float32)
    linear = library.get("linear").without({"r"})

    def run(eng):
        soft = eng.run("softmax", x=eng.tensor(big))
        return eng.run(linear, x=eng.tensor(x), w=eng.tensor(w))["y"].numpy(), soft["y"].numpy(), soft["lse"].numpy()
    whole = run(engine)
    small = lowered(ctx, monkeypatch)
    assert _pieced(small, linear, {"T": T, "K": K, "N": N})["w"] == -(-N * K * 4 // LIMIT)
    assert _pieced(small, library.get("softmax"), {"T": big.shape[0], "D": N})["x"] >= 2
    pieces = run(small)
    for a, b in zip(pieces, whole):
        np.testing.assert_array_equal(a, b)
    np.testing.assert_allclose(pieces[0], x.astype(np.float64) @ w.T.astype(np.float64), rtol=1e-4, atol=1e-4)
    e = np.exp(big.astype(np.float64) - big.max(-1, keepdims=True))
    np.testing.assert_allclose(pieces[1], e / e.sum(-1, keepdims=True), rtol=1e-5, atol=1e-7)


def test_pieces_are_accessor_functions_and_whole_bindings_stay_plain_indexing(small_engine):
    """A pieced tensor is declared as consecutive bindings with load/store functions picking the
    piece; a tensor that fits is indexed directly, as before."""
    k = compile_source("kernel twice(x: f32[N], y: f32[N]) -> (z: f32[N]) {\n  z = x * 2.0 + y\n}")["twice"]
    spec = k.kernels[0].specialize({"N": 2000}, 1, target=small_engine.target)    # 8000 bytes: 2 pieces each
    assert [(b.tensor, b.binding, b.pieces) for b in spec.bindings] == [("x", 1, 2), ("y", 3, 2), ("z", 5, 2)]
    text = render(spec)
    for name in ("x", "y", "z"):
        assert f"fn {name}_load(i: u32)" in text and f"{name}_1_" in text
    assert "fn z_store(" in text and "fn x_store(" not in text
    small = k.kernels[0].specialize({"N": 100}, 1, target=small_engine.target)
    assert all(b.pieces == 1 for b in small.bindings) and "_load(" not in render(small)


def test_too_many_bindings_and_unpieceable_templates_are_refused_before_gpu_work(small_engine):
    wide = compile_source("kernel wide(a: f32[N], b: f32[N], c: f32[N], d: f32[N], e: f32[N], f: f32[N], "
                          "g: f32[N], h: f32[N]) -> (z: f32[N]) {\n  z = a + b + c + d + e + f + g + h\n}")["wide"]
    args = {n: small_engine.tensor(np.ones(4, np.float32)) for n in "abcdefgh"}
    with pytest.raises(DeviceLimitError, match=r"wide: the pointwise kernel needs 9 storage bindings; the device "
                                                r"allows 8 \(max-storage-buffers-per-shader-stage\)"):
        small_engine.run(wide, **args)
    before = small_engine.dispatches
    q = small_engine.tensor(np.zeros((64, 4, 16), np.float32))       # 16 KiB: 4 pieces the template cannot take
    kv = small_engine.tensor(np.zeros((64, 2, 16), np.float32))
    with pytest.raises(DeviceLimitError, match=r"q binds 16384 bytes .* the attention_fwd template binds this "
                                                r"tensor whole"):
        small_engine.run("attention", q=q, k=kv, v=kv)
    assert small_engine.dispatches == before


def test_a_pass_over_an_arena_never_binds_more_than_one_binding(small_engine, rng):
    """The optimizer and the gradient norm walk arena spans, which are cut to one binding each."""
    ts = arena.carve(small_engine, [(3000,), (7,), (900,)])
    spans = [r.span for r in arena.runs(ts)]
    assert max(s.nbytes for s in spans) <= LIMIT and sum(s.nbytes for s in spans) >= sum(t.nbytes for t in ts)
    together = arena.runs_together([ts, ts])
    assert all(a.nbytes == b.nbytes <= LIMIT and a.offset == b.offset for a, b in together)


def test_the_matrix_dkdv_fits_default_limits(engine):
    """Under WebGPU's default 8 storage buffers the matrix dk/dv keeps its template: lse and D = dO . O
    come in one tensor (stats), so q, k, v, stats, dO, dk, dv and the group's workspace make 8 (given
    matrix tiles too)."""
    from dataclasses import replace

    from lfm2jit.cli import MATRIX_UNITS
    from lfm2jit.driver import grad
    from lfm2jit.tune.tiles import MatrixAttentionTiles
    fwd = library.get("attention").variant("f16")
    dkdv = grad(fwd, cotangents=["o"]).kernels[-1]
    dims = {"B": 1, "T": 64, "H": 4, "G": 2, "E": 64}
    default = replace(MATRIX_UNITS, storage_buffers=engine.ctx.limits["max-storage-buffers-per-shader-stage"])
    for tiles in (None, MatrixAttentionTiles(32, 16)):
        spec = dkdv.specialize(dims, 64, frozenset(), tiles, default)
        assert spec.template == "attention_dkdv_matrix" and sum(b.pieces for b in spec.bindings) == 8
        assert spec.params.split == 2


def test_a_tensor_larger_than_the_largest_buffer_lives_in_parts(ctx, engine, monkeypatch, rng):
    """With the largest buffer lowered to 8 KiB, a 12 KiB table is three buffers of one binding
    each: written, read, sliced by rows, cleared and bound (gathered from, scattered into) part by part."""
    from lfm2jit import Tensor
    V, D = 150, 20                                              # 12000 bytes
    table = rng.standard_normal((V, D)).astype(np.float32)
    ids = rng.integers(0, V, 30).astype(np.int32)
    g = rng.standard_normal((30, D)).astype(np.float32)
    whole = _embedding(engine, table, ids, g)
    small = lowered(ctx, monkeypatch)
    monkeypatch.setitem(ctx.limits, "max-buffer-size", 8192)
    t = Tensor.from_numpy(ctx, table)
    assert t.parts is not None and [p.size for p in t.parts] == [LIMIT, LIMIT, 12000 - 2 * LIMIT]
    np.testing.assert_array_equal(t.numpy(), table)
    np.testing.assert_array_equal(t.rows(112, 150).numpy(), table[112:150])     # within the last part
    with pytest.raises(ValueError, match="cross one of its 4096-byte buffers"):
        t.rows(48, 60)
    y = small.run("embedding", table=t, ids=small.tensor(ids))["y"].numpy()
    np.testing.assert_array_equal(y, whole[0])
    d_table = Tensor.from_numpy(ctx, np.ones((V, D), np.float32))
    order, bounds, rows = slots(ids)
    small.run("embedding_backward", dims={"V": V}, g=small.tensor(g), order=small.tensor(order),
              bounds=small.tensor(bounds), rows=small.tensor(rows), out={"d_table": d_table}, accumulate={"d_table"})
    np.testing.assert_array_equal(d_table.numpy(), whole[1])
    small.zero_(d_table)
    assert not d_table.numpy().any()
    assert len(small.tensor(table).parts) == 3                 # the engine's own tensors too, unpooled
    with pytest.raises(ValueError, match="largest buffer is 8192"):
        small.empty((10, D), capacity=V * D)                   # a bucket's reserve cannot be in parts


def test_a_split_k_workspace_that_would_be_a_ninth_binding_is_left_out(engine, rng):
    """LoRA's fused down-projection backward binds 8 tensors (a, b, w, al, d_y, d_z -> d_a, d_b): a
    short, wide-K output would take split-K, whose workspace is a ninth binding; under WebGPU's
    default 8 the planner keeps K whole, and the result is the same sum."""
    from dataclasses import replace

    from lfm2jit.driver import grad
    bwd = grad(library.get("swiglu_down_lora"), ["a", "b"], ["y", "z"])
    (part,) = bwd.kernels
    dims = {"T": 16, "F": 64, "D": 1024, "R": 4}
    assert engine.target.storage_buffers == 8
    roomy = part.specialize(dims, 16, target=replace(engine.target, storage_buffers=16))
    tight = part.specialize(dims, 16, target=engine.target)
    assert roomy.params.tiles.split > 1 and {s.tensor for s in roomy.scratch} == {"ws"}
    assert tight.params.tiles.split == 1 and not tight.scratch and len(tight.bindings) == 8
    T, F, D, R = dims.values()
    a, b = rng.standard_normal((T, F)), rng.standard_normal((T, F))
    w, al = rng.standard_normal((D, F)) * 0.05, rng.standard_normal((R, F)) * 0.05
    dy, dz = rng.standard_normal((T, D)), rng.standard_normal((T, R))
    f32 = {k: engine.tensor(v.astype(np.float32)) for k, v in dict(a=a, b=b, w=w, al=al, d_y=dy, d_z=dz).items()}
    got = engine.run(bwd, bucket=16, **f32)
    dg = dy @ w + dz @ al
    sig = 1 / (1 + np.exp(-a))
    np.testing.assert_allclose(got["d_b"].numpy(), dg * a * sig, rtol=1e-4, atol=1e-5)
    np.testing.assert_allclose(got["d_a"].numpy(), dg * b * sig * (1 + a * (1 - sig)), rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("dtype", ["f32", "f16"])
def test_every_length_in_a_bucket_binds_whatever_its_piece_split(small_engine, dtype):
    """A kernel of a length bucket is planned (its pieces counted) for the bucket's rows, but a
    tensor may hold only its real rows (a caller's, or logits made at their real length), or more
    than the bucket's (a buffer reserved for a longer one). A tensor short of the planned pieces
    (3 rows of a 48-row bucket: 1 piece of 3 planned) or past them binds all the same, for
    lengths at and one over a piece boundary; padded rows never change the real ones."""
    if dtype == "f16" and not getattr(small_engine.ctx, "has_f16", True):
        pytest.skip("no shader-f16")
    k = compile_source("kernel scale(x: f32[T, D]) -> (y: f32[T, D]) {\n  y = x * 2.0 + 1.0\n}")["scale"]
    f16 = {"x", "y"} if dtype == "f16" else set()
    np_dtype = np.float16 if dtype == "f16" else np.float32
    D = 256 // np.dtype(np_dtype).itemsize                      # 256 bytes a row: 16 rows a 4 KiB piece
    rng = np.random.default_rng(7)
    for T, bucket in [(3, 48), (16, 48), (17, 48), (32, 48), (33, 48), (47, 48), (48, 48), (5, 8)]:
        x = rng.standard_normal((T, D)).astype(np_dtype)
        want = x.astype(np.float32) * 2 + 1
        got = small_engine.run(k, bucket=bucket, f16=f16, x=small_engine.tensor(x))["y"].numpy()
        np.testing.assert_allclose(got, want, rtol=1e-3, err_msg=f"T={T} bucket={bucket}")
        y = small_engine.empty((T, D), dtype)                   # out= of the real rows only
        small_engine.run(k, bucket=bucket, f16=f16, x=small_engine.tensor(x), out={"y": y})
        np.testing.assert_allclose(y.numpy(), want, rtol=1e-3, err_msg=f"out= T={T} bucket={bucket}")
    T = 4                                                       # 1 piece planned, 3 in the tensor's buffer
    x = small_engine.empty((T, D), dtype, capacity=40 * D)
    x.write(rng.standard_normal((T, D)).astype(np_dtype))
    got = small_engine.run(k, bucket=4, f16=f16, x=x)["y"].numpy()
    np.testing.assert_allclose(got, x.numpy().astype(np.float32) * 2 + 1, rtol=1e-3)
