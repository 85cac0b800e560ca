"""The DSL front end: grammar, AST, round-tripping, located errors, and robustness on any input.

Valid programs must survive parse -> unparse -> parse unchanged (modulo locations). Invalid ones must
raise the one DslError, naming file:line:col of the offending token, the line with a caret, and what
was expected. Arbitrary text never escapes as any other exception.
"""
from __future__ import annotations

import dataclasses
import sys
import textwrap
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import lfm2jit
from lfm2jit import DslError, compile_source
from lfm2jit.dsl import ast
from lfm2jit.dsl.parser import MAX_EXPR_DEPTH, parse
from dsl_errors import assert_dsl_error

KERNEL_DIR = Path(lfm2jit.__file__).parent / "ops" / "kernels"
SHIPPED = sorted(KERNEL_DIR.glob("*.lk"))
CORPUS = sorted((Path(__file__).resolve().parents[1] / "dsl_corpus" / "valid").glob("*.lk"))
NOLOC = ast.Loc(0, 0)


def strip(x):
    """A copy of an AST with every location zeroed, for comparing trees modulo positions."""
    if isinstance(x, ast.Loc):
        return NOLOC
    if dataclasses.is_dataclass(x) and not isinstance(x, type):
        return type(x)(**{f.name: strip(getattr(x, f.name)) for f in dataclasses.fields(x)})
    if isinstance(x, tuple):
        return tuple(strip(i) for i in x)
    return x


def roundtrip(text: str, filename: str = "<rt>") -> None:
    first = parse(text, filename)
    again_text = ast.unparse(first)
    again = parse(again_text, filename)
    assert strip(again.kernels) == strip(first.kernels)
    # unparse is a fixed point after one step: its own output prints identically
    assert ast.unparse(again) == again_text


def read(path: Path) -> str:
    return path.read_bytes().decode("utf-8")   # keep \r\n as written


# --------------------------------------------------------------------------- valid programs

def test_corpus_is_present():
    assert len(SHIPPED) >= 2, "the shipped kernels should be found next to the package"
    assert len(CORPUS) >= 5


@pytest.mark.parametrize("path", SHIPPED + CORPUS, ids=lambda p: p.name)
def test_valid_file_roundtrips_and_compiles(path):
    text = read(path)
    roundtrip(text, path.name)
    module = compile_source(text, path.name)
    assert len(module) == len(parse(text).kernels)


HAND_WRITTEN = {
    "minimal": "kernel k(x: f32[T]) -> (y: f32[T]) { y = x }",
    "no_inputs": "kernel k() -> (y: f32[T]) { y = 1 }",
    "comments": textwrap.dedent("""\
        # leading comment
        kernel k(x: f32[T]) # after the inputs
            -> (y: f32[T])  # after the outputs
        {   # after the brace
            y = x  # after a statement
            # before the brace
        }   # trailing
        # end"""),
    "trailing_commas": "kernel k(x: f32[T, D], w: f32[D],) -> (y: f32[T, D],) { y = max(x, w,) }",
    "scientific": "kernel k(x: f32[T]) -> (y: f32[T]) { y = x * 1e-5 + 2.5E+3 - .5 * 3. + 1.e2 / 6.02e23 }",
    "nested_calls": "kernel k(x: f32[T]) -> (y: f32[T]) { y = exp(log(sqrt(abs(sigmoid(tanh(x)))))) }",
    "unary_minus": "kernel k(x: f32[T]) -> (y: f32[T]) { y = -x * --x - -(-x) + 2 * -x }",
    "power": "kernel k(x: f32[T]) -> (y: f32[T]) { y = x ** 2 + x ** -1 + 2 ** x ** 3 + -x ** 2 }",
    "comparisons": "kernel k(x: f32[T], z: f32[T]) -> (y: f32[T], c: f32[T]) { y = x < z  c = (x + 1) > z * 2 }",
    "where": "kernel k(x: f32[T, D]) -> (y: f32[T, D]) { y = where(x > 0, x, 0.01 * x) }",
    "casts": "kernel k(h: f16[T, D]) -> (y: f32[T, D], g: f16[T, D]) { y = f32(h) * 2  g = f16(y) }",
    "integer_dims": "kernel k(x: f32[D, 3], b: f32[3]) -> (y: f32[D, 3]) { y = x + b }",
    "reductions": "kernel k(x: f32[T, D]) -> (s: f32[T], m: f32[T], a: f32[T]) "
                  "{ s = sum(x, D) m = max(x, D) a = mean(x, D) }",
    "int_types": "kernel k(i: i32[T], u: u32[T]) -> (a: i32[T], b: u32[T]) { a = abs(-i) + 1  b = u * 3 }",
    "two_kernels": "kernel a(x: f32[T]) -> (y: f32[T]) { y = x }\nkernel b(x: f32[T]) -> (y: f32[T]) { y = -x }",
    "empty": "",
    "only_comments": "# nothing\n   # here\n",
    "keyword_like_names": "kernel k(kernel: f32[T], f32x: f32) -> (y: f32[T]) { f16 = kernel * f32x  y = f16 }",
    "deep_parens": "kernel k(x: f32[T]) -> (y: f32[T]) { y = " + "(" * 3000 + "x" + ")" * 3000 + " }",
    f"depth_{MAX_EXPR_DEPTH}": "kernel k(x: f32[T]) -> (y: f32[T]) { y = " + "-" * (MAX_EXPR_DEPTH - 1) + "x }",
}


