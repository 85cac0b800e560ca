"""Post-training data from chat records (the shipped tasks by default): preference pairs for DPO
and prompts with answers for GRPO, as JSONL in TRL's formats.

    python -m trainer.post_data [--chat FILE] [--out DIR] [--seed N] [--limit N]

writes ``DIR/prefs.jsonl`` (conversational: the prompt's messages; chosen = the record's own final
answer; rejected = the final answer of another record of the same task, different from it) and
``DIR/prompts.jsonl`` (``{"prompt": [messages], "answer": ..., "task": ...}``, for exact-match
rewards). Only records whose final message is the assistant's are used; a task with a single record
gives no pair.
"""
from __future__ import annotations

import argparse
import json
import sys
from collections import defaultdict
from pathlib import Path

import numpy as np

from .data import default_dataset


def _records(path) -> list[dict]:
    out = []
    with open(path, encoding="utf-8") as f:
        for line in f:
            if line.strip():
                r = json.loads(line)
                msgs = r.get("messages") or []
                if msgs and msgs[-1].get("role") == "assistant" and isinstance(msgs[-1].get("content"), str):
                    out.append(r)
    return out


def preference_records(records: list[dict], seed: int = 0) -> list[dict]:
    """One pair per record whose task has another record with a different answer."""
    rng = np.random.default_rng(seed)
    by_task = defaultdict(list)
    for r in records:
        by_task[r.get("task")].append(r["messages"][-1]["content"])
    out = []
    for r in records:
        answer = r["messages"][-1]["content"]
        others = [a for a in by_task[r.get("task")] if a != answer]
        if others:
            out.append({"prompt": r["messages"][:-1], "chosen": [{"role": "assistant", "content": answer}],
                        "rejected": [{"role": "assistant", "content": str(rng.choice(others))}]})
    return out


def prompt_records(records: list[dict]) -> list[dict]:
    return [{"prompt": r["messages"][:-1], "answer": r["messages"][-1]["content"], "task": r.get("task")}
            for r in records]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m trainer.post_data", description=__doc__.split("\n")[0])
    ap.add_argument("--chat", default=None, help="chat JSONL (default: the shipped chat tasks)")
    ap.add_argument("--out", default="post_data", help="directory for prefs.jsonl and prompts.jsonl")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--limit", type=int, default=None, help="use the first N usable records")
    args = ap.parse_args(argv)
    chat = Path(args.chat) if args.chat else default_dataset()
    if not chat.is_file():
        print(f"python -m trainer.post_data: error: no such chat file: {chat}", file=sys.stderr)
        return 2
    records = _records(chat)[:args.limit]
    if not records:
        print(f"python -m trainer.post_data: error: {chat} has no record ending with an assistant message",
              file=sys.stderr)
        return 2
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    for name, rows in (("prefs.jsonl", preference_records(records, args.seed)), ("prompts.jsonl", prompt_records(records))):
        (out / name).write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows), encoding="utf-8")
        print(f"{out / name}: {len(rows)} records")
    return 0


if __name__ == "__main__":
    sys.exit(main())
