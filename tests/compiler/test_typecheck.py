"""The shape/dtype checker: AST -> typed IR with symbolic axes, and its located errors.

Valid programs get the right IR shapes and dtypes (reductions drop their axis, operands broadcast
by axis name, mean divides by the axis size, literals adopt their operand's dtype, comparisons keep
it). Name, shape and dtype mistakes raise DslError at the offending token with what was expected.
"""
from __future__ import annotations

import textwrap
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import lfm2jit
from lfm2jit import DslError, compile_source
from lfm2jit.ir.nodes import SEQ_AXIS, KernelIR, Node, toposort
from lfm2jit.ir.ops import REDUCE, Op
from dsl_errors import assert_dsl_error

ABSTRACT = "float"   # a literal's dtype until it meets a typed operand


def ir_of(text: str, name: str | None = None) -> KernelIR:
    module = compile_source(text, "t.lk")
    kernel = module[name] if name else next(iter(module))
    return kernel.ir


def result(text: str, out: str = "y") -> Node:
    return ir_of(text).results[out]


def nodes(ir: KernelIR, op: Op) -> list[Node]:
    return [n for n in toposort(ir.results.values()) if n.op == op]


def sig(inputs: str, outputs: str = "y: f32[T, D]") -> str:
    return f"kernel k({inputs}) -> ({outputs}) {{\n"


# --------------------------------------------------------------------------- shipped kernels

def test_rmsnorm_ir():
    text = (Path(lfm2jit.__file__).parent / "ops" / "kernels" / "norms.lk").read_text()
    ir = ir_of(text, "rmsnorm")
    assert [(t.name, t.dtype, t.shape) for t in ir.inputs] == [("x", "f32", ("T", "D")), ("w", "f32", ("D",))]
    assert ir.scalars == ("eps",)
    assert [(t.name, t.dtype, t.shape) for t in ir.outputs] == [("y", "f32", ("T", "D")), ("inv", "f32", ("T",))]
    assert ir.defaults == {"eps": 1e-5}
    y = ir.results["y"]
    assert (y.op, y.shape, y.dtype) == (Op.MUL, ("T", "D"), "f32")
    (rsqrt,) = nodes(ir, Op.RSQRT)
    assert (rsqrt.shape, rsqrt.dtype) == (("T",), "f32")     # the per-row factor
    (s,) = nodes(ir, Op.SUM)
    assert (s.arg, s.shape) == ("D", ("T",))
    (dimsize,) = nodes(ir, Op.DIMSIZE)
    assert dimsize.arg == "D"


def test_softmax_ir():
    text = (Path(lfm2jit.__file__).parent / "ops" / "kernels" / "norms.lk").read_text()
    ir = ir_of(text, "softmax")
    assert {n: (v.shape, v.dtype) for n, v in ir.results.items()} == {
        "y": (("T", "D"), "f32"), "lse": (("T",), "f32")}
    (m,) = nodes(ir, Op.RMAX)
    assert (m.arg, m.shape) == ("D", ("T",))
    assert ir.axes == ("T", "D")


# --------------------------------------------------------------------------- reductions

@pytest.mark.parametrize("call, shape", [
    ("sum(x, D)", ("T", "F")),
    ("sum(x, F)", ("T", "D")),
    ("sum(x, T)", ("D", "F")),
    ("max(x, D)", ("T", "F")),
    ("mean(x, F)", ("T", "D")),
    ("sum(sum(x, D), F)", ("T",)),
    ("max(mean(x, F), D)", ("T",)),
    ("sum(x * x, D) + 1", ("T", "F")),
])
def test_reduction_drops_its_axis(call, shape):
    ir = ir_of(sig("x: f32[T, D, F]", f"y: f32[{', '.join(shape)}]") + f"    y = {call}\n}}\n")
    y = ir.results["y"]
    assert y.shape == shape and y.dtype == "f32"
    for r in nodes(ir, Op.SUM) + nodes(ir, Op.RMAX):
        (src,) = r.srcs
        assert r.arg in src.shape and r.arg not in r.shape
        assert r.shape == tuple(a for a in src.shape if a != r.arg)


