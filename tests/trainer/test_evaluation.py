"""Held-out evaluation: answers found in the token data equal the chat renderer's prompt and answer;
exact match is scored against the model's own greedy decoding; the trainer's run directory and
``python -m trainer eval`` report it (eval.jsonl, samples.jsonl, summary.json)."""
from __future__ import annotations

import json
import math
import shutil
from pathlib import Path

import numpy as np
import pytest

from lfm2jit import ComputeEngine
from lfm2jit.model import Lfm2Config, Lfm2Model
from lfm2jit.model.config import PRESETS
from trainer.cli import main
from trainer.data import Batch, encode_chat, load_tokenizer
from trainer.evaluation import (ANSWER_SLACK, AnswerCase, answer_cases, exact_match, greedy_answers, held_out_loss,
                                last_user_turn)

ASSETS = Path(__file__).resolve().parents[2] / "trainer" / "assets"
RECORDS = [json.loads(line) for line in (ASSETS / "chat.jsonl").read_text().splitlines()[:60]]


def _items(batch):
    out = []
    for s in batch:
        ids, targets, mask = s.triple()
        out.append((ids, targets, np.ones_like(mask), mask))
    return out


def test_answer_cases_equal_the_rendered_prompt_and_last_answer(tmp_path):
    """For every record: the prompt is the conversation before its last assistant turn rendered
    with the generation prompt, the expected ids that turn's content and its <|im_end|>."""
    tok = load_tokenizer(ASSETS)
    path = tmp_path / "d.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in RECORDS))
    cases = answer_cases(_items(Batch.from_jsonl(path, tok)), answers_are_the_loss=False)
    assert len(cases) == len(RECORDS)
    for rec, case in zip(RECORDS, cases):
        msgs = rec["messages"]
        prompt, _ = encode_chat(msgs[:-1], tok, add_generation_prompt=True)
        np.testing.assert_array_equal(case.prompt, prompt)
        want = tok.encode(msgs[-1]["content"], add_special_tokens=False).ids + [tok.token_to_id("<|im_end|>")]
        assert case.expected.tolist() == want
        assert last_user_turn(tok.decode(case.prompt.tolist(), skip_special_tokens=False)) == msgs[-2]["content"]
    # answers_are_the_loss: the loss mask itself marks the answers (a run on assistant tokens only)
    items = [(i, t, a, None) for i, t, _, a in _items(Batch.from_jsonl(path, tok))]
    assert [c.expected.tolist() for c in answer_cases(items, True)] == [c.expected.tolist() for c in cases]
    assert answer_cases(items, False) == []


