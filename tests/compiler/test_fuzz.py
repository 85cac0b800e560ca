"""The differential fuzzer (tests/fuzz): its own reference, its regression corpus, a fixed-seed batch.

The corpus (tests/fuzz/cases) holds one shrunk case per cause of every failure the fuzzer found;
each must now pass, as must a fixed-seed batch of generated kernels. A long run is
``python -m tests.fuzz 5000 --seed S``.

Run: PYTHONPATH=. python -m pytest -q tests/compiler/test_fuzz.py   (about 30 s on lavapipe, 2 CPU cores, with a
cold WGSL cache; about 10 s warm)
"""
from __future__ import annotations

import collections
import time

import numpy as np
import pytest

from tests.fuzz import FAILING, Runner, case_from_text, corpus, generate
from tests.fuzz.cli import case_seed, causes_table, counts_table, features_table
from tests.fuzz.expr import (Checker, Evaluator, ModelError, check, kernel_text, left_out_axes, merge, parse,
                               passed_shape, returned_shape)
from tests.fuzz.generate import Case, features
from tests.fuzz.shrink import failure_of, shrink

BATCH_SEED = 0
BATCH_SIZE = 200      # each kernel compiles new pipelines; long runs: python -m tests.fuzz N --seed S

@pytest.fixture(scope="module")
def runner(ctx) -> Runner:
    return Runner(ctx)


# ---------------------------------------------------------------- the fuzzer's own model
def test_merge_follows_the_documented_rule():
    assert merge(("T", "K"), ("N", "K")) == ("T", "N", "K")        # x[T, K] * w[N, K] is [T, N, K]
    assert merge(("T", "N"), ("T", "K")) == ("T", "N", "K")
    assert merge(("N", "K"), ("T", "K")) == ("N", "T", "K")
    assert merge(("T", "D"), ("D",)) == ("T", "D")
    assert merge((), ("D",)) == ("D",)
    assert merge(("N", "K"), ("K", "N")) is None


def _eval(src: str, sizes: dict, inputs: dict) -> dict:
    (k,) = parse(src)
    c = check(k)
    return Evaluator(k, c, sizes).run(inputs)


def test_reference_rmsnorm_softmax_linear():
    rng = np.random.default_rng(0)
    x = rng.standard_normal((5, 7))
    w = rng.standard_normal(7)
    out = _eval("kernel k(x: f32[T, D], w: f32[D], eps: f32) -> (y: f32[T, D]) {\n"
                "  inv = rsqrt(mean(x * x, D) + eps)\n  y = x * inv * w\n}", {"T": 5, "D": 7},
                {"x": x, "w": w, "eps": 1e-6})
    np.testing.assert_allclose(out["y"], x / np.sqrt((x * x).mean(-1, keepdims=True) + 1e-6) * w, rtol=1e-12)
    out = _eval("kernel k(x: f32[T, D]) -> (y: f32[T, D], lse: f32[T]) {\n m = max(x, D)\n e = exp(x - m)\n"
                " s = sum(e, D)\n y = e / s\n lse = m + log(s)\n}", {"T": 5, "D": 7}, {"x": x})
    np.testing.assert_allclose(out["y"], np.exp(x) / np.exp(x).sum(-1, keepdims=True), rtol=1e-12)
    np.testing.assert_allclose(out["lse"], np.log(np.exp(x).sum(-1)), rtol=1e-12)
    wt = rng.standard_normal((3, 7))
    out = _eval("kernel k(x: f32[T, K], w: f32[N, K]) -> (y: f32[T, N]) { y = sum(x * w, K) }",
                {"T": 5, "K": 7, "N": 3}, {"x": x, "w": wt})
    np.testing.assert_allclose(out["y"], x @ wt.T, rtol=1e-12)


