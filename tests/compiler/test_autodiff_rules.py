"""Each autodiff rule against central finite differences, in float64, through the IR interpreter.

For a forward kernel k and random cotangents c, L = sum_o sum(c_o * y_o) is a scalar function of
the inputs; grad_ir(k) must give dL/dx for each input. Both the forward and the backward IR are
evaluated by tests/ir_eval.py (numpy float64), so this checks the rules themselves, not codegen.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

import numpy as np
import pytest

from numerics import rel_err
from ir_eval import evaluate
from lfm2jit import compile_source
from lfm2jit.ir.grad import RULES, AutodiffError, grad_ir
from lfm2jit.ir.nodes import KernelIR, toposort
from lfm2jit.ir.ops import Op

TOL = 1e-6
H = 1e-6       # central-difference step: truncation ~H^2, rounding ~1e-16/H, both far below TOL
T, D, K, N, M, S, E, HD = 3, 4, 5, 2, 3, 2, 3, 2


def normal(*shape):
    return lambda r: r.standard_normal(shape)


def positive(*shape):
    return lambda r: r.uniform(0.5, 2.0, shape)


def away_from_zero(*shape):
    """|x| in [0.2, 2]: abs, recip and division stay smooth within the FD step."""
    return lambda r: r.choice([-1.0, 1.0], shape) * r.uniform(0.2, 2.0, shape)


def pair_apart(shape, names=("a", "b")):
    """Two arrays whose entries differ by at least 0.1 everywhere (no ties for max/min/where)."""
    def make(r):
        a = r.standard_normal(shape)
        b = a + r.choice([-1.0, 1.0], shape) * r.uniform(0.1, 1.0, shape)
        return dict(zip(names, (a, b)))
    return make


@dataclass
class Case:
    id: str
    src: str
    inputs: dict[str, Callable] | Callable        # name -> maker, or one maker giving a dict
    scalars: dict[str, float] = field(default_factory=dict)
    wrt: list[str] | None = None
    cotangents: list[str] | None = None

    def kernel(self) -> KernelIR:
        (k,) = list(compile_source(self.src, f"<{self.id}>"))
        return k.ir

    def make_inputs(self, r) -> dict[str, np.ndarray]:
        if callable(self.inputs):
            return self.inputs(r)
        return {n: f(r) for n, f in self.inputs.items()}


TD = "a: f32[T, D], b: f32[T, D]"
CASES = [
    Case("add", f"kernel k({TD}) -> (y: f32[T, D]) {{ y = a + b }}", {"a": normal(T, D), "b": normal(T, D)}),
    Case("sub", f"kernel k({TD}) -> (y: f32[T, D]) {{ y = a - b }}", {"a": normal(T, D), "b": normal(T, D)}),
    Case("mul", f"kernel k({TD}) -> (y: f32[T, D]) {{ y = a * b }}", {"a": normal(T, D), "b": normal(T, D)}),
    Case("div", f"kernel k({TD}) -> (y: f32[T, D]) {{ y = a / b }}",
         {"a": normal(T, D), "b": away_from_zero(T, D)}),
    Case("pow", f"kernel k({TD}) -> (y: f32[T, D]) {{ y = a ** b }}", {"a": positive(T, D), "b": normal(T, D)}),
    Case("pow_const", "kernel k(a: f32[T, D]) -> (y: f32[T, D]) { y = a ** 3.0 }", {"a": positive(T, D)}),
    Case("max2", f"kernel k({TD}) -> (y: f32[T, D]) {{ y = max(a, b) }}", pair_apart((T, D))),
    Case("min2", f"kernel k({TD}) -> (y: f32[T, D]) {{ y = min(a, b) }}", pair_apart((T, D))),
    Case("max_const", "kernel k(a: f32[T, D]) -> (y: f32[T, D]) { y = max(a, 0.0) + min(0.5, a) }",
         {"a": lambda r: np.array([[-1.3, 0.2, 0.9, -0.4]] * T) + r.uniform(-0.05, 0.05, (T, D))}),
    Case("where_gt", f"kernel k({TD}) -> (y: f32[T, D]) {{ y = where(a > b, a, b) }}", pair_apart((T, D))),
    Case("where_lt", f"kernel k({TD}) -> (y: f32[T, D]) {{ y = where(a < b, a * b, 2.0) + (a > 0.0) }}",
         pair_apart((T, D))),
    Case("where_bcast", "kernel k(a: f32[T, D], w: f32[D]) -> (y: f32[T, D]) { y = where(w > 0.0, a, w * w) }",
         {"a": normal(T, D), "w": away_from_zero(D)}),
    Case("neg", "kernel k(a: f32[T, D]) -> (y: f32[T, D]) { y = -a }", {"a": normal(T, D)}),
    Case("exp", "kernel k(a: f32[T, D]) -> (y: f32[T, D]) { y = exp(a) }", {"a": normal(T, D)}),
    Case("log", "kernel k(a: f32[T, D]) -> (y: f32[T, D]) { y = log(a) }", {"a": positive(T, D)}),
    Case("sqrt", "kernel k(a: f32[T, D]) -> (y: f32[T, D]) { y = sqrt(a) }", {"a": positive(T, D)}),
    Case("rsqrt", "kernel k(a: f32[T, D]) -> (y: f32[T, D]) { y = rsqrt(a) }", {"a": positive(T, D)}),
    Case("recip", "kernel k(a: f32[T, D]) -> (y: f32[T, D]) { y = recip(a) }", {"a": away_from_zero(T, D)}),
    Case("abs", "kernel k(a: f32[T, D]) -> (y: f32[T, D]) { y = abs(a) }", {"a": away_from_zero(T, D)}),
    Case("sigmoid", "kernel k(a: f32[T, D]) -> (y: f32[T, D]) { y = sigmoid(a) }",
         {"a": lambda r: 3 * r.standard_normal((T, D))}),
    Case("silu", "kernel k(a: f32[T, D]) -> (y: f32[T, D]) { y = silu(a) }",
         {"a": lambda r: 3 * r.standard_normal((T, D))}),
    Case("tanh", "kernel k(a: f32[T, D]) -> (y: f32[T, D]) { y = tanh(a) }", {"a": normal(T, D)}),
    Case("cast_f16", "kernel k(a: f32[T, D], h: f16[T, D]) -> (y: f32[T, D], z: f16[T, D]) "
         "{ y = a * f32(h)\n z = f16(a) * h }", {"a": normal(T, D), "h": normal(T, D)}),
    Case("cast_int", "kernel k(a: f32[T, D], i: i32[T, D]) -> (y: f32[T, D]) { y = a * f32(i) }",
         {"a": normal(T, D), "i": lambda r: r.integers(-3, 4, (T, D)).astype(np.float64)}),
    Case("sum", "kernel k(a: f32[T, D]) -> (y: f32[T]) { y = sum(exp(a), D) }", {"a": normal(T, D)}),
    Case("mean", "kernel k(a: f32[T, D]) -> (y: f32[T]) { y = mean(a * a, D) }", {"a": normal(T, D)}),
    Case("sum_t", f"kernel k({TD}) -> (y: f32[D]) {{ y = sum(a * b, T) }}", {"a": normal(T, D), "b": normal(T, D)}),
    Case("rmax", "kernel k(a: f32[T, D]) -> (y: f32[T]) { y = max(a, D) }", {"a": normal(T, D)}),
    # the max of an expression: its gradient compares the stored (MATERIALIZE) entries with their max
    Case("rmax_of_expression", "kernel k(a: f32[T, D]) -> (y: f32[T]) { y = max(sin(a) * a, D) }",
         {"a": normal(T, D)}),
    Case("softmax", "kernel k(x: f32[T, D]) -> (y: f32[T, D]) "
         "{ m = max(x, D)\n e = exp(x - m)\n y = e / sum(e, D) }", {"x": normal(T, D)}),
    Case("broadcast_w", "kernel k(a: f32[T, D], w: f32[D]) -> (y: f32[T, D]) { y = a * w }",
         {"a": normal(T, D), "w": normal(D)}),
    Case("scalars", "kernel k(a: f32[T, D], alpha: f32, beta: f32) -> (y: f32[T, D]) { y = alpha * a * a + beta }",
         {"a": normal(T, D)}, scalars={"alpha": 0.7, "beta": -1.5}),
    Case("cos_sin", "kernel k(a: f32[T, D]) -> (y: f32[T, D]) { y = cos(a) * sin(2.0 * a) }", {"a": normal(T, D)}),
    Case("eq_index", "kernel k(a: f32[T, D]) -> (y: f32[T, D]) { y = a * eq(f32(index(D)), 1.0) + a * a }",
         {"a": normal(T, D)}),
    Case("shift", "kernel k(a: f32[T, D], w: f32[D]) -> (y: f32[T, D]) { y = a[T - 1, :] * w + a * a[T + 2, :] }",
         {"a": normal(T, D), "w": normal(D)}),
    # a causal conv over a window axis (LFM2's short conv): x[T - L] reads x[t - l] for each tap l
    Case("window_flip", "kernel k(x: f32[T, D], w: f32[D, L]) -> (y: f32[T, D]) { y = sum(flip(w, L) * x[T - L, :], L) }",
         {"x": normal(T, D), "w": normal(D, 3)}),
    Case("window_ahead", "kernel k(x: f32[T, D], w: f32[L]) -> (y: f32[T, D]) { y = sum(w * x[T + L, :] * x, L) }",
         {"x": normal(T, D), "w": normal(2)}),
    # the adjoint of a sum over T does not vary along T: the shift's rule repeats it over T first
    Case("shift_of_sum", "kernel k(a: f32[T, D]) -> (y: f32[D]) { y = sum(a[T - 1, :], T) * sum(a, T) }",
         {"a": normal(T, D)}),
    Case("take_stack", "kernel k(a: f32[T, 2, D]) -> (y: f32[T, 2, D]) "
         "{ y = stack(a[:, 0, :] * a[:, 1, :], sin(a[:, 0, :]), 2) }", {"a": normal(T, 2, D)}),
    Case("gather", "kernel k(e: f32[V, D], ids: i32[T], h: f32[T, D]) -> (y: f32[T, D]) { y = h * exp(gather(e, ids)) }",
         {"e": normal(6, D), "ids": lambda r: np.array([3, 0, 3, 5][:T] + [1] * max(0, T - 4), np.float64),
          "h": normal(T, D)}),
    # the table's adjoint: bucket_sort + segment_sum; ids over two axes, a row no id reaches
    Case("gather_slots", "kernel k(e: f32[V, D], ids: i32[T, K], w: f32[T, K]) -> (y: f32[T, D]) "
         "{ y = sum(w * sin(gather(e, ids)), K) }",
         {"e": normal(7, D), "ids": lambda r: r.integers(0, 6, (T, K)).astype(np.float64), "w": normal(T, K)}),
    # the gradient flows to the picked entries only (distinct values: no ties for the differences to cross)
    Case("topk", "kernel k(x: f32[T, E], s: f32[T, J]) -> (y: f32[T, J]) { v, i = topk(x, J)\n y = tanh(v) * s }",
         {"x": lambda r: r.permutation(T * E).reshape(T, E) * 0.37, "s": normal(T, 2)}),
    # experts over their own rows (ends: running sums, expert 1 empty); w a decode gather(table, codes) * s
    Case("grouped_matmul", "kernel k(x: f32[T, K], w: f32[E, N, K], ends: i32[E]) -> (y: f32[T, N]) "
         "{ y = grouped_matmul(x, w, ends) }",
         {"x": normal(T, K), "w": normal(E, N, K), "ends": lambda r: np.array([1.0, 1.0, T])}),
    Case("grouped_matmul_scaled", "kernel k(x: f32[T, K], w: f32[E, N, K], ends: i32[E], s: f32[T]) -> (y: f32[T, N]) "
         "{ y = tanh(grouped_matmul_scaled(x, w, ends, s)) }",
         {"x": normal(T, K), "w": normal(E, N, K), "ends": lambda r: np.array([0.0, 2.0, T]), "s": normal(T)}),
    # dy arrives as a broadcast of sum(y, T)'s adjoint [N]: dy * scale must still be laid out [T, N]
    Case("grouped_matmul_scaled_summed", "kernel k(x: f32[T, K], w: f32[E, N, K], ends: i32[E], s: f32[T]) -> (y: f32[N]) "
         "{ y = sum(grouped_matmul_scaled(x, w, ends, s), T) }",
         {"x": normal(T, K), "w": normal(E, N, K), "ends": lambda r: np.array([1.0, 1.0, T]), "s": normal(T)}),
    Case("grouped_matmul_decoded", "kernel k(x: f32[T, K], tab: f32[V], c: i32[E, N, K], b: f32[E, N], ends: i32[E], "
         "s: f32[T]) -> (y: f32[T, N]) { y = grouped_matmul_scaled(x, gather(tab, c) * b, ends, s) }",
         {"x": normal(T, K), "tab": normal(4), "c": lambda r: r.integers(0, 4, (E, N, K)).astype(np.float64),
          "b": normal(E, N), "ends": lambda r: np.array([2.0, 2.0, T]), "s": normal(T)}),
    Case("contraction", "kernel k(x: f32[T, K], w: f32[N, K]) -> (y: f32[T, N]) { y = sum(x * w, K) }",
         {"x": normal(T, K), "w": normal(N, K)}),
    Case("contraction_kn", "kernel k(x: f32[T, K], w: f32[K, N]) -> (y: f32[T, N]) { y = sum(x * w, K) }",
         {"x": normal(T, K), "w": normal(K, N)}),
    # w's adjoints arrive as [N, K] (from the contraction) and [K, N] (elementwise): summed by name
    Case("adjoint_orders", "kernel k(x: f32[T, K], w: f32[K, N]) -> (y: f32[T, N], z: f32[K, N]) "
         "{ y = sum(x * w, K)\n z = w * w }", {"x": normal(T, K), "w": normal(K, N)}),
    Case("adjoint_orders_bcast", "kernel k(x: f32[T, K], w: f32[K, N]) -> (y: f32[T, N]) "
         "{ y = sum(x * w, K) + sum(w, K) }", {"x": normal(T, K), "w": normal(K, N)}),
    Case("batched", "kernel k(a: f32[H, M, E], b: f32[H, S, E]) -> (c: f32[H, M, S]) { c = sum(a * b, E) }",
         {"a": normal(HD, M, E), "b": normal(HD, S, E)}),
    Case("chain", "kernel k(a: f32[T, D]) -> (y: f32[T, D]) { h = tanh(a)\n y = h * h + sigmoid(h) - h / 3.0 }",
         {"a": normal(T, D)}),
    Case("rmsnorm", "kernel k(x: f32[T, D], w: f32[D], eps: f32) -> (y: f32[T, D], inv: f32[T]) "
         "{ inv = rsqrt(mean(x * x, D) + eps)\n y = x * inv * w }",
         {"x": normal(T, D), "w": normal(D)}, scalars={"eps": 1e-5}),
    Case("rmsnorm_y_only", "kernel k(x: f32[T, D], w: f32[D], eps: f32) -> (y: f32[T, D], inv: f32[T]) "
         "{ inv = rsqrt(mean(x * x, D) + eps)\n y = x * inv * w }",
         {"x": normal(T, D), "w": normal(D)}, scalars={"eps": 1e-5}, cotangents=["y"]),
    Case("broadcast_output", "kernel k(a: f32[T, D], w: f32[D]) -> (y: f32[T, D], z: f32[T, D]) "
         "{ z = exp(w)\n y = a * z }", {"a": normal(T, D), "w": normal(D)}),
    Case("wrt_subset", f"kernel k({TD}) -> (y: f32[T, D]) {{ y = a * exp(b) }}",
         {"a": normal(T, D), "b": normal(T, D)}, wrt=["b"]),
    Case("unused_input", f"kernel k({TD}) -> (y: f32[T, D]) {{ y = a * 2.0 }}",
         {"a": normal(T, D), "b": normal(T, D)}),
    Case("integer_ops", "kernel k(a: f32[T, D], c: i32[T, D], u: u32[T, D]) -> (y: f32[T, D]) "
         "{ y = a * a * f32(((c >> 1) & 3) | (c << 2) % 7) + a * f32((u >> 3) % 5 | (u & 6)) }",
         lambda r: {"a": r.standard_normal((T, D)), "c": r.integers(-50, 50, (T, D)),
                    "u": r.integers(0, 1000, (T, D))}),
    Case("identity", "kernel k(a: f32[T, D]) -> (y: f32[T, D], z: f32[T, D]) { y = a\n z = a * a }",
         {"a": normal(T, D)}),
]


def _ops(ir: KernelIR) -> set[Op]:
    return {n.op for n in toposort(ir.results.values())}


def _loss(fwd: KernelIR, inputs, scalars, cot) -> float:
    outs = evaluate(fwd, inputs, scalars, {})
    return float(sum(np.sum(c * outs[o]) for o, c in cot.items()))


def _fd_grad(fwd: KernelIR, inputs, scalars, cot, name) -> np.ndarray:
    x = inputs[name]
    g = np.zeros_like(x)
    for idx in np.ndindex(x.shape):
        vals = []
        for sign in (1.0, -1.0):
            xs = x.copy()
            xs[idx] += sign * H
            vals.append(_loss(fwd, {**inputs, name: xs}, scalars, cot))
        g[idx] = (vals[0] - vals[1]) / (2 * H)
    return g


def _backward_inputs(fwd: KernelIR, bwd: KernelIR, inputs, outs, cot) -> dict[str, np.ndarray]:
    given = {}
    for t in bwd.inputs:
        if t.name in inputs:
            given[t.name] = inputs[t.name]
        elif t.name in outs:                      # a saved forward output
            given[t.name] = outs[t.name]
        elif t.name.startswith("d_") and t.name[2:] in cot:
            given[t.name] = cot[t.name[2:]]
        else:
            raise AssertionError(f"backward input {t.name!r} is neither a forward input, output nor cotangent")
    return given


@pytest.mark.parametrize("case", CASES, ids=[c.id for c in CASES])
def test_rule_matches_finite_differences(case: Case):
    r = np.random.default_rng(sum(map(ord, case.id)))
    fwd = case.kernel()
    inputs = case.make_inputs(r)
    bwd = grad_ir(fwd, case.wrt, case.cotangents)
    outs = evaluate(fwd, inputs, case.scalars, {})
    cot_names = case.cotangents if case.cotangents is not None else [o.name for o in fwd.outputs]
    cot = {o: r.standard_normal(outs[o].shape) for o in cot_names}
    grads = evaluate(bwd, _backward_inputs(fwd, bwd, inputs, outs, cot), case.scalars, {})

    wrt = case.wrt if case.wrt is not None else [t.name for t in fwd.inputs if t.dtype in ("f32", "f16")]
    assert sorted(grads) == sorted(f"d_{n}" for n in wrt)
    for name in wrt:
        got = grads[f"d_{name}"]
        want = _fd_grad(fwd, inputs, case.scalars, cot, name)
        assert got.shape == inputs[name].shape
        err = rel_err(got, want)
        assert err < TOL, f"{case.id}: d_{name} rel err {err:.3g}\ngot\n{got}\nwant\n{want}"


SHIFT_OF_SUM = next(c for c in CASES if c.id == "shift_of_sum")


def test_second_order_through_an_explicit_broadcast():
    """The backward of shift_of_sum holds a BROADCAST (the sum's adjoint repeated over T before it
    is shifted); differentiating that backward again exercises the BROADCAST rule."""
    r = np.random.default_rng(7)
    bwd = grad_ir(SHIFT_OF_SUM.kernel())
    assert Op.BROADCAST in _ops(bwd)
    inputs = {"a": r.standard_normal((T, D)), "d_y": r.standard_normal(D)}
    outs = evaluate(bwd, inputs, {}, {})
    cot = {"d_a": r.standard_normal(outs["d_a"].shape)}
    grads = evaluate(grad_ir(bwd, ["d_y", "a"]), {**inputs, "d_d_a": cot["d_a"]}, {}, {})
    for name in ("d_y", "a"):
        err = rel_err(grads[f"d_{name}"], _fd_grad(bwd, inputs, {}, cot, name))
        assert err < TOL, f"second order d_{name}: rel err {err:.3g}"


RMAX_OF_EXPRESSION = next(c for c in CASES if c.id == "rmax_of_expression")


def test_second_order_through_a_materialized_maximum():
    """Differentiating the backward of max(sin(a) * a, D) again passes through MATERIALIZE."""
    r = np.random.default_rng(8)
    bwd = grad_ir(RMAX_OF_EXPRESSION.kernel())
    assert Op.MATERIALIZE in _ops(bwd)
    inputs = {"a": r.standard_normal((T, D)), "d_y": r.standard_normal(T)}
    cot = {"d_a": r.standard_normal((T, D))}
    grads = evaluate(grad_ir(bwd, ["d_y"]), {**inputs, "d_d_a": cot["d_a"]}, {}, {})
    err = rel_err(grads["d_d_y"], _fd_grad(bwd, inputs, {}, cot, "d_y"))
    assert err < TOL, f"second order d_d_y: rel err {err:.3g}"


def test_every_rule_is_exercised():
    seen = set().union(*(_ops(c.kernel()) for c in CASES), _ops(grad_ir(SHIFT_OF_SUM.kernel())),
                       _ops(grad_ir(RMAX_OF_EXPRESSION.kernel())))
    missing = sorted(op.name for op in RULES if op not in seen)
    assert not missing, f"no finite-difference case uses {missing}"


def test_op_without_rule_is_an_error(monkeypatch):
    ir = compile_source("kernel k(a: f32[T, D]) -> (y: f32[T, D]) { y = tanh(a) * 2.0 }").k.ir
    monkeypatch.delitem(RULES, Op.TANH)
    with pytest.raises(AutodiffError, match="TANH"):
        grad_ir(ir)


def test_comparisons_pass_no_gradient():
    ir = compile_source(f"kernel k({TD}) -> (y: f32[T, D]) {{ y = (a > b) + (a < b) }}").k.ir
    bwd = grad_ir(ir)
    r = np.random.default_rng(0)
    grads = evaluate(bwd, {"d_y": r.standard_normal((T, D))}, {}, {"T": T, "D": D})
    assert np.all(grads["d_a"] == 0) and np.all(grads["d_b"] == 0)


def test_grad_wrt_non_float_input_names_it():
    ir = compile_source("kernel k(a: f32[T, D], idx: i32[T, D]) -> (y: f32[T, D]) { y = a * f32(idx) }").k.ir
    assert [t.name for t in grad_ir(ir).outputs] == ["d_a"]      # default: float inputs only
    with pytest.raises(AutodiffError, match="'idx'"):
        grad_ir(ir, wrt=["idx"])


def test_grad_wrt_unknown_input_names_it():
    ir = compile_source("kernel k(a: f32[T, D]) -> (y: f32[T, D]) { y = a * a }").k.ir
    with pytest.raises(AutodiffError, match="'nope'"):
        grad_ir(ir, wrt=["nope"])
    with pytest.raises(AutodiffError, match="'z'"):
        grad_ir(ir, cotangents=["z"])


RMS = """
kernel rms(x: f32[T, D], w: f32[D], eps: f32) -> (y: f32[T, D], inv: f32[T]) {
    inv = rsqrt(mean(x * x, D) + eps)
    y = x * inv * w
}
"""


def test_saved_outputs_are_reused():
    """The backward reads the forward's `inv` instead of recomputing the row reduction."""
    ir = compile_source(RMS).rms.ir
    bwd = grad_ir(ir, cotangents=["y"])
    names = [t.name for t in bwd.inputs]
    assert "inv" in names and "d_y" in names and "d_inv" not in names
    # inv is read, not recomputed: the only reduction over D left is the one the chain rule needs
    sums = [n for n in toposort(bwd.results.values()) if n.op == Op.SUM and n.arg == "D"]
    assert len(sums) == 1 and not any(n.op == Op.RSQRT for n in toposort(bwd.results.values()))