def test_held_out_loss_equals_each_records_cross_entropy(ctx):
    """Records run packed (padded to a common length, pads unscored): the loss per supervised token,
    and per answer token where a record has an answer mask, equals float64 cross-entropy of each
    record's own logits taken alone, for records of mixed lengths (packs and single passes)."""
    rng = np.random.default_rng(5)
    cfg = Lfm2Config(**{**PRESETS["tiny"], "vocab_size": 96})
    engine = ComputeEngine(ctx)
    model = Lfm2Model(cfg, ctx, engine, seed=2)
    items = []
    for n in [7, 9, 12, 8, 70, 11, 10, 3, 30, 33]:
        ids = rng.integers(0, 96, n).astype(np.int32)
        targets = rng.integers(0, 96, n).astype(np.int32)
        answer = (np.arange(n) >= n // 2).astype(np.float32) if n % 3 else None
        items.append((ids, targets, np.ones(n, np.float32), answer))
    sums, counts = np.zeros(2), np.zeros(2)
    E = model.lm_head.numpy().astype(np.float64)
    for ids, targets, mask, answer in items:
        logits = model.forward(ids, 16).hn.numpy().astype(np.float64) @ E.T
        top = logits.max(axis=1)
        ce = top + np.log(np.exp(logits - top[:, None]).sum(axis=1)) - logits[np.arange(len(ids)), targets]
        for j, m in enumerate((mask, answer)):
            if m is not None:
                sums[j] += (m * ce).sum()
                counts[j] += m.sum()
    loss, answer_loss = held_out_loss(model, engine, items, 16)
    assert loss == pytest.approx(sums[0] / counts[0], rel=1e-5)
    assert answer_loss == pytest.approx(sums[1] / counts[1], rel=1e-5)


def test_greedy_answers_are_the_models_decoded_text(ctx):
    """Each answer is the model's own greedy continuation (to an end id, at most ANSWER_SLACK tokens
    past the expected length) as text; right exactly when it equals the expected text."""
    tok = load_tokenizer(ASSETS)
    cfg = Lfm2Config(**{**PRESETS["tiny"], "vocab_size": tok.get_vocab_size(with_added_tokens=True)})
    model = Lfm2Model(cfg, ctx, ComputeEngine(ctx), seed=3)
    end = tok.token_to_id("<|im_end|>")
    cases = [AnswerCase(encode_chat(r["messages"][:-1], tok, add_generation_prompt=True)[0],
                        np.array(tok.encode(r["messages"][-1]["content"], add_special_tokens=False).ids + [end], np.int32))
             for r in RECORDS[:20]]
    samples = greedy_answers(model, tok, cases, {end})
    for rec, case, x in zip(RECORDS, cases, samples):
        own = model.generate(case.prompt.tolist(), max_new_tokens=len(case.expected) + ANSWER_SLACK, eos_token_id=end)
        assert x["answer"] == tok.decode([t for t in own if t != end], skip_special_tokens=True).strip()
        assert x["expected"] == rec["messages"][-1]["content"].strip()
        assert x["correct"] == (x["answer"] == x["expected"])

    class Knows:            # a model whose greedy answer is the expected one for every other prompt
        generation_eos = ()

        def generate(self, prompts, max_new_tokens, eos_token_id):
            right = {tuple(c.prompt.tolist()): c.expected.tolist() for c in cases[::2]}
            return [right.get(tuple(p), [33, end]) for p in prompts]
    scored = greedy_answers(Knows(), tok, cases, {end})
    assert [x["correct"] for x in scored] == [i % 2 == 0 for i in range(20)]
    assert exact_match(scored) == 0.5 and math.isnan(exact_match([]))


@pytest.fixture(scope="module")
def data_files(tmp_path_factory):
    d = tmp_path_factory.mktemp("data")
    (d / "train.jsonl").write_text("".join(json.dumps(r) + "\n" for r in RECORDS[:40]))
    (d / "held.jsonl").write_text("".join(json.dumps(r) + "\n" for r in RECORDS[40:52]))
    return d


def test_a_run_reports_exact_match_and_samples(data_files, tmp_path, capsys):
    out = tmp_path / "run"
    rc = main(["--preset", "tiny", "--data", str(data_files / "train.jsonl"), "--eval-data",
               str(data_files / "held.jsonl"), "--steps", "4", "--eval-every", "2", "--samples", "3",
               "--out", str(out)])
    printed = capsys.readouterr()
    assert rc == 0
    # greedy answering shows its progress, counted in answers, at step 2 and at the end
    done = [x for x in printed.err.splitlines() if x.startswith("held-out answers: answer 12/12 ") and "done" in x]
    assert len(done) == 2, printed.err
    evals = [json.loads(line) for line in (out / "eval.jsonl").read_text().splitlines()]
    assert [e["step"] for e in evals] == [2]
    assert evals[0]["answers_scored"] == 12 and 0 <= evals[0]["exact_match"] <= 1
    assert evals[0]["perplexity"] == pytest.approx(math.exp(evals[0]["loss"]))
    samples = [json.loads(line) for line in (out / "samples.jsonl").read_text().splitlines()]
    mid, final = [x for x in samples if x["step"] == 2], [x for x in samples if x["step"] == 4]
    assert len(mid) == 3 and len(final) == 12
    summary = json.loads((out / "summary.json").read_text())
    assert summary["eval_sequences"] == 12
    assert summary["eval_exact_match"] == sum(x["correct"] for x in final) / 12
    assert "held-out answers exactly right" in printed.out and printed.out.count(" -> ") >= 3


def test_eval_command_scores_a_model_alone(data_files, tmp_path, ctx, capsys):
    tok = load_tokenizer(ASSETS)
    cfg = Lfm2Config(**{**PRESETS["tiny"], "vocab_size": tok.get_vocab_size(with_added_tokens=True)})
    Lfm2Model(cfg, ctx, ComputeEngine(ctx), seed=1).save_pretrained(tmp_path / "m")
    shutil.copy(ASSETS / "tokenizer.json", tmp_path / "m")
    shutil.copy(ASSETS / "tokenizer_config.json", tmp_path / "m")
    rc = main(["eval", "--model", str(tmp_path / "m"), "--data", str(data_files / "held.jsonl"),
               "--json", str(tmp_path / "e.json")])
    assert rc == 0
    got = json.loads((tmp_path / "e.json").read_text())
    engine = ComputeEngine(ctx)
    model = Lfm2Model.from_pretrained(tmp_path / "m", ctx, engine)
    items = _items(Batch.from_jsonl(data_files / "held.jsonl", tok))
    loss, answer_loss = held_out_loss(model, engine, items, 64)
    assert got["loss"] == pytest.approx(loss, rel=1e-6) and got["answer_loss"] == pytest.approx(answer_loss, rel=1e-6)
    samples = greedy_answers(model, tok, answer_cases(items, False), {tok.token_to_id("<|im_end|>"), 2})
    assert got["answers"] == samples and got["exact_match"] == exact_match(samples)
    assert f"{got['records']} records" in capsys.readouterr().out
    # --packing concat: the same losses (one concatenated row per pass), no answers decoded again
    assert main(["eval", "--model", str(tmp_path / "m"), "--data", str(data_files / "held.jsonl"), "--no-answers",
                 "--packing", "concat", "--json", str(tmp_path / "c.json")]) == 0
    concat = json.loads((tmp_path / "c.json").read_text())
    assert concat["packing"] == "concat" and concat["records"] == got["records"]
    assert concat["loss"] == pytest.approx(loss, rel=1e-5) and concat["answer_loss"] == pytest.approx(answer_loss, rel=1e-5)
    for argv, match in ([["--model", str(tmp_path), "--data", str(data_files / "held.jsonl")], "not a model directory"],
                        [["--model", str(tmp_path / "m"), "--data", str(tmp_path / "none.jsonl")], "no such file"],
                        [["--model", str(tmp_path / "m"), "--data", str(data_files / "held.jsonl"),
                          "--max-records", "0"], "--max-records must be at least 1"]):
        assert main(["eval", *argv]) == 2
        assert match in capsys.readouterr().err
    with pytest.raises(SystemExit) as bad:     # argparse's usage error: exit 2 naming the choices
        main(["eval", "--model", str(tmp_path / "m"), "--data", str(data_files / "held.jsonl"), "--packing", "rows"])
    assert bad.value.code == 2 and "invalid choice: 'rows'" in capsys.readouterr().err