@pytest.mark.parametrize("name", sorted(HAND_WRITTEN))
def test_hand_written_valid_program(name):
    text = HAND_WRITTEN[name]
    roundtrip(text)
    compile_source(text, f"{name}.lk")


def test_ast_structure_and_precedence():
    src = parse("kernel k(x: f32[T, D], s: f32) -> (y: f32[T, D]) {\n"
                "  y = -x ** 2 * s + 1 < 3 - x\n"
                "}\n")
    (k,) = src.kernels
    E = strip
    V = lambda n: ast.Var(n, NOLOC)           # noqa: E731
    N = lambda t: ast.Number(float(t), t, NOLOC)  # noqa: E731
    B = lambda op, a, b: ast.BinOp(op, a, b, NOLOC)  # noqa: E731
    want = B("lt", B("add", B("mul", ast.Neg(B("pow", V("x"), N("2")), NOLOC), V("s")), N("1")),
             B("sub", N("3"), V("x")))
    assert E(k.body[0].value) == want
    # ** is right-associative and takes a signed exponent
    (k,) = parse("kernel k(x: f32[T]) -> (y: f32[T]) { y = 2 ** x ** -3 }").kernels
    assert E(k.body[0].value) == B("pow", N("2"), B("pow", V("x"), ast.Neg(N("3"), NOLOC)))
    # - and / associate to the left
    (k,) = parse("kernel k(x: f32[T]) -> (y: f32[T]) { y = x - 1 - 2 / x / 4 }").kernels
    assert E(k.body[0].value) == B("sub", B("sub", V("x"), N("1")), B("div", B("div", N("2"), V("x")), N("4")))


def test_signature_ast():
    (k,) = parse("kernel k(x: f32[T, D], w: f32[D, 3], eps: f32) -> (y: f16[T, D]) { y = f16(x) }").kernels
    assert k.name == "k"
    assert [(p.name, p.type.dtype, p.type.dims) for p in k.inputs] == [
        ("x", "f32", ("T", "D")), ("w", "f32", ("D", 3)), ("eps", "f32", ())]
    assert [(p.name, p.type.dtype, p.type.dims) for p in k.outputs] == [("y", "f16", ("T", "D"))]
    assert isinstance(k.inputs[1].type.dims[1], int)


