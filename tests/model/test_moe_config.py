"""Lfm2MoeConfig (issue 47): lfm2_moe config.json keys in and out against transformers' Lfm2MoeConfig,
the published presets' sizes, and bad values as ConfigErrors naming the key, the value and what was expected."""
from __future__ import annotations

import json

import pytest

from lfm2jit.model import ConfigError, Lfm2Config, Lfm2MoeConfig
from lfm2jit.model.moe_checkpoint import moe_parameter_shapes, moe_tensor_shapes
from lfm2jit.model.moe_config import MOE_PRESETS

torch = pytest.importorskip("torch", reason="transformers is the reference")
transformers = pytest.importorskip("transformers")
if not hasattr(transformers, "Lfm2MoeConfig"):
    pytest.skip("this transformers has no Lfm2MoeConfig", allow_module_level=True)


@pytest.mark.parametrize("name", list(MOE_PRESETS))
def test_config_round_trips_through_transformers(name):
    ours = Lfm2MoeConfig.preset(name)
    hf = transformers.Lfm2MoeConfig(**ours.to_dict()).to_dict()
    for key, value in ours.to_dict().items():
        assert hf[key] == value, f"{key}: ours {value!r}, transformers {hf[key]!r}"
    assert Lfm2MoeConfig.from_dict(hf) == ours


def test_defaults_are_transformers_defaults():
    hf = transformers.Lfm2MoeConfig(layer_types=["conv"] * 32).to_dict()
    ours = Lfm2MoeConfig(layer_types=["conv"] * 32).to_dict()
    ours.pop("architectures")          # transformers leaves it None on a bare config
    assert {k: hf[k] for k in ours} == ours


def test_reads_transformers_4_spellings(tmp_path):
    d = dict(Lfm2MoeConfig.preset("tiny-moe").to_dict())
    d.pop("rope_parameters")
    d.pop("layer_types")
    d.pop("tie_word_embeddings")
    d.update(rope_theta=5e6, full_attn_idxs=[1, 3], tie_embedding=False, head_dim=16)
    (tmp_path / "config.json").write_text(json.dumps(d))
    cfg = Lfm2MoeConfig.from_json(tmp_path)
    assert cfg.rope_theta == 5e6 and cfg.tie_word_embeddings is False
    assert cfg.layer_types == ["conv", "full_attention", "conv", "full_attention"]


def test_published_sizes():
    """Total parameters of the published configs: LFM2-8B-A1B 8,339,929,856 (Hugging Face's count for
    the checkpoint), with 22 sparse layers x 32 experts = 704 f32 expert_bias entries beside them."""
    cfg = Lfm2MoeConfig.preset("8B-A1B")
    params = moe_parameter_shapes(cfg)
    total = sum(int(__import__("math").prod(s)) for s in params.values())
    assert total == 8_339_929_856
    buffers = {n: s for n, s in moe_tensor_shapes(cfg).items() if n not in params}
    assert sum(s[0] for s in buffers.values()) == 704
    big = Lfm2MoeConfig.preset("24B-A2B")
    assert (big.num_hidden_layers, big.num_experts, len(big.attention_layers)) == (40, 64, 10)
    big_total = sum(int(__import__("math").prod(s)) for s in moe_parameter_shapes(big).values())
    assert round(big_total / 1e8) == 238          # "23.8B" as Liquid reports it


@pytest.mark.parametrize("change, words", [
    (dict(num_experts=0), ["num_experts", "0", "positive integer"]),
    (dict(num_experts="8"), ["num_experts", "'8' (string)", "positive integer"]),
    (dict(num_experts_per_tok=5), ["num_experts_per_tok", "5", "num_experts 4", "1..4"]),
    (dict(num_dense_layers=-1), ["num_dense_layers", "-1", ">= 0"]),
    (dict(num_dense_layers=9), ["num_dense_layers 9", "num_hidden_layers 4", "0..4"]),
    (dict(moe_intermediate_size=0), ["moe_intermediate_size", "positive integer"]),
    (dict(use_expert_bias="yes"), ["use_expert_bias", "'yes' (string)", "true or false"]),
    (dict(norm_topk_prob=1), ["norm_topk_prob", "true or false"]),
    (dict(routed_scaling_factor=float("nan")), ["routed_scaling_factor", "nan", "positive finite"]),
    (dict(routed_scaling_factor=0), ["routed_scaling_factor", "positive"]),
    (dict(layer_types=["conv", "mamba", "conv", "conv"]), ["layer_types", "mamba", "full_attention"]),
    (dict(head_dim=32), ["head_dim", "32", "16"]),
    (dict(rope_parameters={"rope_type": "yarn", "rope_theta": 1e6}), ["rope_type", "yarn", "default"]),
    (dict(model_type="lfm2"), ["model_type", "'lfm2'", "'lfm2_moe'", "Lfm2Config"]),
])
def test_bad_values_name_key_value_and_expectation(tmp_path, change, words):
    d = dict(Lfm2MoeConfig.preset("tiny-moe").to_dict(), **change)
    (tmp_path / "config.json").write_text(json.dumps(d))
    with pytest.raises(ConfigError) as err:
        Lfm2MoeConfig.from_json(tmp_path / "config.json")
    msg = str(err.value)
    assert str(tmp_path / "config.json") in msg
    for w in words:
        assert w in msg, f"{w!r} not in {msg!r}"


def test_dense_config_points_at_moe_config():
    with pytest.raises(ConfigError, match="lfm2_moe.*Lfm2MoeConfig"):
        Lfm2Config.from_dict(Lfm2MoeConfig.preset("tiny-moe").to_dict())


def test_unknown_preset_lists_the_known_ones():
    with pytest.raises(ConfigError, match="8B-A1B.*24B-A2B"):
        Lfm2MoeConfig.preset("8B")
