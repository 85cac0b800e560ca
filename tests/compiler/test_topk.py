"""topk(x, K): the k largest entries of each row, against torch on the CPU.

torch.topk's tie order on the CPU depends on its algorithm (for equal values it often does not
list the lower index first), so the index reference is torch's stable descending sort, whose ties
are by index: what the intrinsic promises. The values are checked against torch.topk itself."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from dsl_errors import assert_dsl_error
from lfm2jit import DslError, compile_source, grad
from numerics import rel_err

SOURCE = """
kernel route(x: f32[T, E]) -> (v: f32[T, K], i: i32[T, K]) {
    v, i = topk(x, K)
}
kernel route2(x: f32[T, E]) -> (v: f32[T, 2], i: i32[T, 2]) {
    v, i = topk(x, 2)
}
kernel route_half(x: f16[T, E]) -> (v: f16[T, K], i: i32[T, K]) {
    v, i = topk(x, K)
}
kernel weights(x: f32[T, E], s: f32[T, K]) -> (w: f32[T, K]) {
    v, i = topk(x, K)
    w = sigmoid(v) * s
}
"""


@pytest.fixture(scope="module")
def mod():
    return compile_source(SOURCE, "topk.lk")


def reference(x: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray]:
    """(values, indices) by torch's stable descending sort: NaN first, equal values by index."""
    s = torch.sort(torch.from_numpy(x), dim=-1, descending=True, stable=True)
    return s.values[:, :k].numpy(), s.indices[:, :k].numpy()


def run(engine, kernel, x, k=None, bucket=16):
    out = engine.run(kernel, x=engine.tensor(x), bucket=bucket, dims={"K": k} if k else None)
    return out["v"].numpy(), out["i"].numpy()


