"""The f16 path (lfm2jit/precision.py): activations stored as f16, parameters, gradients and statistics f32.

Tolerances. f16 keeps 11 significant bits: each stored activation is off by at most u = 2**-11 = 4.9e-4
relative. Every layer stores about ten activations in a chain (norm, projections, conv or attention,
SwiGLU, residual), and the backward pass as many again, so errors of a few u per layer are expected:
measured on the golden configs, logits 1-2e-3, gradients at most 3.5e-3 and the loss 1e-5 relative.
The bounds below (logits 1e-2 = 20u, gradients 2e-2 = 40u) hold that with room for other GPUs' f32
arithmetic, and are still far below what a wrong kernel (errors of order 1) would give.
"""
from __future__ import annotations

import types

import numpy as np
import pytest
from safetensors.numpy import load_file

from lfm2jit.model import Lfm2Model
from lfm2jit.model.layers import AttentionSaved
from lfm2jit.ops.precision import check_activation_dtype
from trainer import SGD, AdamW, GradScaler, Trainer
from numerics import rel_err
from test_model import BUCKET, GOLDEN, GOLDEN_CONFIGS, run_loss_and_grads, worst
from micro_model import make_data, micro, snap

LOGITS_TOL, GRAD_TOL, LOSS_TOL = 1e-2, 2e-2, 1e-3


@pytest.fixture(autouse=True)
def needs_f16(ctx):
    if not ctx.has_f16:
        pytest.skip("adapter has no shader-f16")


@pytest.mark.parametrize("name", GOLDEN_CONFIGS)
def test_golden_configs_in_f16_match_transformers(ctx, engine, name):
    _check_golden_f16(ctx, engine, name)


@pytest.mark.parametrize("name", GOLDEN_CONFIGS)
def test_golden_configs_in_f16_on_the_matrix_units_match_transformers(ctx, matrix_engine, name, monkeypatch):
    """The same on the matrix templates (the device's subgroup matrices, or emulated where it has none):
    every f16 product of the forward and backward goes through them, within the same bounds."""
    templates = []
    compile_ = matrix_engine.compile

    def spy(*args, **kw):
        compiled = compile_(*args, **kw)
        templates.append(compiled.spec.template)
        return compiled
    monkeypatch.setattr(matrix_engine, "compile", spy)
    _check_golden_f16(ctx, matrix_engine, name)
    assert templates.count("matmul_matrix") >= 3 * 4, sorted(set(templates))   # forward, dX, dW of the layers


def _check_golden_f16(ctx, engine, name):
    d = GOLDEN / name
    data, want = load_file(str(d / "golden.safetensors")), load_file(str(d / "grads.safetensors"))
    model = Lfm2Model.from_pretrained(d, ctx, engine, activation_dtype="f16")
    logits = model.logits(data["input_ids"], bucket=BUCKET)
    assert logits.dtype == np.float32
    assert rel_err(logits, data["logits"]) < LOGITS_TOL
    loss, grads = run_loss_and_grads(model, data["input_ids"], data["targets"], data["loss_mask"])
    want_loss = float(data["loss"][0])
    assert abs(loss - want_loss) / want_loss < LOSS_TOL
    err, worst_name = worst(grads, want)
    assert err < GRAD_TOL, f"{worst_name}: relative error {err:.3g}"


def test_activations_are_f16_and_parameters_stay_f32(ctx, engine):
    cfg = micro()
    model = Lfm2Model(cfg, ctx, engine, seed=1, activation_dtype="f16")
    trace = model.forward(np.arange(1, 12), bucket=16)
    assert trace.h_in.dtype == trace.hn.dtype == "f16"
    for mixer, mlp in trace.layers:
        assert mixer.h.dtype == mlp.a.dtype == mlp.b.dtype == "f16"
        assert mixer.inv.dtype == "f32"                         # statistics stay f32
        if isinstance(mixer, AttentionSaved):
            assert mixer.o.dtype == "f16" and mixer.lse.dtype == "f32"
    model.zero_grad()
    model.backward(trace, engine.tensor(np.ones((11, cfg.hidden_size), np.float16)), model.parameters())
    for name, t in model.named_parameters().items():
        assert t.dtype == t.grad.dtype == "f32", name
        assert np.isfinite(t.grad.numpy()).all(), name


