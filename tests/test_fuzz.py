"""The differential fuzzer (lfm2jit/fuzz): its own reference, its regression corpus, a fixed-seed batch.

The corpus (lfm2jit/fuzz/cases) holds one shrunk case per cause of every failure the fuzzer found;
each must now pass, as must a fixed-seed batch of generated kernels. A long run is
``python -m lfm2jit fuzz 5000 --seed S``.

Run: PYTHONPATH=. python -m pytest -q tests/test_fuzz.py   (about 10 s on lavapipe, 2 CPU cores)
"""
from __future__ import annotations

import collections
import time

import numpy as np
import pytest

from lfm2jit.fuzz import FAILING, Runner, case_from_text, corpus, generate
from lfm2jit.fuzz.cli import case_seed, causes_table, counts_table
from lfm2jit.fuzz.expr import Checker, Evaluator, ModelError, check, kernel_text, merge, parse
from lfm2jit.fuzz.generate import Case
from lfm2jit.fuzz.shrink import failure_of, shrink

BATCH_SEED = 0
BATCH_SIZE = 400

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


def test_model_rejects_what_the_language_rejects():
    for src in ["kernel k(x: f32[D, T]) -> (y: f32[D]) { y = sum(x, T) }",          # T not leading
                "kernel k(x: f32[T, 3]) -> (y: f32[T]) { y = sum(x, 3) }",            # reductions name an axis
                "kernel k(x: f32[N, K], w: f32[K, N]) -> (y: f32[N, K]) { y = x * w }",  # order conflict
                "kernel k(x: i32[N]) -> (y: i32[N]) { y = exp(x) }",
                "kernel k(x: i32[N]) -> (y: i32[N]) { y = x + 0.5 }",
                "kernel k(x: f32[N]) -> (y: f32[D]) { y = x }"]:
        with pytest.raises(ModelError):
            check(parse(src)[0])


def test_generated_kernels_are_well_typed_and_print_parse_round_trip():
    for i in range(300):
        case = generate(case_seed(123, i))
        Checker(case.kernel).check()
        src = kernel_text(case.kernel)
        (again,) = parse(src)
        assert kernel_text(again) == src
        assert all(case.sizes["T"] % case.bucket for _ in [0] if "T" in case.sizes)


def test_case_files_round_trip():
    case = generate(case_seed(5, 0))
    from lfm2jit.fuzz.corpus import case_text
    again = case_from_text(case_text(case))
    assert kernel_text(again.kernel) == kernel_text(case.kernel)
    assert (again.sizes, again.bucket, again.data_seed) == (case.sizes, case.bucket, case.data_seed)


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
def test_runner_agrees_with_the_engine_on_shipped_kernels(runner, src, sizes):
    (k,) = parse(src)
    r = runner.run(Case(k, sizes, 4, data_seed=3))
    assert r.forward.cls == "ok", r.forward.detail
    assert r.backward.cls in ("ok", "refused"), r.backward.detail


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
    failing = [(r.case.seed, failure_of(r)) for r in results if r.failing]
    assert not failing, f"{len(failing)} failing kernels:\n" + causes_table(results)
    assert refused <= 0.1 * BATCH_SIZE, causes_table(results, ("refused",))