def test_reference_shifts_takes_and_stack():
    rng = np.random.default_rng(1)
    bcx = rng.standard_normal((6, 3, 4))
    w = rng.standard_normal((4, 3))
    out = _eval("kernel k(bcx: f32[T, 3, D], w: f32[D, 3]) -> (y: f32[T, D]) {\n"
                "  bx = bcx[:, 0, :] * bcx[:, 2, :]\n"
                "  conv = w[:, 0] * bx[T - 2, :] + w[:, 1] * bx[T - 1, :] + w[:, 2] * bx\n"
                "  y = bcx[:, 1, :] * conv\n}", {"T": 6, "D": 4}, {"bcx": bcx, "w": w})
    bx = bcx[:, 0] * bcx[:, 2]
    pad = np.concatenate([np.zeros((2, 4)), bx])
    want = bcx[:, 1] * (w[:, 0] * pad[:-2] + w[:, 1] * pad[1:-1] + w[:, 2] * bx)
    np.testing.assert_allclose(out["y"], want, rtol=1e-12)
    x = rng.standard_normal((5, 2, 2, 3))
    cos, sin = rng.standard_normal((5, 3)), rng.standard_normal((5, 3))
    out = _eval("kernel k(x: f32[T, H, 2, R], cos: f32[T, R], sin: f32[T, R]) -> (y: f32[T, H, 2, R]) {\n"
                "  x1 = x[:, :, 0, :]\n  x2 = x[:, :, 1, :]\n"
                "  y = stack(x1 * cos - x2 * sin, x2 * cos + x1 * sin, 2)\n}", {"T": 5, "H": 2, "R": 3},
                {"x": x, "cos": cos, "sin": sin})
    c, s = cos[:, None], sin[:, None]
    want = np.stack([x[:, :, 0] * c - x[:, :, 1] * s, x[:, :, 1] * c + x[:, :, 0] * s], axis=2)
    np.testing.assert_allclose(out["y"], want, rtol=1e-12)
    d = rng.standard_normal((4, 5))
    out = _eval("kernel k(x: f32[T, D]) -> (y: f32[T, D], z: f32[T, D]) {\n y = x[:, D - 1]\n z = x[T + 2, :]\n}",
                {"T": 4, "D": 5}, {"x": d})
    np.testing.assert_array_equal(out["y"], np.concatenate([np.zeros((4, 1)), d[:, :-1]], axis=1))
    np.testing.assert_array_equal(out["z"], np.concatenate([d[2:], np.zeros((2, 5))]))


def test_reference_casts_where_index_and_mean_over_the_real_length():
    x = np.array([[-1.7, 0.2], [2.5, -0.4], [0.9, 1.1]])
    out = _eval("kernel k(x: f32[T, D]) -> (a: i32[T, D], b: f32[T, D], c: f32[D], d: f32[T]) {\n"
                " a = i32(x)\n b = where(x > 0.5, x, 0.0) + f32(index(D))\n c = mean(x, T)\n"
                " d = f32(index(T)) * 0.5\n}", {"T": 3, "D": 2}, {"x": x})
    np.testing.assert_array_equal(out["a"], [[-1, 0], [2, 0], [0, 1]])
    np.testing.assert_allclose(out["b"], np.where(x > 0.5, x, 0.0) + [0, 1])
    np.testing.assert_allclose(out["c"], x.mean(0))
    np.testing.assert_allclose(out["d"], [0, 0.5, 1.0])
    out = _eval("kernel k(x: f32[D]) -> (y: f32[T, D]) { y = x * 2.0 }", {"T": 3, "D": 2}, {"x": x[0]})
    np.testing.assert_allclose(out["y"], np.broadcast_to(2 * x[0], (3, 2)))   # an output wider than its value


def _window(x: np.ndarray, ax: int, n: int, sign: int) -> np.ndarray:
    """x[.., a + sign * l, ..] over a new last axis l < n, zero outside the axis (by hand)."""
    size = x.shape[ax]
    out = np.zeros(x.shape + (n,))
    for l in range(n):
        for a in range(size):
            b = a + sign * l
            if 0 <= b < size:
                src = [slice(None)] * x.ndim
                dst = [slice(None)] * x.ndim
                src[ax], dst[ax] = b, a
                out[tuple(dst) + (l,)] = x[tuple(src)]
    return out


