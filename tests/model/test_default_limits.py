"""Published LFM2 shapes on a device with exactly WebGPU's default limits (LFM2JIT_LIMITS=default:
128 MiB bindings, 256 MiB buffers, 8 storage buffers a kernel), where LFM2-350M's f32 embedding
(256 MiB) and LFM2-1.2B's f16 one already need several bindings (schedule/pieces.py).

Each model is run twice on this adapter, with default and with raised limits, and against
transformers on a random-init checkpoint of the same shapes. Large: each runs once in CI, at a
short length.
"""
from __future__ import annotations

import gc

import numpy as np
import pytest

from numerics import rel_err
from lfm2jit import ComputeEngine
from lfm2jit.model import LoraConfig, Lfm2Config, Lfm2Model
from lfm2jit.schedule.pieces import piece_bytes
from trainer import AdamW, Trainer

torch = pytest.importorskip("torch", reason="transformers is the reference")
transformers = pytest.importorskip("transformers")

pytestmark = pytest.mark.large
T = 12


def hf_model(preset: str, seed: int):
    """transformers' Lfm2ForCausalLM with the preset's shapes (the real 65536-entry vocabulary), seeded."""
    cfg = Lfm2Config.preset(preset)
    torch.manual_seed(seed)
    return transformers.Lfm2ForCausalLM(transformers.Lfm2Config(**cfg.to_dict())).float().eval()


def weights(hf, dtype=np.float32) -> dict[str, np.ndarray]:
    return {n: t.detach().numpy().astype(dtype) for n, t in hf.state_dict().items()}


def inputs(vocab: int, seed: int):
    rng = np.random.default_rng(seed)
    return rng.integers(0, vocab, T), rng.integers(0, vocab, T)


def hf_loss_and_grads(hf, ids, targets, names) -> tuple[np.ndarray, float, dict[str, np.ndarray]]:
    """transformers' float32 logits, mean cross-entropy and the named parameters' gradients."""
    hf.zero_grad()
    logits = hf(input_ids=torch.as_tensor(ids)[None]).logits[0]
    loss = torch.nn.functional.cross_entropy(logits, torch.as_tensor(targets))
    loss.backward()
    named = dict(hf.named_parameters())
    grads = {n: named[n].grad.detach().numpy().copy() for n in names}
    hf.zero_grad(set_to_none=True)
    return logits.detach().numpy(), float(loss), grads


def bound_in_pieces(model: Lfm2Model) -> bool:
    """Whether the model's embedding is larger than one binding of its engine's device."""
    return model.named_parameters()["model.embed_tokens.weight"].nbytes > piece_bytes(model.engine.target)


@pytest.mark.parametrize("activations", ["f32", "f16"])
def test_350m_logits_and_a_full_training_step_under_default_limits(default_limits_ctx, raised_ctx, activations):
    hf = hf_model("350M", seed=3)
    ids, targets = inputs(hf.config.vocab_size, seed=4)
    names = ["model.embed_tokens.weight", "model.layers.0.conv.in_proj.weight", "model.layers.2.self_attn.q_proj.weight"]
    want_logits, want_loss, want_grads = hf_loss_and_grads(hf, ids, targets, names)
    tensors = weights(hf)
    del hf
    results = {}
    for mode, ctx in (("default", default_limits_ctx), ("raised", raised_ctx)):
        engine = ComputeEngine(ctx)
        model = Lfm2Model(Lfm2Config.preset("350M"), ctx, engine, tensors=tensors, activation_dtype=activations)
        assert bound_in_pieces(model) == (mode == "default")
        logits = model.logits(ids, bucket=16)
        params = model.parameters()
        before = {n: model.named_parameters()[n].numpy() for n in names}
        trainer = Trainer(model, AdamW(lr=1e-3, weight_decay=0.0), ctx, engine).with_length_bucket(16)
        stats = trainer.train_step(ids, targets, params)
        after = {n: model.named_parameters()[n].numpy() for n in names}
        results[mode] = logits, stats, before, after
        del model, trainer, params, engine
        gc.collect()
    (logits, stats, before, after), (r_logits, r_stats, _, r_after) = results["default"], results["raised"]
    tol = 1e-4 if activations == "f32" else 2e-2
    assert rel_err(logits, r_logits) < 1e-5, "default and raised limits differ by more than f32 rounding"
    assert rel_err(logits, want_logits) < tol
    assert stats.stepped and abs(stats.loss - want_loss) < tol * want_loss
    assert abs(stats.grad_norm - r_stats.grad_norm) < 1e-5 * r_stats.grad_norm
    for n in names:
        step = before[n] - after[n]
        np.testing.assert_allclose(after[n], r_after[n], rtol=0, atol=2e-6)
        # AdamW's first step moves each weight by lr * sign(gradient) (where the gradient is well above eps)
        g = want_grads[n]
        clear = np.abs(g) > 1e-3 * np.abs(g).max()
        agree = np.mean(np.sign(step[clear]) == np.sign(g[clear]))
        assert agree > 0.999, f"{n}: the step follows transformers' gradient sign on {agree:.4%} of weights"
        np.testing.assert_allclose(np.abs(step[clear]), 1e-3, rtol=2e-2)


def test_1_2b_logits_and_a_lora_step_on_an_f16_base_under_default_limits(default_limits_ctx, raised_ctx):
    hf = hf_model("1.2B", seed=5)
    for p in hf.parameters():                    # the f16 base as the reference sees it: f16-rounded weights
        p.data = p.data.half().float()
    ids, targets = inputs(hf.config.vocab_size, seed=6)
    with torch.no_grad():
        logits = hf(input_ids=torch.as_tensor(ids)[None]).logits[0]
        want_loss = float(torch.nn.functional.cross_entropy(logits, torch.as_tensor(targets)))
    want_logits = logits.numpy()
    tensors = weights(hf, np.float16)
    del hf, logits
    gc.collect()
    results = {}
    for mode, ctx in (("default", default_limits_ctx), ("raised", raised_ctx)):
        engine = ComputeEngine(ctx)
        model = Lfm2Model(Lfm2Config.preset("1.2B"), ctx, engine, tensors=tensors)
        lora = model.add_lora(LoraConfig(r=4, alpha=8, target_modules=("q_proj", "v_proj", "w2")), seed=7,
                              base_dtype="f16")
        assert bound_in_pieces(model) == (mode == "default")
        got = model.logits(ids, bucket=16)
        trainer = Trainer(model, AdamW(lr=1e-3), ctx, engine).with_length_bucket(16)
        stats = trainer.train_step(ids, targets, lora)
        results[mode] = got, stats, {n: t.numpy() for n, t in zip(range(len(lora)), lora)}
        del model, trainer, lora, engine
        gc.collect()
    (got, stats, after), (r_got, r_stats, r_after) = results["default"], results["raised"]
    assert rel_err(got, r_got) < 1e-5
    assert rel_err(got, want_logits) < 1e-3
    assert stats.stepped and abs(stats.loss - want_loss) < 1e-3 * want_loss
    assert abs(stats.grad_norm - r_stats.grad_norm) < 1e-4 * r_stats.grad_norm
    for i in after:
        np.testing.assert_allclose(after[i], r_after[i], rtol=0, atol=1e-6)