def test_number_literals_keep_text_and_value():
    (k,) = parse("kernel k(x: f32[T]) -> (y: f32[T]) { y = 1e-5 + 2.5E+3 + .5 + 3. + 007 }").kernels
    nums = []
    stack = [k.body[0].value]
    while stack:
        e = stack.pop()
        if isinstance(e, ast.Number):
            nums.append((e.text, e.value))
        elif isinstance(e, ast.BinOp):
            stack += [e.rhs, e.lhs]
    assert nums == [("1e-5", 1e-5), ("2.5E+3", 2500.0), (".5", 0.5), ("3.", 3.0), ("007", 7.0)]


def test_locations_point_at_tokens():
    text = textwrap.dedent("""\
        kernel k(x: f32[T, D],
                 s: f32) -> (y: f32[T, D]) {
            a = -x * s
            y = exp(a) + (x - 2.5)
        }
        """)
    (k,) = parse(text).kernels
    L = ast.Loc
    assert k.loc == L(1, 8)
    x, s = k.inputs
    assert (x.loc, x.type.loc, x.type.dim_locs) == (L(1, 10), L(1, 13), (L(1, 17), L(1, 20)))
    assert (s.loc, s.type.loc, s.type.dim_locs) == (L(2, 10), L(2, 13), ())
    assert k.outputs[0].loc == L(2, 22)
    a, y = k.body
    assert a.loc == L(3, 5)
    mul = a.value
    assert mul.loc == L(3, 12)                 # a binary operation is located at its operator
    assert mul.lhs.loc == L(3, 9)              # the unary minus
    assert mul.lhs.operand.loc == L(3, 10)
    assert mul.rhs.loc == L(3, 14)
    add = y.value
    assert add.loc == L(4, 16)
    assert add.lhs.loc == L(4, 9)              # a call is located at its function name
    assert add.lhs.args[0].loc == L(4, 13)
    sub = add.rhs
    assert sub.loc == L(4, 21)
    assert sub.rhs.loc == L(4, 23) and sub.rhs.text == "2.5"


def test_unparse_is_fully_parenthesised():
    src = parse("kernel k(x: f32[T]) -> (y: f32[T]) { y = -x ** 2 * 3 + 1 }")
    assert "y = (((-(x ** 2)) * 3) + 1)" in ast.unparse(src)


# --------------------------------------------------------------------------- generated round trips

NAMES = ["x", "y", "w", "eps", "T", "D", "f32", "kernel", "exp", "a_1"]
NUMBER_TEXTS = ["0", "1", "2.5", "1e-5", ".5", "3.", "6.02E+23", "007", "1e999"]
FUNCS = ["exp", "max", "sum", "where", "f32", "f16", "foo", "mean"]
BINOPS = ["add", "sub", "mul", "div", "pow", "lt", "gt"]

leaves = st.one_of(st.sampled_from(NAMES).map(lambda n: ast.Var(n, NOLOC)),
                   st.sampled_from(NUMBER_TEXTS).map(lambda t: ast.Number(float(t), t, NOLOC)))
exprs = st.recursive(leaves, lambda sub: st.one_of(
    st.builds(lambda op, a, b: ast.BinOp(op, a, b, NOLOC), st.sampled_from(BINOPS), sub, sub),
    st.builds(lambda a: ast.Neg(a, NOLOC), sub),
    st.builds(lambda f, args: ast.Call(f, tuple(args), NOLOC), st.sampled_from(FUNCS),
              st.lists(sub, max_size=3))), max_leaves=25)
dims = st.lists(st.one_of(st.sampled_from(["T", "D", "F"]), st.integers(1, 4096)), max_size=3).map(tuple)
types = st.builds(lambda d, ds: ast.TypeSpec(d, ds, NOLOC, (NOLOC,) * len(ds)),
                  st.sampled_from(["f32", "f16", "i32", "u32"]), dims)