def test_max_is_a_reduction_over_an_axis_and_elementwise_over_values():
    ir = ir_of(sig("x: f32[T, D], z: f32[T, D]", "m: f32[T], e: f32[T, D]")
               + "    m = max(x, D)\n    e = max(x, z)\n}\n")
    assert (ir.results["m"].op, ir.results["m"].arg) == (Op.RMAX, "D")
    assert ir.results["e"].op == Op.MAX and ir.results["e"].shape == ("T", "D")


def test_mean_divides_the_sum_by_the_axis_size():
    for dtype in ("f32", "f16"):
        ir = ir_of(sig(f"x: {dtype}[T, D]", f"y: {dtype}[T]") + "    y = mean(x, D)\n}\n")
        y = ir.results["y"]
        assert (y.op, y.shape, y.dtype) == (Op.DIV, ("T",), dtype)
        total, size = y.srcs
        assert (total.op, total.arg, total.shape, total.dtype) == (Op.SUM, "D", ("T",), dtype)
        assert (size.op, size.arg, size.shape) == (Op.DIMSIZE, "D", ())
        assert total.srcs[0].op == Op.INPUT


def test_reduction_over_an_integer_axis_keeps_symbolic_ones():
    ir = ir_of(sig("x: f32[T, D, 3]", "y: f32[T, 3]") + "    y = sum(x, D)\n}\n")
    assert ir.results["y"].shape == ("T", "3")
    assert ir.fixed_dims == {"3": 3}


# --------------------------------------------------------------------------- broadcasting

@pytest.mark.parametrize("a, b, shape", [
    ("f32[T, D]", "f32[D]", ("T", "D")),
    ("f32[D]", "f32[T, D]", ("T", "D")),
    ("f32[T, D]", "f32", ("T", "D")),
    ("f32", "f32[T, D]", ("T", "D")),
    ("f32[T, D]", "f32[T]", ("T", "D")),
    ("f32[T, D, F]", "f32[T, F]", ("T", "D", "F")),
    ("f32[T, D, F]", "f32[D]", ("T", "D", "F")),
    ("f32[T, D, 3]", "f32[3]", ("T", "D", "3")),
    ("f32[T, D]", "f32[T, D]", ("T", "D")),
])
def test_broadcast_by_axis_name_takes_the_containing_shape(a, b, shape):
    out = f"y: f32[{', '.join(shape)}]"
    for expr in ("a + b", "a * b", "b - a", "max(a, b)", "a < b", "a ** b"):
        y = result(sig(f"a: {a}, b: {b}", out) + f"    y = {expr}\n}}\n")
        assert (y.shape, y.dtype) == (shape, "f32"), expr


def test_where_broadcasts_all_three_operands():
    y = result(sig("c: f32[T], a: f32[T, D], b: f32[D]") + "    y = where(c, a, b)\n}\n")
    assert (y.op, y.shape, y.dtype) == (Op.WHERE, ("T", "D"), "f32")
    assert [s.shape for s in y.srcs] == [("T",), ("T", "D"), ("D",)]


def test_literals_and_scalars_broadcast_as_scalars():
    ir = ir_of(sig("x: f32[T, D], s: f32") + "    y = x * s + 2\n}\n")
    (scalar,) = nodes(ir, Op.SCALAR)
    (const,) = nodes(ir, Op.CONST)
    assert (scalar.shape, scalar.dtype, scalar.arg) == ((), "f32", "s")
    assert (const.shape, const.dtype, const.arg) == ((), ABSTRACT, 2.0)
    assert ir.results["y"].shape == ("T", "D")


# --------------------------------------------------------------------------- dtypes

@pytest.mark.parametrize("dtype", ["f32", "f16"])
def test_literal_adopts_its_operands_dtype(dtype):
    ir = ir_of(sig(f"h: {dtype}[T, D]", f"y: {dtype}[T, D]") + "    y = 2 * h + h / 3 - 1.5\n}\n")
    for n in toposort(ir.results.values()):
        if n.op == Op.CONST:
            assert n.dtype == ABSTRACT
        else:
            assert n.dtype == dtype, n


