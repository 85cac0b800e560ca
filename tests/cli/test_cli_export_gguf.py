"""``python -m trainer export-gguf``: a model directory as a GGUF file (equal to what
gguf_export.write_model writes), a LoRA adapter as an adapter GGUF, an adapter merged into the model
(W + (alpha / r) B A, computed here in numpy); bad input exits 2 with one line and writes nothing."""
from __future__ import annotations

import re
import shutil
from pathlib import Path

import gguf
import numpy as np
import pytest

from lfm2jit.model import Lfm2Config, LoraConfig
from lfm2jit.model import gguf_export as ge
from lfm2jit.model.checkpoint import init_tensors, save_checkpoint
from lfm2jit.model.lora import init_weights, write_adapter
from trainer.cli import main

ASSETS = Path(__file__).resolve().parents[2] / "trainer" / "assets"
TINY = dict(vocab_size=102, hidden_size=64, intermediate_size=192, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, layer_types=["conv", "full_attention"], block_multiple_of=16)
LORA = LoraConfig(r=4, alpha=8.0, target_modules=("q_proj", "in_proj", "w1"))


def _model_dir(d: Path, cfg: Lfm2Config, seed: int = 0) -> Path:
    save_checkpoint(d, cfg, init_tensors(cfg, seed))
    for f in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(ASSETS / f, d / f)
    return d


def _adapter_dir(d: Path, cfg: Lfm2Config) -> tuple[Path, dict]:
    weights = init_weights(LORA, LORA.modules(cfg), seed=2)
    for n in weights:                                   # B starts at zero: give the adapter an effect
        weights[n] = np.random.default_rng(len(n)).standard_normal(weights[n].shape).astype(np.float32) * 0.1
    write_adapter(d, LORA, weights, None)
    return d, weights


@pytest.fixture(scope="module")
def dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("export")
    cfg = Lfm2Config(**TINY)
    model = _model_dir(root / "model", cfg)
    adapter, weights = _adapter_dir(root / "adapter", cfg)
    other = Lfm2Config(**{**TINY, "hidden_size": 32, "num_attention_heads": 2, "num_key_value_heads": 1})
    wrong, _ = _adapter_dir(root / "other_adapter", other)
    return cfg, model, adapter, weights, wrong


def _run(argv, capsys) -> tuple[int, str, str]:
    rc = main(["export-gguf", *argv])
    out = capsys.readouterr()
    return rc, out.out, out.err


def _tensors(path) -> dict[str, np.ndarray]:
    return {t.name: np.array(t.data) for t in gguf.GGUFReader(path).tensors}


@pytest.mark.parametrize("outtype", ["f16", "q8_0"])
def test_model_directory_to_gguf(dirs, tmp_path, capsys, outtype):
    cfg, model, *_ = dirs
    rc, out, err = _run(["--model", str(model), "--outtype", outtype, "--out", str(tmp_path / "m.gguf")], capsys)
    assert rc == 0, err
    assert out == f"wrote {tmp_path / 'm.gguf'}\n"
    from lfm2jit.model.checkpoint import load_checkpoint
    ge.write_model(tmp_path / "api.gguf", cfg, load_checkpoint(model), model, outtype, name="model")
    assert (tmp_path / "m.gguf").read_bytes() == (tmp_path / "api.gguf").read_bytes()
    r = gguf.GGUFReader(tmp_path / "m.gguf")
    assert r.fields["general.name"].contents() == "model"
    assert r.fields["tokenizer.ggml.eos_token_id"].contents() == 4