params = st.lists(st.builds(lambda n, t: ast.Param(n, t, NOLOC), st.sampled_from(NAMES), types), max_size=3)
kernels = st.builds(
    lambda n, ins, outs, body: ast.KernelDef(n, tuple(ins), tuple(outs), tuple(body), NOLOC),
    st.sampled_from(["k", "rmsnorm", "f32", "kernel_2"]), params, params.filter(bool),
    st.lists(st.builds(lambda t, v: ast.Assign((t,), v, NOLOC), st.sampled_from(NAMES), exprs), max_size=4))


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(kernels, max_size=3))
def test_generated_ast_roundtrips(ks):
    src = ast.SourceFile("<gen>", "", tuple(ks))
    text = ast.unparse(src)
    back = parse(text, "<gen>")
    assert strip(back.kernels) == strip(src.kernels)


# --------------------------------------------------------------------------- syntax errors

SIG = "kernel k(x: f32[T, D], s: f32) -> (y: f32[T, D]) {"

# (name, source, line, column, token at that position, message fragment, expected fragment)
SYNTAX_ERRORS = [
    ("missing_arrow", "kernel k(x: f32[T]) (y: f32[T]) {\n    y = x\n}\n",
     1, 21, "(", "unexpected '('", "'->'"),
    ("missing_close_brace", f"{SIG}\n    y = x\n",
     2, 10, "", "unexpected end of input", "'}'"),
    ("unclosed_paren", f"{SIG}\n    y = (x + 1\n}}\n",
     3, 1, "}", "unexpected '}'", "')'"),
    ("stray_close_paren", f"{SIG}\n    y = x + 1)\n}}\n",
     2, 14, ")", "unexpected ')'", "'}'"),
    ("bad_character", f"{SIG}\n    y = x $ 2\n}}\n",
     2, 11, "$", "unexpected character '$'", "'+'"),
    ("semicolon", f"{SIG}\n    y = x;\n}}\n",
     2, 10, ";", "unexpected character ';'", "'}'"),
    ("non_ascii_name", f"{SIG}\n    y = é + x\n}}\n",
     2, 9, "é", "unexpected character 'é'", "a name"),
    ("nul_byte", f"{SIG}\n    y = x\x00\n}}\n",
     2, 10, "\x00", "unexpected character '\\x00'", "'}'"),
    ("missing_dtype", "kernel k(x: [T]) -> (y: f32[T]) {\n    y = x\n}\n",
     1, 13, "[", "unexpected '['", "a dtype"),
    ("unknown_dtype", "kernel k(x: f64[T]) -> (y: f32[T]) {\n    y = x\n}\n",
     1, 13, "f64", "unexpected name 'f64'", "a dtype"),
    ("dtype_prefix_is_a_name", "kernel k(x: f32x[T]) -> (y: f32[T]) {\n    y = x\n}\n",
     1, 13, "f32x", "unexpected name 'f32x'", "a dtype"),
    ("empty_shape", "kernel k(x: f32[]) -> (y: f32[T]) {\n    y = x\n}\n",
     1, 17, "]", "unexpected ']'", "a name, an integer"),
    ("fractional_dim", "kernel k(x: f32[T, 2.5]) -> (y: f32[T]) {\n    y = x\n}\n",
     1, 21, ".5", "unexpected number '.5'", "']'"),
    ("negative_dim", "kernel k(x: f32[T, -3]) -> (y: f32[T]) {\n    y = x\n}\n",
     1, 20, "-", "unexpected '-'", "an integer"),
    ("double_comma", "kernel k(x: f32[T],, z: f32[T]) -> (y: f32[T]) {\n    y = x\n}\n",
     1, 20, ",", "unexpected ','", "a name"),
    ("no_outputs", "kernel k(x: f32[T]) -> () {\n}\n",
     1, 25, ")", "unexpected ')'", "a name"),
    ("param_without_type", "kernel k(x) -> (y: f32[T]) {\n    y = x\n}\n",
     1, 11, ")", "unexpected ')'", "':'"),
    ("keyword_typo", "kernal k(x: f32[T]) -> (y: f32[T]) {\n    y = x\n}\n",
     1, 1, "kernal", "unexpected name 'kernal'", "'kernel'"),
    ("missing_kernel_name", "kernel (x: f32[T]) -> (y: f32[T]) {\n    y = x\n}\n",
     1, 8, "(", "unexpected '('", "a name"),
    ("statement_without_equals", f"{SIG}\n    y x\n}}\n",
     2, 7, "x", "unexpected name 'x'", "'='"),
    ("assign_to_call", f"{SIG}\n    exp(y) = x\n}}\n",
     2, 8, "(", "unexpected '('", "'='"),
    ("trailing_operator", f"{SIG}\n    y = x +\n}}\n",
     3, 1, "}", "unexpected '}'", "a number"),
    ("double_operator", f"{SIG}\n    y = x ** * 2\n}}\n",
     2, 14, "*", "unexpected '*'", "'('"),
    ("chained_comparison", f"{SIG}\n    y = x < s < 1\n}}\n",
     2, 15, "<", "unexpected '<'", "'}'"),
    ("empty_argument", f"{SIG}\n    y = max(x, , s)\n}}\n",
     2, 16, ",", "unexpected ','", "a name"),
    ("two_dots", f"{SIG}\n    y = x * 1.2.3\n}}\n",
     2, 16, ".3", "unexpected number '.3'", "'}'"),
    ("stray_brace_after_kernel", f"{SIG}\n    y = x\n}}\n}}\n",
     4, 1, "}", "unexpected '}'", "'kernel'"),
    ("only_keyword", "kernel", 1, 7, "", "unexpected end of input", "a name"),
    ("axis_size_too_large", "kernel k(x: f32[T, 99999999999]) -> (y: f32[T]) {\n    y = x\n}\n",
     1, 20, "99999999999", "axis size 99999999999 is too large", "at most 2147483647"),
    ("axis_size_beyond_int_conversion", "kernel k(x: f32[T, " + "9" * 5000 + "]) -> (y: f32[T]) {}",
     1, 20, "9999", "is too large", "at most"),
    ("crlf_line_counting", f"{SIG}\r\n    y = x\r\n    z = x +\r\n}}\r\n",
     4, 1, "}", "unexpected '}'", "a name"),
    ("formfeed_is_not_a_newline", f"{SIG}\n\x0c    y = x $\n}}\n",
     2, 12, "$", "unexpected character '$'", "'}'"),
]


