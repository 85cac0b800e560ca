"""Integer features of the kernel language (% & | << >>, size(AXIS)) and GEMMs whose weight operand is
decoded from a quantized format in the operand fetch (linear_nf4, linear_int8): against numpy
float64 on the dequantized weights (lfm2jit/model/quantize.py), forward and input gradient."""
from __future__ import annotations

import numpy as np
import pytest

from lfm2jit import DslError, compile_source, grad, library
from lfm2jit.cli import MATRIX_UNITS
from lfm2jit.model.quantize import (NF4_CODE, dequantize_int8, dequantize_nf4, quantize_int8, quantize_nf4)
from lfm2jit.codegen.render import render

BITS = compile_source("""
kernel bits(a: u32[T, D], b: u32[T, D], c: i32[T, D]) -> (y: u32[T, D], z: i32[T, D], s: f32[T, D]) {
    y = ((a >> (b & 7)) & 255) | (a << 3) % 1000
    z = (c >> 2) + (c % 5) + (c << i32(b)) + i32(size(D)) - (c | 6)
    s = f32(a & 15) * 0.5
}
kernel mixed(x: f32[T, D], a: u32[T, D]) -> (y: f32[T, D]) {
    y = x * x * f32((a >> 1) & 3)
}
""", "bits.lk")


def test_integer_operators_match_numpy(engine, rng):
    a = rng.integers(0, 2**32, (5, 12), dtype=np.uint64).astype(np.uint32)
    b = rng.integers(0, 40, (5, 12)).astype(np.uint32)
    c = rng.integers(-1000, 1000, (5, 12)).astype(np.int32)
    r = engine.run(BITS.bits, a=engine.tensor(a), b=engine.tensor(b), c=engine.tensor(c), bucket=8)
    shift = (b & 31).astype(np.uint32)
    want_y = ((a >> (b & 7)) & 255) | ((a << np.uint32(3)) % np.uint32(1000))
    want_z = (c >> 2) + np.fmod(c, 5) + (c << shift.astype(np.int32)) + 12 - (c | 6)   # % truncates; << wraps
    assert np.array_equal(r["y"].numpy(), want_y)
    assert np.array_equal(r["z"].numpy(), want_z.astype(np.int32))
    assert np.array_equal(r["s"].numpy(), (a & 15).astype(np.float32) * 0.5)


def test_integer_operands_carry_no_gradient(engine, rng):
    x = rng.standard_normal((6, 8)).astype(np.float32)
    a = rng.integers(0, 100, (6, 8)).astype(np.uint32)
    bwd = grad(BITS.mixed, cotangents=["y"])
    assert list(bwd.outputs) == ["d_x"]          # the u32 input has none
    d = engine.run(bwd, x=engine.tensor(x), a=engine.tensor(a), d_y=engine.tensor(np.ones_like(x)), bucket=8)
    assert np.allclose(d["d_x"].numpy(), 2 * x * ((a >> 1) & 3), rtol=1e-6)
    with pytest.raises(Exception, match="only float inputs have gradients"):
        grad(BITS.mixed, wrt=["a"])


@pytest.mark.parametrize("src,message", [
    ("y = x & 3", "& needs integer operands, got f32"),
    ("y = f32(7 >> 1) + x", ">> needs integer operands, got literals only"),
    ("y = x % x", "% needs integer operands, got f32"),
])
def test_bit_operators_refuse_floats(src, message):
    with pytest.raises(DslError, match=message) as e:
        compile_source(f"kernel k(x: f32[T, D]) -> (y: f32[T, D]) {{\n    {src}\n}}\n", "k.lk")
    assert "k.lk:2:" in str(e.value)


# T not a bucket multiple, N * K not a multiple of 64 (a short last block) or of 2 (an odd nibble)
SHAPES = [(37, 50, 45), (5, 130, 192), (1, 7, 9)]


def _nf4_inputs(engine, w, double):
    q = quantize_nf4(w, "w", double_quant=double)
    return q, dict(codes=engine.tensor(q.words()), absmax=engine.tensor(q.block_absmax()),
                   code=engine.tensor(NF4_CODE))


