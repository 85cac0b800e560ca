"""Language features that let one kernel serve what used to be forks: inputs with defaults, optional
leading axes, windows over a new axis and flip. Each checked against numpy float64 forward and,
where it has one, backward (against numpy's own derivative or the torch reference)."""
from __future__ import annotations

import numpy as np
import pytest

from numerics import rel_err
from dsl_errors import assert_dsl_error
from lfm2jit import compile_source, grad, library
from lfm2jit.ir.nodes import format_ir

TOL = 2e-5


def one(src: str):
    (k,) = list(compile_source(src))
    return k


def test_a_left_out_input_takes_its_default(engine, rng):
    k = one("kernel k(x: f32[T, D], b: f32[D] = 0.5, s: f32 = -2) -> (y: f32[T, D]) { y = s * x + b }")
    x = rng.standard_normal((7, 4)).astype(np.float32)
    b = rng.standard_normal(4).astype(np.float32)
    full = engine.run(k, bucket=4, x=engine.tensor(x), b=engine.tensor(b), s=3.0)["y"].numpy()
    bare = engine.run(k, bucket=4, x=engine.tensor(x))["y"].numpy()
    assert rel_err(full, 3.0 * x + b) < TOL and rel_err(bare, -2.0 * x + 0.5) < TOL
    # the default is folded in: the kernel that runs has no binding for b
    assert [t.name for t in k.without({"b", "s"}).ir.inputs] == ["x"]


def test_gradients_of_a_kernel_run_without_its_defaulted_input(engine, rng):
    k = one("kernel k(x: f32[T, D], b: f32[D] = 0) -> (y: f32[T, D]) { y = x * (x + b) }")
    bwd = grad(k, ["x"])
    x = rng.standard_normal((5, 3)).astype(np.float32)
    dy = rng.standard_normal((5, 3)).astype(np.float32)
    got = engine.run(bwd, bucket=4, x=engine.tensor(x), d_y=engine.tensor(dy))["d_x"].numpy()
    assert rel_err(got, dy * 2 * x) < TOL


def test_optional_leading_axes_may_be_left_out(engine, rng):
    k = one("kernel k(x: f32[B?, T, D]) -> (y: f32[B?, T, D], s: f32[B, D]) { y = x * 2.0\n s = sum(x, T) }")
    x = rng.standard_normal((6, 3)).astype(np.float32)
    out = engine.run(k, bucket=2, x=engine.tensor(x))
    assert out["y"].shape == (6, 3) and out["s"].shape == (1, 3)     # s does not mark B optional
    assert rel_err(out["y"].numpy(), 2 * x) < TOL and rel_err(out["s"].numpy(), x.sum(0)[None]) < TOL
    xb = rng.standard_normal((3, 6, 3)).astype(np.float32)
    out = engine.run(k, bucket=2, x=engine.tensor(xb))
    assert out["y"].shape == (3, 6, 3) and rel_err(out["s"].numpy(), xb.sum(1)) < TOL


def test_window_and_flip_are_a_causal_conv(engine, rng):
    k = one("kernel k(x: f32[T, D], w: f32[D, L]) -> (y: f32[T, D]) { y = sum(flip(w, L) * x[T - L, :], L) }")
    for taps in (1, 2, 5):
        x = rng.standard_normal((9, 4)).astype(np.float32)
        w = rng.standard_normal((4, taps)).astype(np.float32)
        y = engine.run(k, bucket=8, x=engine.tensor(x), w=engine.tensor(w))["y"].numpy()
        pad = np.concatenate([np.zeros((taps - 1, 4)), x])
        want = sum(w[:, j] * pad[j:j + 9] for j in range(taps))
        assert rel_err(y, want) < TOL