def test_saved_output_with_broadcast_value_keeps_shapes_consistent():
    """An output declared wider than its value (z = exp(w) stored as [T, D]) must not replace the
    narrower node inside the backward graph: every node's sources fit within its shape."""
    ir = compile_source("kernel k(a: f32[T, D], w: f32[D]) -> (y: f32[T, D], z: f32[T, D]) "
                        "{ z = exp(w)\n y = a * z }").k.ir
    bwd = grad_ir(ir)
    for n in toposort(bwd.results.values()):
        for s in n.srcs:
            assert set(s.shape) <= set(n.shape) or n.op in (Op.SUM, Op.RMAX), f"{s} under {n}"


def test_interpreter_matches_numpy():
    """The reference itself: forward kernels evaluated by ir_eval equal direct numpy."""
    r = np.random.default_rng(7)
    x, w, wkn = r.standard_normal((T, D)), r.standard_normal(D), r.standard_normal((K, N))
    xk, a3, b3 = r.standard_normal((T, K)), r.standard_normal((HD, M, E)), r.standard_normal((HD, S, E))
    mod = compile_source(RMS + """
kernel sm(x: f32[T, D]) -> (y: f32[T, D], lse: f32[T]) {
    m = max(x, D)
    e = exp(x - m)
    y = e / sum(e, D)
    lse = m + log(sum(e, D))
}
kernel lin(x: f32[T, K], w: f32[K, N]) -> (y: f32[T, N]) { y = sum(x * w, K) }
kernel bmm(a: f32[H, M, E], b: f32[H, S, E]) -> (c: f32[H, M, S]) { c = sum(a * b, E) }
kernel misc(x: f32[T, D], w: f32[D], i: i32[T, D]) -> (y: f32[T, D], z: f32[T, D], q: i32[T, D]) {
    y = where(x > w, sigmoid(x), silu(w)) + f32(i) * abs(w)
    z = w
    q = i / 2
}
""")
    out = evaluate(mod.rms.ir, {"x": x, "w": w}, {"eps": 1e-5})
    inv = 1 / np.sqrt((x * x).mean(-1) + 1e-5)
    assert np.allclose(out["inv"], inv, rtol=1e-14) and np.allclose(out["y"], x * inv[:, None] * w, rtol=1e-14)
    out = evaluate(mod.sm.ir, {"x": x}, {})
    e = np.exp(x)
    assert np.allclose(out["y"], e / e.sum(-1, keepdims=True), rtol=1e-14)
    assert np.allclose(out["lse"], np.log(e.sum(-1)), rtol=1e-14)
    assert np.allclose(evaluate(mod.lin.ir, {"x": xk, "w": wkn})["y"], xk @ wkn, rtol=1e-14)
    assert np.allclose(evaluate(mod.bmm.ir, {"a": a3, "b": b3})["c"], np.einsum("hme,hse->hms", a3, b3), rtol=1e-14)
    i = r.integers(-5, 6, (T, D)).astype(np.float64)
    out = evaluate(mod.misc.ir, {"x": x, "w": w, "i": i})
    sig = 1 / (1 + np.exp(-x))
    assert np.allclose(out["y"], np.where(x > w, sig, w / (1 + np.exp(-w))) + i * np.abs(w), rtol=1e-14)
    assert out["z"].shape == (T, D) and np.all(out["z"] == w)     # an output wider than its value
    assert np.all(out["q"] == np.trunc(i / 2))                       # integer division truncates