@pytest.mark.parametrize("case", SYNTAX_ERRORS, ids=[c[0] for c in SYNTAX_ERRORS])
def test_syntax_error(case):
    _, text, line, col, token, message, expected = case
    assert_dsl_error(text, line, col, token, message, expected)


def test_parse_alone_raises_located_dsl_error():
    with pytest.raises(DslError) as info:
        parse("kernel k(x: f32[T]) -> (y: f32[T]) {\n    y = x +\n}", filename="direct.lk")
    assert (info.value.line, info.value.column) == (3, 1)
    assert str(info.value).startswith("direct.lk:3:1: ")


def test_parse_rejects_non_text():
    with pytest.raises(TypeError):
        parse(b"kernel")  # type: ignore[arg-type]


def test_error_excerpt_of_a_very_long_line_keeps_the_caret_on_the_token():
    n = MAX_EXPR_DEPTH - 50
    text = f"{SIG}\n    y = x" + " + x" * n + " + zz" + " + x" * 40 + "\n}\n"
    err = assert_dsl_error(text, 2, 10 + 4 * n + 3, "zz", "unknown name 'zz'", "a parameter", "long.lk")
    _, shown, caret = str(err).split("\n")[:3]
    assert len(shown) < 120 and shown.startswith("    ...") and shown.endswith("...")


# --------------------------------------------------------------------------- deep nesting

DEEP = 5000


@pytest.mark.parametrize("body", [
    "(" * DEEP + "x" + ")" * DEEP,                      # parentheses alone add no depth
], ids=["parens"])
def test_deep_parentheses_compile(body):
    compile_source(f"{SIG}\n    y = {body}\n}}\n")