def test_reference_windows_and_flip():
    rng = np.random.default_rng(2)
    x = rng.standard_normal((7, 4))
    w = rng.standard_normal((4, 3))
    out = _eval("kernel k(x: f32[T, D], w: f32[D, L]) -> (y: f32[T, D], r: f32[T, D], m: f32[T, D]) {\n"
                " y = sum(flip(w, L) * x[T - L, :], L)\n r = flip(x, T)\n m = max(x[T + L, :], L)\n}",
                {"T": 7, "D": 4, "L": 3}, {"x": x, "w": w})
    pad = np.concatenate([np.zeros((2, 4)), x])          # the causal conv of conv.lk: taps read flipped
    np.testing.assert_allclose(out["y"], sum(w[:, j] * pad[j:j + 7] for j in range(3)), rtol=1e-12)
    np.testing.assert_array_equal(out["r"], x[::-1])      # over the real length (the reference has no padding)
    ahead = np.concatenate([x, np.zeros((2, 4))])         # x[T + L]: zero past the real end
    np.testing.assert_array_equal(out["m"], np.max([ahead[l:l + 7] for l in range(3)], axis=0))
    # a window over another axis, then a take of a fixed axis: L is appended after the remaining axes
    z = rng.standard_normal((5, 2, 6))
    out = _eval("kernel k(z: f32[T, 2, D]) -> (y: f32[T, D, L], v: f32[T, D, W, L]) {\n"
                " y = z[:, 1, D + L]\n v = flip(z[:, 0, :][T - W, D - L], L)\n}",
                {"T": 5, "D": 6, "L": 4, "W": 2}, {"z": z})
    np.testing.assert_array_equal(out["y"], _window(z[:, 1], 1, 4, 1))
    both = _window(_window(z[:, 0], 0, 2, -1), 1, 4, -1)  # [T, D, W, L]: windows append in item order
    np.testing.assert_array_equal(out["v"], np.flip(both, -1))
    # a window longer than the sequence reads nothing
    out = _eval("kernel k(x: f32[T]) -> (y: f32[T, L]) { y = x[T - L] }", {"T": 2, "L": 5}, {"x": x[:2, 0]})
    np.testing.assert_array_equal(out["y"], [[x[0, 0], 0, 0, 0, 0], [x[1, 0], x[0, 0], 0, 0, 0]])


def test_reference_defaults_and_optional_axes():
    (k,) = parse("kernel k(x: f32[B?, T, D], b: f32[D] = 0.5, s: f32 = -2, n: i32[D] = 3, c: f32[B?, D]) "
                 "-> (y: f32[B?, T, D], z: f32[B, D]) {\n y = s * x + b + f32(n)\n z = sum(x, T) + c\n}")
    c = check(k)
    assert [(p.optional, p.default) for p in k.inputs] == [(("B",), None), ((), 0.5), ((), -2.0), ((), 3.0),
                                                           (("B",), None)]
    rng = np.random.default_rng(3)
    x = rng.standard_normal((6, 3))                       # passed without B: size 1
    cc = rng.standard_normal(3)
    out = Evaluator(k, c, {"B": 1, "T": 6, "D": 3}).run({"x": x, "c": cc})
    np.testing.assert_allclose(out["y"], (-2.0 * x + 0.5 + 3)[None], rtol=1e-12)
    np.testing.assert_allclose(out["z"], (x.sum(0) + cc)[None], rtol=1e-12)
    out = Evaluator(k, c, {"B": 1, "T": 6, "D": 3}).run({"x": x, "c": cc, "b": np.ones(3), "s": 1.0})
    np.testing.assert_allclose(out["y"], (x + 1 + 3)[None], rtol=1e-12)
    xb = rng.standard_normal((2, 6, 3))
    out = Evaluator(k, c, {"B": 2, "T": 6, "D": 3}).run({"x": xb, "c": rng.standard_normal((2, 3))})
    np.testing.assert_allclose(out["y"], -2.0 * xb + 3.5, rtol=1e-12)
    # what the call passes and gets back: y marks B optional and is returned without it, z is not
    x_, b_, _, _, c_ = k.inputs
    assert passed_shape(x_, ("B",)) == ("T", "D") and passed_shape(b_, ("B",)) == ("D",)
    gone = left_out_axes(k, ("B",))
    assert gone == {"B"}
    assert [returned_shape(o, gone) for o in k.outputs] == [("T", "D"), ("B", "D")]
    assert left_out_axes(k, ("B",), passed={"b"}) == set()
    (k2,) = parse("kernel k(x: f32[B?, C?, T]) -> (y: f32[B?, C?, T]) { y = x }")
    assert passed_shape(k2.inputs[0], ("B",)) == ("C", "T") and passed_shape(k2.inputs[0], ("C",)) == ("B", "C", "T")
    assert returned_shape(k2.outputs[0], left_out_axes(k2, ("B", "C"))) == ("T",)


