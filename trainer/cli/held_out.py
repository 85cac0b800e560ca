"""The held-out evaluations of a training run: loss, perplexity and exact match of greedy answers,
added up over the ranks, recorded in eval.jsonl and samples.jsonl, printed with a few samples."""
from __future__ import annotations

import json
import sys
from contextlib import contextmanager
from pathlib import Path

from .progress import Progress
from .run_dir import clean
from .state import Session


def evaluate(s: Session, items, answers: bool) -> dict:
    """The held-out metrics of ``items``: loss and perplexity over the supervised tokens and over
    the answers, and with ``answers`` the exact match of greedy answers (up to --eval-answers
    records) with every scored sample (see trainer/evaluation.py)."""
    from ..evaluation import answer_cases, exact_match, greedy_answers, held_out_loss, perplexity
    run, data, model = s.run, s.data, s.model
    with _bar(run, len(items), "held-out loss", "sequence") as bar:
        loss, answer_loss = held_out_loss(model, s.engine, items, run.bucket, progress=bar.update,
                                          packing=run.packing)
    out = {"loss": loss, "perplexity": perplexity(loss), "answer_loss": answer_loss,
           "answer_perplexity": perplexity(answer_loss), "exact_match": None, "answers_scored": 0}
    if answers and run.eval_answers != 0:
        # with several ranks: the one-process run's cases, every world_size-th of them on this rank
        source = data.eval if run.world_size > 1 else items
        cases = answer_cases(source, data.label == "assistant tokens")[:run.eval_answers][run.rank::run.world_size]
        if cases:
            end = s.tok.token_to_id("<|im_end|>")
            with _bar(run, len(cases), "held-out answers", "answer") as bar:
                samples = greedy_answers(model, s.tok, cases, set(model.generation_eos) | ({end} - {None}),
                                         progress=bar.update)
            out.update(exact_match=exact_match(samples), answers_scored=len(samples), samples=samples)
    return _combine(s, out, items) if run.world_size > 1 else out


@contextmanager
def _bar(run, total: int, desc: str, unit: str):
    """A progress bar on stderr over one part of the evaluation (long on a slow device: --eval-max and
    --eval-answers shorten it); its first pass compiles, so the pace counts from the second."""
    bar = Progress(total=total, enabled=run.progress, file=sys.stderr, desc=desc, unit=unit, warmup=1)
    try:
        yield bar
    finally:
        bar.close()


def _combine(s: Session, out: dict, items) -> dict:
    """This rank's held-out metrics of its share ``items`` made the whole held-out set's: the loss
    sums and token counts, correct answers and answers scored, added over the ranks."""
    from ..evaluation import perplexity
    n_tok = float(sum(m.sum() for _, _, m, _ in items if m.any()))
    n_ans = float(sum(a.sum() for *_, a in items if a is not None and a.any()))
    correct = sum(bool(x["correct"]) for x in out.get("samples", []))
    t = s.sum_over_ranks([out["loss"] * n_tok if n_tok else 0.0, n_tok,
                          out["answer_loss"] * n_ans if n_ans else 0.0, n_ans, correct, out["answers_scored"]],
                         "the held-out sums")
    loss = t[0] / t[1] if t[1] else float("nan")
    answer_loss = t[2] / t[3] if t[3] else float("nan")
    return {**out, "loss": loss, "perplexity": perplexity(loss), "answer_loss": answer_loss,
            "answer_perplexity": perplexity(answer_loss), "exact_match": t[4] / t[5] if t[5] else None,
            "answers_scored": int(t[5])}


def print_samples(samples: list[dict], k: int, write) -> None:
    """The first ``k`` scored answers, one line each through ``write``: right or not, the question,
    the answer, and what was expected where it differs."""
    from ..evaluation import last_user_turn
    for x in samples[:k]:
        write(f"    {'ok ' if x['correct'] else 'BAD'} {last_user_turn(x['prompt'])!r} -> {x['answer']!r}"
              + ("" if x["correct"] else f" (expected {x['expected']!r})"))


def record(step: int, ev: dict, eval_path: Path, samples_path: Path, k: int) -> dict:
    """Append an evaluation during the run to eval.jsonl (and its first k samples to samples.jsonl)."""
    rec = {"step": step, **{key: clean(v) for key, v in ev.items() if key != "samples"}}
    with open(eval_path, "a") as f:
        f.write(json.dumps(rec) + "\n")
    if ev.get("samples") and k:
        with open(samples_path, "a") as f:
            f.writelines(json.dumps({"step": step, **x}) + "\n" for x in ev["samples"][:k])
    return {**rec, "samples": ev.get("samples", [])}