@pytest.mark.parametrize("body", [
    "-" * DEEP + "x",
    "exp(" * DEEP + "x" + ")" * DEEP,
    "x" + " + x" * DEEP,
    "x" + " ** x" * DEEP,
    "(" * DEEP + "x + 1)" + " * 2)" * (DEEP - 1),
    "max(" * DEEP + "x" + ", s)" * DEEP,
    "sum(" * DEEP + "x" + ", D)" * DEEP,
], ids=["neg", "calls", "sum_chain", "pow_chain", "nested_binops", "binary_calls", "reductions"])
def test_deep_expressions_are_located_dsl_errors(body):
    text = f"{SIG}\n    y = {body}\n}}\n"
    with pytest.raises(DslError) as info:
        compile_source(text, "deep.lk")
    err = info.value
    assert f"nested more than {MAX_EXPR_DEPTH} levels" in err.message
    assert err.line == 2 and err.column > 8
    assert "split it into several assignments" in err.expected


@pytest.mark.parametrize("text", [
    "(" * 100_000,
    f"{SIG}\n    y = " + "(" * 100_000 + "\n}\n",
    f"{SIG}\n    y = " + "exp(" * 20_000 + "\n}\n",
    f"{SIG}\n    y = x" + ")" * 10_000 + "\n}\n",
    "[" * 10_000,
])
def test_unbalanced_deep_input_is_a_dsl_error(text):
    with pytest.raises(DslError):
        compile_source(text)


def test_depth_limit_does_not_depend_on_the_recursion_limit():
    text = f"{SIG}\n    y = " + "-" * (MAX_EXPR_DEPTH - 1) + "x\n}\n"
    old = sys.getrecursionlimit()
    sys.setrecursionlimit(max(old, 1000))
    try:
        compile_source(text)
    finally:
        sys.setrecursionlimit(old)


# --------------------------------------------------------------------------- fuzzing

def compiles_or_dsl_error(text: str) -> None:
    try:
        compile_source(text, "fuzz.lk")
    except DslError as e:
        msg = str(e)                          # formatting never fails either
        assert msg.startswith("fuzz.lk:")
        assert e.line >= 1 and e.column >= 1, msg


FUZZ = settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])


@FUZZ
@given(st.text(alphabet=st.characters(codec="utf-8"), max_size=200))
def test_fuzz_random_text(text):
    compiles_or_dsl_error(text)


@FUZZ
@given(st.text(alphabet="kernel(x:f32[T,D])->{y=exp}+-*/<>#\n 0123.5e", max_size=200))
def test_fuzz_random_text_from_the_grammar_alphabet(text):
    compiles_or_dsl_error(text)


TOKENS = (["kernel", "kernel", "->", "(", ")", "[", "]", "{", "}", ",", ":", "=", "+", "-", "*", "/", "**",
           "<", ">", "# comment\n", "f32", "f16", "i32", "u32", "T", "D", "F", "x", "y", "w", "s", "eps",
           "exp", "log", "sqrt", "sum", "max", "mean", "min", "where", "silu", "foo", "0", "1", "3", "2.5",
           ".5", "1e-5", "1e999", "99999999999", "\t", "\r\n", "\x00", "é", "$"])


@FUZZ
@given(st.lists(st.tuples(st.sampled_from(TOKENS), st.sampled_from([" ", "\n", "", "  "])), max_size=60))
def test_fuzz_token_sequences(pairs):
    compiles_or_dsl_error("".join(tok + sep for tok, sep in pairs))


@FUZZ
@given(st.lists(st.sampled_from(TOKENS), max_size=40), st.integers(0, 3))
def test_fuzz_tokens_inside_a_kernel_body(toks, where):
    """Token soup placed where it gets furthest: inside a valid signature and body."""
    soup = " ".join(toks)
    parts = [f"{SIG}\n    a = x * s\n", "    y = ", soup, "\n}\n"]
    parts.insert(where, soup)
    compiles_or_dsl_error("".join(parts))