def test_a_window_reaching_ahead_stops_at_the_real_length(engine, rng):
    k = one("kernel k(x: f32[T], w: f32[L]) -> (y: f32[T]) { y = sum(w * x[T + L], L) }")
    x = rng.standard_normal(6).astype(np.float32)
    w = rng.standard_normal(3).astype(np.float32)
    y = engine.run(k, bucket=8, x=engine.tensor(x), w=engine.tensor(w))["y"].numpy()
    ext = np.concatenate([x, np.zeros(3)])
    assert rel_err(y, sum(w[j] * ext[j:j + 6] for j in range(3))) < TOL


def test_rmsnorm_eps_defaults_to_lfm2s(engine, rng):
    x = engine.tensor(rng.standard_normal((5, 8)).astype(np.float32))
    w = engine.tensor(rng.standard_normal(8).astype(np.float32))
    a = engine.run("rmsnorm", x=x, w=w)["y"].numpy()
    b = engine.run("rmsnorm", x=x, w=w, eps=1e-5)["y"].numpy()
    assert np.array_equal(a, b)
    assert library.get("rmsnorm").ir.defaults == {"eps": 1e-5}


@pytest.mark.parametrize("text,line,col,token,message,expected", [
    ("kernel k(x: f32[T, B?]) -> (y: f32[T]) {\n    y = x[:, 0]\n}", 1, 20, "B",
     "optional axis B of 'x' follows a required one", "optional axes (B?) first"),
    ("kernel k(x: f32[T?, D]) -> (y: f32[T, D]) {\n    y = x\n}", 1, 17, "T", "axis T of 'x' is optional",
     "T as a required axis"),
    ("kernel k(x: f32[T, D]) -> (y: f32[T, D] = 1) {\n    y = x\n}", 1, 28, "y", "output 'y' has a default",
     "defaults on inputs only"),
    ("kernel k(x: f32[T, D], i: i32[D] = 0.5) -> (y: f32[T, D]) {\n    y = x\n}", 1, 24, "i",
     "default 0.5 of 'i' is not representable as i32", "a whole number"),
    ("kernel k(x: f32[T, L]) -> (y: f32[T, L]) {\n    y = x[T - L, :]\n}", 2, 15, "L",
     "window axis L is already an axis of the value", "a new axis name"),
    ("kernel k(x: f32[T, D]) -> (y: f32[T, D]) {\n    y = flip(x, E)\n}", 2, 17, "E",
     "flip() along axis E, which f32[T, D] does not have", "an axis of the value"),
])
def test_feature_errors_are_located(text, line, col, token, message, expected):
    assert_dsl_error(text, line, col, token, message, expected)


@pytest.mark.parametrize("body,ref", [
    ("p = p[T - 1, :] + p", lambda p: np.concatenate([np.zeros((1, 4)), p[:-1]]) + p),      # reads another row
    ("p = p - mean(p, D)", lambda p: p - p.mean(1, keepdims=True)),                        # a reduction
    ("p = p * sum(p * p, T)", lambda p: p * (p * p).sum(0)),                               # over T: two parts
    ("p = p * 2.0 + 1.0", lambda p: 2 * p + 1),                                            # one pass, no copy
])
def test_in_place_updates_read_the_old_values(engine, rng, body, ref):
    k = one(f"kernel k(p: f32[T, D]) -> (p: f32[T, D]) {{ {body} }}")
    p0 = rng.standard_normal((6, 4)).astype(np.float32)
    p = engine.tensor(p0)
    out = engine.run(k, bucket=4, p=p)["p"]
    assert out is p and rel_err(p.numpy(), ref(p0.astype(np.float64))) < TOL
    assert (len(k.kernels) == 1) == (body == "p = p * 2.0 + 1.0")


# operator -> (the default that leaves the other operand, whether it does so on the left too, numpy's op)
IDENTITY_CASES = {"+": (0.0, True, np.add), "-": (0.0, False, np.subtract), "*": (1.0, True, np.multiply),
                  "/": (1.0, False, np.divide)}


