"""Dense LFM2 checkpoints written as shards with model.safetensors.index.json (issue 47, item 1): transformers'
Lfm2ForCausalLM loads them with every tensor equal, lfm2jit reads them back, and a re-save in another
form leaves no stale index or shard behind (a stale index would be read before the new file)."""
from __future__ import annotations

import json

import numpy as np
import pytest

from lfm2jit.model import CheckpointError, Lfm2Config
from lfm2jit.model.checkpoint import check_tensors, init_tensors, load_checkpoint, save_checkpoint
from lfm2jit.model.shards import parse_size


def test_sharded_dense_checkpoint_reads_back_and_stale_files_go(tmp_path):
    cfg = Lfm2Config.preset("tiny-untied")
    tensors = init_tensors(cfg, seed=0)
    files = save_checkpoint(tmp_path, cfg, tensors, max_shard_size="50KB")
    assert len(files) > 2
    index = json.loads((tmp_path / "model.safetensors.index.json").read_text())
    assert sorted(set(index["weight_map"].values())) == sorted(f.name for f in files)
    assert sorted(index["weight_map"]) == sorted(tensors)
    assert index["metadata"]["total_size"] == sum(a.nbytes for a in tensors.values())
    assert not (tmp_path / "model.safetensors").exists()
    got = check_tensors(cfg, load_checkpoint(tmp_path))
    assert all(np.array_equal(got[n], tensors[n]) for n in tensors)

    save_checkpoint(tmp_path, cfg, {n: a * 2 for n, a in tensors.items()})       # one file now
    assert sorted(p.name for p in tmp_path.iterdir()) == ["config.json", "model.safetensors"]
    got = check_tensors(cfg, load_checkpoint(tmp_path))
    assert all(np.array_equal(got[n], tensors[n] * 2) for n in tensors)


def test_transformers_loads_a_sharded_dense_save(tmp_path):
    torch = pytest.importorskip("torch", reason="transformers is the reference")
    transformers = pytest.importorskip("transformers")
    cfg = Lfm2Config.preset("tiny")
    tensors = init_tensors(cfg, seed=1)
    save_checkpoint(tmp_path, cfg, tensors, dtype="f16", max_shard_size=40_000)
    model = transformers.Lfm2ForCausalLM.from_pretrained(tmp_path, dtype=torch.float32)
    sd = model.state_dict()
    for n, a in tensors.items():
        assert np.array_equal(sd[n].numpy(), a.astype(np.float16).astype(np.float32)), n


def test_missing_shard_is_named(tmp_path):
    cfg = Lfm2Config.preset("tiny")
    files = save_checkpoint(tmp_path, cfg, init_tensors(cfg, seed=2), max_shard_size="40KB")
    files[-1].unlink()
    with pytest.raises(CheckpointError, match=f"names shard {files[-1].name}, which is missing from"):
        load_checkpoint(tmp_path)


@pytest.mark.parametrize("text, n", [("5GB", 5 * 10**9), ("2GiB", 2 * 2**30), ("500 MB", 5 * 10**8), (123, 123)])
def test_parse_size(text, n):
    assert parse_size(text) == n


def test_parse_size_refuses_nonsense():
    with pytest.raises(ValueError, match="max_shard_size.*'lots'"):
        parse_size("lots")