def test_random_rows_with_ties_match_torch(engine, mod):
    rng = np.random.default_rng(0)
    for case in range(24):
        e = int(rng.choice([4, 5, 8, 16, 33, 64]))
        k = int(rng.choice([1, 2, max(1, e // 2), e]))
        t = int(rng.integers(1, 70))                        # rarely a multiple of the bucket
        levels = int(rng.choice([2, 3, 1000]))              # few levels: many ties
        x = (rng.integers(0, levels, (t, e)) * 0.5 - 1).astype(np.float32)
        v, i = run(engine, mod.route, x, k)
        want_v, want_i = reference(x, k)
        assert np.array_equal(i, want_i), (case, e, k, t)
        assert np.array_equal(v, want_v) and np.array_equal(v, torch.topk(torch.from_numpy(x), k).values.numpy())


def test_k_equal_to_e_is_a_stable_descending_sort(engine, mod):
    x = np.array([[2, 2, 2, 1, 2], [0, 0, 0, 0, 0], [-1, 3, -1, 3, 0]], np.float32)
    v, i = run(engine, mod.route, x, 5)
    assert i.tolist() == [[0, 1, 2, 4, 3], [0, 1, 2, 3, 4], [1, 3, 4, 0, 2]]
    assert np.array_equal(v, -np.sort(-x, axis=1))


def test_nan_ranks_first_and_signed_zeros_tie(engine, mod):
    """NaN above +inf (NaNs among themselves by index), -0 equal to +0: torch's order of values."""
    nan, inf = np.nan, np.inf
    x = np.array([[1, nan, 3, nan, inf, -0.0, 0.0, 3],
                  [-inf, -0.0, -1e-30, 0.0, 1e-30, -nan, -inf, 5]], np.float32)
    v, i = run(engine, mod.route, x, 8)
    assert i.tolist() == [[1, 3, 4, 2, 7, 0, 5, 6], [5, 7, 4, 1, 3, 2, 0, 6]]
    want_v, _ = reference(x, 8)
    assert np.array_equal(v, want_v, equal_nan=True)
    assert np.array_equal(v, torch.topk(torch.from_numpy(x), 8).values.numpy(), equal_nan=True)
    assert np.signbit(v[0, 6]) and not np.signbit(v[0, 7])   # the values are the entries picked, bits and all


def test_f16_rows(engine, mod):
    rng = np.random.default_rng(1)
    x = (rng.integers(-4, 4, (29, 12)) * 0.25).astype(np.float16)
    x[3, 7], x[5, 0], x[5, 1] = np.nan, np.float16(-0.0), np.inf
    v, i = run(engine, mod.route_half, x, 6)
    s = torch.sort(torch.from_numpy(x).float(), dim=-1, descending=True, stable=True)
    assert np.array_equal(i, s.indices[:, :6].numpy())
    assert v.dtype == np.float16 and np.array_equal(v.astype(np.float32), s.values[:, :6].numpy(), equal_nan=True)


def test_integer_k_and_padding(engine, mod):
    """A fixed K written in the call, and a length far from its bucket: padded rows are not written."""
    rng = np.random.default_rng(2)
    x = rng.standard_normal((3, 7)).astype(np.float32)
    v, i = run(engine, mod.route2, x, bucket=64)
    want_v, want_i = reference(x, 2)
    assert np.array_equal(i, want_i) and np.array_equal(v, want_v)


def grad_reference(x: np.ndarray, idx: np.ndarray, dv: np.ndarray) -> np.ndarray:
    dx = np.zeros(x.shape, np.float64)
    np.add.at(dx, (np.arange(x.shape[0])[:, None].repeat(idx.shape[1], 1), idx), dv)
    return dx


@pytest.mark.parametrize("kernel,k", [("route", 3), ("route2", 2)])
def test_gradient_flows_through_the_picked_values(engine, mod, kernel, k):
    """dx against torch autograd through torch.topk (distinct values, so the picks agree), and with
    ties against the stable picks."""
    rng = np.random.default_rng(3)
    bwd = grad(mod[kernel], ["x"], cotangents=["v"])
    for tied in (False, True):
        x = (rng.integers(0, 3, (45, 9)) if tied else rng.standard_normal((45, 9))).astype(np.float32)
        dv = rng.standard_normal((45, k)).astype(np.float32)
        dims = {"K": k} if kernel == "route" else None
        fwd = engine.run(mod[kernel], x=engine.tensor(x), bucket=16, dims=dims)
        got = engine.run(bwd, x=engine.tensor(x), i=fwd["i"], d_v=engine.tensor(dv), bucket=16, dims=dims)["d_x"].numpy()
        _, idx = reference(x, k)
        assert np.array_equal(got, grad_reference(x, idx, dv))
        if not tied:
            xt = torch.from_numpy(x).requires_grad_()
            torch.topk(xt, k).values.backward(torch.from_numpy(dv))
            assert np.array_equal(got, xt.grad.numpy())


def test_gradient_through_an_expression_of_the_values(engine, mod):
    """w = sigmoid(v) * s: the chain rule through topk, x's gradient against torch."""
    rng = np.random.default_rng(4)
    x = rng.standard_normal((21, 8)).astype(np.float32)
    s = rng.standard_normal((21, 3)).astype(np.float32)
    dw = rng.standard_normal((21, 3)).astype(np.float32)
    out = engine.run(grad(mod.weights, ["x", "s"]), x=engine.tensor(x), s=engine.tensor(s), d_w=engine.tensor(dw),
                     bucket=16)
    xt, st = torch.from_numpy(x).double().requires_grad_(), torch.from_numpy(s).double().requires_grad_()
    (torch.sigmoid(torch.topk(xt, 3).values) * st).backward(torch.from_numpy(dw).double())
    assert rel_err(out["d_x"].numpy(), xt.grad.numpy()) < 1e-5
    assert rel_err(out["d_s"].numpy(), st.grad.numpy()) < 1e-5


@pytest.mark.parametrize("body,col,message,expected", [
    ("x: i32[T, E]) -> (v: i32[T, 2]) {\n    v, i = topk(x, 2)", 12, "x must be a float tensor", "x, K"),
    ("x: f32[T, 4]) -> (v: f32[T, 5]) {\n    v, i = topk(x, 5)", 12, "K = 5 is larger than x's last axis E = 4", "K"),
    ("x: f32[T]) -> (v: f32[T, K]) {\n    v, i = topk(x, K)", 12, "x must be [T, E]", "x, K"),
    ("x: f32[A, R, E]) -> (v: f32[A, R, K]) {\n    v, i = topk(x, K)", 12, "got f32[A, R, E] with 3 axes", "x, K"),
    ("x: f32[T, E]) -> (v: f32[T, E]) {\n    v, i = topk(x, E)", 12, "K = E is already an axis of x", "x, K"),
    ("x: f32[T, E]) -> (v: f32[T, K]) {\n    v, i = topk(x)", 12, "takes 1 operands and 1 axis (x, K), got 1", "x, K"),
    ("x: f32[T, E]) -> (v: f32[T, K]) {\n    v, i = topk(x, x)", 20, "takes its K as an axis name or a positive", "an axis name"),
    ("x: f32[T, E]) -> (v: f32[T, K]) {\n    v, i = topk(x, 0)", 20, "takes its K as an axis name or a positive", "an integer"),
])
def test_type_errors_name_the_operand(body, col, message, expected):
    text = f"kernel bad({body}\n}}\n"
    token = text.split("\n")[1][col - 1:]
    assert_dsl_error(text, 2, col, token[:4], message, expected)


def test_k_larger_than_e_at_run_time_is_refused_before_any_gpu_work(engine, mod):
    with pytest.raises(ValueError, match=r"topk: K = K = 9 is larger than x's last axis E = 8"):
        run(engine, mod.route, np.zeros((4, 8), np.float32), 9)


def test_indices_take_no_cotangent(mod):
    with pytest.raises(DslError, match="indices are integers and take no cotangent"):
        grad(mod.route, ["x"], cotangents=["v", "i"])


def test_values_stored_and_read_by_another_part(engine):
    """An intrinsic's result that is an output (f16 too) and read by another part, and an output
    declared wider than it: each stored once by the call, the others copies (ir/partition.py)."""
    k = compile_source("""
kernel k(x: f16[T, E]) -> (v: f16[T, 2], w: f16[T, 2, E], y: f32[T, 2], i: i32[T, 2]) {
    v, i = topk(x, 2)
    w = v
    y = f32(v[T - 1, :]) * f32(i)
}
""").k
    x = np.random.default_rng(5).standard_normal((11, 6)).astype(np.float16)
    out = engine.run(k, x=engine.tensor(x), bucket=8)
    want_v, want_i = reference(x.astype(np.float32), 2)
    assert np.array_equal(out["v"].numpy().astype(np.float32), want_v) and np.array_equal(out["i"].numpy(), want_i)
    assert np.array_equal(out["w"].numpy().astype(np.float32), np.repeat(want_v[:, :, None], 6, 2))
    prev = np.concatenate([np.zeros((1, 2), np.float32), want_v[:-1]])
    assert np.array_equal(out["y"].numpy(), prev * want_i)


def test_topk_of_a_computed_value_with_gathered_weights(engine):
    """LFM2-MoE's routing in one kernel: experts picked on sigmoid(logits) + bias, weights the
    unbiased scores at those experts, normalised over the k; against torch, gradients included."""
    k = compile_source("""
kernel route(logits: f32[T, E], bias: f32[E]) -> (w: f32[T, K], experts: i32[T, K]) {
    scores = sigmoid(logits)
    picked, experts = topk(scores + bias, K)
    g = sum(where(eq(experts, index(E)), scores, 0), E)
    w = g / sum(g, K)
}
""").route
    rng = np.random.default_rng(6)
    logits = rng.standard_normal((19, 8)).astype(np.float32)
    bias = (rng.standard_normal(8) * 0.1).astype(np.float32)
    out = engine.run(k, logits=engine.tensor(logits), bias=engine.tensor(bias), dims={"K": 3}, bucket=8)
    lt = torch.from_numpy(logits).double().requires_grad_()
    scores = torch.sigmoid(lt)
    experts = torch.topk(scores + torch.from_numpy(bias).double(), 3).indices
    g = scores.gather(1, experts)
    w = g / g.sum(1, keepdim=True)
    assert np.array_equal(out["experts"].numpy(), experts.numpy())
    assert rel_err(out["w"].numpy(), w.detach().numpy()) < 1e-5
    dw = rng.standard_normal((19, 3)).astype(np.float32)
    w.backward(torch.from_numpy(dw).double())
    got = engine.run(grad(k, ["logits"], cotangents=["w"]), logits=engine.tensor(logits), bias=engine.tensor(bias),
                     w=out["w"], experts=out["experts"], d_w=engine.tensor(dw), dims={"K": 3}, bucket=8)["d_logits"].numpy()
    assert rel_err(got, lt.grad.numpy()) < 1e-5