def test_model_rejects_what_the_language_rejects():
    for src in ["kernel k(x: f32[D, T]) -> (y: f32[D]) { y = sum(x, T) }",          # T not leading
                "kernel k(x: f32[T, 3]) -> (y: f32[T]) { y = sum(x, 3) }",            # reductions name an axis
                "kernel k(x: f32[N, K], w: f32[K, N]) -> (y: f32[N, K]) { y = x * w }",  # order conflict
                "kernel k(x: i32[N]) -> (y: i32[N]) { y = exp(x) }",
                "kernel k(x: i32[N]) -> (y: i32[N]) { y = x + 0.5 }",
                "kernel k(x: f32[N]) -> (y: f32[D]) { y = x }",
                "kernel k(x: f32[T, L]) -> (y: f32[T, L]) { y = x[T - L, :] }",          # window axis exists
                "kernel k(x: f32[T, D]) -> (y: f32[T, D]) { y = flip(x, E) }",            # flip of a missing axis
                "kernel k(x: f32[T, B?]) -> (y: f32[T]) { y = x[:, 0] }",                # optional axes first
                "kernel k(x: f32[T?, D]) -> (y: f32[T, D]) { y = x }",                   # T never optional
                "kernel k(x: f32[B, T, D]) -> (y: f32[B, T, D]) { y = x }",              # T after optional only
                "kernel k(x: f32[T, D]) -> (y: f32[T, D] = 1) { y = x }",                # no output defaults
                "kernel k(x: f32[T, D], i: i32[D] = 0.5) -> (y: f32[T, D]) { y = x }"]:  # whole-number int default
        with pytest.raises(ModelError):
            check(parse(src)[0])


def test_reference_grouped_matmul_and_drawn_ends():
    """y[s] = x[s] w[e]^T over expert e's rows ends[e-1] <= s < ends[e] (an empty expert owns none),
    times scale[s]; rows past ends[E-1] are NaN (unspecified) unless masked to the owned rows."""
    rng = np.random.default_rng(3)
    x, w, s = rng.standard_normal((6, 4)), rng.standard_normal((3, 2, 4)), rng.standard_normal(6)
    ends = np.array([2, 2, 5])
    out = _eval("kernel k(x: f32[T, K], w: f32[E, N, K], e: i32[E], s: f32[T]) -> (y: f32[T, N], z: f32[T, N]) {\n"
                " y = grouped_matmul_scaled(x, w, e, s)\n"
                " z = where(sum(f32(index(T) < e), E) > 0.5, grouped_matmul(x, w, e), 0.0)\n}",
                {"T": 6, "K": 4, "N": 2, "E": 3}, {"x": x, "w": w, "e": ends, "s": s})
    want = np.concatenate([x[:2] @ w[0].T, x[2:5] @ w[2].T])
    np.testing.assert_allclose(out["y"][:5], want * s[:5, None], rtol=1e-12)
    assert np.isnan(out["y"][5]).all()
    np.testing.assert_allclose(out["z"], np.concatenate([want, np.zeros((1, 2))]), rtol=1e-12)
    from tests.fuzz.run import draw_ends
    for short in (False, True):
        for i in range(50):
            e = draw_ends(np.random.default_rng(i), 1 + i % 4, 1 + i % 7, short)
            assert (np.diff(e) >= 0).all() and e[0] >= 0 and (e[-1] < 1 + i % 7 if short else e[-1] == 1 + i % 7)


