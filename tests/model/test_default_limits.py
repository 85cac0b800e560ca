"""Published LFM2 shapes on a device with exactly WebGPU's default limits (LFM2JIT_LIMITS=default:
128 MiB bindings, 256 MiB buffers, 8 storage buffers a kernel), where LFM2-350M's f32 embedding
(256 MiB) and LFM2-1.2B's f16 one already need several bindings (schedule/pieces.py).

Each model is run against transformers on a random-init checkpoint of the same shapes. Large: each
runs once in CI, at a short length.
"""
from __future__ import annotations

import dataclasses
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
LAYERS_1_2B = 3     # LFM2-1.2B's first conv, conv and attention layers: its 16 add time, not new sizes
LAYERS_350M = 3     # LFM2-350M's first three (conv, conv, attention), for the same reason


def shapes(preset: str, layers: int | None = None) -> Lfm2Config:
    """The preset's shapes (the real 65536-entry vocabulary), with only its first ``layers`` decoder
    layers when given: every tensor keeps its size (what the limits act on), the pass gets shorter."""
    cfg = Lfm2Config.preset(preset)
    if layers is None:
        return cfg
    return dataclasses.replace(cfg, num_hidden_layers=layers, layer_types=cfg.layer_types[:layers])


def hf_model(cfg: Lfm2Config, seed: int):
    """transformers' Lfm2ForCausalLM of these shapes, seeded."""
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


def embedding(model: Lfm2Model):
    return model.named_parameters()["model.embed_tokens.weight"]


def check_first_adamw_step(before, after, grads, lr: float, scale: float, exact: bool) -> None:
    """AdamW's first step moves each weight by lr * g / (|g| + eps) against its (clipped: times
    ``scale``) gradient g; the step taken must be that of transformers' gradients: in size too
    where ``exact`` (f32), in sign where not (f16 activations: without loss scaling a few tiny
    gradients lose their size to f16 underflow)."""
    for name, g in grads.items():
        step = before[name] - after[name]
        g = g.astype(np.float64) * scale
        clear = np.abs(g) > max(1e-3 * np.abs(g).max(), 1e-5)      # where eps cannot matter
        assert clear.sum() > 100, name
        agree = np.mean(np.sign(step[clear]) == np.sign(g[clear]))
        assert agree > 0.999, f"{name}: the step follows transformers' gradient sign on {agree:.4%} of weights"
        if exact:
            np.testing.assert_allclose(np.abs(step[clear]), lr * np.abs(g[clear]) / (np.abs(g[clear]) + 1e-8),
                                       rtol=2e-2, err_msg=name)
        else:
            assert np.mean(np.abs(np.abs(step[clear]) / lr - 1) < 2e-2) > 0.999, name


def test_350m_logits_and_full_training_steps_under_default_limits(default_limits_ctx):
    """LFM2-350M's shapes (its first LAYERS_350M layers; its f32 embedding is two bindings) give
    transformers' logits, and one full training step, f32 and with f16 activations (--f16), moves
    every checked weight as transformers' gradients say."""
    cfg = shapes("350M", LAYERS_350M)
    hf = hf_model(cfg, seed=3)
    ids, targets = inputs(hf.config.vocab_size, seed=4)
    names = ["model.embed_tokens.weight", "model.layers.0.conv.in_proj.weight",
             "model.layers.2.self_attn.q_proj.weight", "model.layers.2.feed_forward.w2.weight"]
    want_logits, want_loss, want_grads = hf_loss_and_grads(hf, ids, targets, names)
    tensors = weights(hf)
    del hf
    ctx, lr = default_limits_ctx, 1e-3
    for activations, tol in (("f32", 1e-4), ("f16", 2e-2)):
        engine = ComputeEngine(ctx)
        model = Lfm2Model(cfg, ctx, engine, tensors=tensors, activation_dtype=activations)
        assert embedding(model).nbytes > piece_bytes(engine.target)          # bound in pieces
        if activations == "f32":
            assert rel_err(model.logits(ids, bucket=16), want_logits) < tol
        before = {n: model.named_parameters()[n].numpy() for n in names}
        trainer = Trainer(model, AdamW(lr=lr, weight_decay=0.0), ctx, engine).with_length_bucket(16)
        stats = trainer.train_step(ids, targets, model.parameters())
        assert stats.stepped and abs(stats.loss - want_loss) < tol * want_loss, (activations, stats.loss, want_loss)
        clip = trainer.clip_grad_norm
        scale = min(1.0, clip / (stats.grad_norm + 1e-6)) if clip else 1.0     # torch's clip_grad_norm_
        check_first_adamw_step(before, {n: model.named_parameters()[n].numpy() for n in names}, want_grads, lr, scale,
                               exact=activations == "f32")
        del model, trainer, engine
        gc.collect()


def test_1_2b_logits_and_a_lora_step_on_an_f16_base_under_default_limits(default_limits_ctx):
    """LFM2-1.2B's shapes (its first LAYERS_1_2B layers) on an f16 base: its f32 embedding (512 MiB) is larger than WebGPU's default largest
    buffer, so it lives in parts (one binding each); the logits equal transformers' on the same
    f16-rounded weights, and a LoRA step (on attention and the MLP's down-projection, whose fused
    backward binds all 8 storage buffers) trains from transformers' loss. (A raised-limits run on
    lavapipe binds the same pieces of one buffer instead of parts: test_binding_limits.py compares
    parts with one buffer bit for bit.)"""
    hf = hf_model(shapes("1.2B", LAYERS_1_2B), seed=5)
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
    ctx = default_limits_ctx
    engine = ComputeEngine(ctx)
    model = Lfm2Model(shapes("1.2B", LAYERS_1_2B), ctx, engine, tensors=tensors)
    lora = model.add_lora(LoraConfig(r=4, alpha=8, target_modules=("q_proj", "v_proj", "w2")), seed=7,
                          base_dtype="f16")
    assert embedding(model).parts is not None and len(embedding(model).parts) == 4
    # on the matrix units a product with the f16 base rounds its f32 input to f16 as it is staged
    matrix = bool(engine.target.matrix_configs)
    assert rel_err(model.logits(ids, bucket=16), want_logits) < (3e-3 if matrix else 1e-3)
    named = model.lora.named
    assert sorted(map(id, named.values())) == sorted(map(id, lora))
    before = {n: t.numpy() for n, t in named.items()}
    trainer = Trainer(model, AdamW(lr=1e-3, weight_decay=0.0), ctx, engine).with_length_bucket(16)
    stats = trainer.train_step(ids, targets, lora)
    assert stats.stepped and abs(stats.loss - want_loss) < 1e-3 * want_loss
    for n, t in named.items():
        after = t.numpy()
        if "lora_B" in n:       # B starts at zero and takes AdamW's first step: lr in size where it moves
            assert np.isfinite(after).all() and 0.9e-3 < np.abs(after).max() <= 1e-3, n
        else:                   # with B zero, A's gradient is exactly zero: it stays
            np.testing.assert_array_equal(after, before[n], err_msg=n)
