"""The run's data: the training sequences and the held-out ones, read from --data (and --eval-data)
with the run's tokenizer, and the shuffled order in which the steps take the training sequences."""
from __future__ import annotations

import hashlib
import random
import warnings
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from .state import Data, Run
from .usage import UsageError


def _triples(seqs, loss_on: str):
    """Training triples; with loss_on "all" every target of a sequence is supervised, and the
    assistant-only mask is kept alongside (None when it is the same)."""
    out = []
    for s in seqs:
        ids, targets, mask = s.triple()
        if ids.size == 0:
            continue
        if loss_on == "all":
            full = np.ones_like(mask)
            out.append((ids, targets, full, None if np.array_equal(mask, full) else mask))
        elif mask.any():
            out.append((ids, targets, mask, None))
    return out


def _read_batch(path: str, run: Run, tok, notes: list[str], flag: str = ""):
    """A JSONL file's records as a Batch; its warnings join ``notes``; bad input is a UsageError."""
    from ..data import Batch, DataError
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            batch = Batch.from_jsonl(path, tok, max_len=run.max_len, kind=run.data_kind)
        except DataError as e:
            hint = ("; this looks like preference data: use python -m trainer dpo"
                    if "'chosen'" in str(e) and "'rejected'" in str(e) else "")
            raise UsageError(f"{flag}{e}{hint}") from None
        except FileNotFoundError as e:
            raise UsageError(f"{flag}{e}") from None
        except UnicodeDecodeError as e:
            raise UsageError(f"{flag}{path}: not UTF-8 text ({e.reason} at byte {e.start})") from None
    notes += [str(w.message) for w in caught]
    return batch


def count(n: int, noun: str) -> str:
    """``n`` and ``noun``, plural unless n is 1: 1 record, 2 records."""
    return f"{n} {noun}" + ("" if n == 1 else "s")


def load_data(run: Run, tok) -> Data:
    """The training and held-out sequences of --data (or --eval-data), with notes on what was left out;
    bad input is a UsageError. A DPO run's are preference pairs (``load_preferences``)."""
    if run.objective == "dpo":
        return load_preferences(run, tok)
    if run.objective == "grpo":
        return load_prompts(run, tok)
    notes: list[str] = []
    batch = _read_batch(run.data, run, tok, notes)
    empty = sum(1 for s in batch if s.is_empty if run.loss_on == "assistant" or s.length == 0)
    if empty:
        notes.append(f"{count(empty, 'record')} {'has' if empty == 1 else 'have'} no supervised token and "
                     f"{'is' if empty == 1 else 'are'} skipped")
    cut = sum(1 for s in batch if s.is_empty and s.length > 0) if run.loss_on == "all" else 0
    if cut:
        notes.append(f"--loss-on all: the {count(cut, 'record')} without an assistant token "
                     f"{'is' if cut == 1 else 'are'} still trained on, on "
                     "every token they kept (only an --loss-on assistant run skips them)")
    if run.eval_data is not None:
        held = _read_batch(run.eval_data, run, tok, notes, "--eval-data ")
        train = batch
    elif run.eval_fraction > 0:
        if len(batch) < 2:
            raise UsageError(f"{run.data}: {count(len(batch), 'record')} cannot be split into training and held-out "
                             "sequences; pass --eval-fraction 0")
        try:
            train, held = batch.split(run.eval_fraction, run.seed)
        except ValueError as e:
            raise UsageError(f"{run.data}: {e}") from None
    else:
        train, held = batch, batch[:0]
    sha1 = hashlib.sha1(Path(run.data).read_bytes()).hexdigest()
    tr = [t[:3] for t in _triples(train, run.loss_on)]
    ev = _triples(held, run.loss_on)[:run.eval_max]
    if not tr:
        raise UsageError(f"{run.data}: no training sequence has a supervised token")
    full = all(bool(t[2].all()) for t in tr)
    return Data(tr, ev, sha1, notes, has_answers=any(e[3] is not None for e in ev),
                label="all tokens" if full else "assistant tokens", held=len(held))


def _read_pairs(path: str, run: Run, tok, notes: list[str], flag: str = "") -> list:
    """A JSONL file's preference records as PreferencePairs; warnings join ``notes``; bad input is a UsageError."""
    from ..data import DataError
    from ..preferences import read_preferences
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            pairs = read_preferences(path, tok, max_len=run.max_len)
        except (DataError, FileNotFoundError, ValueError) as e:
            raise UsageError(f"{flag}{e}") from None
        except UnicodeDecodeError as e:
            raise UsageError(f"{flag}{path}: not UTF-8 text ({e.reason} at byte {e.start})") from None
    notes += [str(w.message) for w in caught]
    return pairs