@pytest.mark.parametrize("seed", range(10))
def test_a_default_that_is_an_identity_folds_away(engine, rng, seed):
    """x + 0, 0 + x, x - 0, x * 1, 1 * x and x / 1 from a left-out input leave no arithmetic on
    the default behind (no literal in the IR), while 0 - x and 1 / x stay; either way the kernel
    computes the expression (float64 reference). Drawn chains of ops, the defaults on either side,
    over inputs of fewer axes than the output (a folded node must then repeat its operand)."""
    draw = np.random.default_rng(seed)
    ins, body, kept = [], "x", False
    x = rng.uniform(0.5, 2.0, (6, 5)).astype(np.float32)
    want = x.astype(np.float64)
    for i in range(int(draw.integers(1, 5))):
        op = list(IDENTITY_CASES)[int(draw.integers(len(IDENTITY_CASES)))]
        neutral, either_side, np_op = IDENTITY_CASES[op]
        shape = ["f32[D]", "f32[T, D]", "f32"][int(draw.integers(3))]
        ins.append(f"b{i}: {shape} = {neutral:g}")
        if draw.random() < 0.5:
            body, want, kept = f"(b{i} {op} {body})", np_op(neutral, want), kept or not either_side
        else:
            body, want = f"({body} {op} b{i})", np_op(want, neutral)
    src = f"kernel k(x: f32[T, D], {', '.join(ins)}) -> (y: f32[T, D]) {{ y = tanh({body}) }}"
    k = one(src)
    bare = k.without({f"b{i}" for i in range(len(ins))})
    assert ("const" in format_ir(bare.ir)) == kept, src
    y = engine.run(k, bucket=4, x=engine.tensor(x))["y"].numpy()
    assert rel_err(y, np.tanh(want)) < TOL, src


def test_an_identity_on_a_lower_rank_operand_repeats_it():
    """y[T, D] = x[T] + b with b left out is x repeated over D, not x with the wrong shape."""
    k = one("kernel k(x: f32[T], b: f32[T, D] = 0) -> (y: f32[T, D]) { y = x + b }")
    (y,) = k.without({"b"}).ir.results.values()
    assert y.op.name == "BROADCAST" and y.shape == ("T", "D") and y.srcs[0].op.name == "INPUT"


def test_a_sum_of_literals_chosen_by_where_counts_in_f32(engine, rng):
    """where(c, 1.0, 0.0) has no dtype of its own (both branches are literals); summed, it counts in
    f32, here the ids at or below each e over the real rows only (the MoE experts' slot ends)."""
    k = one("kernel k(idx: i32[T, K]) -> (ends: i32[E]) { ends = i32(sum(sum(where(idx < index(E) + 1, 1.0, 0.0), K), T)) }")
    for t in (1, 7, 21):
        idx = rng.integers(0, 5, (t, 3)).astype(np.int32)
        got = engine.run(k, bucket=8, dims={"E": 5}, idx=engine.tensor(idx))["ends"].numpy()
        np.testing.assert_array_equal(got, np.cumsum(np.bincount(idx.ravel(), minlength=5)))


@pytest.mark.parametrize("name", ["std", "var", "let", "select", "info", "main"])
def test_a_scalar_or_tensor_may_be_named_like_a_wgsl_keyword_or_builtin(engine, rng, name):
    """Runtime scalars live in the Info uniform and tensors in bindings, both under suffixed WGSL
    names, so a kernel's own names never collide with WGSL's (``std`` once rendered a struct field
    that Tint and naga refuse)."""
    k = one(f"kernel k(x: f32[T, D], {name}: f32) -> (y: f32[T, D]) {{ y = x * {name} }}")
    x = rng.standard_normal((5, 3)).astype(np.float32)
    assert rel_err(engine.run(k, bucket=4, x=engine.tensor(x), **{name: 1.5})["y"].numpy(), 1.5 * x) < TOL
    t = one(f"kernel t({name}: f32[T, D]) -> (y: f32[T, D]) {{ y = {name} + 1.0 }}")
    assert rel_err(engine.run(t, bucket=4, **{name: engine.tensor(x)})["y"].numpy(), x + 1.0) < TOL