def test_literal_only_output_is_cast_to_the_declared_dtype():
    for dtype in ("f32", "f16", "i32", "u32"):
        y = result(sig("x: f32[T]", f"y: {dtype}[T]") + "    y = 1 + 2\n}\n")
        assert (y.op, y.dtype, y.arg) == (Op.CAST, dtype, dtype)
        assert y.srcs[0].dtype == ABSTRACT


@pytest.mark.parametrize("dtype", ["i32", "u32"])
def test_integer_literals_adopt_integer_dtypes(dtype):
    y = result(sig(f"i: {dtype}[T]", f"y: {dtype}[T]") + "    y = i * 3 + 1\n}\n")
    assert (y.op, y.dtype) == (Op.ADD, dtype)
    consts = [n for n in toposort([y]) if n.op == Op.CONST]
    assert sorted(c.arg for c in consts) == [1.0, 3.0]
    assert all(float(c.arg).is_integer() for c in consts)


def test_negative_literal_in_i32_context_is_folded():
    y = result(sig("i: i32[T]", "y: i32[T]") + "    y = i + (-4)\n}\n")
    lit = y.srcs[1]
    assert (lit.op, lit.arg) == (Op.CONST, -4.0)


def test_compound_literal_expression_in_integer_context_is_cast():
    y = result(sig("i: i32[T]", "y: i32[T]") + "    y = i * (2 + 1)\n}\n")
    factor = y.srcs[1]
    assert (factor.op, factor.dtype, factor.arg) == (Op.CAST, "i32", "i32")
    assert factor.srcs[0].op == Op.ADD and factor.srcs[0].dtype == ABSTRACT


@pytest.mark.parametrize("dtype", ["f32", "f16", "i32"])
def test_comparisons_yield_the_operand_dtype(dtype):
    ir = ir_of(sig(f"a: {dtype}[T, D], b: {dtype}[D]", f"lt: {dtype}[T, D], gt: {dtype}[T, D]")
               + "    lt = a < b\n    gt = a > 0\n}\n")
    for name, op in (("lt", Op.LT), ("gt", Op.GT)):
        n = ir.results[name]
        assert (n.op, n.dtype, n.shape) == (op, dtype, ("T", "D"))


def test_casts():
    ir = ir_of(sig("x: f32[T, D], h: f16[T, D]", "a: f16[T, D], b: f32[T, D], c: f32[T, D], d: i32[T, D]")
               + "    a = f16(x)\n    b = f32(h) * 2\n    c = f32(x)\n    d = i32(x * 10)\n}\n")
    a, b, c, d = (ir.results[n] for n in "abcd")
    assert (a.op, a.dtype, a.arg, a.srcs[0].dtype) == (Op.CAST, "f16", "f16", "f32")
    assert (b.op, b.dtype) == (Op.MUL, "f32") and b.srcs[0].op == Op.CAST
    assert c.op == Op.INPUT and c.arg == "x"           # a cast to the same dtype is no node
    assert (d.op, d.dtype, d.shape) == (Op.CAST, "i32", ("T", "D"))


@pytest.mark.parametrize("func, op", [("exp", Op.EXP), ("log", Op.LOG), ("sqrt", Op.SQRT), ("rsqrt", Op.RSQRT),
                                      ("abs", Op.ABS), ("sigmoid", Op.SIGMOID), ("silu", Op.SILU),
                                      ("tanh", Op.TANH), ("recip", Op.RECIP)])
def test_unary_functions_keep_shape_and_dtype(func, op):
    y = result(sig("h: f16[T, D]", "y: f16[T, D]") + f"    y = {func}(h)\n}}\n")
    assert (y.op, y.shape, y.dtype) == (op, ("T", "D"), "f16")