def _held_out(items: list, held: list | None, run: Run, noun: str) -> tuple[list, list]:
    """(training, held-out) items: ``held`` as given (--eval-data), else --eval-fraction of ``items``
    chosen with --seed, as Batch.split chooses SFT's held-out records."""
    if held is not None:
        return items, held
    if run.eval_fraction <= 0:
        return items, []
    n, n_held = len(items), max(1, round(len(items) * run.eval_fraction))
    if n_held >= n:
        raise UsageError(f"{run.data}: {count(n, noun)} cannot be split into training and held-out "
                         f"{noun}s with --eval-fraction {run.eval_fraction:g}; pass --eval-fraction 0")
    order = list(range(n))
    random.Random(run.seed).shuffle(order)
    out = set(order[:n_held])
    return [x for i, x in enumerate(items) if i not in out], [x for i, x in enumerate(items) if i in out]


def load_preferences(run: Run, tok) -> Data:
    """A DPO run's training and held-out preference pairs: --data split by --eval-fraction and --seed (as
    SFT's records are split), or --eval-data; bad input is a UsageError."""
    notes: list[str] = []
    pairs = _read_pairs(run.data, run, tok, notes)
    held = _read_pairs(run.eval_data, run, tok, notes, "--eval-data ") if run.eval_data is not None else None
    train, held = _held_out(pairs, held, run, "preference pair")
    sha1 = hashlib.sha1(Path(run.data).read_bytes()).hexdigest()
    return Data(train, held[:run.eval_max], sha1, notes, has_answers=False, label="DPO, mean over pairs",
                held=len(held))


def _read_prompts(path: str, run: Run, tok, notes: list[str], flag: str = "") -> list:
    """A prompts file's records (trainer/grpo.py's read_prompts), those longer than --max-len left out with a
    note; bad input is a UsageError."""
    from ..data import DataError
    from ..grpo import read_prompts
    try:
        records = read_prompts(path, tok)
    except (DataError, FileNotFoundError, ValueError) as e:
        raise UsageError(f"{flag}{e}") from None
    except UnicodeDecodeError as e:
        raise UsageError(f"{flag}{path}: not UTF-8 text ({e.reason} at byte {e.start})") from None
    kept = [r for r in records if r.ids.size <= run.max_len]
    if len(kept) < len(records):
        notes.append(f"{path}: {count(len(records) - len(kept), 'prompt')} longer than --max-len {run.max_len} "
                     f"tokens left out")
    if not kept:
        raise UsageError(f"{flag}{path}: every prompt is longer than --max-len {run.max_len} tokens")
    lacking = next((r for r in kept if "answer" not in r.columns), None)
    if "exact_match" in run.rewards and lacking is not None:      # refused now, not at the first batch (exit 1)
        raise UsageError(f"--reward exact_match compares each completion with its record's 'answer': "
                         f"{lacking.origin} has none")
    return kept


def load_prompts(run: Run, tok) -> Data:
    """A GRPO run's training and held-out prompts: --data (--prompts) split by --eval-fraction and --seed (as
    preference pairs are split), or --eval-data; bad input is a UsageError."""
    notes: list[str] = []
    prompts = _read_prompts(run.data, run, tok, notes)
    held = _read_prompts(run.eval_data, run, tok, notes, "--eval-data ") if run.eval_data is not None else None
    train, held = _held_out(prompts, held, run, "prompt")
    sha1 = hashlib.sha1(Path(run.data).read_bytes()).hexdigest()
    return Data(train, held[:run.eval_max], sha1, notes, has_answers=False, label="GRPO", held=len(held))


def epoch_order(n: int, seed: int, epoch: int) -> np.ndarray:
    """The training order of an epoch: a permutation of 0..n-1 fixed by (seed, epoch)."""
    return np.random.default_rng([seed, epoch]).permutation(n)


@dataclass
class Cursor:
    """Where the run is in its data: the epoch, the next sequence of the epoch's order, the tokens
    trained on so far (all of it kept in a checkpoint's data position)."""
    n: int                 # training sequences
    seed: int
    epoch: int = 0
    next: int = 0
    tokens: int = 0

    def __post_init__(self):
        self.order = epoch_order(self.n, self.seed, self.epoch)

    def take(self, per_step: int) -> np.ndarray:
        """The next step's window of ``per_step`` sequence indices; a window that does not fit in the
        epoch starts the next one."""
        if self.next + per_step > self.n:
            self.epoch, self.next = self.epoch + 1, 0
            self.order = epoch_order(self.n, self.seed, self.epoch)
        window = self.order[self.next:self.next + per_step]
        self.next += per_step
        return window
