"""python -m trainer.post_data: preference pairs and prompts from the shipped chat tasks, in the formats
the DPO and GRPO readers take."""
from __future__ import annotations

import json

from trainer.data import default_tokenizer, load_tokenizer
from trainer.grpo import read_prompts
from trainer.post_data import main
from trainer.preferences import read_preferences


def test_pairs_and_prompts_from_the_shipped_tasks(tmp_path):
    assert main(["--out", str(tmp_path), "--limit", "200", "--seed", "3"]) == 0
    prefs = [json.loads(l) for l in (tmp_path / "prefs.jsonl").read_text().splitlines()]
    prompts = [json.loads(l) for l in (tmp_path / "prompts.jsonl").read_text().splitlines()]
    assert len(prompts) == 200 and 150 < len(prefs) <= 200
    answers_by_task = {}
    for p in prompts:
        answers_by_task.setdefault(p["task"], set()).add(p["answer"])
    for r in prefs:
        chosen, rejected = r["chosen"][0]["content"], r["rejected"][0]["content"]
        assert chosen != rejected and any(rejected in a for a in answers_by_task.values())
        assert r["prompt"][-1]["role"] == "user"
    tok = load_tokenizer(default_tokenizer())
    assert len(read_preferences(tmp_path / "prefs.jsonl", tok)) == len(prefs)
    records = read_prompts(tmp_path / "prompts.jsonl", tok)
    assert [r.columns["answer"] for r in records] == [p["answer"] for p in prompts]


def test_a_missing_chat_file_is_one_line(tmp_path, capsys):
    assert main(["--chat", str(tmp_path / "none.jsonl"), "--out", str(tmp_path)]) == 2
    assert "no such chat file" in capsys.readouterr().err