def test_adapter_to_lora_gguf(dirs, tmp_path, capsys):
    cfg, model, adapter, weights, _ = dirs
    rc, _, err = _run(["--model", str(model), "--adapter", str(adapter), "--outtype", "f32",
                       "--out", str(tmp_path / "a.gguf")], capsys)
    assert rc == 0, err
    r = gguf.GGUFReader(tmp_path / "a.gguf")
    assert r.fields["general.type"].contents() == "adapter" and r.fields["adapter.lora.alpha"].contents() == 8.0
    got = _tensors(tmp_path / "a.gguf")
    p = "base_model.model.model.layers."
    assert sorted(got) == sorted(["blk.0.shortconv.in_proj.weight.lora_a", "blk.0.shortconv.in_proj.weight.lora_b",
                                  "blk.0.ffn_gate.weight.lora_a", "blk.0.ffn_gate.weight.lora_b",
                                  "blk.1.attn_q.weight.lora_a", "blk.1.attn_q.weight.lora_b",
                                  "blk.1.ffn_gate.weight.lora_a", "blk.1.ffn_gate.weight.lora_b"])
    np.testing.assert_array_equal(got["blk.1.attn_q.weight.lora_a"], weights[p + "1.self_attn.q_proj.lora_A.weight"])
    np.testing.assert_array_equal(got["blk.0.shortconv.in_proj.weight.lora_b"],
                                  weights[p + "0.conv.in_proj.lora_B.weight"])


def test_merged_adapter(dirs, tmp_path, capsys):
    cfg, model, adapter, weights, _ = dirs
    rc, _, err = _run(["--model", str(model), "--adapter", str(adapter), "--merge", "--outtype", "f32",
                       "--out", str(tmp_path / "merged.gguf")], capsys)
    assert rc == 0, err
    got = _tensors(tmp_path / "merged.gguf")
    base = init_tensors(cfg, 0)
    p = "base_model.model."
    for module, name in (("model.layers.1.self_attn.q_proj", "blk.1.attn_q.weight"),
                         ("model.layers.0.conv.in_proj", "blk.0.shortconv.in_proj.weight"),
                         ("model.layers.0.feed_forward.w1", "blk.0.ffn_gate.weight")):
        a = weights[p + module + ".lora_A.weight"].astype(np.float64)
        b = weights[p + module + ".lora_B.weight"].astype(np.float64)
        want = (base[module + ".weight"].astype(np.float64) + (8.0 / 4) * (b @ a)).astype(np.float32)
        np.testing.assert_array_equal(got[name], want)
    np.testing.assert_array_equal(got["blk.1.attn_k.weight"], base["model.layers.1.self_attn.k_proj.weight"])


@pytest.mark.parametrize("argv,match", [
    (["--model", "{m}", "--outtype", "q4_0", "--out", "{o}"], r"--outtype 'q4_0': expected one of f32, f16, bf16, q8_0"),
    (["--model", "{m}", "--merge", "--out", "{o}"], "--merge goes with --adapter"),
    (["--model", "{tmp}", "--out", "{o}"], "not a model directory"),
    (["--model", "{m}", "--adapter", "{wrong}", "--out", "{o}"], "does not fit this model"),
    (["--model", "{m}", "--adapter", "{wrong}", "--merge", "--out", "{o}"], "does not fit this model"),
    (["--model", "{m}", "--adapter", "{tmp}", "--out", "{o}"], "no adapter_config.json"),
    (["--model", "{m}", "--out", "{file}/m.gguf"], "is not a writable directory"),
    (["--model", "{m}", "--out", "{tmp}"], "is a directory"),
    (["--model", "{m}", "--tokenizer", "{tmp}", "--out", "{o}"], "no tokenizer.json"),
])
def test_bad_input_exits_2_with_one_line_and_writes_nothing(dirs, tmp_path, capsys, argv, match):
    _, model, _, _, wrong = dirs
    (tmp_path / "afile").write_text("x")
    subs = {"{m}": str(model), "{o}": str(tmp_path / "o.gguf"), "{tmp}": str(tmp_path), "{wrong}": str(wrong),
            "{file}": str(tmp_path / "afile")}
    args = []
    for a in argv:
        for k, v in subs.items():
            a = a.replace(k, v)
        args.append(a)
    before = sorted(tmp_path.iterdir())
    rc, out, err = _run(args, capsys)
    assert rc == 2 and out == ""
    assert len(err.strip().splitlines()) == 1 and "Traceback" not in err, err
    assert re.search(match, err), err
    assert sorted(tmp_path.iterdir()) == before