def test_generated_kernels_are_well_typed_and_print_parse_round_trip():
    seen = collections.Counter()
    for i in range(300):
        case = generate(case_seed(123, i))
        Checker(case.kernel).check()
        src = kernel_text(case.kernel)
        (again,) = parse(src)
        assert kernel_text(again) == src
        packed = any(case.sizes.get(a, 1) > 1 for a in ("B", "C"))
        if "T" in case.sizes:       # padded, unless several sequences share a tensor (they fill buckets)
            assert (case.sizes["T"] % case.bucket == 0) == packed
        seen.update(features(case))
        assert ("packed" in features(case)) == packed
    # the language's newer features at a sensible rate
    assert 30 <= seen["window"] <= 80 and seen["flip"] >= 15, seen
    assert 20 <= seen["default"] <= 60 and seen["left out"] >= 10, seen
    assert 20 <= seen["optional"] <= 60 and seen["dropped"] >= 5 and seen["packed"] >= 5, seen
    assert 90 <= seen["poison"] <= 180, seen
    assert 20 <= seen["grouped"] <= 75 and seen["grouped computed w"] >= 8, seen


def test_case_files_round_trip():
    from tests.fuzz.corpus import case_text
    cases = [generate(case_seed(5, i)) for i in range(200)]
    picked = [cases[0]] + [next(c for c in cases if c.left_out), next(c for c in cases if c.dropped),
                           next(c for c in cases if c.poison)]
    for case in picked:
        again = case_from_text(case_text(case))
        assert kernel_text(again.kernel) == kernel_text(case.kernel)
        assert (again.sizes, again.bucket, again.data_seed) == (case.sizes, case.bucket, case.data_seed)
        assert (again.left_out, again.dropped, again.poison) == (case.left_out, case.dropped, case.poison)


# ---------------------------------------------------------------- the pipeline on kernels that work
GOOD = [
    ("kernel k(x: f32[T, D], w: f32[D], eps: f32) -> (y: f32[T, D]) {\n"
     "    inv = rsqrt(mean(x * x, D) + eps)\n    y = x * inv * w\n}\n", {"T": 7, "D": 5}),
    ("kernel k(x: f32[T, D]) -> (y: f32[T, D], lse: f32[T]) {\n    m = max(x, D)\n    e = exp(x - m)\n"
     "    s = sum(e, D)\n    y = e / s\n    lse = m + log(s)\n}\n", {"T": 5, "D": 6}),
    ("kernel k(bcx: f32[T, 3, D], w: f32[D, 3], b: f32[D]) -> (y: f32[T, D]) {\n"
     "    bx = bcx[:, 0, :] * bcx[:, 2, :]\n"
     "    conv = w[:, 0] * bx[T - 2, :] + w[:, 1] * bx[T - 1, :] + w[:, 2] * bx + b\n"
     "    y = bcx[:, 1, :] * conv\n}\n", {"T": 9, "D": 4}),
    ("kernel k(x: f32[T, K], w: f32[N, K]) -> (y: f32[T, N]) {\n    y = sum(x * w, K)\n}\n",
     {"T": 6, "K": 5, "N": 3}),
    ("kernel k(a: f32[T, F], b: f32[T, F]) -> (y: f32[T, F]) {\n    y = silu(a) * b\n}\n", {"T": 3, "F": 4}),
]