def test_integer_elementwise_ops():
    ir = ir_of(sig("i: i32[T], u: u32[T]", "a: i32[T], b: u32[T], c: i32[T]")
               + "    a = abs(-i)\n    b = max(u, 7)\n    c = where(i > 0, i, 0)\n}\n")
    assert [(ir.results[n].op, ir.results[n].dtype) for n in "abc"] == [
        (Op.ABS, "i32"), (Op.MAX, "u32"), (Op.WHERE, "i32")]


# --------------------------------------------------------------------------- signature and graph

def test_signature_and_axes():
    ir = ir_of("kernel k(x: f32[T, D, 3], w: f32[D, 3], ids: i32[T], eps: f32, beta: f32)"
               " -> (y: f32[T, D, 3], z: f16[T, 3]) {\n    y = x * w * eps\n    z = f16(sum(x, D)) + f16(beta)\n}\n")
    assert ir.name == "k"
    assert [t.name for t in ir.inputs] == ["x", "w", "ids"]
    assert ir.scalars == ("eps", "beta")
    assert [(t.name, t.dtype, t.shape) for t in ir.outputs] == [("y", "f32", ("T", "D", "3")), ("z", "f16", ("T", "3"))]
    assert ir.axes == ("T", "D", "3")
    assert ir.fixed_dims == {"3": 3}
    assert ir.filename == "t.lk" and ir.line == 1
    assert SEQ_AXIS == "T"


def test_equal_subexpressions_are_one_node():
    ir = ir_of(sig("x: f32[T, D]", "a: f32[T, D], b: f32[T, D]") + "    a = exp(x) * 2\n    b = exp(x) * 2\n}\n")
    assert ir.results["a"] is ir.results["b"]
    assert len(nodes(ir, Op.EXP)) == 1


def test_assignments_name_values_for_later_statements():
    ir = ir_of(sig("x: f32[T, D]", "y: f32[T, D], r: f32[T]")
               + "    s = sum(x, D)\n    r = s * 2\n    y = x / s\n}\n")
    (s,) = nodes(ir, Op.SUM)
    assert ir.results["r"].srcs[0] is s and ir.results["y"].srcs[1] is s


def test_outputs_may_feed_later_statements():
    ir = ir_of(sig("x: f32[T, D]", "m: f32[T], y: f32[T, D]") + "    m = max(x, D)\n    y = x - m\n}\n")
    assert ir.results["y"].srcs[1] is ir.results["m"]


# --------------------------------------------------------------------------- semantic errors

def D(s: str) -> str:
    return textwrap.dedent(s).lstrip("\n")