def test_an_existing_output_needs_force(dirs, tmp_path, capsys):
    _, model, *_ = dirs
    out = tmp_path / "m.gguf"
    out.write_bytes(b"earlier")
    rc, _, err = _run(["--model", str(model), "--out", str(out)], capsys)
    assert rc == 2 and err.strip() == f"error: --out {out}: exists; pass --force to replace it"
    assert out.read_bytes() == b"earlier"
    rc, _, err = _run(["--model", str(model), "--out", str(out), "--force"], capsys)
    assert rc == 0, err
    assert gguf.GGUFReader(out).fields["general.architecture"].contents() == "lfm2"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["m.gguf"]


def test_moe_model_directory(tmp_path, capsys):
    from lfm2jit.model import Lfm2MoeConfig
    from lfm2jit.model.moe_checkpoint import init_moe_tensors, save_moe_pretrained
    cfg = Lfm2MoeConfig.preset("tiny-moe")
    tensors = init_moe_tensors(cfg, seed=1)
    save_moe_pretrained(tmp_path / "moe", cfg, tensors, "f32", None)
    shutil.copy(ASSETS / "tokenizer.json", tmp_path / "moe" / "tokenizer.json")
    rc, _, err = _run(["--model", str(tmp_path / "moe"), "--outtype", "q8_0", "--out", str(tmp_path / "m.gguf")], capsys)
    assert rc == 0, err
    ge.write_model(tmp_path / "api.gguf", cfg, tensors, tmp_path / "moe", "q8_0", name="moe")
    assert (tmp_path / "m.gguf").read_bytes() == (tmp_path / "api.gguf").read_bytes()
    assert gguf.GGUFReader(tmp_path / "m.gguf").fields["general.architecture"].contents() == "lfm2moe"


def test_moe_expert_adapter_is_merged_or_refused(tmp_path, capsys):
    """An adapter on an MoE model's expert tensors (PEFT's target_parameters) has no LoRA GGUF form:
    refused without --merge; merged, each expert's stacked weights are W[e] + (alpha / r) B_e A_e."""
    from lfm2jit.model import Lfm2MoeConfig
    from lfm2jit.model.lora import experts_from_peft, parameter_peft_names
    from lfm2jit.model.moe_checkpoint import init_moe_tensors, save_moe_pretrained
    cfg = Lfm2MoeConfig.preset("tiny-moe")
    tensors = init_moe_tensors(cfg, seed=1)
    save_moe_pretrained(tmp_path / "moe", cfg, tensors, "f32", None)
    shutil.copy(ASSETS / "tokenizer.json", tmp_path / "moe" / "tokenizer.json")
    lora = LoraConfig(r=2, alpha=6.0, target_modules=("q_proj",), target_parameters=("experts.down_proj",))
    params = lora.parameters(cfg)
    weights = init_weights(lora, lora.modules(cfg), 3, params)
    for n in weights:
        weights[n] = np.random.default_rng(len(n)).standard_normal(weights[n].shape).astype(np.float32) * 0.1
    write_adapter(tmp_path / "adapter", lora, weights, None)
    argv = ["--model", str(tmp_path / "moe"), "--adapter", str(tmp_path / "adapter"), "--outtype", "f32"]
    rc, _, err = _run([*argv, "--out", str(tmp_path / "a.gguf")], capsys)
    assert rc == 2 and "merge it into the model instead (--merge)" in err and not (tmp_path / "a.gguf").exists()
    rc, _, err = _run([*argv, "--merge", "--out", str(tmp_path / "m.gguf")], capsys)
    assert rc == 0, err
    got = _tensors(tmp_path / "m.gguf")
    for name, (a_name, b_name) in parameter_peft_names(params).items():
        layer = name.split(".")[2]
        a, b = experts_from_peft(weights[a_name], weights[b_name], cfg.num_experts)    # [E, r, in], [E, out, r]
        w = np.stack([tensors[f"model.layers.{layer}.feed_forward.experts.{e}.w2.weight"] for e in range(cfg.num_experts)])
        want = (w.astype(np.float64) + 3.0 * np.einsum("eor,eri->eoi", b.astype(np.float64), a.astype(np.float64)))
        np.testing.assert_array_equal(got[f"blk.{layer}.ffn_down_exps.weight"], want.astype(np.float32))