@pytest.mark.parametrize("T,N,K", SHAPES)
@pytest.mark.parametrize("double", [False, True])
def test_nf4_linear_and_its_input_gradient(engine, rng, T, N, K, double):
    x = rng.standard_normal((T, K)).astype(np.float32)
    r = rng.standard_normal((T, N)).astype(np.float32)
    dy = rng.standard_normal((T, N)).astype(np.float32)
    w = (rng.standard_normal((N, K)) * rng.uniform(0.01, 2, (N, 1))).astype(np.float32)
    q, packed = _nf4_inputs(engine, w, double)
    wd = dequantize_nf4(q).astype(np.float64)
    scale = np.abs(x).astype(np.float64) @ np.abs(wd).T + 1
    y = engine.run("linear_nf4", x=engine.tensor(x), r=engine.tensor(r), **packed, dims={"N": N}, bucket=16)["y"]
    assert np.all(np.abs(y.numpy() - (x.astype(np.float64) @ wd.T + r)) <= 1e-6 * scale)
    bwd = grad(library.get("linear_nf4"), wrt=["x"], cotangents=["y"])
    dx = engine.run(bwd, d_y=engine.tensor(dy), **packed, dims={"N": N, "K": K}, bucket=16)["d_x"].numpy()
    want = dy.astype(np.float64) @ wd
    assert np.all(np.abs(dx - want) <= 1e-6 * (np.abs(dy).astype(np.float64) @ np.abs(wd) + 1))


@pytest.mark.parametrize("T,N,K", SHAPES)
def test_int8_linear_and_its_input_gradient(engine, rng, T, N, K):
    x = rng.standard_normal((T, K)).astype(np.float32)
    dy = rng.standard_normal((T, N)).astype(np.float32)
    w = (rng.standard_normal((N, K)) * rng.uniform(0.01, 2, (N, 1))).astype(np.float32)
    w[0, :] = 0.0
    q = quantize_int8(w, "w")
    wd = dequantize_int8(q).astype(np.float64)
    packed = dict(codes=engine.tensor(q.words()), scale=engine.tensor(q.scale))
    y = engine.run("linear_int8", x=engine.tensor(x), **packed, bucket=16)["y"].numpy()
    assert np.all(np.abs(y - x.astype(np.float64) @ wd.T) <= 1e-6 * (np.abs(x).astype(np.float64) @ np.abs(wd).T + 1))
    bwd = grad(library.get("linear_int8"), wrt=["x"], cotangents=["y"])
    dx = engine.run(bwd, d_y=engine.tensor(dy), **packed, dims={"K": K}, bucket=16)["d_x"].numpy()
    assert np.all(np.abs(dx - dy.astype(np.float64) @ wd) <= 1e-6 * (np.abs(dy).astype(np.float64) @ np.abs(wd) + 1))