SEMANTIC_ERRORS = [
    ("unknown_name", D("""
        kernel k(x: f32[T, D]) -> (y: f32[T, D]) {
            y = x * scale
        }"""), 2, 13, "scale", "unknown name 'scale'", "a parameter or an earlier assignment: x"),
    ("use_before_assignment", D("""
        kernel k(x: f32[T, D]) -> (y: f32[T, D]) {
            y = x * a
            a = x
        }"""), 2, 13, "a", "unknown name 'a'", "an earlier assignment"),
    ("unknown_function", D("""
        kernel k(x: f32[T, D]) -> (y: f32[T, D]) {
            y = 2 * gelu(x)
        }"""), 2, 13, "gelu", "unknown function 'gelu'", "exp"),
    ("unary_arity", D("""
        kernel k(x: f32[T, D]) -> (y: f32[T, D]) {
            y = x + exp(x, x)
        }"""), 2, 13, "exp", "exp() takes 1 argument, got 2", "1 argument"),
    ("where_arity", D("""
        kernel k(x: f32[T, D]) -> (y: f32[T, D]) {
            y = where(x > 0, x)
        }"""), 2, 9, "where", "where() takes 3 arguments, got 2", "3 arguments"),
    ("cast_arity", D("""
        kernel k(x: f32[T, D]) -> (y: f32[T, D]) {
            y = f32()
        }"""), 2, 9, "f32", "f32() takes 1 argument, got 0", "1 argument"),
    ("reduction_without_axis", D("""
        kernel k(x: f32[T, D]) -> (y: f32[T]) {
            y = sum(x)
        }"""), 2, 9, "sum", "sum() needs a value and an axis name", "sum(value, AXIS)"),
    ("reduction_over_missing_axis", D("""
        kernel k(x: f32[T, D]) -> (y: f32[T]) {
            y = 1 + sum(x * 2, F)
        }"""), 2, 24, "F", "sum() over axis F, which f32[T, D] does not have", "an axis of the value: T, D"),
    ("reduction_over_reduced_axis", D("""
        kernel k(x: f32[T, D]) -> (y: f32[T]) {
            m = max(x, D)
            y = mean(m, D)
        }"""), 3, 17, "D", "mean() over axis D", "an axis of the value: T"),
    ("broadcast_order_mismatch", D("""
        kernel k(a: f32[D, F], b: f32[F, D]) -> (y: f32[D, F]) {
            y = 2 * a + b
        }"""), 2, 15, "+", "cannot broadcast add", "order"),
    ("broadcast_mismatch_in_where", D("""
        kernel k(c: f32[D, F], a: f32[F, D]) -> (y: f32[D, F]) {
            y = where(c, a, 0)
        }"""), 2, 9, "where", "cannot broadcast where", "order"),
    ("dtype_mismatch_f32_f16", D("""
        kernel k(x: f32[T, D], h: f16[T, D]) -> (y: f32[T, D]) {
            y = x * 2 - h
        }"""), 2, 15, "-", "dtype mismatch in sub: f32 and f16", "cast with f32(...)"),
    ("dtype_mismatch_scalar_f16", D("""
        kernel k(h: f16[T, D], s: f32) -> (y: f16[T, D]) {
            y = max(h, s)
        }"""), 2, 9, "max", "dtype mismatch in max: f16 and f32", "operands of one dtype"),
    ("dtype_mismatch_in_where", D("""
        kernel k(x: f32[T, D], i: i32[T, D]) -> (y: f32[T, D]) {
            y = where(x > 0, x, i)
        }"""), 2, 9, "where", "dtype mismatch in where: f32 and i32", "operands of one dtype"),
    ("output_wrong_shape", D("""
        kernel k(x: f32[T, D]) -> (y: f32[T]) {
            y = x * 2
        }"""), 2, 5, "y", "output 'y' is declared f32[T] but its value is f32[T, D]", "f32[T]"),
    ("output_wrong_dtype", D("""
        kernel k(x: f32[T, D]) -> (y: f16[T, D]) {
            y = x * 2
        }"""), 2, 5, "y", "output 'y' is declared f16 but its value is f32", "cast with f16(...)"),
    ("output_never_assigned", D("""
        kernel k(x: f32[T, D]) -> (y: f32[T, D], z: f32[T]) {
            y = x
        }"""), 1, 42, "z", "output 'z' is never assigned", "an assignment 'z = ...'"),
    ("output_is_scalar", D("""
        kernel k(x: f32[T, D]) -> (y: f32) {
            y = sum(sum(x, D), T)
        }"""), 1, 31, "f32", "output 'y' is a scalar", "outputs are tensors"),
    ("reassignment", D("""
        kernel k(x: f32[T, D]) -> (y: f32[T, D]) {
            a = x
            a = x * 2
            y = a
        }"""), 3, 5, "a", "'a' is already assigned", "values are assigned once"),
    ("output_assigned_twice", D("""
        kernel k(x: f32[T, D]) -> (y: f32[T, D]) {
            y = x
            y = x * 2
        }"""), 3, 5, "y", "'y' is already assigned", "a new name"),
    ("assign_to_parameter", D("""
        kernel k(x: f32[T, D], s: f32) -> (y: f32[T, D]) {
            s = 2
            y = x * s
        }"""), 2, 5, "s", "'s' is a parameter", "a new name"),
    ("duplicate_input", D("""
        kernel k(x: f32[T, D], w: f32[D], x: f32) -> (y: f32[T, D]) {
            y = x
        }"""), 1, 35, "x", "parameter 'x' is declared twice", "unique parameter names"),
    ("inout_with_other_type", D("""
        kernel k(x: f32[T, D]) -> (x: f32[T]) {
            x = 1
        }"""), 1, 28, "x", "in-place output 'x' is declared with another type than input 'x'",
     "the same dtype and shape for an updated parameter"),
    ("inout_assigned_twice", D("""
        kernel k(x: f32[T, D]) -> (x: f32[T, D]) {
            x = x + 1
            x = x * 2
        }"""), 3, 5, "x", "'x' is a parameter", "a new name (values are assigned once)"),
    ("shift_with_non_integer", D("""
        kernel k(x: f32[T, D]) -> (y: f32[T, D]) {
            y = x[T - 1.5, :]
        }"""), 2, 13, "-", "cannot subscript axis T with this expression",
     "':', an integer index, T - k / T + k with an integer k, or a window T - L / T + L over a new axis L"),
    ("subscript_wrong_arity", D("""
        kernel k(x: f32[T, D]) -> (y: f32[T, D]) {
            y = x[:]
        }"""), 2, 9, "x", "subscript has 1 item but the value is f32[T, D]", "one item per axis: ':', an index, or AXIS - k"),
    ("index_out_of_range", D("""
        kernel k(x: f32[T, 3, D]) -> (y: f32[T, D]) {
            y = x[:, 3, :]
        }"""), 2, 14, "3", "index 3 is out of range for axis 3 of size 3", "an index below 3"),
    ("intrinsic_result_count", D("""
        kernel k(q: f32[T, H, E], k: f32[T, G, E], v: f32[T, G, E]) -> (o: f32[T, H, E]) {
            o = causal_attention(q, k, v)
        }"""), 2, 9, "causal_attention", "causal_attention() returns 2 values (o, lse)",
     "an assignment of all of them: o, lse = causal_attention(...)"),
    ("seq_axis_not_leading", D("""
        kernel k(x: f32[T, D], w: f32[D, T]) -> (y: f32[T, D]) {
            y = x
        }"""), 1, 34, "T", "axis T of 'w' is not the leading axis", "T first"),
    ("duplicate_axis", D("""
        kernel k(x: f32[T, D, F, D]) -> (y: f32[T, D]) {
            y = x
        }"""), 1, 26, "D", "axis D appears twice in the type of 'x'", "each axis name once"),
    ("duplicate_integer_axis", D("""
        kernel k(x: f32[T, 3, 3]) -> (y: f32[T]) {
            y = x
        }"""), 1, 23, "3", "axis 3 appears twice", "each axis name once"),
    ("zero_size_axis", D("""
        kernel k(x: f32[T, 0]) -> (y: f32[T]) {
            y = x
        }"""), 1, 20, "0", "axis size 0 of 'x' is not positive", "a size >= 1"),
    ("non_f32_scalar", D("""
        kernel k(x: f32[T, D],
                 n: i32) -> (y: f32[T, D]) {
            y = x
        }"""), 2, 13, "i32", "scalar parameter 'n' has dtype i32", "f32"),
    ("f16_scalar", D("""
        kernel k(x: f16[T, D], s: f16) -> (y: f16[T, D]) {
            y = x * s
        }"""), 1, 27, "f16", "scalar parameter 's' has dtype f16", "f32"),
    ("number_out_of_range", D("""
        kernel k(x: f32[T, D]) -> (y: f32[T, D]) {
            y = x * 1e999
        }"""), 2, 13, "1e999", "number 1e999 is out of range", "a finite f32 value"),
    ("number_beyond_f32", D("""
        kernel k(x: f32[T, D]) -> (y: f32[T, D]) {
            y = x + 3.5e38
        }"""), 2, 13, "3.5e38", "number 3.5e38 is out of range", "a finite f32 value"),
    ("exp_of_i32", D("""
        kernel k(i: i32[T, D]) -> (y: f32[T, D]) {
            y = f32(exp(i))
        }"""), 2, 13, "exp", "exp needs a float operand, got i32", "an f32 or f16 operand"),
    ("sqrt_of_u32", D("""
        kernel k(u: u32[T, D]) -> (y: u32[T, D]) {
            y = sqrt(u)
        }"""), 2, 9, "sqrt", "sqrt needs a float operand, got u32", "an f32 or f16 operand"),
    ("pow_of_i32", D("""
        kernel k(i: i32[T, D]) -> (y: i32[T, D]) {
            y = i ** 2
        }"""), 2, 11, "**", "pow needs float operands, got i32", "f32 or f16 operands"),
    ("mean_of_i32", D("""
        kernel k(i: i32[T, D]) -> (y: i32[T]) {
            y = mean(i, D)
        }"""), 2, 9, "mean", "mean() needs a float value, got i32", "an f32 or f16 value"),
    ("negate_u32", D("""
        kernel k(u: u32[T, D]) -> (y: u32[T, D]) {
            y = u * -u
        }"""), 2, 13, "-", "cannot negate a u32 value", "a signed or float operand"),
    ("fractional_literal_with_i32", D("""
        kernel k(i: i32[T, D]) -> (y: i32[T, D]) {
            y = i * 1.5
        }"""), 2, 13, "1.5", "literal 1.5 is not representable as i32", "a whole number"),
    ("negative_literal_with_u32", D("""
        kernel k(u: u32[T, D]) -> (y: u32[T, D]) {
            y = u + (-1)
        }"""), 2, 14, "-", "literal -1 is not representable as u32", "a whole number in [0, 4294967295]"),
    ("literal_too_large_for_i32", D("""
        kernel k(i: i32[T, D]) -> (y: i32[T, D]) {
            y = where(i > 0, 3e9, i)
        }"""), 2, 22, "3e9", "literal 3000000000 is not representable as i32", "a whole number"),
    ("fractional_literal_into_int_output", D("""
        kernel k(i: i32[T, D]) -> (y: i32[T, D], z: i32[T]) {
            y = i
            z = 0.5
        }"""), 3, 9, "0.5", "literal 0.5 is not representable as i32", "a whole number"),
    ("duplicate_kernel_names", D("""
        kernel k(x: f32[T]) -> (y: f32[T]) {
            y = x
        }
        kernel other(x: f32[T]) -> (y: f32[T]) {
            y = x
        }
        kernel k(x: f32[T]) -> (y: f32[T]) {
            y = -x
        }"""), 7, 8, "k", "kernel 'k' is defined twice", "unique kernel names"),
    ("error_in_second_kernel", D("""
        kernel a(x: f32[T]) -> (y: f32[T]) {
            y = x
        }

        kernel b(x: f32[T]) -> (y: f32[T]) {
            y = x + q
        }"""), 6, 13, "q", "unknown name 'q'", "x"),
]


