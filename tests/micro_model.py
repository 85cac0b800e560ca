"""The micro LFM2 many trainer tests share, with its data and a snapshot of its weights."""
from __future__ import annotations

import numpy as np

from lfm2jit.model import Lfm2Config

# Two layers (one conv, one attention), hidden 32, vocab 64: every kernel of the model, compiled quickly.
MICRO = dict(vocab_size=64, hidden_size=32, intermediate_size=96, num_hidden_layers=2, num_attention_heads=2,
             num_key_value_heads=1, layer_types=["conv", "full_attention"], block_multiple_of=16)


def micro(**overrides) -> Lfm2Config:
    return Lfm2Config(**{**MICRO, **overrides})


def make_data(cfg: Lfm2Config, lengths, seed: int = 3, masked: bool = True):
    """(input_ids, target_ids, loss_mask) triples; ids avoid the padding token 0."""
    r = np.random.default_rng(seed)
    out = []
    for n in lengths:
        ids = r.integers(1, cfg.vocab_size, n + 1)
        mask = (r.random(n) > 0.3).astype(np.float32) if masked else np.ones(n, np.float32)
        mask[0] = 1.0
        out.append((ids[:-1], ids[1:], mask))
    return out


def snap(model) -> dict[str, np.ndarray]:
    return {n: t.numpy().copy() for n, t in model.named_parameters().items()}
