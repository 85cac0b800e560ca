"""`python -m trainer` with LoRA and parameter subsets, in subprocesses as a user runs it: adapters
that PEFT loads, --merge-lora models that transformers loads, resume of a LoRA run, --train-only and
--freeze, and one-line errors."""
from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from safetensors.numpy import load_file

from lfm2jit.model import Lfm2Config, Lfm2Model
from test_cli_trainer import SHORT, assert_same_steps, cli, metrics

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
peft = pytest.importorskip("peft")

LORA = ["--lora-r", "4", "--lora-alpha", "8"]


def ids_for(vocab: int) -> np.ndarray:
    return np.random.default_rng(0).integers(1, vocab, 19)


def assert_same_adapters(run_a: Path, run_b: Path) -> None:
    a = load_file(run_a / "adapter" / "adapter_model.safetensors")
    b = load_file(run_b / "adapter" / "adapter_model.safetensors")
    assert a.keys() == b.keys() and all(np.array_equal(a[n], b[n]) for n in a)


@pytest.fixture(scope="module")
def lora_long(tmp_path_factory):
    out = tmp_path_factory.mktemp("lora") / "long"
    r = cli(*SHORT, *LORA, "--steps", 6, "--checkpoint-every", 3, "--out", out)
    assert r.returncode == 0, r.stderr
    return out, r


def test_lora_run_writes_an_adapter_peft_loads(lora_long, ctx, engine):
    out, r = lora_long
    assert "training" in r.stdout and "LoRA r 4 alpha 8" in r.stdout
    ckpt = out / "checkpoints" / "step-000006"
    base = transformers.Lfm2ForCausalLM.from_pretrained(ckpt / "model").eval()
    theirs = peft.PeftModel.from_pretrained(base, out / "adapter").eval()
    ours = Lfm2Model.from_pretrained(ckpt / "model", ctx, engine)
    ours.load_adapter(out / "adapter")
    ids = ids_for(ours.cfg.vocab_size)
    with torch.no_grad():
        want = theirs(input_ids=torch.as_tensor(ids)[None]).logits[0].numpy()
    got = ours.logits(ids, bucket=16)
    assert np.abs(got - want).max() / np.abs(want).max() < 1e-4
    # the adapter trained (B moved off zero) and the base did not: it is the seed's initialisation
    adapter = load_file(out / "adapter" / "adapter_model.safetensors")
    assert all(np.abs(a).max() > 0 for n, a in adapter.items() if "lora_B" in n)
    init = Lfm2Model(Lfm2Config.from_json(ckpt / "model" / "config.json"), ctx, engine, seed=0).state_dict()
    saved = load_file(ckpt / "model" / "model.safetensors")
    assert all(np.array_equal(saved[n], a) for n, a in init.items())


def test_lora_run_resumes_exactly(lora_long, tmp_path):
    long_out, _ = lora_long
    short = tmp_path / "short"
    assert cli(*SHORT, *LORA, "--steps", 3, "--out", short).returncode == 0
    r = cli("--resume", short, "--steps", 6, "--no-progress")
    assert r.returncode == 0, r.stderr
    assert_same_steps(metrics(short)[3:], metrics(long_out)[3:])
    assert_same_adapters(short, long_out)


def test_merge_lora_writes_the_merged_model(lora_long, tmp_path):
    out = tmp_path / "merged"
    r = cli(*SHORT, *LORA, "--steps", 6, "--merge-lora", "--out", out)
    assert r.returncode == 0, r.stderr
    assert (out / "model" / "tokenizer.json").is_file() and not (out / "adapter").exists()
    ckpt = lora_long[0] / "checkpoints" / "step-000006"        # the same run without merging
    want = peft.PeftModel.from_pretrained(transformers.Lfm2ForCausalLM.from_pretrained(ckpt / "model"),
                                          lora_long[0] / "adapter").merge_and_unload()
    merged = transformers.Lfm2ForCausalLM.from_pretrained(out / "model")
    for name, t in want.state_dict().items():
        np.testing.assert_allclose(merged.state_dict()[name].numpy(), t.numpy(), rtol=1e-5, atol=1e-6, err_msg=name)


def test_train_only_and_freeze_train_what_they_name(tmp_path, ctx, engine):
    out = tmp_path / "head"
    r = cli(*SHORT, "--preset", "tiny-untied", "--steps", 2, "--train-only", "lm_head.weight", "model.layers.2.*",
            "--freeze", "model.layers.2.*norm*", "--out", out)
    assert r.returncode == 0, r.stderr
    ckpt = out / "checkpoints" / "step-000002" / "model"
    init = Lfm2Model(Lfm2Config.from_json(ckpt / "config.json"), ctx, engine, seed=0).state_dict()
    saved = load_file(ckpt / "model.safetensors")
    moved = {n for n, a in init.items() if not np.array_equal(saved[n], a)}
    assert "lm_head.weight" in moved and any(n.startswith("model.layers.2.") for n in moved)
    assert all(n == "lm_head.weight" or (n.startswith("model.layers.2.") and "norm" not in n) for n in moved), moved