@pytest.mark.parametrize("case", SEMANTIC_ERRORS, ids=[c[0] for c in SEMANTIC_ERRORS])
def test_semantic_error(case):
    _, text, line, col, token, message, expected = case
    assert_dsl_error(text, line, col, token, message, expected)


def test_error_names_the_file_given():
    with pytest.raises(DslError) as info:
        compile_source(sig("x: f32[T, D]") + "    y = x + nope\n}\n", filename="kernels/my_norm.lk")
    assert str(info.value).startswith("kernels/my_norm.lk:2:13: unknown name 'nope'")


def test_error_in_a_tab_indented_line_keeps_the_caret_aligned():
    text = sig("x: f32[T, D]") + "\t\ty = x + nope\n}\n"
    with pytest.raises(DslError) as info:
        compile_source(text, "tabs.lk")
    err = info.value
    assert (err.line, err.column) == (2, 11)
    _, shown, caret = str(err).split("\n")[:3]
    assert shown[caret.index("^"):].startswith("nope")


# --------------------------------------------------------------------------- generated programs

AXES = ["T", "D", "F", "3"]
FUNCS1 = ["exp", "log", "sqrt", "rsqrt", "abs", "sigmoid", "silu", "tanh", "recip", "f32", "f16", "i32", "u32"]


