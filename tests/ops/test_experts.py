"""The MoE experts' SwiGLU MLPs (ops/experts.py over kernels/experts.lk) against torch autograd on a
per-expert loop in float64: y, and the gradients of x, the combine weights and both fused weights,
with empty experts and slots no expert owns; the frozen f16 base (no weight gradients)."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from lfm2jit import grad, library
from lfm2jit.ops.experts import experts_backward, experts_forward


def _case(rng, E, S, D, I, owned, weights_dtype=np.float32):
    counts = rng.multinomial(owned, rng.dirichlet(np.ones(E)))
    counts[rng.random(E) < 0.25] = 0
    return dict(x=rng.standard_normal((S, D)).astype(np.float32),
                gate_up=(rng.standard_normal((E, 2 * I, D)) / np.sqrt(D)).astype(weights_dtype),
                down=(rng.standard_normal((E, D, I)) / np.sqrt(I)).astype(weights_dtype),
                ends=np.cumsum(counts).astype(np.int32),
                scale=rng.random(S).astype(np.float32),
                d_y=rng.standard_normal((S, D)).astype(np.float32))


def _torch(case):
    """y and the gradients of sum(y * d_y) over the owned slots, one expert at a time (as
    transformers' Lfm2MoeExperts loops), in float64."""
    t = {k: torch.tensor(case[k].astype(np.float64), requires_grad=True)
         for k in ("x", "gate_up", "down", "scale")}
    ends = case["ends"]
    I = case["down"].shape[2]
    outs = []
    start = 0
    for e, end in enumerate(ends):
        x = t["x"][start:end]
        h1 = x @ t["gate_up"][e, :I].T
        h3 = x @ t["gate_up"][e, I:].T
        outs.append(t["scale"][start:end, None] * ((torch.nn.functional.silu(h1) * h3) @ t["down"][e].T))
        start = end
    y = torch.cat(outs)
    (y * torch.tensor(case["d_y"][:int(ends[-1])].astype(np.float64))).sum().backward()
    return y.detach().numpy(), {k: v.grad.numpy() for k, v in t.items()}


def _close(got, want, tol):
    err = np.abs(got - want).max(initial=0.0)
    assert err <= tol * max(1.0, np.abs(want).max(initial=0.0)), err


def _run(engine, case, weights=True, bucket=1, keep_h=True):
    tensors = {k: engine.tensor(v) for k, v in case.items() if k != "d_y"}
    y, saved = experts_forward(engine, tensors["x"], tensors["gate_up"], tensors["down"], tensors["ends"],
                               tensors["scale"], bucket=bucket, keep_h=keep_h)
    assert (saved.h is None) == (not keep_h)
    grads = experts_backward(engine, tensors["x"], tensors["gate_up"], tensors["down"], tensors["ends"],
                             tensors["scale"], saved, engine.tensor(case["d_y"]), bucket=bucket, weights=weights)
    return y.numpy(), {k: v.numpy() for k, v in grads.items()}


@pytest.mark.parametrize("seed", range(4))
def test_expert_mlps_and_their_gradients_match_torch(engine, seed):
    rng = np.random.default_rng(seed)
    E = int(rng.integers(1, 9))
    D, I = int(rng.choice([8, 24, 36])), int(rng.choice([4, 16, 20]))
    S = int(rng.integers(5, 120))
    owned = S if seed % 2 else int(rng.integers(1, S + 1))
    case = _case(rng, E, S, D, I, owned)
    y, grads = _run(engine, case, bucket=16 if seed == 3 else 1)
    want_y, want = _torch(case)
    v = int(case["ends"][-1])
    _close(y[:v], want_y, 1e-5)
    _close(grads["d_x"][:v], want["x"][:v], 1e-5)
    _close(grads["d_scale"][:v], want["scale"][:v], 1e-5)
    _close(grads["d_gate_up"], want["gate_up"], 1e-5)
    _close(grads["d_down"], want["down"], 1e-5)


@pytest.mark.parametrize("seed", range(3))
def test_a_forward_that_keeps_no_h_gives_the_same_gradients_bit_for_bit(engine, seed):
    """keep_h=False (the model's recompute_mlp): the backward's gate_up GEMM again, on the same
    inputs with the same kernel, so nothing the backward returns may differ."""
    rng = np.random.default_rng(100 + seed)
    case = _case(rng, int(rng.integers(2, 7)), int(rng.integers(8, 70)), 24, 12, int(rng.integers(4, 8)))
    y_kept, kept = _run(engine, case, bucket=16 if seed else 1)
    y_again, again = _run(engine, case, bucket=16 if seed else 1, keep_h=False)
    np.testing.assert_array_equal(y_again, y_kept)
    assert set(again) == set(kept)
    for name in kept:
        np.testing.assert_array_equal(again[name], kept[name], err_msg=name)


def test_a_frozen_f16_base_gives_input_and_combine_gradients_only(engine):
    rng = np.random.default_rng(7)
    case = _case(rng, 6, 90, 32, 16, 85, np.float16)
    y, grads = _run(engine, case, weights=False)
    want_y, want = _torch(case)          # on the f16 weights' own values
    v = int(case["ends"][-1])
    assert set(grads) == {"d_x", "d_scale"}
    # on the matrix units (a device's) a product with f16 weights stages its f32 input as f16
    tol = 3e-3 if engine.target.matrix_configs else 1e-5
    _close(y[:v], want_y, tol)
    _close(grads["d_x"][:v], want["x"][:v], tol)
    _close(grads["d_scale"][:v], want["scale"][:v], tol)


def test_weight_gradients_accumulate_into_the_tensors_given(engine):
    """Gradient accumulation: d_gate_up and d_down added into what the caller's tensors hold."""
    rng = np.random.default_rng(8)
    case = _case(rng, 3, 40, 16, 8, 40)
    _, want = _torch(case)
    old = {"d_gate_up": rng.standard_normal(case["gate_up"].shape).astype(np.float32),
           "d_down": rng.standard_normal(case["down"].shape).astype(np.float32)}
    t = {k: engine.tensor(v) for k, v in case.items() if k != "d_y"}
    out = {k: engine.tensor(v) for k, v in old.items()}
    _, saved = experts_forward(engine, t["x"], t["gate_up"], t["down"], t["ends"], t["scale"])
    grads = experts_backward(engine, t["x"], t["gate_up"], t["down"], t["ends"], t["scale"], saved,
                             engine.tensor(case["d_y"]), out=out, accumulate={"d_gate_up", "d_down"})
    assert grads["d_gate_up"] is out["d_gate_up"] and grads["d_down"] is out["d_down"]
    _close(out["d_gate_up"].numpy(), old["d_gate_up"] + want["gate_up"], 1e-5)
    _close(out["d_down"].numpy(), old["d_down"] + want["down"], 1e-5)


@pytest.mark.parametrize("fmt,seed", [("nf4", 0), ("nf4", 1), ("int8", 2), ("int8", 3)])
def test_a_quantized_base_is_decoded_in_the_grouped_gemms(engine, fmt, seed):
    """Experts held as NF4 / int8 (QuantizedWeight): y, d_x and d_scale equal torch on the dequantized
    weights; the kernels bind the packed words and no temporary of the weights' size."""
    from lfm2jit.model.quantized_base import QuantizedWeight
    from lfm2jit.ops import quantized
    rng = np.random.default_rng(20 + seed)
    E, S, D, I = int(rng.integers(2, 7)), int(rng.integers(20, 90)), int(rng.choice([24, 36])), int(rng.choice([12, 20]))
    case = _case(rng, E, S, D, I, S - seed)
    held = {n: QuantizedWeight(engine.ctx, n, case[n], fmt) for n in ("gate_up", "down")}
    t = {k: engine.tensor(v) for k, v in case.items() if k not in ("d_y", "gate_up", "down")}
    y, saved = experts_forward(engine, t["x"], held["gate_up"], held["down"], t["ends"], t["scale"], bucket=16)
    grads = experts_backward(engine, t["x"], held["gate_up"], held["down"], t["ends"], t["scale"], saved,
                             engine.tensor(case["d_y"]), bucket=16, weights=False)
    want_y, want = _torch({**case, **{n: w.numpy() for n, w in held.items()}})
    v = int(case["ends"][-1])
    _close(y.numpy()[:v], want_y, 1e-5)
    _close(grads["d_x"].numpy()[:v], want["x"][:v], 1e-5)
    _close(grads["d_scale"].numpy()[:v], want["scale"][:v], 1e-5)
    packed = {f"gate_up_{k}": v.shape[0] for k, v in held["gate_up"].tensors.items()}
    sizes = {"T": 32, "E": E, "F": 2 * I, "D": D} | ({"gate_up_P": packed["gate_up_q"], "gate_up_B": packed["gate_up_s"],
                                                     "gate_up_C": 16} if fmt == "nf4" else {"gate_up_P": packed["gate_up_q"]})
    for k in (quantized.decoded("expert_gate_up", "gate_up", fmt),
              quantized.decoded(grad(library.get("expert_gate_up"), wrt=["x"]), "gate_up", fmt)):
        (part,) = k.kernels
        names = {b.tensor for b in part.specialize(sizes, 16).bindings}
        assert "gate_up_q" in names and not any(n.startswith("tmp") for n in names), names


@pytest.mark.parametrize("fmt", ["nf4", "int8"])
def test_a_quantized_base_with_f16_activations_runs_on_the_matrix_template(matrix_engine, fmt):
    """--f16 on a quantized base: the grouped GEMMs on the matrix units (emulated on lavapipe), the
    decoded weight staged as f16; against torch on the dequantized weights within f16 rounding."""
    from lfm2jit.model.quantized_base import QuantizedWeight
    engine = matrix_engine
    rng = np.random.default_rng(31)
    case = _case(rng, 4, 70, 32, 16, 66)
    held = {n: QuantizedWeight(engine.ctx, n, case[n], fmt) for n in ("gate_up", "down")}
    t = {k: engine.tensor(v) for k, v in case.items() if k not in ("d_y", "gate_up", "down")}
    x16 = engine.tensor(case["x"].astype(np.float16))
    y, saved = experts_forward(engine, x16, held["gate_up"], held["down"], t["ends"], t["scale"], bucket=16,
                               dtype="f16")
    grads = experts_backward(engine, x16, held["gate_up"], held["down"], t["ends"], t["scale"], saved,
                             engine.tensor(case["d_y"].astype(np.float16)), bucket=16, weights=False, dtype="f16")
    assert y.dtype == "f16"
    from lfm2jit.ops import quantized
    packed = {f"gate_up_{k}": v for k, v in held["gate_up"].tensors.items()}
    kernel = quantized.decoded("expert_gate_up", "gate_up", fmt).variant("f16", set(packed) | {"ends"})
    sizes = {"E": 4, "F": 32, "D": 32, "gate_up_P": packed["gate_up_q"].shape[0]}
    sizes |= {"gate_up_B": packed["gate_up_s"].shape[0], "gate_up_C": 16} if fmt == "nf4" else {}
    assert kernel.specialize(sizes | {"T": 70}, 16, target=engine.target).template == "matmul_matrix"
    want_y, want = _torch({**case, "x": case["x"].astype(np.float16).astype(np.float32),
                           **{n: w.numpy() for n, w in held.items()}})
    v = int(case["ends"][-1])
    _close(y.numpy()[:v].astype(np.float64), want_y, 1e-2)
    _close(grads["d_x"].numpy()[:v].astype(np.float64), want["x"][:v], 1e-2)
    _close(grads["d_scale"].numpy()[:v], want["scale"][:v], 1e-2)
