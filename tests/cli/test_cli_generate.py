"""``python -m trainer generate``: what it prints equals Lfm2Model.generate on the chat-rendered
prompt, with and without a LoRA adapter; a conversation keeps its history; bad input exits 2."""
from __future__ import annotations

import io
import shutil
from pathlib import Path

import numpy as np
import pytest

from lfm2jit import ComputeEngine
from lfm2jit.model import Lfm2Config, Lfm2Model, LoraConfig
from trainer.cli import main
from trainer.data import encode_chat, encode_text, load_tokenizer

ASSETS = Path(__file__).resolve().parents[2] / "trainer" / "assets"


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory, ctx):
    """A tiny random LFM2 with the built-in tokenizer, as a Hugging Face directory."""
    d = tmp_path_factory.mktemp("model")
    tok = load_tokenizer(ASSETS)
    from lfm2jit.model.config import PRESETS
    cfg = Lfm2Config(**{**PRESETS["tiny"], "vocab_size": tok.get_vocab_size(with_added_tokens=True),
                        "eos_token_id": tok.token_to_id("<|im_end|>")})
    Lfm2Model(cfg, ctx, ComputeEngine(ctx), seed=5).save_pretrained(d)
    for f in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(ASSETS / f, d / f)
    return d


def _run(argv, capsys, stdin: str | None = None, monkeypatch=None) -> tuple[int, str, str]:
    if stdin is not None:
        monkeypatch.setattr("sys.stdin", io.StringIO(stdin))
    rc = main(["generate", *argv])
    out = capsys.readouterr()
    return rc, out.out, out.err


def _expected(model, tok, messages, n: int, **kw) -> str:
    ids, _ = encode_chat(messages, tok, add_generation_prompt=True)
    end = sorted(set(model.generation_eos) | {tok.token_to_id("<|im_end|>")})
    return tok.decode(model.generate(ids.tolist(), max_new_tokens=n, eos_token_id=end, **kw), skip_special_tokens=True)


def test_prompt_prints_the_models_answer(model_dir, ctx, capsys):
    tok = load_tokenizer(model_dir)
    model = Lfm2Model.from_pretrained(model_dir, ctx, ComputeEngine(ctx))
    rc, out, _ = _run(["--model", str(model_dir), "--prompt", "reverse van", "--max-new-tokens", "12"], capsys)
    assert rc == 0
    assert out == _expected(model, tok, [{"role": "user", "content": "reverse van"}], 12) + "\n"
    rc, out, _ = _run(["--model", str(model_dir), "--prompt", "hello", "--max-new-tokens", "9", "--sample",
                       "--temperature", "1.3", "--top-k", "20", "--seed", "4"], capsys)
    assert out == _expected(model, tok, [{"role": "user", "content": "hello"}], 9, do_sample=True, temperature=1.3,
                            top_k=20, seed=4) + "\n"
    rc, out, _ = _run(["--model", str(model_dir), "--prompt", "plain text", "--raw", "--max-new-tokens", "6"], capsys)
    ids = encode_text("plain text", tok)[:-1].tolist()
    assert out == tok.decode(model.generate(ids, max_new_tokens=6), skip_special_tokens=True) + "\n"


def test_chat_keeps_the_conversation(model_dir, ctx, capsys, monkeypatch):
    tok = load_tokenizer(model_dir)
    model = Lfm2Model.from_pretrained(model_dir, ctx, ComputeEngine(ctx))
    rc, out, _ = _run(["--model", str(model_dir), "--chat", "--system", "Be brief.", "--max-new-tokens", "5"],
                      capsys, "first question\nsecond one\n\nnever read\n", monkeypatch)
    assert rc == 0
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "first question"}]
    first = _expected(model, tok, messages, 5)
    messages += [{"role": "assistant", "content": first}, {"role": "user", "content": "second one"}]
    assert out == first + "\n" + _expected(model, tok, messages, 5) + "\n"


def test_adapter_is_applied(model_dir, ctx, capsys, tmp_path):
    tok = load_tokenizer(model_dir)
    model = Lfm2Model.from_pretrained(model_dir, ctx, ComputeEngine(ctx))
    model.add_lora(LoraConfig(r=4, alpha=8), seed=1)
    for t in model.lora_parameters():        # B starts at zero: give the adapter an effect
        t.write(np.random.default_rng(2).standard_normal(t.shape).astype(np.float32) * 0.5)
    model.save_adapter(tmp_path / "adapter")
    rc, out, _ = _run(["--model", str(model_dir), "--adapter", str(tmp_path / "adapter"), "--prompt", "hi",
                       "--max-new-tokens", "10"], capsys)
    assert rc == 0
    with_adapter = _expected(model, tok, [{"role": "user", "content": "hi"}], 10)
    assert out == with_adapter + "\n"
    plain = _run(["--model", str(model_dir), "--prompt", "hi", "--max-new-tokens", "10"], capsys)[1]
    assert plain != out


@pytest.mark.parametrize("argv,match", [
    (["--prompt", "x"], "the following arguments are required: --model"),
    (["--model", "{m}"], "give --prompt TEXT .* or --chat"),
    (["--model", "{tmp}", "--prompt", "x"], "not a model directory"),
    (["--model", "{m}", "--prompt", "x", "--max-new-tokens", "0"], "--max-new-tokens must be at least 1"),
    (["--model", "{m}", "--prompt", "x", "--sample", "--temperature", "0"], "temperature must be a positive"),
    (["--model", "{m}", "--prompt", "x", "--top-p", "1.5"], r"top_p must be in \(0, 1\]"),
    (["--model", "{m}", "--chat", "--raw"], "--raw goes with --prompt"),
    (["--model", "{m}", "--prompt", "x", "--adapter", "{tmp}"], "no adapter_config.json"),
])
def test_bad_usage_exits_2_with_one_line(model_dir, tmp_path, capsys, argv, match):
    argv = [a.format(m=model_dir, tmp=tmp_path) for a in argv]
    try:
        rc, _, err = _run(argv, capsys)
    except SystemExit as e:                # argparse's own errors
        rc, err = e.code, capsys.readouterr().err
    assert rc == 2
    assert "Traceback" not in err
    import re
    assert re.search(match, err), err


def test_generate_without_prompt_or_chat_is_one_line(model_dir, capsys):
    rc, out, err = _run(["--model", str(model_dir)], capsys)
    assert rc == 2 and out == ""
    assert err.count("\n") == 1 and "--prompt" in err and "--chat" in err and "usage:" not in err, err


def test_a_bad_tokenizer_given_does_not_say_give_one(model_dir, tmp_path, capsys):
    rc, _, err = _run(["--model", str(model_dir), "--tokenizer", str(tmp_path / "none.json"), "--prompt", "x"], capsys)
    assert rc == 2 and err.count("\n") == 1
    assert "--tokenizer" in err and "none.json" in err and "give --tokenizer" not in err, err


def test_eval_counts_one_record_as_one_record(model_dir, tmp_path, capsys):
    data = tmp_path / "one.jsonl"
    data.write_text('{"text": "hello there"}\n')
    rc = main(["eval", "--model", str(model_dir), "--data", str(data), "--no-answers"])
    out = capsys.readouterr().out
    assert rc == 0 and f"{data}: 1 record\n" in out, out


def test_record_counts_are_singular_for_one():
    from trainer.cli.splits import count
    assert count(1, "record") == "1 record" and count(0, "record") == "0 records" and count(3, "record") == "3 records"
