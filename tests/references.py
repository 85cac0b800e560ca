"""The transformers and PEFT references several model test files build the same way (torch, transformers
and peft are imported by the callers, which skip without them)."""
from __future__ import annotations

import copy

import numpy as np


def moe_hf_model(cfg, seed: int = 0):
    """transformers' Lfm2MoeForCausalLM with the shapes of ``cfg`` (an Lfm2MoeConfig), seeded, its
    expert_bias buffers made non-zero (as a trained model's are), so that routing by score + bias
    differs from routing by score."""
    import torch
    import transformers
    torch.manual_seed(seed)
    model = transformers.Lfm2MoeForCausalLM(transformers.Lfm2MoeConfig(**cfg.to_dict())).float().eval()
    with torch.no_grad():
        for module in model.modules():
            if getattr(module, "expert_bias", None) is not None:
                module.expert_bias.normal_(0.0, 0.1)
    return model


def peft_on_copy(hf, config, seed: int = 0):
    """PEFT's adapters of ``config`` (a peft.LoraConfig) on a copy of ``hf``, B randomised (seeded):
    at B = 0 an adapter would change nothing a test could see."""
    import peft
    import torch
    model = peft.get_peft_model(copy.deepcopy(hf), config)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.copy_(torch.randn(p.shape, generator=gen) * 0.2)
    return model


def masked_inputs(vocab: int, t: int, seed: int):
    """Ids (never the padding id 0), targets and a loss mask of about 80% ones (the first always)."""
    rng = np.random.default_rng(seed)
    ids, targets = rng.integers(1, vocab, t), rng.integers(0, vocab, t)
    mask = (rng.random(t) < 0.8).astype(np.float32)
    mask[0] = 1.0
    return ids, targets, mask