def test_bad_activation_dtype_and_missing_shader_f16_are_clear_errors(ctx, engine):
    with pytest.raises(ValueError, match="activation dtype must be one of f32, f16, got 'bf16'"):
        Lfm2Model(micro(), ctx, engine, activation_dtype="bf16")
    no_f16 = types.SimpleNamespace(has_f16=False, name="SomeGPU")
    with pytest.raises(ValueError, match="shader-f16 feature, which adapter 'SomeGPU' lacks"):
        check_activation_dtype("f16", no_f16)


def test_f16_training_follows_f32_training(ctx, engine):
    """Six SGD steps on one sequence with a loss scaler: per-step losses track the f32 run, the loss
    falls, and each weight's total update (lr times the summed gradients, so as accurate as the
    gradients) agrees with the f32 run's within GRAD_TOL."""
    cfg = micro()
    data = make_data(cfg, [14], seed=23) * 6
    runs = []
    for dtype in ("f32", "f16"):
        model = Lfm2Model(cfg, ctx, engine, seed=7, activation_dtype=dtype)
        start = snap(model)
        tr = (Trainer(model, SGD(lr=0.2, momentum=0.9), ctx, engine).with_length_bucket(16)
              .with_clip_grad_norm(1.0).with_grad_scaler(GradScaler()))
        losses = [tr.train_step_masked(i, t, m, model.parameters()).loss for i, t, m in data]
        runs.append((losses, {n: w - start[n] for n, w in snap(model).items()}))
    (l32, u32), (l16, u16) = runs
    assert l16 == pytest.approx(l32, rel=LOSS_TOL)
    assert l16[-1] < 0.9 * l16[0]
    err, name = worst(u16, u32)
    assert err < GRAD_TOL, f"{name}: update relative error {err:.3g}"


def test_f16_gradient_overflow_skips_the_step_and_backs_off(ctx, engine):
    """A loss scale of 2**40 overflows f16 activation gradients (max 65504): the inf reaches the
    f32 parameter gradients, the GPU norm pass reports it, the step is skipped and the scale halves."""
    cfg = micro()
    model = Lfm2Model(cfg, ctx, engine, seed=3, activation_dtype="f16")
    scaler = GradScaler(init_scale=2.0 ** 40)
    tr = Trainer(model, AdamW(lr=1e-2), ctx, engine).with_length_bucket(16).with_grad_scaler(scaler)
    (ids, tgt, mask), = make_data(cfg, [12], seed=29)
    before = snap(model)
    s = tr.train_step_masked(ids, tgt, mask, model.parameters())
    assert s.skipped and not s.stepped and scaler.scale == 2.0 ** 39 and tr.optimizer_steps() == 0
    after = snap(model)
    for n in before:
        assert np.array_equal(after[n], before[n]), n
    scaler.scale = 2.0 ** 8
    s = tr.train_step_masked(ids, tgt, mask, model.parameters())
    assert s.stepped and not s.skipped and tr.optimizer_steps() == 1


def test_variants_keep_named_tensors_f32_and_reject_unknown_names():
    from lfm2jit import library
    lin = library.get("linear")
    mixed = lin.variant("f16", keep={"w"})
    assert {t.name: t.dtype for t in mixed.ir.inputs + mixed.ir.outputs} == {"x": "f16", "w": "f32", "r": "f16",
                                                                            "y": "f16"}
    assert mixed is lin.variant("f16", keep=frozenset({"w"}))             # memoised
    assert lin.variant("f16", keep={"x", "w", "r", "y"}) is lin            # nothing left to retype
    with pytest.raises(ValueError, match=r"cannot keep \['nope'\] in f32: the kernel has no such tensors"):
        lin.variant("f16", keep={"nope"})
    with pytest.raises(ValueError, match="storage precision must be f32 or f16, got 'bf16'"):
        lin.variant("bf16")