@st.composite
def programs(draw):
    """Well-formed kernels over random signatures: they check or fail with DslError, nothing else."""
    names = []
    params = []
    for i in range(draw(st.integers(1, 4))):
        dtype = draw(st.sampled_from(["f32", "f32", "f32", "f16", "i32", "u32"]))
        axes = draw(st.lists(st.sampled_from(AXES), unique=True, max_size=3))
        if "T" in axes and draw(st.integers(0, 9)):   # mostly well-formed: T leads, scalars are f32
            axes.remove("T")
            axes.insert(0, "T")
        if not axes and draw(st.integers(0, 9)):
            dtype = "f32"
        name = f"p{i}"
        names.append(name)
        params.append(f"{name}: {dtype}" + (f"[{', '.join(axes)}]" if axes else ""))

    def expr(depth):
        choices = ["name", "num"] + (["bin", "neg", "call1", "call2", "red", "where"] if depth < 4 else [])
        kind = draw(st.sampled_from(choices))
        if kind == "name":
            return draw(st.sampled_from(names))
        if kind == "num":
            return draw(st.sampled_from(["0", "1", "2.5", "1e-3", "7", "3"]))
        if kind == "bin":
            op = draw(st.sampled_from(["+", "-", "*", "/", "**", "<", ">"]))
            return f"({expr(depth + 1)} {op} {expr(depth + 1)})"
        if kind == "neg":
            return f"-{expr(depth + 1)}"
        if kind == "call1":
            return f"{draw(st.sampled_from(FUNCS1))}({expr(depth + 1)})"
        if kind == "call2":
            return f"{draw(st.sampled_from(['max', 'min']))}({expr(depth + 1)}, {expr(depth + 1)})"
        if kind == "red":
            func, axis = draw(st.sampled_from(["sum", "max", "mean"])), draw(st.sampled_from(["T", "D", "F"]))
            return f"{func}({expr(depth + 1)}, {axis})"
        return f"where({expr(depth + 1)}, {expr(depth + 1)}, {expr(depth + 1)})"

    body = []
    for j in range(draw(st.integers(0, 3))):
        body.append(f"    v{j} = {expr(0)}")
        names.append(f"v{j}")
    out_dtype = draw(st.sampled_from(["f32", "f32", "f16", "i32", "u32"]))
    out_axes = draw(st.sampled_from([["T"], ["T", "D"], ["D"], ["T", "D", "F"], ["T", "3"]]))
    body.append(f"    y = {expr(0)}")
    return f"kernel g({', '.join(params)}) -> (y: {out_dtype}[{', '.join(out_axes)}]) {{\n" + "\n".join(body) + "\n}\n"


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(programs())
def test_generated_programs_check_or_raise_dsl_error(text):
    try:
        ir = ir_of(text)
    except DslError as e:
        assert e.line >= 1 and e.column >= 1 and e.expected, str(e)
        assert str(e).startswith("t.lk:")
        return
    (out,) = ir.outputs
    y = ir.results["y"]
    assert y.dtype == out.dtype
    assert all(a in out.shape for a in y.shape)
    for n in toposort(ir.results.values()):
        assert n.dtype in ("f32", "f16", "i32", "u32", ABSTRACT)
        if n.op in REDUCE:
            assert n.arg in n.srcs[0].shape and n.arg not in n.shape
            assert n.dtype in ("f32", "f16")
        if n.dtype in ("i32", "u32") and n.op != Op.CAST:   # literals met by integers are whole numbers
            assert all(float(s.arg).is_integer() for s in n.srcs if s.op == Op.CONST), n
            assert all(s.dtype != ABSTRACT or s.op == Op.CONST for s in n.srcs), n
        for s in n.srcs:   # every operand's axes appear in its consumer (reductions excepted)
            if n.op not in REDUCE:
                assert all(a in n.shape for a in s.shape), (n, s)
