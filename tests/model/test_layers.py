"""The forward's saved state: one typed record per layer of each decoder layer's list, holding the
shapes its field comments give."""
from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from lfm2jit.model import Lfm2Model
from lfm2jit.model.layers import Attention, AttentionSaved, Conv, ConvSaved, Mlp, MlpSaved
from micro_model import micro

T = 11


@pytest.fixture(scope="module")
def model(ctx, engine):
    return Lfm2Model(micro(), ctx, engine, seed=1)


def test_each_decoder_layer_is_its_mixer_then_the_mlp(model):
    kinds = [[type(layer) for layer in block] for block in model.blocks]
    assert kinds == [[Conv, Mlp], [Attention, Mlp]]          # micro's layer_types: conv, full_attention


def test_saved_fields_have_their_documented_shapes(model):
    cfg = model.cfg
    d, h, g, e = cfg.hidden_size, cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
    f = model.p("model.layers.0.feed_forward.w1.weight").shape[0]     # F as block_multiple_of rounds it
    trace = model.forward(np.arange(1, T + 1), bucket=16)
    (conv, mlp0), (attention, mlp1) = trace.layers
    assert isinstance(conv, ConvSaved) and isinstance(attention, AttentionSaved)
    assert isinstance(mlp0, MlpSaved) and isinstance(mlp1, MlpSaved)
    want = {"h": (T, d), "inv": (T,), "bcx": (T, 3 * d), "c": (T, d), "q": (T, h, e), "k": (T, g, e),
            "v": (T, g, e), "q_inv": (T, h), "k_inv": (T, g), "cos": (T, e // 2), "sin": (T, e // 2),
            "qr": (T, h, e), "kr": (T, g, e), "o": (T, h, e), "lse": (T, h), "a": (T, f), "b": (T, f)}
    for saved in (conv, mlp0, attention, mlp1):
        kept = {x.name: getattr(saved, x.name) for x in dataclasses.fields(saved)}
        for name, shape in want.items():
            if name in kept:
                assert kept[name].shape == shape, (type(saved).__name__, name)
        # what backward recomputes is not kept by the forward
        assert all(kept[name] is None for name in ("xn", "xf", "g") if name in kept)


def test_recompute_mlp_keeps_neither_a_nor_b_and_keep_from_drops_lower_layers(ctx, engine):
    model = Lfm2Model(micro(), ctx, engine, seed=1, recompute_mlp=True)
    trace = model.forward(np.arange(1, T + 1), bucket=16, keep_from=1)
    assert trace.layers[0] is None
    mlp = trace.layers[1][1]
    assert mlp.a is None and mlp.b is None
