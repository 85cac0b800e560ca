"""Regenerate the golden outputs that hold lfm2jit's Lfm2Model to transformers' Lfm2ForCausalLM.

    .venv/bin/python tests/golden/make_golden.py          # rewrites tests/golden/<config>/

For each config in CONFIGS (small random LFM2 models covering tied/untied embeddings, conv_bias on/off,
attention first/middle/last, KV groups 1, 2 and 4, head dims 16 and 24) it:

1. builds Lfm2ForCausalLM in float32 with transformers' own initialisation (seeded), then perturbs
   every norm weight away from 1 and every bias away from 0 so that they matter;
2. writes the model with transformers' save_pretrained (config.json + f32 model.safetensors);
3. runs the same weights in float64 on a sequence of T=37 ids (not a multiple of 16, and containing
   the pad id), with targets and a loss mask with holes (targets at some masked positions are -100);
4. stores in golden.safetensors: input_ids, targets (int64), loss_mask (f32 0/1), logits (f32 [T, V]),
   loss (f64 [1]: sum of CE over mask=1 positions / their count), n_supervised (int64 [1]);
   and in grads.safetensors every parameter's gradient of that loss (f32, transformers names; a tied
   model has only model.embed_tokens.weight, holding both the input and output embedding's share).

Deterministic: fixed seeds, float64 CPU arithmetic. Needs torch and transformers; the tests that read
these files do not.
"""
from __future__ import annotations

import copy
import json
import shutil
from pathlib import Path

import numpy as np
import torch
from safetensors.numpy import save_file
from transformers import Lfm2Config, Lfm2ForCausalLM

HERE = Path(__file__).resolve().parent
T = 37

# name -> (transformers config kwargs, seed). head_dim = hidden_size / num_attention_heads.
CONFIGS: dict[str, tuple[dict, int]] = {
    # 4 layers, attention in the middle (layer 1); KV group 1 (kv heads = heads); head_dim 16; tied; no bias.
    "tied_g1_attn_mid": (dict(
        vocab_size=128, hidden_size=32, intermediate_size=96, num_hidden_layers=4, num_attention_heads=2,
        num_key_value_heads=2, layer_types=["conv", "full_attention", "conv", "conv"], conv_bias=False,
        tie_word_embeddings=True, block_multiple_of=32, initializer_range=0.1, pad_token_id=0), 11),
    # 2 layers, attention first; KV group 2; head_dim 24; untied; conv bias; no ff auto-adjust; pad id 5;
    # rope_theta and norm_eps not the defaults.
    "untied_bias_g2_attn_first": (dict(
        vocab_size=211, hidden_size=48, intermediate_size=80, num_hidden_layers=2, num_attention_heads=2,
        num_key_value_heads=1, layer_types=["full_attention", "conv"], conv_bias=True,
        tie_word_embeddings=False, block_auto_adjust_ff_dim=False, initializer_range=0.1, pad_token_id=5,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0}, norm_eps=1e-6), 22),
    # 3 layers, attention last; KV group 4 (one kv head for four query heads); head_dim 16; tied; conv
    # bias; ffn multiplier 1.5.
    "tied_bias_g4_attn_last": (dict(
        vocab_size=300, hidden_size=64, intermediate_size=48, num_hidden_layers=3, num_attention_heads=4,
        num_key_value_heads=1, layer_types=["conv", "conv", "full_attention"], conv_bias=True,
        tie_word_embeddings=True, block_multiple_of=16, block_ffn_dim_multiplier=1.5, initializer_range=0.08,
        pad_token_id=0), 33),
}


def perturb(model: torch.nn.Module, gen: torch.Generator) -> None:
    """Norm weights 1 -> 1 + 0.3 N(0,1); biases 0 -> 0.1 N(0,1)."""
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.add_(0.3 * torch.randn(p.shape, generator=gen, dtype=p.dtype))
            elif name.endswith(".bias"):
                p.add_(0.1 * torch.randn(p.shape, generator=gen, dtype=p.dtype))


def inputs(vocab: int, pad: int, seed: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    ids = rng.integers(0, vocab, T)
    ids[[3, 17, 30]] = pad                               # the pad id appears (its embedding row gets no grad)
    targets = np.concatenate([ids[1:], rng.integers(0, vocab, 1)])
    mask = np.ones(T, np.float32)
    mask[[0, 1, 8, 9, 10, 21, 36]] = 0                   # holes, including the first and last positions
    targets[[9, 21]] = -100                              # masked positions may hold anything
    return ids.astype(np.int64), targets.astype(np.int64), mask


def build(kwargs: dict, seed: int) -> Lfm2ForCausalLM:
    """A float32 Lfm2ForCausalLM initialised by transformers (seeded), norms and biases perturbed."""
    torch.manual_seed(seed)
    model = Lfm2ForCausalLM(Lfm2Config(**kwargs)).float().eval()
    perturb(model, torch.Generator().manual_seed(seed + 1))
    return model


def reference(model: Lfm2ForCausalLM, ids, targets, mask) -> tuple[np.ndarray, float, dict[str, np.ndarray]]:
    """float64 logits [T, V], masked mean cross-entropy, and every parameter's gradient of it, from a
    float64 copy of ``model`` (its weights are exact in float64, so this is the f32 model's true output)."""
    ref = copy.deepcopy(model).double()
    ref.config._attn_implementation = "eager"
    logits = ref(input_ids=torch.as_tensor(np.asarray(ids), dtype=torch.long)[None]).logits[0]   # (T, V)
    sel = torch.as_tensor(np.asarray(mask) != 0)
    n = int(sel.sum())
    ce = torch.nn.functional.cross_entropy(logits[sel], torch.as_tensor(np.asarray(targets), dtype=torch.long)[sel],
                                           reduction="sum")
    loss = ce / n
    loss.backward()
    grads = {name: p.grad.detach().numpy() for name, p in ref.named_parameters()}
    return logits.detach().numpy(), loss.item(), grads


def make(name: str, kwargs: dict, seed: int) -> None:
    out = HERE / name
    if out.exists():
        shutil.rmtree(out)
    model = build(kwargs, seed)
    model.save_pretrained(out, safe_serialization=True)
    for extra in out.iterdir():                          # keep config.json and the weights only
        if extra.name not in ("config.json", "model.safetensors"):
            extra.unlink()
    ids, targets, mask = inputs(model.config.vocab_size, model.config.pad_token_id, seed + 2)
    logits, loss, grads = reference(model, ids, targets, mask)
    save_file({"input_ids": ids, "targets": targets, "loss_mask": mask,
               "logits": logits.astype(np.float32),
               "loss": np.array([loss], np.float64),
               "n_supervised": np.array([int(mask.sum())], np.int64)}, str(out / "golden.safetensors"))
    save_file({n: g.astype(np.float32) for n, g in grads.items()}, str(out / "grads.safetensors"))
    size = sum(f.stat().st_size for f in out.iterdir())
    print(f"{name}: loss {loss:.6f}, {len(grads)} gradients, {size / 1024:.0f} KiB")


def main() -> None:
    torch.use_deterministic_algorithms(True)
    for name, (kwargs, seed) in CONFIGS.items():
        make(name, kwargs, seed)
    (HERE / "index.json").write_text(json.dumps(sorted(CONFIGS), indent=2) + "\n")


if __name__ == "__main__":
    main()