@pytest.mark.parametrize("src,sizes", GOOD, ids=["rmsnorm", "softmax", "short_conv", "linear", "silu_mul"])
@pytest.mark.parametrize("poison", [False, True], ids=["plain", "poison"])
def test_runner_agrees_with_the_engine_on_shipped_kernels(runner, src, sizes, poison):
    (k,) = parse(src)
    r = runner.run(Case(k, sizes, 4, data_seed=3, poison=poison))
    assert r.forward.cls == "ok", r.forward.detail
    assert r.backward.cls in ("ok", "refused"), r.backward.detail


def test_precision_model_of_tanh_and_casts(runner):
    """WGSL's tanh has an absolute error (lavapipe: ~1 ulp of 1, so tanh(1e-5) is 1% off), and a
    float a rounding away from a whole number truncates either way: neither is a wrong number."""
    (k,) = parse("kernel k(x: f32[N]) -> (y: f32[N]) { y = 1000.0 * tanh(x * 1e-05) }")
    r = runner.run(Case(k, {"N": 64}, 4, data_seed=1))
    assert r.forward.cls == "ok" and r.backward.cls == "ok", (r.forward.detail, r.backward.detail)
    (k,) = parse("kernel k(x: f32[N]) -> (y: u32[N]) { y = u32(tanh(x * 0.0 + 9.5) * 2.0) }")
    r = runner.run(Case(k, {"N": 4}, 4, data_seed=1))        # float64: 1.99999998, f32: 2.0
    assert r.forward.cls == "skipped", r.forward.detail


CONV = ("kernel k(bcx: f32[B?, T, 3, D], w: f32[D, L], b: f32[D] = 0.5) -> (y: f32[B?, T, D]) {\n"
        "    bx = bcx[:, :, 0, :] * bcx[:, :, 2, :]\n"
        "    y = bcx[:, :, 1, :] * (sum(flip(w, L) * bx[:, T - L, :], L) + b)\n}\n")


@pytest.mark.parametrize("sizes,left_out,dropped,poison", [
    ({"B": 1, "T": 7, "D": 4, "L": 3}, (), ("B",), True),         # B left out, padded rows poisoned
    ({"B": 1, "T": 7, "D": 4, "L": 3}, ("b",), (), True),         # B passed as 1, b left out
    ({"B": 3, "T": 8, "D": 4, "L": 3}, ("b",), (), False),        # packed: 3 sequences filling buckets
], ids=["dropped", "left_out", "packed"])
def test_runner_on_conv_lk_calls(runner, sizes, left_out, dropped, poison):
    """conv.lk's short_conv as the fuzzer calls it: the call variants it generates."""
    (k,) = parse(CONV)
    r = runner.run(Case(k, sizes, 4, data_seed=5, left_out=left_out, dropped=dropped, poison=poison))
    assert r.forward.cls == "ok", r.forward.detail
    assert r.backward.cls == "ok", r.backward.detail


def test_poisoned_uploads_keep_nan_in_the_padded_rows(runner):
    (k,) = parse("kernel k(x: f32[T, D]) -> (y: f32[T, D]) { y = x }")
    case = Case(k, {"T": 5, "D": 3}, 4, poison=True)
    x = np.arange(15, dtype=np.float32).reshape(5, 3)
    t = runner.upload(x, "f32", ("T", "D"), case)
    assert t.shape == (5, 3) and t.capacity >= 8 * 3          # the pool may round a buffer up
    np.testing.assert_array_equal(t.numpy(), x)
    raw = t._base.numpy()
    assert raw.shape == (8, 3) and np.isnan(raw[5:]).all()
    assert runner.upload(x[None], "f32", ("B", "T", "D"), case)._base is not None      # a batch of one: poisoned
    assert runner.upload(x[:4], "f32", ("T", "D"), case)._base is None                # fills its bucket
    assert runner.upload(np.stack([x, x]), "f32", ("B", "T", "D"), case)._base is None  # packed: not poisoned
    # reads past the real end and flips over T must not see the padded rows
    (k,) = parse("kernel k(x: f32[T, D]) -> (y: f32[T, D], z: f32[T, D]) {\n y = x[T + 2, :] * 2.0\n"
                 " z = sum(flip(x, T)[T + L, :], L)\n}")
    r = runner.run(Case(k, {"T": 5, "D": 3, "L": 4}, 4, data_seed=1, poison=True))
    assert r.forward.cls == "ok" and r.backward.cls == "ok", (r.forward.detail, r.backward.detail)


