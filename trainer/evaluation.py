"""Held-out evaluation: the loss (and perplexity) over every supervised token and over the answers,
and the exact match of greedy answers on chat records.

An item is (input_ids, target_ids, loss_mask, answer_mask or None) as the trainer's data has them.
A record's answer is its last assistant turn: the last run of supervised targets of its answer
mask (the loss mask itself when the run trains on the answers only). The model is given the
tokens before it (the conversation up to the assistant's header) and decodes greedily until an
end id; the answer is right when its text equals the expected text (both stripped).
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from math import lcm

import numpy as np

from .packing import concat, concatenable, concatenating_saves_rows, pack, packable, pad_token

ANSWER_SLACK = 8          # tokens a wrong answer may run past the expected one's length
GENERATE_BATCH = 16       # prompts decoded together
EVAL_PACK_ROWS = 4096     # rows of one packed evaluation pass (its activations grow with them)


def held_out_loss(model, engine, items, bucket: int, progress=None, packing: str = "pad") -> tuple[float, float]:
    """Mean cross-entropy per supervised token over ``items`` (forward only: no weight or gradient
    of the model is touched), and the same over the answer tokens of items that carry an answer
    mask (NaN when none does). Consecutive items run packed, as training packs them (up to
    EVAL_PACK_ROWS rows a pass, see packing.py; ``packing`` "pad" or "concat"): one pass for many
    short records instead of one each. ``progress(n)`` is told of every n items scored."""
    from lfm2jit.ops.lmhead import lm_head_cross_entropy
    unit = lcm(model.pack_multiple(), bucket)
    lengths = [len(it[0]) for it in items]
    sums, counts = [0.0, 0.0], [0, 0]
    at = 0
    while at < len(items):
        rest = lengths[at:]
        group = items[at:at + (concatenable(rest, EVAL_PACK_ROWS) if packing == "concat"
                               else packable(rest, unit, EVAL_PACK_ROWS))]
        at += len(group)
        segments = None
        if len(group) == 1:
            ids, targets, mask, answer = group[0]
            masks = (mask, answer)
        elif packing == "concat" and concatenating_saves_rows([len(it[0]) for it in group], unit, bucket):
            # an absent answer mask scores none of its sequence's positions
            ids, targets, masks, segments = concat(
                [it[0] for it in group], [it[1] for it in group],
                [[it[j] if it[j] is not None else np.zeros(len(it[0]), np.float32) for it in group] for j in (2, 3)],
                bucket, pad_token(model.cfg))
        else:
            ids, targets, masks = pack([it[0] for it in group], [it[1] for it in group],
                                       [[it[j] if it[j] is not None else () for it in group] for j in (2, 3)],
                                       unit, pad_token(model.cfg))
        trace = model.forward(ids, bucket, segments=segments)
        for j, m in enumerate(masks):
            if m is None or not m.any():
                continue
            res = lm_head_cross_entropy(engine, trace.hn, model.lm_head, targets, m, normalizer=1.0, bucket=bucket,
                                        grads=False)
            sums[j] += res.loss_value()
            counts[j] += int(m.sum())
        if progress is not None:
            progress(len(group))
    return tuple(s / c if c else float("nan") for s, c in zip(sums, counts))


def perplexity(loss: float) -> float:
    return math.exp(loss) if math.isfinite(loss) and loss < 700 else float("nan")


@dataclass(frozen=True)
class AnswerCase:
    prompt: np.ndarray        # the ids the model is given
    expected: np.ndarray      # the answer's ids (its content and closing end token)


def answer_cases(items, answers_are_the_loss: bool) -> list[AnswerCase]:
    """The last answer of each item that has one (see the module docstring); with
    ``answers_are_the_loss`` the loss mask is the answer mask (the run supervises answers only)."""
    cases = []
    for ids, targets, mask, answer in items:
        m = answer if answer is not None else (mask if answers_are_the_loss else None)
        if m is None or not m.any():
            continue
        on = np.flatnonzero(m > 0)
        start = on[-1]
        while start > 0 and m[start - 1] > 0:
            start -= 1
        cases.append(AnswerCase(np.asarray(ids[:start + 1], np.int32), np.asarray(targets[start:on[-1] + 1], np.int32)))
    return cases


def greedy_answers(model, tok, cases: list[AnswerCase], eos_ids, progress=None) -> list[dict]:
    """Each case's greedy answer beside the expected one: {"prompt", "expected", "answer", "correct"};
    ``progress(n)`` is told of every n answers."""
    eos = sorted(set(int(i) for i in eos_ids))
    out = []
    for at in range(0, len(cases), GENERATE_BATCH):
        chunk = cases[at:at + GENERATE_BATCH]
        longest = max(len(c.expected) for c in chunk) + ANSWER_SLACK
        for case, got in zip(chunk, model.generate([c.prompt.tolist() for c in chunk], max_new_tokens=longest,
                                                   eos_token_id=eos)):
            expected = _text(tok, case.expected, eos)
            answer = _text(tok, got, eos)
            out.append({"prompt": tok.decode(case.prompt.tolist(), skip_special_tokens=False),
                        "expected": expected, "answer": answer, "correct": answer == expected})
        if progress is not None:
            progress(len(chunk))
    return out


def exact_match(samples: list[dict]) -> float:
    return sum(s["correct"] for s in samples) / len(samples) if samples else float("nan")


def last_user_turn(prompt: str) -> str:
    """The last user message of a rendered chat prompt (for printing a sample), else the prompt."""
    head = "<|im_start|>user\n"
    if head not in prompt:
        return prompt.strip()
    return prompt.rsplit(head, 1)[1].split("<|im_end|>", 1)[0].strip()


def _text(tok, ids, eos) -> str:
    ids = [int(i) for i in ids]
    while ids and ids[-1] in eos:
        ids.pop()
    return tok.decode(ids, skip_special_tokens=True).strip()