@pytest.mark.parametrize("args, message", [
    (["--lora-alpha", "8"], "--lora-alpha needs --lora-r R"),
    (["--lora-r", "0"], "--lora-r must be > 0"),
    (["--lora-r", "4", "--lora-targets", "q_proj", "o_proj"],
     "LoRA: LoRA target 'o_proj' matches no linear layer of this LFM2 (LFM2 calls it 'out_proj')"),
    (["--lora-dropout", "0.1"], "--lora-dropout needs --lora-r R"),
    (["--lora-r", "4", "--lora-dropout", "1"], "--lora-dropout must be in [0, 1), got 1"),
    (["--lora-target-parameters", "experts.down_proj"], "--lora-target-parameters needs --lora-r R"),
    (["--lora-r", "4", "--lora-target-parameters", "experts.down_proj"],
     "LoRA: LoRA target parameter 'experts.down_proj' matches no expert tensor; this model has no expert tensors"),
    (["--base-dtype", "nf4"], "--base-dtype needs --lora-r R"),
    (["--lora-r", "4", "--lora-f16-base", "--base-dtype", "nf4"], "--lora-f16-base and --base-dtype nf4 ask for two"),
    (["--train-only", "nothing.*"], "--train-only 'nothing.*' matches no parameter"),
    (["--freeze", "*"], "leave no parameter to train"),
])
def test_bad_lora_flags_exit_2_with_a_message(args, message):
    r = cli(*SHORT, "--steps", 1, *args)
    assert r.returncode == 2, (r.stdout, r.stderr)
    assert message in r.stderr and "Traceback" not in r.stderr


def test_lora_dropout_trains_resumes_exactly_and_is_written_for_peft(lora_long, tmp_path):
    """--lora-dropout 0.25 trains (the adapters' inputs dropped in training) and differs from the same
    run without dropout once B has moved; a run stopped after 2 steps and resumed continues bitwise
    as the unbroken run (masks come from where a pass is in training); lora_dropout is written for PEFT."""
    whole, part = tmp_path / "whole", tmp_path / "part"
    for out, steps in ((whole, 4), (part, 2)):
        r = cli(*SHORT, *LORA, "--lora-dropout", "0.25", "--steps", steps, "--out", out)
        assert r.returncode == 0, r.stderr
    r = cli("--resume", part, "--steps", 4, "--no-progress")
    assert r.returncode == 0, r.stderr
    assert_same_steps(metrics(part)[2:], metrics(whole)[2:])
    assert_same_adapters(part, whole)
    plain = {m["step"]: m["loss"] for m in metrics(lora_long[0])}
    got = {m["step"]: m["loss"] for m in metrics(whole)}
    assert got[1] == pytest.approx(plain[1], rel=1e-6)      # B = 0: dropout cannot show yet
    assert got[4] != pytest.approx(plain[4], rel=1e-6)
    config = peft.PeftConfig.from_pretrained(whole / "adapter")
    assert config.lora_dropout == 0.25 and config.r == 4


@pytest.mark.parametrize("dtype", ["nf4", "int8"])
def test_lora_on_a_quantized_base_trains_resumes_exactly_and_writes_an_adapter(tmp_path, dtype):
    """The checkpoints hold the base dequantized; quantizing it again on --resume gives the same
    codes and scales, so the resumed run is the unbroken one."""
    long_out, short = tmp_path / f"{dtype}-long", tmp_path / f"{dtype}-short"
    r = cli(*SHORT, *LORA, "--base-dtype", dtype, "--steps", 4, "--out", long_out)
    assert r.returncode == 0, r.stderr
    assert f"{dtype} base" in r.stdout
    adapter = load_file(long_out / "adapter" / "adapter_model.safetensors")
    assert adapter and all(np.isfinite(a).all() for a in adapter.values())
    assert cli(*SHORT, *LORA, "--base-dtype", dtype, "--steps", 2, "--checkpoint-every", 2, "--out", short).returncode == 0
    r = cli("--resume", short, "--steps", 4, "--no-progress")
    assert r.returncode == 0, r.stderr
    assert_same_steps(metrics(short)[2:], metrics(long_out)[2:])
    assert_same_adapters(short, long_out)
