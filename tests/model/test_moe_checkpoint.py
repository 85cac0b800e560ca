"""LFM2-MoE checkpoints (issue 47) against transformers' Lfm2MoeForCausalLM: a random-init model saved by
save_pretrained (one file, and sharded with an index) reads into the per-expert tensors equal to its
state dict; its fused in-memory state dict reads to the same tensors; lfm2jit's saves (one file, shards,
f32/bf16) load back into transformers with every tensor equal; bad checkpoints are clear errors."""
from __future__ import annotations

import dataclasses
import json

import numpy as np
import pytest
from safetensors.numpy import save_file

from lfm2jit.model import CheckpointError, Lfm2MoeConfig
from lfm2jit.model.checkpoint import read_safetensors_raw
from lfm2jit.model.moe_checkpoint import (check_moe_tensors, fuse_experts, init_moe_tensors, is_buffer,
                                          load_moe_pretrained, moe_tensor_shapes, save_moe_pretrained,
                                          unfuse_experts)
from lfm2jit.model.shards import plan_shards

torch = pytest.importorskip("torch", reason="transformers is the reference")
transformers = pytest.importorskip("transformers")
if not hasattr(transformers, "Lfm2MoeForCausalLM"):
    pytest.skip("this transformers has no Lfm2MoeForCausalLM", allow_module_level=True)

PRESETS = ["tiny-moe", "tiny-moe-untied", "tiny-moe-top1"]


def hf_model(cfg: Lfm2MoeConfig, seed: int = 0):
    """transformers' model with cfg's shapes, seeded, its expert_bias buffers made non-zero."""
    torch.manual_seed(seed)
    model = transformers.Lfm2MoeForCausalLM(transformers.Lfm2MoeConfig(**cfg.to_dict())).float().eval()
    with torch.no_grad():
        for module in model.modules():
            if getattr(module, "expert_bias", None) is not None:
                module.expert_bias.normal_()
    return model


def per_expert(cfg, model) -> dict[str, np.ndarray]:
    """The model's state dict split per expert by hand (independently of moe_checkpoint)."""
    out = {}
    i = cfg.moe_intermediate_size
    for name, t in model.state_dict().items():
        a = t.detach().numpy()
        if name.endswith("experts.gate_up_proj"):
            p = name[: -len("gate_up_proj")]
            for e in range(cfg.num_experts):
                out[f"{p}{e}.w1.weight"], out[f"{p}{e}.w3.weight"] = a[e, :i], a[e, i:]
        elif name.endswith("experts.down_proj"):
            p = name[: -len("down_proj")]
            for e in range(cfg.num_experts):
                out[f"{p}{e}.w2.weight"] = a[e]
        else:
            out[name] = a
    if cfg.tie_word_embeddings:
        out.pop("lm_head.weight", None)
    return out


def assert_same(got: dict, want: dict):
    assert sorted(got) == sorted(want)
    for n in want:
        assert got[n].shape == want[n].shape, n
        assert np.array_equal(got[n], want[n]), n


@pytest.mark.parametrize("name", PRESETS)
def test_table_matches_transformers(name):
    cfg = Lfm2MoeConfig.preset(name)
    want = {n: tuple(a.shape) for n, a in per_expert(cfg, hf_model(cfg)).items()}
    assert moe_tensor_shapes(cfg) == {n: want[n] for n in moe_tensor_shapes(cfg)}
    assert set(moe_tensor_shapes(cfg)) == set(want)
    assert any(is_buffer(n) for n in want) == cfg.use_expert_bias


@pytest.mark.parametrize("name", PRESETS)
@pytest.mark.parametrize("shard", [None, "20KB"])
def test_reads_what_transformers_saves(tmp_path, name, shard):
    cfg = Lfm2MoeConfig.preset(name)
    model = hf_model(cfg, seed=1)
    model.save_pretrained(tmp_path, **({"max_shard_size": shard} if shard else {}))
    index = tmp_path / "model.safetensors.index.json"
    assert index.exists() == (shard is not None)
    if shard:
        names = json.loads(index.read_text())["weight_map"]
        assert len(set(names.values())) > 1
        assert "model.layers.1.feed_forward.experts.0.w1.weight" in names     # saved per expert
    got_cfg, got = load_moe_pretrained(tmp_path)
    assert got_cfg == cfg
    assert_same(got, per_expert(cfg, model))


@pytest.mark.parametrize("name", PRESETS)
def test_fused_state_dict_reads_to_the_same_tensors(tmp_path, name):
    cfg = Lfm2MoeConfig.preset(name)
    model = hf_model(cfg, seed=2)
    sd = model.state_dict()
    assert any(n.endswith("experts.gate_up_proj") for n in sd)
    from_memory = check_moe_tensors(cfg, sd)
    model.save_pretrained(tmp_path)
    _, from_disk = load_moe_pretrained(tmp_path)
    assert_same(from_memory, from_disk)
    half = check_moe_tensors(cfg, model.to(torch.bfloat16).state_dict())      # a bf16 model in memory
    want = {n: torch.from_numpy(a).bfloat16().float().numpy() for n, a in from_memory.items()}
    assert_same(half, want)
    fused = fuse_experts(cfg, from_memory)           # and back to transformers' in-memory form
    for n, t in sd.items():
        if n in fused:
            assert np.array_equal(fused[n], t.float().numpy()), n


@pytest.mark.parametrize("name, dtype, shard", [("tiny-moe", "f32", None), ("tiny-moe-untied", "f32", 30_000),
                                                ("tiny-moe", "bf16", "10KB")])