def test_packed_sequences_must_fill_whole_buckets(runner):
    """With a batch axis of size > 1 before T, the engine refuses a T that is not a bucket multiple
    (the fuzzer then draws T as one; here the refusal itself)."""
    from lfm2jit import compile_source
    kernel = compile_source(CONV, "conv.lk")["k"]
    e = runner.engine
    args = dict(bcx=e.tensor(np.ones((2, 7, 3, 4), np.float32)), w=e.tensor(np.ones((4, 3), np.float32)))
    with pytest.raises(ValueError, match="fill whole buckets"):
        e.run(kernel, bucket=4, **args)
    out = e.run(kernel, bucket=4, bcx=e.tensor(np.ones((2, 8, 3, 4), np.float32)), w=args["w"])
    assert out["y"].shape == (2, 8, 4)


def test_shrinker_keeps_the_failure(runner):
    """A planted failure (a reference that disagrees) shrinks to a smaller case that still fails."""
    src = ("kernel k(x0: f32[T, D], x1: f32[D], s0: f32) -> (y0: f32[T, D], y1: f32[D]) {\n"
           "    t0 = exp(x1) * s0\n    y0 = x0 * 2.0 + t0\n    y1 = sum(x0, T)\n}\n")
    (k,) = parse(src)
    case = Case(k, {"T": 5, "D": 3}, 4, data_seed=1)

    def pred(r):          # "fails" while the kernel still sums over T
        return "sum(" in kernel_text(r.case.kernel)
    small = shrink(case, runner, pred, budget=200)
    text = kernel_text(small.kernel)
    assert "sum(" in text and len(text) < len(src)


# ---------------------------------------------------------------- regression corpus and fixed-seed batch
@pytest.mark.parametrize("path", corpus(), ids=[p.stem for p in corpus()])
def test_corpus_case(runner, path):
    """Every failure the fuzzer ever found, shrunk (its header says what the compiler did then)."""
    case = case_from_text(path.read_text(), str(path))
    r = runner.run(case)
    assert r.forward.cls not in FAILING, f"forward {r.forward.cls}: {r.forward.detail[:2000]}"
    assert r.backward.cls not in FAILING, f"backward {r.backward.cls}: {r.backward.detail[:2000]}"


@pytest.fixture(scope="module")
def batch(runner):
    start = time.time()
    results = [runner.run(generate(case_seed(BATCH_SEED, i), runner.has_f16)) for i in range(BATCH_SIZE)]
    return results, time.time() - start


def test_fixed_seed_batch(batch, capsys):
    """No wrong number, invalid WGSL, foreign or unlocated error; and the language's own programs
    compile: at most 10% of the generated kernels are refused."""
    results, elapsed = batch
    refused = collections.Counter(r.forward.cls for r in results)["refused"]
    with capsys.disabled():
        print(f"\nfuzz batch: {BATCH_SIZE} kernels (seed {BATCH_SEED}) in {elapsed:.1f}s; "
              f"refused share (forward) {refused / BATCH_SIZE:.1%}")
        print(counts_table(results))
        print(features_table(results))
    failing = [(r.case.seed, failure_of(r)) for r in results if r.failing]
    assert not failing, f"{len(failing)} failing kernels:\n" + causes_table(results)
    assert refused <= 0.1 * BATCH_SIZE, causes_table(results, ("refused",))
