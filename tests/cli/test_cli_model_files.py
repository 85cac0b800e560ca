"""What `python -m trainer` writes beside the weights, so that transformers can tokenize, chat with
and stop a trained model: the tokenizer, its chat template, and a generation config that stops at
the end of an answer (<|im_end|>), or the input model's own files when fine-tuning."""
from __future__ import annotations

import json
import shutil

import pytest

from lfm2jit.model import Lfm2Config, Lfm2Model
from lfm2jit.model.config import PRESETS
from test_cli_trainer import SHORT, cli
from trainer.data import default_dataset, default_tokenizer

transformers = pytest.importorskip("transformers")


def test_a_model_trained_from_scratch_stops_at_the_end_of_a_turn(tmp_path):
    out = tmp_path / "scratch"
    assert cli(*SHORT, "--steps", 1, "--out", out).returncode == 0
    model_dir = out / "checkpoints" / "step-000001" / "model"
    gen = transformers.GenerationConfig.from_pretrained(model_dir)
    tok = transformers.AutoTokenizer.from_pretrained(model_dir)
    im_end, endoftext = tok.convert_tokens_to_ids("<|im_end|>"), tok.convert_tokens_to_ids("<|endoftext|>")
    assert sorted(gen.eos_token_id) == sorted([im_end, endoftext])
    assert gen.pad_token_id == tok.pad_token_id and gen.bos_token_id == tok.bos_token_id
    text = tok.apply_chat_template([{"role": "user", "content": "reverse van"}], tokenize=False,
                                   add_generation_prompt=True)
    assert text.endswith("<|im_start|>assistant\n")


def test_fine_tuning_keeps_the_input_models_own_files(tmp_path, ctx, engine):
    src = tmp_path / "hf"
    Lfm2Model(Lfm2Config(**{**PRESETS["tiny"], "vocab_size": 102}), ctx, engine, seed=3).save_pretrained(src)
    shutil.copyfile(default_tokenizer(), src / "tokenizer.json")
    own = {"chat_template.jinja": "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
                                  "{% endfor %}",
           "generation_config.json": json.dumps({"eos_token_id": [4, 2], "do_sample": True, "temperature": 0.3}),
           "special_tokens_map.json": json.dumps({"eos_token": "<|im_end|>"})}
    for name, text in own.items():
        (src / name).write_text(text)
    out = tmp_path / "ft"
    r = cli("--model", src, "--data", default_dataset(), "--steps", 1, "--grad-accum", 1, "--lr", 1e-3,
            "--eval-max", 2, "--no-progress", "--out", out)
    assert r.returncode == 0, r.stderr
    model_dir = out / "checkpoints" / "step-000001" / "model"
    for name, text in own.items():
        assert (model_dir / name).read_text() == text, name
    assert transformers.GenerationConfig.from_pretrained(model_dir).temperature == 0.3


def test_eval_every_scores_the_held_out_split_during_training(tmp_path):
    """--eval-every 2 of a 4-step run scores step 2 as a 2-step run scores its end (the schedule does
    not depend on the total), writes eval.jsonl and the summary, and a resume keeps the earlier points."""
    two, four = tmp_path / "two", tmp_path / "four"
    assert cli(*SHORT, "--steps", 2, "--out", two).returncode == 0
    r = cli(*SHORT, "--steps", 4, "--eval-every", 2, "--out", four)
    assert r.returncode == 0, r.stderr
    assert "step 2: held-out loss" in r.stderr
    evals = [json.loads(line) for line in (four / "eval.jsonl").read_text().splitlines()]
    end_of_two = json.loads((two / "summary.json").read_text())
    assert [e["step"] for e in evals] == [2]
    assert evals[0]["loss"] == pytest.approx(end_of_two["eval_after"], rel=1e-6)
    assert evals[0]["answer_loss"] == pytest.approx(end_of_two["eval_answer_after"], rel=1e-6)
    assert json.loads((four / "summary.json").read_text())["evals_during"] == evals
    r = cli("--resume", two, "--steps", 6, "--eval-every", 2, "--no-progress")
    assert r.returncode == 0, r.stderr
    assert [json.loads(line)["step"] for line in (two / "eval.jsonl").read_text().splitlines()] == [4]


@pytest.mark.parametrize("flag,want", [([], "BF16"), (["--save-dtype", "f16"], "F16"), (["--save-dtype", "f32"], "F32")])
def test_the_final_model_is_saved_in_the_inputs_dtype_or_the_one_asked(tmp_path, ctx, engine, flag, want):
    """A bf16 input gives a bf16 OUT/model (checkpoints stay f32 for an exact resume); transformers
    reads it as the final checkpoint's weights rounded as torch rounds them."""
    import struct
    import torch
    src = tmp_path / "hf"
    Lfm2Model(Lfm2Config(**{**PRESETS["tiny"], "vocab_size": 102}), ctx, engine, seed=4).save_pretrained(src, "bf16")
    shutil.copyfile(default_tokenizer(), src / "tokenizer.json")
    out = tmp_path / "ft"
    r = cli("--model", src, "--data", default_dataset(), "--steps", 1, "--grad-accum", 1, "--lr", 1e-3,
            "--eval-max", 2, "--no-progress", "--out", out, *flag)
    assert r.returncode == 0, r.stderr
    raw = (out / "model" / "model.safetensors").read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    assert {m["dtype"] for k, m in json.loads(raw[8:8 + n]).items() if k != "__metadata__"} == {want}
    final = transformers.Lfm2ForCausalLM.from_pretrained(out / "checkpoints" / "step-000001" / "model")
    saved = transformers.Lfm2ForCausalLM.from_pretrained(out / "model", dtype=torch.float32)
    dtype = {"BF16": torch.bfloat16, "F16": torch.float16, "F32": torch.float32}[want]
    for name, t in final.state_dict().items():
        assert torch.equal(saved.state_dict()[name], t.to(dtype).float()), name
    assert (out / "model" / "tokenizer.json").is_file()