def test_transformers_loads_what_we_save(tmp_path, name, dtype, shard):
    cfg = Lfm2MoeConfig.preset(name)
    tensors = init_moe_tensors(cfg, seed=3)
    for n in tensors:
        if is_buffer(n):
            tensors[n] = np.linspace(-1, 1, cfg.num_experts, dtype=np.float32)
    files = save_moe_pretrained(tmp_path, cfg, tensors, dtype=dtype, max_shard_size=shard)
    assert (len(files) > 1) == (shard is not None)
    assert (tmp_path / "model.safetensors.index.json").exists() == (shard is not None)
    model = transformers.Lfm2MoeForCausalLM.from_pretrained(tmp_path, dtype=torch.float32)
    got = per_expert(cfg, model)
    if dtype == "bf16":
        for n, a in tensors.items():
            want = a if is_buffer(n) else torch.from_numpy(a).bfloat16().float().numpy()
            assert np.array_equal(got[n], want), n
        stored = {}
        for f in files:
            stored.update(read_safetensors_raw(f))          # bf16 as its uint16 bits
        assert stored["model.layers.1.feed_forward.expert_bias"].dtype == np.float32       # the buffer stays f32
        assert stored["model.layers.1.feed_forward.gate.weight"].dtype == np.uint16
    else:
        assert_same(got, tensors)
    _, back = load_moe_pretrained(tmp_path)
    assert sorted(back) == sorted(tensors)


def test_resaving_removes_stale_weight_files(tmp_path):
    cfg = Lfm2MoeConfig.preset("tiny-moe")
    tensors = init_moe_tensors(cfg, seed=4)
    many = save_moe_pretrained(tmp_path, cfg, tensors, max_shard_size="10KB")
    few = save_moe_pretrained(tmp_path, cfg, tensors, max_shard_size="40KB")
    assert 1 < len(few) < len(many)
    assert sorted(p.name for p in tmp_path.glob("model*.safetensors")) == sorted(p.name for p in few)
    save_moe_pretrained(tmp_path, cfg, tensors)
    assert sorted(p.name for p in tmp_path.glob("model*")) == ["model.safetensors"]
    assert_same(load_moe_pretrained(tmp_path)[1], tensors)


def test_shard_plan_keeps_order_and_limit():
    sizes = {"a": 4, "b": 4, "c": 10, "d": 1, "e": 3}
    assert plan_shards(sizes, 8) == [["a", "b"], ["c"], ["d", "e"]]
    with pytest.raises(ValueError, match="max_shard_size"):
        plan_shards(sizes, 0)


def test_index_naming_a_missing_shard(tmp_path):
    cfg = Lfm2MoeConfig.preset("tiny-moe")
    files = save_moe_pretrained(tmp_path, cfg, init_moe_tensors(cfg, seed=5), max_shard_size="10KB")
    files[1].unlink()
    with pytest.raises(CheckpointError, match=f"names shard {files[1].name}, which is missing"):
        load_moe_pretrained(tmp_path)


def test_expert_count_mismatch_is_named(tmp_path):
    small = Lfm2MoeConfig.preset("tiny-moe")                  # 4 experts
    model = hf_model(small)
    model.save_pretrained(tmp_path)
    big = dataclasses.replace(small, num_experts=8)
    with pytest.raises(CheckpointError, match=r"layer 1 has 4 experts.*but num_experts is 8"):
        load_moe_pretrained(tmp_path, big)
    with pytest.raises(CheckpointError, match=r"gate_up_proj has 4 experts but num_experts is 8"):
        check_moe_tensors(big, model.state_dict())


def test_missing_expert_and_wrong_shape_are_named(tmp_path):
    cfg = Lfm2MoeConfig.preset("tiny-moe")
    tensors = init_moe_tensors(cfg, seed=6)
    del tensors["model.layers.3.feed_forward.experts.3.w2.weight"]
    with pytest.raises(CheckpointError, match=r"missing: model\.layers\.3\.feed_forward\.experts\.3\.w2\.weight"):
        check_moe_tensors(cfg, tensors)
    tensors = init_moe_tensors(cfg, seed=6)
    tensors["model.layers.2.feed_forward.experts.1.w3.weight"] = np.zeros((16, 64), np.float32)
    with pytest.raises(CheckpointError, match=r"experts\.1\.w3\.weight: \[16, 64\] \(expected \[32, 64\]\)"):
        check_moe_tensors(cfg, tensors)
    fused = fuse_experts(cfg, init_moe_tensors(cfg, seed=6))
    fused["model.layers.1.feed_forward.experts.down_proj"] = np.zeros((4, 64, 16), np.float32)
    with pytest.raises(CheckpointError, match=r"down_proj has shape \[4, 64, 16\], expected \[4, 64, 32\]"):
        unfuse_experts(cfg, fused)


def test_both_expert_forms_in_one_layer(tmp_path):
    cfg = Lfm2MoeConfig.preset("tiny-moe")
    tensors = init_moe_tensors(cfg, seed=7)
    both = {**tensors, **fuse_experts(cfg, tensors)}
    with pytest.raises(CheckpointError, match=r"layers \[1, 2, 3\] hold their experts both fused"):
        check_moe_tensors(cfg, both)


def test_dense_names_in_a_sparse_layer_are_unexpected(tmp_path):
    cfg = Lfm2MoeConfig.preset("tiny-moe")
    tensors = init_moe_tensors(cfg, seed=8)
    tensors["model.layers.2.feed_forward.w1.weight"] = np.zeros((128, 64), np.float32)
    save_file(tensors, str(tmp_path / "model.safetensors"))
    (tmp_path / "config.json").write_text(json.dumps(cfg.to_dict()))
    with pytest.raises(CheckpointError, match=r"unexpected: model\.layers\.2\.feed_forward\.w1\.weight"):
        load_moe_pretrained(tmp_path)
