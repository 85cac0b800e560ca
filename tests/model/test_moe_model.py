"""Lfm2Model on LFM2-MoE checkpoints (issue 47) against transformers' Lfm2MoeForCausalLM: what the model
holds (experts fused as transformers keeps them in memory, the expert_bias buffers beside the
parameters) and what it writes back."""
from __future__ import annotations

import numpy as np
import pytest

from lfm2jit.model import CheckpointError, Lfm2Model, Lfm2MoeConfig

torch = pytest.importorskip("torch", reason="transformers is the reference")
transformers = pytest.importorskip("transformers")


def hf_model(cfg: Lfm2MoeConfig, seed: int = 0):
    """transformers' model with cfg's shapes, seeded, its expert_bias buffers made non-zero (as a
    trained model's are), so that routing by score + bias differs from routing by score."""
    torch.manual_seed(seed)
    model = transformers.Lfm2MoeForCausalLM(transformers.Lfm2MoeConfig(**cfg.to_dict())).float().eval()
    with torch.no_grad():
        for module in model.modules():
            if getattr(module, "expert_bias", None) is not None:
                module.expert_bias.normal_(0.0, 0.1)
    return model


@pytest.mark.parametrize("name", ["tiny-moe", "tiny-moe-untied"])
def test_the_model_holds_transformers_state_dict_and_writes_it_back(ctx, engine, tmp_path, name):
    cfg = Lfm2MoeConfig.preset(name)
    hf = hf_model(cfg, seed=3)
    hf.save_pretrained(tmp_path / "hf")
    model = Lfm2Model.from_pretrained(tmp_path / "hf", ctx, engine)
    assert isinstance(model.cfg, Lfm2MoeConfig)
    want = {n: t.detach().numpy() for n, t in hf.state_dict().items()
            if not (cfg.tie_word_embeddings and n == "lm_head.weight")}
    have = model.state_dict()
    assert sorted(have) == sorted(want)
    for n, a in want.items():
        np.testing.assert_array_equal(have[n], a, err_msg=n)
    # the expert_bias buffers are not parameters: nothing trains them
    assert not [n for n in model.named_parameters() if n.endswith("expert_bias")]
    assert [n for n in have if n.endswith("expert_bias")]
    model.save_pretrained(tmp_path / "ours")
    back = transformers.Lfm2MoeForCausalLM.from_pretrained(tmp_path / "ours").float()
    for n, t in back.state_dict().items():
        np.testing.assert_array_equal(t.numpy(), hf.state_dict()[n].numpy(), err_msg=n)


def test_load_state_takes_either_expert_form_and_checks_before_writing(ctx, engine):
    cfg = Lfm2MoeConfig.preset("tiny-moe")
    model = Lfm2Model(cfg, ctx, engine, seed=1)
    other = Lfm2Model(cfg, ctx, engine, seed=2).state_dict()
    before = model.state_dict()
    broken = dict(other)
    broken.pop(next(n for n in broken if n.endswith("experts.down_proj")))
    with pytest.raises(CheckpointError, match="missing"):
        model.load_state(broken)
    for n, a in model.state_dict().items():                    # nothing half-written
        np.testing.assert_array_equal(a, before[n], err_msg=n)
    model.load_state(other)
    for n, a in model.state_dict().items():
        np.testing.assert_array_equal(a, other[n], err_msg=n)