@pytest.mark.parametrize("name", ["linear_nf4", "linear_int8"])
def test_the_weight_is_decoded_in_the_gemm_fetch(name):
    """One GEMM each way, reading the packed words: no dequantized weight is stored."""
    kernel = library.get(name).without({"r"})
    sizes = {"T": 40, "N": 48, "K": 64, "P": 48 * 64 // 4, "B": 48, "C": 16}
    for k in (kernel, grad(kernel, wrt=["x"], cotangents=["y"])):
        parts = k.kernels
        assert len(parts) == 1
        spec = parts[0].specialize(sizes, 16)
        assert spec.template == "matmul"
        assert "codes" in {b.tensor for b in spec.bindings}
        assert not any(b.tensor.startswith("tmp") for b in spec.bindings)


F16_PRODUCTS = {      # the products of a decoded linear layer in --f16 mode: activations f16, packed weights as they are
    "y": lambda k: k.without({"r"}).variant("f16", {"codes", "absmax", "code"}),
    "d_x": lambda k: grad(k.without({"r"}), ["x"], ["y"]).variant("f16", {"codes", "absmax", "code"}),
}


@pytest.mark.parametrize("out", F16_PRODUCTS)
def test_decoded_f16_products_go_to_the_matrix_units(out):
    """... each fetch decoding four neighbours (along K forward, along the weight's rows for d_x) into
    one vec4 where the weight's contiguous axis is a multiple of 4, else one element."""
    kernel = F16_PRODUCTS[out](library.get("linear_nf4"))
    for n, k, by_vec4 in ((48, 64, True), (48, 45, False)):
        sizes = {"T": 40, "N": n, "K": k, "P": -(-n * k // 8), "B": -(-n * k // 64), "C": 16}
        spec = kernel.specialize(sizes, 16, target=MATRIX_UNITS)
        assert spec.template == "matmul_matrix"
        wgsl = render(spec)
        assert "subgroupMatrixMultiplyAccumulate" in wgsl and "codes_[" in wgsl
        assert ("= vec4<f16>(vec4<f32>(pf0_" in wgsl) == by_vec4, (n, k)


@pytest.mark.parametrize("T,N,K", [(37, 50, 45), (5, 130, 192)])
def test_nf4_linear_on_the_matrix_template(matrix_engine, rng, T, N, K):
    """On the device's matrix units, or (lavapipe) the same template with them emulated: the decoded
    weight and x are staged as f16, so the products are those of the f16-rounded operands."""
    engine = matrix_engine
    x = rng.standard_normal((T, K)).astype(np.float16)
    dy = rng.standard_normal((T, N)).astype(np.float16)
    w = rng.standard_normal((N, K)).astype(np.float32)
    q, packed = _nf4_inputs(engine, w, False)
    wd = dequantize_nf4(q).astype(np.float16).astype(np.float64)
    kernel = F16_PRODUCTS["y"](library.get("linear_nf4"))
    sizes = {"T": T, "N": N, "K": K, "P": q.words().size, "B": q.absmax.size, "C": 16}
    assert kernel.specialize(sizes, 16, target=engine.target).template == "matmul_matrix"
    y = engine.run(kernel, x=engine.tensor(x), **packed, dims={"N": N}, bucket=16)["y"].numpy().astype(np.float64)
    want = x.astype(np.float64) @ wd.T
    assert np.all(np.abs(y - want) <= 2e-3 * (np.abs(x).astype(np.float64) @ np.abs(wd).T) + 1e-2)
    bwd = F16_PRODUCTS["d_x"](library.get("linear_nf4"))
    dx = engine.run(bwd, d_y=engine.tensor(dy), **packed, dims={"N": N, "K": K}, bucket=16)["d_x"].numpy()
    want = dy.astype(np.float64) @ wd
    assert np.all(np.abs(dx.astype(np.float64) - want) <= 2e-3 * (np.abs(dy).astype(np.float64) @ np.abs(wd)) + 1e-2)


def test_int8_linear_on_the_matrix_template(matrix_engine, rng):
    """The int8 weight decoded four neighbours a fetch (four bytes of one word) on the matrix template."""
    engine, (T, N, K) = matrix_engine, (21, 132, 64)
    x = rng.standard_normal((T, K)).astype(np.float16)
    dy = rng.standard_normal((T, N)).astype(np.float16)
    q = quantize_int8(rng.standard_normal((N, K)).astype(np.float32), "w")
    wd = dequantize_int8(q).astype(np.float16).astype(np.float64)
    packed = dict(codes=engine.tensor(q.words()), scale=engine.tensor(q.scale))
    fwd = library.get("linear_int8").without({"r"}).variant("f16", {"codes", "scale"})
    y = engine.run(fwd, x=engine.tensor(x), **packed, bucket=16)["y"].numpy().astype(np.float64)
    assert np.all(np.abs(y - x.astype(np.float64) @ wd.T) <= 2e-3 * (np.abs(x).astype(np.float64) @ np.abs(wd).T) + 1e-2)
    bwd = grad(library.get("linear_int8").without({"r"}), ["x"], ["y"]).variant("f16", {"codes", "scale"})
    dx = engine.run(bwd, d_y=engine.tensor(dy), **packed, dims={"K": K}, bucket=16)["d_x"].numpy().astype(np.float64)
    assert np.all(np.abs(dx - dy.astype(np.float64) @ wd) <= 2e-3 * (np.abs(dy).astype(np.float64) @ np.abs(wd)) + 1e-2)


def test_a_table_lookup_operand_is_computed_in_the_fetch(engine, rng):
    """Any operand that reads tables by gather() is a prologue, not only the shipped decoders: rows of
    an embedding table, scaled, multiplied straight from the table in one GEMM (and its x gradient)."""
    m = compile_source("""
kernel k(x: f32[T, K], ids: i32[N], tab: f32[V, K], s: f32[K]) -> (y: f32[T, N]) {
    y = sum(x * (gather(tab, ids) * s), K)
}
""", "lookup.lk")
    x = rng.standard_normal((21, 32)).astype(np.float32)
    tab = rng.standard_normal((7, 32)).astype(np.float32)
    s = rng.standard_normal(32).astype(np.float32)
    ids = rng.integers(0, 7, 19).astype(np.int32)
    assert len(m.k.kernels) == 1
    args = dict(ids=engine.tensor(ids), tab=engine.tensor(tab), s=engine.tensor(s), bucket=16)
    y = engine.run(m.k, x=engine.tensor(x), **args)["y"].numpy()
    w = (tab[ids] * s).astype(np.float64)
    assert np.allclose(y, x.astype(np.float64) @ w.T, rtol=1e-5, atol=1e-5)
    bwd = grad(m.k, wrt=["x"])
    assert len(bwd.kernels) == 1
    dy = rng.standard_normal((21, 19)).astype(np.float32)
    dx = engine.run(bwd, d_y=engine.tensor(dy), **args)["d_x"].numpy()
    assert np.allclose(dx, dy.astype(np.float64) @ w, rtol=1e-5, atol=1e-5)
