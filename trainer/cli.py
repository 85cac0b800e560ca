"""``python -m trainer``: train a tiny LFM2 from scratch on the shipped data (no arguments), or fine-tune
a Hugging Face LFM2 checkpoint on a chat or text JSONL file (``--model DIR --data FILE``).

Each optimizer step takes the next ``world_size * grad_accum`` sequences of the epoch's shuffled
order; rank r trains on sequences r, r + world_size, ... of that window (one micro-batch per
sequence, as ``Trainer`` runs them), so N ranks with accumulation A see exactly the sequences that
one process with accumulation N*A would. A run directory holds::

    metrics.jsonl            one JSON line per optimizer step (see METRICS_KEYS)
    loss.png                 the loss curve (and the held-out loss before and after)
    summary.json             the numbers the summary prints
    run.json                 the resolved settings of the run
    checkpoints/step-NNNNNN  Trainer.save_checkpoint: model/ (a Hugging Face LFM2 directory, with the
                             tokenizer copied in), optimizer.safetensors, trainer.json

``--resume`` restores weights, optimizer state, loss scaler, step count, schedule and data position
from a checkpoint, plus the run's settings (kept in the checkpoint's data position as "run"), so
the resumed run continues exactly as if it had not stopped. Flags given with ``--resume`` override
the saved settings (a note lists what changed).

Exit status: 0 done; 1 training failed (a TrainError such as a sync timeout or a non-finite loss,
or the no-argument run's loss did not fall); 2 bad usage or input (missing files, malformed JSONL,
a tokenizer larger than the model's vocabulary), reported in one line without a traceback.
"""
from __future__ import annotations

import argparse
import hashlib
import json
import math
import os
import re
import shutil
import sys
import time
import warnings
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from .trainer import DEFAULT_PACK_TOKENS

# Defaults of the run `python -m trainer` does with no arguments: a small model trained from
# scratch on the shipped chat data (measured on lavapipe, 2 CPU cores: about 3 minutes).
DEMO_PRESET = "demo"
DEMO_SHAPE = dict(hidden_size=64, intermediate_size=192, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, layer_types=["conv", "full_attention"], block_multiple_of=16)
DEMO_STEPS = 250
DEMO_LR = 1e-2
DEMO_CHECK_LOSS_DROP = 0.5     # with no arguments: exit 1 unless eval loss after <= 0.5 * before

FINETUNE_LR = 5e-5
DEFAULT_ACCUM = 4
DEFAULT_MAX_LEN = 512
DEFAULT_EVAL_FRACTION = 0.05
DEFAULT_EVAL_MAX = 200
DEFAULT_KEEP = 2
MAX_SKIPPED_IN_A_ROW = 50

METRICS_KEYS = ("step", "loss", "tokens", "supervised", "tokens_per_s", "lr", "grad_norm", "loss_scale",
                "skipped", "elapsed", "epoch")

SCHEDULES = ("constant", "warmup", "cosine", "linear")


class UsageError(Exception):
    """Bad flags or inputs: reported as one line, exit status 2."""


# ---------------------------------------------------------------------------------------------
# command line
# ---------------------------------------------------------------------------------------------

EPILOG = """\
examples:
  python -m trainer                                   # the main job: tiny LFM2 from scratch, ~3 min on CPU
  python -m trainer --preset tiny --steps 50 --out runs/tiny
  python -m trainer --model DIR --data chat.jsonl --lr 2e-5 --epochs 1 --grad-accum 8
  python -m trainer --resume runs/tiny --steps 100    # continue a run from its latest checkpoint
  python -m trainer --model DIR --data d.jsonl --sync-dir /shared/sync --rank 0 --world-size 2 --out runs/x &
  python -m trainer --model DIR --data d.jsonl --sync-dir /shared/sync --rank 1 --world-size 2 --out runs/x

defaults that depend on the mode:
  from scratch (no --model): --preset demo --lr 1e-2 --loss-on all, and on the built-in data --steps 250
  fine-tuning (--model DIR):  --lr 5e-5 --loss-on assistant
  otherwise --epochs 1 when neither --steps nor --epochs is given
  python -m trainer with no arguments at all also implies --check-loss-drop 0.5

exit status: 0 done, 1 training failed (or --check-loss-drop not met), 2 bad usage or input
"""


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m trainer",
        description="Train an LFM2 model on lfm2jit's WebGPU kernels. With no arguments: train a tiny LFM2 "
                    "from scratch on the shipped synthetic chat data and tokenizer, then report. With "
                    "--model DIR --data FILE.jsonl: fine-tune a Hugging Face LFM2 checkpoint.",
        epilog=EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter)
    # Every default is None here so that --resume can tell given flags from defaults; the
    # documented defaults are filled in by resolve().
    m = p.add_argument_group("model and data")
    m.add_argument("--model", metavar="DIR",
                   help="fine-tune this Hugging Face LFM2 checkpoint: config.json, model.safetensors (or a "
                        "sharded index) and tokenizer.json in DIR. Without it a model is trained from scratch")
    m.add_argument("--preset", metavar="NAME",
                   help="shape of a model trained from scratch: demo (hidden 64, 2 layers: conv + attention; "
                        "the default), tiny, tiny-untied, 350M, 700M, 1.2B; vocab_size is set to the "
                        "tokenizer's size")
    m.add_argument("--tokenizer", metavar="FILE",
                   help="tokenizer.json (or a directory holding one); default: DIR/tokenizer.json with "
                        "--model, else the shipped character-level tokenizer")
    m.add_argument("--data", metavar="FILE.jsonl",
                   help='training data: one JSON object a line, {"text": ...} or chat {"messages": [{"role", '
                        '"content"}, ...]} (only assistant tokens are supervised); default: the shipped '
                        "synthetic chat dataset (3000 records)")
    m.add_argument("--data-kind", choices=("auto", "text", "chat"),
                   help="record kind of --data: auto (by each record's key; default), text or chat")
    m.add_argument("--loss-on", choices=("assistant", "all"),
                   help="targets of chat records the loss counts: assistant (only the assistant answers, as in "
                        "fine-tuning; the default with --model) or all (every next token of the rendered "
                        "conversation, as in pretraining; the default from scratch). Text records: always all")
    m.add_argument("--max-len", type=int, metavar="N",
                   help=f"at most N positions per sequence; longer records are cut (with a note) "
                        f"(default {DEFAULT_MAX_LEN})")
    m.add_argument("--eval-fraction", type=float, metavar="F",
                   help=f"hold out this fraction of the records (chosen by --seed) and report their mean loss "
                        f"before and after training; 0 disables (default {DEFAULT_EVAL_FRACTION})")
    m.add_argument("--eval-max", type=int, metavar="N",
                   help=f"evaluate at most N held-out sequences (default {DEFAULT_EVAL_MAX})")
    m.add_argument("--seed", type=int, metavar="N",
                   help="seed of the initial weights (from scratch), the held-out split and the per-epoch "
                        "shuffle (default 0)")

    o = p.add_argument_group("optimization")
    o.add_argument("--optimizer", choices=("adamw", "sgd"), help="adamw (torch.optim.AdamW; default) or sgd "
                                                                 "(torch.optim.SGD)")
    o.add_argument("--lr", type=float, metavar="LR",
                   help=f"peak learning rate (default {DEMO_LR:g} from scratch, {FINETUNE_LR:g} with --model)")
    o.add_argument("--weight-decay", type=float, metavar="WD",
                   help="weight decay: decoupled for adamw (default 0.01), added to the gradient for sgd "
                        "(default 0)")
    o.add_argument("--momentum", type=float, metavar="M", help="sgd momentum (default 0.9; adamw ignores it)")
    o.add_argument("--schedule", choices=SCHEDULES,
                   help="learning-rate schedule over the optimizer steps: constant; warmup (linear warmup, then "
                        "constant); cosine (warmup, then cosine down to --min-lr; default); linear (warmup, then "
                        "linear down to --min-lr)")
    o.add_argument("--warmup-steps", type=int, metavar="N",
                   help="warmup steps of the warmup/cosine/linear schedules (default 5%% of the steps)")
    o.add_argument("--min-lr", type=float, metavar="LR",
                   help="final learning rate of the cosine and linear schedules (default lr / 10)")
    o.add_argument("--grad-accum", type=int, metavar="N",
                   help=f"sequences per optimizer step (per rank): the batch size; the update is the mean over "
                        f"them (default {DEFAULT_ACCUM})")
    o.add_argument("--pack-tokens", type=int, metavar="N",
                   help="run the sequences of a step packed, up to N positions per pass (padded to the longest); "
                        f"0 = one sequence per pass (default {DEFAULT_PACK_TOKENS})")
    o.add_argument("--clip", type=float, metavar="NORM",
                   help="clip the global gradient L2 norm to NORM (torch.nn.utils.clip_grad_norm_); 0 = off "
                        "(default 1.0)")
    o.add_argument("--bucket", type=int, metavar="N",
                   help="length bucket: kernels are compiled for lengths rounded up to a multiple of N, "
                        "so every length in a bucket reuses them (default 64)")
    o.add_argument("--scaler", action="store_true", default=None,
                   help="dynamic loss scaling (GradScaler: scale 2**16, x0.5 and skip the step on inf/NaN "
                        "gradients, x2 after 2000 clean steps)")
    o.add_argument("--f16", action="store_true", default=None,
                   help="mixed precision: activations and their gradients stored as f16 (half the activation "
                        "memory and traffic); weights, gradients and optimizer state stay f32 and every kernel "
                        "computes in f32. Turns on --scaler (f16 gradients need loss scaling). Needs an adapter "
                        "with shader-f16"),
    length = o.add_mutually_exclusive_group()
    length.add_argument("--steps", type=int, metavar="N",
                        help="train until optimizer step N (total, counting steps before a --resume)")
    length.add_argument("--epochs", type=float, metavar="E",
                        help="train for E passes over the training split (E may be fractional; default 1 unless "
                             "--steps is given or the built-in run is done)")

    c = p.add_argument_group("output, checkpoints, resume")
    c.add_argument("--out", metavar="DIR",
                   help="run directory for metrics.jsonl, loss.png, summary.json, run.json and checkpoints/ "
                        "(default runs/<date>-<time>; with --world-size > 1 runs/<run-id>; with --resume the run "
                        "directory holding the checkpoint, whose metrics.jsonl is continued)")
    c.add_argument("--checkpoint-every", type=int, metavar="N",
                   help="also checkpoint every N optimizer steps (default 0: only at the end)")
    c.add_argument("--keep-checkpoints", type=int, metavar="K",
                   help=f"keep only the newest K checkpoints of the run; 0 keeps all (default {DEFAULT_KEEP})")
    c.add_argument("--resume", metavar="DIR",
                   help="continue from a checkpoint (DIR/trainer.json) or a run directory's newest checkpoint: "
                        "weights, optimizer, scaler, schedule, data position and the run's settings")
    c.add_argument("--check-loss-drop", type=float, metavar="F",
                   help="exit with status 1 unless the held-out loss after training is at most F times the loss "
                        f"before (default: off; {DEMO_CHECK_LOSS_DROP} for the no-argument run)")
    c.add_argument("--no-progress", action="store_true", default=None, help="no progress bar")

    s = p.add_argument_group("multi-process gradient sync (FileGradSync) and device")
    s.add_argument("--sync-dir", metavar="DIR",
                   help="shared directory through which --world-size processes average their gradients every "
                        "optimizer step; start one process per rank with the same flags")
    s.add_argument("--rank", type=int, metavar="R", help="this process's rank, 0 .. world-size - 1 (default 0)")
    s.add_argument("--world-size", type=int, metavar="N", help="number of processes (default 1)")
    s.add_argument("--run-id", metavar="ID",
                   help="name of the run's sync files, so files of another run are never mixed in (default run)")
    s.add_argument("--sync-timeout", type=float, metavar="S",
                   help="seconds to wait for the other ranks at a step before failing (default 600)")
    s.add_argument("--adapter", metavar="SUBSTRING",
                   help="use the wgpu adapter whose name/vendor/backend contains SUBSTRING (sets LFM2JIT_ADAPTER)")
    return p


# Settings whose change on --resume does not alter the training itself (a changed --steps shows up as a
# changed schedule, noted separately).
AS_YOU_LIKE = {"steps", "checkpoint_every", "keep_checkpoints", "eval_max", "sync_timeout", "check_loss_drop"}

# Settings a checkpoint carries and --resume restores (flags given with --resume override them).
RESUMABLE = ("tokenizer", "data", "data_kind", "loss_on", "max_len", "eval_fraction", "eval_max", "seed", "optimizer", "lr",
             "weight_decay", "momentum", "schedule", "warmup_steps", "min_lr", "grad_accum", "pack_tokens", "clip", "bucket",
             "scaler", "f16", "steps", "checkpoint_every", "keep_checkpoints", "world_size", "sync_dir", "run_id",
             "sync_timeout", "check_loss_drop", "source", "preset")


@dataclass
class Run:
    """The resolved settings of a run (everything a default or a checkpoint could supply)."""
    source: str                     # "scratch" or "model"
    model: str | None
    preset: str | None
    tokenizer: str
    data: str
    data_kind: str
    loss_on: str
    max_len: int
    eval_fraction: float
    eval_max: int
    seed: int
    optimizer: str
    lr: float
    weight_decay: float
    momentum: float
    schedule: str
    warmup_steps: int | None        # None: 5% of the steps, fixed once steps are known
    min_lr: float
    grad_accum: int
    pack_tokens: int
    clip: float
    bucket: int
    scaler: bool
    f16: bool
    steps: int | None
    epochs: float | None
    out: str | None
    checkpoint_every: int
    keep_checkpoints: int
    check_loss_drop: float | None
    progress: bool
    sync_dir: str | None
    rank: int
    world_size: int
    run_id: str
    sync_timeout: float
    adapter: str | None
    resume: str | None
    builtin_data: bool = False
    notes: list[str] = field(default_factory=list)
    derived: set = field(default_factory=set)     # settings left to defaults that follow others

    def saved(self) -> dict:
        """The settings a checkpoint keeps. Defaults derived from other settings (min_lr = lr / 10,
        warmup = 5% of the steps) are kept as None, so they follow an overridden lr or steps."""
        return {k: None if k in self.derived else getattr(self, k) for k in RESUMABLE}


def _given(args: argparse.Namespace) -> dict:
    return {k: v for k, v in vars(args).items() if v is not None}


def resolve(args: argparse.Namespace, argv_empty: bool, saved: dict | None = None, ckpt: Path | None = None) -> Run:
    """Fill in defaults (or, with --resume, the checkpoint's settings), then validate."""
    from .data import default_dataset, default_tokenizer
    g = _given(args)
    notes: list[str] = []
    if saved is not None:
        for flag in ("model", "preset"):
            if flag in g:
                raise UsageError(f"--{flag} cannot be combined with --resume: the model comes from the checkpoint")
        base = {k: v for k, v in saved.items() if v is not None}
        changed = [k for k in RESUMABLE if k in g and k in base and g[k] != base[k] and k not in AS_YOU_LIKE]
        if changed:
            notes.append("--resume with changed settings (the run will not continue exactly as before): "
                         + ", ".join(f"{k} {base[k]!r} -> {g[k]!r}" for k in changed))
        if "epochs" in g:
            base.pop("steps", None)
        base.update({k: v for k, v in g.items() if k in RESUMABLE})
        g = {**g, **base}
        source = g["source"]
    else:
        source = "model" if "model" in g else "scratch"
        if source == "model" and "preset" in g:
            raise UsageError("--preset is for training from scratch; --model DIR brings its own config.json")
    builtin_data = "data" not in g
    model_dir = g.get("model")
    if source == "model" and saved is None:
        md = Path(model_dir)
        if not md.is_dir():
            raise UsageError(f"--model {model_dir}: no such directory")
        if not (md / "config.json").is_file():
            raise UsageError(f"--model {model_dir}: no config.json (a Hugging Face LFM2 checkpoint directory holds "
                             "config.json, model.safetensors and tokenizer.json)")
        if not any(md.glob("*.safetensors")) and not (md / "model.safetensors.index.json").is_file():
            raise UsageError(f"--model {model_dir}: no *.safetensors weights")
    tokenizer = g.get("tokenizer")
    if tokenizer is None and ckpt is not None and (ckpt / "model" / "tokenizer.json").is_file():
        tokenizer = str(ckpt / "model" / "tokenizer.json")      # the copy every checkpoint carries
    if tokenizer is None:
        if source == "model":
            tokenizer = str(Path(model_dir) / "tokenizer.json")
            if not Path(tokenizer).is_file():
                raise UsageError(f"--model {model_dir}: no tokenizer.json (pass --tokenizer FILE)")
        else:
            tokenizer = str(default_tokenizer())
    data = g.get("data") or str(default_dataset())
    if not Path(data).is_file():
        raise UsageError(f"--data {data}: no such file")
    if not Path(tokenizer).exists():
        raise UsageError(f"--tokenizer {tokenizer}: no such file or directory")
    optimizer = g.get("optimizer", "adamw")
    lr = g.get("lr", DEMO_LR if source == "scratch" else FINETUNE_LR)
    steps = g.get("steps")
    epochs = g.get("epochs")
    if steps is None and epochs is None and source == "scratch" and builtin_data:
        steps = DEMO_STEPS
    world = g.get("world_size", 1)
    run = Run(
        source=source, model=model_dir, preset=g.get("preset", DEMO_PRESET if source == "scratch" else None),
        tokenizer=tokenizer, data=data, data_kind=g.get("data_kind", "auto"),
        loss_on=g.get("loss_on", "all" if source == "scratch" else "assistant"),
        max_len=g.get("max_len", DEFAULT_MAX_LEN), eval_fraction=g.get("eval_fraction", DEFAULT_EVAL_FRACTION),
        eval_max=g.get("eval_max", DEFAULT_EVAL_MAX), seed=g.get("seed", 0), optimizer=optimizer, lr=lr,
        weight_decay=g.get("weight_decay", 0.01 if optimizer == "adamw" else 0.0), momentum=g.get("momentum", 0.9),
        schedule=g.get("schedule", "cosine"), warmup_steps=g.get("warmup_steps"), min_lr=g.get("min_lr", lr / 10),
        grad_accum=g.get("grad_accum", DEFAULT_ACCUM), pack_tokens=g.get("pack_tokens", DEFAULT_PACK_TOKENS), clip=g.get("clip", 1.0), bucket=g.get("bucket", 64),
        scaler=bool(g.get("scaler", False) or g.get("f16", False)), f16=bool(g.get("f16", False)),
        steps=steps, epochs=epochs, out=g.get("out"),
        checkpoint_every=g.get("checkpoint_every", 0), keep_checkpoints=g.get("keep_checkpoints", DEFAULT_KEEP),
        check_loss_drop=g.get("check_loss_drop", DEMO_CHECK_LOSS_DROP if argv_empty else None),
        progress=not g.get("no_progress", False), sync_dir=g.get("sync_dir"), rank=g.get("rank", 0),
        world_size=world, run_id=g.get("run_id", "run"), sync_timeout=g.get("sync_timeout", 600.0),
        adapter=g.get("adapter"), resume=g.get("resume"), builtin_data=builtin_data, notes=notes,
        derived={k for k in ("min_lr", "warmup_steps", "tokenizer", "data") if k not in g})
    _validate(run)
    for key in ("model", "tokenizer", "data", "sync_dir"):      # kept in checkpoints: independent of the cwd
        if getattr(run, key) is not None:
            setattr(run, key, str(Path(getattr(run, key)).resolve()))
    return run


def _validate(r: Run) -> None:
    def positive(name, value, allow_zero=False):
        if value is None:
            return
        if not math.isfinite(value) or value < 0 or (value == 0 and not allow_zero):
            raise UsageError(f"--{name.replace('_', '-')} must be {'>= 0' if allow_zero else '> 0'}, got {value}")
    for name in ("lr", "min_lr", "weight_decay", "momentum", "clip", "eval_fraction", "sync_timeout"):
        positive(name, getattr(r, name), allow_zero=name not in ("sync_timeout",))
    for name in ("grad_accum", "bucket", "max_len", "eval_max", "world_size"):
        positive(name, getattr(r, name))
    for name in ("checkpoint_every", "keep_checkpoints", "warmup_steps", "pack_tokens"):
        positive(name, getattr(r, name), allow_zero=True)
    positive("steps", r.steps)
    positive("epochs", r.epochs)
    if r.min_lr > r.lr and r.schedule in ("cosine", "linear"):
        raise UsageError(f"--min-lr {r.min_lr:g} is larger than --lr {r.lr:g}")
    if r.eval_fraction >= 1:
        raise UsageError(f"--eval-fraction must be below 1, got {r.eval_fraction}")
    if r.preset is not None and r.source == "scratch":
        from lfm2jit.model.config import PRESETS
        if r.preset != DEMO_PRESET and r.preset not in PRESETS:
            raise UsageError(f"unknown --preset {r.preset!r}; available: {', '.join([DEMO_PRESET, *PRESETS])}")
    if not 0 <= r.rank < r.world_size:
        raise UsageError(f"--rank must be in 0..{r.world_size - 1} for --world-size {r.world_size}, got {r.rank}")
    if r.world_size > 1 and not r.sync_dir:
        raise UsageError("--world-size > 1 needs --sync-dir DIR, a directory every rank can read and write")
    if r.run_id and any(ch in r.run_id for ch in "/\\"):
        raise UsageError(f"--run-id must not contain slashes, got {r.run_id!r}")


# ---------------------------------------------------------------------------------------------
# data
# ---------------------------------------------------------------------------------------------

@dataclass
class Data:
    train: list            # (input_ids, target_ids, loss_mask) with at least one supervised target
    eval: list             # (input_ids, target_ids, loss_mask, answer_mask or None)
    sha1: str
    notes: list[str]
    has_answers: bool      # eval holds chat records trained on all tokens: also report the answer loss
    label: str = "all tokens"    # which targets the loss counts, for the summary


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


def load_data(run: Run, tok) -> Data:
    from .data import Batch, DataError
    notes: list[str] = []
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            batch = Batch.from_jsonl(run.data, tok, max_len=run.max_len, kind=run.data_kind)
        except (DataError, FileNotFoundError) as e:
            raise UsageError(str(e)) from None
        except UnicodeDecodeError as e:
            raise UsageError(f"{run.data}: not UTF-8 text ({e.reason} at byte {e.start})") from None
    notes += [str(w.message) for w in caught]
    empty = sum(1 for s in batch if s.is_empty if run.loss_on == "assistant" or s.length == 0)
    if empty:
        notes.append(f"{empty} record(s) have no supervised token and are skipped")
    if run.eval_fraction > 0:
        if len(batch) < 2:
            raise UsageError(f"{run.data}: {len(batch)} record(s) cannot be split into training and held-out "
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
                label="all tokens" if full else "assistant tokens")


def epoch_order(n: int, seed: int, epoch: int) -> np.ndarray:
    """The training order of an epoch: a permutation of 0..n-1 fixed by (seed, epoch)."""
    return np.random.default_rng([seed, epoch]).permutation(n)


# ---------------------------------------------------------------------------------------------
# evaluation
# ---------------------------------------------------------------------------------------------

def evaluate(model, engine, items, bucket: int) -> tuple[float, float]:
    """Mean cross-entropy per supervised token over held-out ``items`` (forward only: no weight or
    gradient of the model is touched), and the same over the assistant-answer tokens of items
    that carry an answer mask (NaN when none does)."""
    from lfm2jit.lmhead import lm_head_cross_entropy
    sums, counts = [0.0, 0.0], [0, 0]
    for ids, targets, mask, answer in items:
        trace = model.forward(ids, bucket)
        for j, m in enumerate((mask, answer)):
            if m is None or not m.any():
                continue
            res = lm_head_cross_entropy(engine, trace.hn, model.lm_head, targets, m, normalizer=1.0, bucket=bucket,
                                        grads=False)
            sums[j] += res.loss_value()
            counts[j] += int(m.sum())
    return tuple(s / c if c else float("nan") for s, c in zip(sums, counts))


# ---------------------------------------------------------------------------------------------
# checkpoints and output files
# ---------------------------------------------------------------------------------------------

_STEP_DIR = re.compile(r"^step-(\d+)(?:\.old-\d+)?$")


def find_checkpoint(path: str) -> Path:
    """A checkpoint directory, or the newest checkpoint of a run directory."""
    p = Path(path)
    if not p.exists():
        raise UsageError(f"--resume {path}: no such directory")
    if (p / "trainer.json").is_file():
        return p
    for base in (p / "checkpoints", p):
        steps = {}
        if base.is_dir():
            for d in base.iterdir():
                m = _STEP_DIR.match(d.name)
                if m and d.is_dir() and (d / "trainer.json").is_file():
                    steps[int(m.group(1))] = base / f"step-{m.group(1)}"
        if steps:
            return steps[max(steps)]
    if any(p.parent.glob(f"{p.name}.old-*")):
        return p                  # an interrupted save: Trainer.load_checkpoint falls back to the old one
    raise UsageError(f"--resume {path}: not a checkpoint (no trainer.json) and no checkpoints/step-* inside")


def read_checkpoint_meta(ckpt: Path) -> dict:
    for cand in [ckpt, *sorted(ckpt.parent.glob(f"{ckpt.name}.old-*"))]:
        f = cand / "trainer.json"
        if f.is_file():
            try:
                return json.loads(f.read_text())
            except json.JSONDecodeError as e:
                raise UsageError(f"{f}: unreadable ({e})") from None
    raise UsageError(f"{ckpt}: no trainer.json")


def copy_tokenizer(tokenizer: str, model_dir: Path) -> None:
    """Put the tokenizer next to the checkpoint's weights, making it a complete Hugging Face directory."""
    src = Path(tokenizer)
    src = src / "tokenizer.json" if src.is_dir() else src
    try:
        shutil.copyfile(src, model_dir / "tokenizer.json")
        cfg = src.with_name("tokenizer_config.json")
        if cfg.is_file():
            shutil.copyfile(cfg, model_dir / "tokenizer_config.json")
    except OSError as e:
        print(f"note: could not copy the tokenizer into {model_dir}: {e}", file=sys.stderr)


def prune_checkpoints(root: Path, keep: int) -> None:
    if keep <= 0 or not root.is_dir():
        return
    found = sorted((int(m.group(1)), d) for d in root.iterdir()
                   if (m := re.match(r"^step-(\d+)$", d.name)) and d.is_dir())
    for _, d in found[:-keep]:
        shutil.rmtree(d, ignore_errors=True)


def _clean(v):
    if isinstance(v, float) and not math.isfinite(v):
        return None
    return v


def read_metrics(path: Path) -> list[dict]:
    if not path.is_file():
        return []
    out = []
    for line in path.read_text().splitlines():
        if line.strip():
            try:
                out.append(json.loads(line))
            except json.JSONDecodeError:
                break             # a line cut by a crash: everything after it is dropped
    return out


_SYNC_FILE = re.compile(r"^(?P<id>.+)\.round(?P<round>\d+)\.rank(?P<rank>\d+)\.safetensors$")


def check_sync_dir(run: Run, sync_id: str) -> None:
    """Refuse to start over stale gradient files of this run id (FileGradSync names them
    ``<sync_id>.round<n>.rank<r>.safetensors``; a resumed run's id ends in ``.from<step>``): a file
    of this rank (it has written none yet), or a peer's file past round 1 (no peer gets there
    without this rank), is left from an earlier run, and reading it would mix that run's gradients
    in. Every rank sees the same files at start, so all of them stop, instead of one waiting for
    the others until the sync timeout."""
    d = Path(run.sync_dir)
    d.mkdir(parents=True, exist_ok=True)
    stale = []
    for f in d.iterdir():
        m = _SYNC_FILE.match(f.name)
        if m and m.group("id") == sync_id and (int(m.group("rank")) == run.rank or int(m.group("round")) > 1):
            stale.append(f.name)
    if stale:
        raise UsageError(f"--sync-dir {d} holds gradient files of an earlier run named {sync_id!r} "
                         f"({', '.join(sorted(stale)[:2])}{', ...' if len(stale) > 2 else ''}); remove them or "
                         "pass a new --run-id to every rank")


def default_out(run: Run) -> Path:
    if run.world_size > 1:
        return Path("runs") / run.run_id
    base = Path("runs") / time.strftime("%Y%m%d-%H%M%S")
    out, i = base, 1
    while out.exists():
        out, i = base.with_name(f"{base.name}-{i}"), i + 1
    return out


# ---------------------------------------------------------------------------------------------
# the run
# ---------------------------------------------------------------------------------------------

def make_schedule(run: Run, total: int):
    from .schedules import ConstantLR, CosineWithWarmup, LinearDecay, LinearWarmup
    warm = run.warmup_steps
    if run.schedule == "constant":
        return ConstantLR(run.lr)
    if warm > total and run.schedule in ("cosine", "linear"):
        raise UsageError(f"--warmup-steps {warm} exceeds the {total} steps of the run")
    if run.schedule == "warmup":
        return LinearWarmup(run.lr, warm)
    if run.schedule == "cosine":
        return CosineWithWarmup(run.lr, warm, total, min_lr=run.min_lr)
    return LinearDecay(run.lr, warm, total, final_lr=run.min_lr)


def _fmt_count(n: int) -> str:
    return f"{n / 1e6:.2f}M" if n >= 1e6 else (f"{n / 1e3:.1f}k" if n >= 1e3 else str(n))


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    args = build_parser().parse_args(argv)
    try:
        setup = prepare(args, argv_empty=not argv)
    except UsageError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return train(setup)


def prepare(args, argv_empty: bool) -> dict:
    """Everything before the first step: settings, tokenizer, data, device, model, trainer.
    Raises UsageError for anything the user can fix."""
    saved = meta = ckpt = None
    if args.resume is not None:
        ckpt = find_checkpoint(args.resume)
        meta = read_checkpoint_meta(ckpt)
        saved = (meta.get("data_position") or {}).get("run")
        if saved is None:
            raise UsageError(f"{ckpt} was not written by python -m trainer (its data position has no run "
                             "settings); load it with Trainer.load_checkpoint instead")
    run = resolve(args, argv_empty, saved, ckpt)
    for note in run.notes:
        print(f"note: {note}", file=sys.stderr)
    if run.adapter is not None:
        os.environ["LFM2JIT_ADAPTER"] = run.adapter

    from lfm2jit.model import CheckpointError, ConfigError, Lfm2Config, Lfm2Model
    from .data import BOS_TOKEN, EOS_TOKEN, PAD_TOKEN, load_tokenizer
    try:
        tok = load_tokenizer(run.tokenizer)
    except (ValueError, FileNotFoundError) as e:
        raise UsageError(f"tokenizer: {e}") from None
    tok_vocab = tok.get_vocab_size(with_added_tokens=True)

    # the model's config first (cheap), so a vocabulary mismatch is reported before any GPU work
    try:
        if ckpt is not None:
            cfg = Lfm2Config.from_json(ckpt / "model" / "config.json") if (ckpt / "model").is_dir() else None
        elif run.source == "model":
            cfg = Lfm2Config.from_json(Path(run.model) / "config.json")
        else:
            from lfm2jit.model.config import PRESETS
            shape = dict(DEMO_SHAPE if run.preset == DEMO_PRESET else PRESETS[run.preset])
            ids = {k: tok.token_to_id(t) for k, t in (("pad_token_id", PAD_TOKEN), ("bos_token_id", BOS_TOKEN),
                                                     ("eos_token_id", EOS_TOKEN))}
            shape.update(vocab_size=tok_vocab, **ids)
            cfg = Lfm2Config(**shape)
    except ConfigError as e:
        raise UsageError(f"model config: {e}") from None
    if cfg is not None and tok_vocab > cfg.vocab_size:
        raise UsageError(f"the tokenizer {run.tokenizer} has {tok_vocab} ids but the model's vocab_size is "
                         f"{cfg.vocab_size}: token ids would fall outside the embedding")

    data = load_data(run, tok)
    for note in data.notes:
        print(f"note: {note}", file=sys.stderr)
    per_step = run.world_size * run.grad_accum
    steps_per_epoch = len(data.train) // per_step
    if steps_per_epoch == 0:
        raise UsageError(f"{len(data.train)} training sequence(s) are fewer than one optimizer step needs "
                         f"(--world-size {run.world_size} x --grad-accum {run.grad_accum})")
    if run.steps is None:
        run.steps = max(1, round((run.epochs if run.epochs is not None else 1.0) * steps_per_epoch))
    if run.warmup_steps is None:
        run.warmup_steps = 0 if run.schedule == "constant" else round(0.05 * run.steps)
    schedule = make_schedule(run, run.steps)

    from lfm2jit import ComputeEngine, WgpuContext
    from lfm2jit.runtime.context import AdapterError
    try:
        ctx = WgpuContext.create()
    except AdapterError as e:
        raise UsageError(str(e)) from None
    engine = ComputeEngine(ctx)
    dtype = "f16" if run.f16 else "f32"
    if run.f16 and not ctx.has_f16:
        raise UsageError(f"--f16: adapter {ctx.name!r} has no shader-f16 feature; train without --f16")
    try:
        if ckpt is not None:
            model = Lfm2Model.from_pretrained(ckpt / "model", ctx, engine, dtype) if cfg is not None else None
            if model is None:
                raise UsageError(f"{ckpt}: no model/ directory")
        elif run.source == "model":
            model = Lfm2Model.from_pretrained(run.model, ctx, engine, dtype)
        else:
            model = Lfm2Model(cfg, ctx, engine, seed=run.seed, activation_dtype=dtype)
    except (CheckpointError, ConfigError) as e:
        raise UsageError(f"model: {e}") from None

    from . import AdamW, SGD, FileGradSyncConfig, GradScaler, TrainError, Trainer
    opt = (AdamW(lr=run.lr, weight_decay=run.weight_decay) if run.optimizer == "adamw"
           else SGD(lr=run.lr, momentum=run.momentum, weight_decay=run.weight_decay))
    tr = (Trainer(model, opt, ctx, engine).with_length_bucket(run.bucket)
          .with_clip_grad_norm(run.clip if run.clip > 0 else None).with_grad_accum_steps(run.grad_accum)
          .with_packing(run.pack_tokens)
          .with_lr_scheduler(schedule))
    if run.scaler:
        tr.with_grad_scaler(GradScaler())
    if run.world_size > 1:        # before loading a checkpoint, which renames the sync files of a resumed run
        tr.with_file_grad_sync(FileGradSyncConfig(dir=run.sync_dir, rank=run.rank, world_size=run.world_size,
                                                  timeout_s=run.sync_timeout, run_id=run.run_id))
    position = {"epoch": 0, "next": 0, "elapsed": 0.0, "tokens": 0}
    if ckpt is not None:
        try:
            position = tr.load_checkpoint(ckpt)
        except (TrainError, CheckpointError, KeyError) as e:
            raise UsageError(f"--resume {ckpt}: {e}") from None
        saved_sched = meta.get("lr_scheduler")
        if saved_sched is not None and saved_sched != schedule.to_dict():
            print(f"note: the learning-rate schedule differs from the checkpoint's ({saved_sched} -> "
                  f"{schedule.to_dict()})", file=sys.stderr)
        if position.get("data_sha1") not in (None, data.sha1):
            print(f"note: {run.data} changed since the checkpoint; the data position refers to the old file",
                  file=sys.stderr)
        if tr.optimizer_steps() >= run.steps:
            print(f"note: the checkpoint is at step {tr.optimizer_steps()}, which already reaches --steps "
                  f"{run.steps}; nothing to train", file=sys.stderr)
    if run.world_size > 1:
        check_sync_dir(run, tr.distributed_grad_sync.run_id)
    if run.out:
        out = Path(run.out)
    elif ckpt is not None:              # resume into the run directory the checkpoint lives in
        out = ckpt.parent.parent if ckpt.parent.name == "checkpoints" else default_out(run)
    else:
        out = default_out(run)
    run.out = str(out)
    return dict(run=run, tok=tok, data=data, ctx=ctx, engine=engine, model=model, trainer=tr, out=out,
                position=position, ckpt=ckpt, steps_per_epoch=steps_per_epoch)


def train(s: dict) -> int:
    from tqdm import tqdm
    from . import TrainError
    from .plot import plot_loss_curve
    run: Run = s["run"]
    data: Data = s["data"]
    model, engine, tr, out = s["model"], s["engine"], s["trainer"], s["out"]
    rank_dir = out if run.rank == 0 else out / f"rank{run.rank}"
    rank_dir.mkdir(parents=True, exist_ok=True)
    ckpt_root = out / "checkpoints"
    metrics_path, png_path = rank_dir / "metrics.jsonl", rank_dir / "loss.png"
    (rank_dir / "run.json").write_text(json.dumps({k: v for k, v in vars(run).items() if k not in ("notes", "derived")}, indent=2))

    start = tr.optimizer_steps()
    history = [m for m in read_metrics(metrics_path) if m.get("step", 0) <= start] if start else []
    with open(metrics_path, "w") as f:        # drop steps past the checkpoint (a run that died later)
        f.writelines(json.dumps(m) + "\n" for m in history)

    cfg = model.cfg
    n_params = sum(int(np.prod(t.shape)) for t in model.parameters())
    what = (f"resuming {s['ckpt']}" if s["ckpt"] else f"fine-tuning {run.model}" if run.source == "model"
            else f"training from scratch (preset {run.preset})")
    print(f"lfm2jit trainer: {what} on {s['ctx'].name}")
    print(f"  model: {_fmt_count(n_params)} parameters, hidden {cfg.hidden_size}, {cfg.num_hidden_layers} layers "
          f"({', '.join(cfg.layer_types)}), vocab {cfg.vocab_size}")
    print(f"  data: {run.data}: {len(data.train)} training sequences, {len(data.eval)} held out"
          + (f"; rank {run.rank} of {run.world_size}" if run.world_size > 1 else ""))
    print(f"  steps {start + 1}..{run.steps}: {run.grad_accum} sequence(s) per step"
          + (f" per rank x {run.world_size} ranks" if run.world_size > 1 else "")
          + f", {run.optimizer} lr {run.lr:g} ({run.schedule}), clip {run.clip:g}, bucket {run.bucket}"
          + (", loss scaling" if run.scaler else "") + (", f16 activations" if run.f16 else ""))
    print(f"  output: {out.resolve()}")
    sys.stdout.flush()

    my_eval = data.eval[run.rank::run.world_size]
    nan = float("nan")
    t_eval = time.perf_counter()
    eval_before, answer_before = evaluate(model, engine, my_eval, run.bucket) if my_eval else (nan, nan)
    if my_eval:
        print(f"  held-out loss before training: {eval_before:.4f}"
              + (f" (answer tokens only: {answer_before:.4f})" if data.has_answers else "")
              + f"; {len(my_eval)} sequences, {time.perf_counter() - t_eval:.1f}s")
        sys.stdout.flush()

    pos = s["position"]
    epoch, nxt = int(pos.get("epoch", 0)), int(pos.get("next", 0))
    elapsed0, tokens_seen = float(pos.get("elapsed", 0.0)), int(pos.get("tokens", 0))
    n = len(data.train)
    per_step = run.world_size * run.grad_accum
    order = epoch_order(n, run.seed, epoch)
    params = model.parameters()
    new: list[dict] = []
    skipped_in_a_row = 0
    last_ckpt = None
    t0 = time.perf_counter()
    bar = tqdm(total=run.steps, initial=start, unit="step", dynamic_ncols=True, disable=not run.progress,
               file=sys.stderr, desc="train")

    def save(step: int) -> Path:
        path = ckpt_root / f"step-{step:06d}"
        position = {"epoch": epoch, "next": nxt, "elapsed": elapsed0 + time.perf_counter() - t0,
                    "tokens": tokens_seen, "data_sha1": data.sha1, "n_train": n, "run": run.saved()}
        tr.save_checkpoint(path, position)
        copy_tokenizer(run.tokenizer, path / "model")
        prune_checkpoints(ckpt_root, run.keep_checkpoints)
        return path

    try:
        with open(metrics_path, "a") as mf:
            while tr.optimizer_steps() < run.steps:
                if nxt + per_step > n:
                    epoch, nxt = epoch + 1, 0
                    order = epoch_order(n, run.seed, epoch)
                window = order[nxt:nxt + per_step][run.rank::run.world_size]
                t_step = time.perf_counter()
                stats = tr.train_sequences([data.train[i] for i in window], params)
                nxt += per_step
                last = stats[-1]
                dt = time.perf_counter() - t_step
                toks = sum(len(data.train[i][0]) for i in window)
                tokens_seen += toks
                step = tr.optimizer_steps() if last.stepped else tr.optimizer_steps() + 1
                rec = {"step": step, "loss": float(np.mean([x.loss for x in stats])), "tokens": toks,
                       "supervised": int(sum(x.tokens for x in stats)), "tokens_per_s": toks / dt if dt > 0 else None,
                       "lr": last.lr, "grad_norm": last.grad_norm, "loss_scale": last.loss_scale,
                       "skipped": bool(last.skipped), "elapsed": round(elapsed0 + time.perf_counter() - t0, 3),
                       "epoch": epoch}
                rec = {k: _clean(v) for k, v in rec.items()}
                mf.write(json.dumps(rec) + "\n")
                mf.flush()
                new.append(rec)
                if last.skipped:
                    skipped_in_a_row += 1
                    if skipped_in_a_row >= MAX_SKIPPED_IN_A_ROW:
                        raise TrainError(f"{skipped_in_a_row} steps in a row overflowed (inf/NaN gradients) and were "
                                         f"skipped; the loss scale is down to {last.loss_scale:g}")
                    continue
                skipped_in_a_row = 0
                bar.set_postfix_str(f"loss={rec['loss'] if rec['loss'] is None else round(rec['loss'], 3)} "
                                    f"tok/s={rec['tokens_per_s'] or 0:.0f} lr={last.lr:.2e}", refresh=False)
                bar.update(1)
                k = tr.optimizer_steps()
                if run.rank == 0 and run.checkpoint_every and k % run.checkpoint_every == 0 and k < run.steps:
                    last_ckpt = save(k)
    except (TrainError, KeyboardInterrupt) as e:
        bar.close()
        _write_plot(plot_loss_curve, png_path, history + new, [])
        where = (f"the newest checkpoint is {last_ckpt.resolve()} (continue with --resume {out})" if last_ckpt
                 else "no checkpoint was written (--checkpoint-every N writes them during the run)")
        if isinstance(e, KeyboardInterrupt):
            print(f"\ninterrupted at step {tr.optimizer_steps() + 1}; {where}", file=sys.stderr)
            return 130
        print(f"error: training failed at step {tr.optimizer_steps() + 1}: {e}\n  {where}", file=sys.stderr)
        return 1
    bar.close()
    train_seconds = time.perf_counter() - t0
    if run.rank == 0 and (new or last_ckpt is None):
        last_ckpt = save(tr.optimizer_steps()) if (new or not s["ckpt"]) else s["ckpt"]

    t_eval = time.perf_counter()
    eval_after, answer_after = evaluate(model, engine, my_eval, run.bucket) if my_eval else (nan, nan)
    eval_seconds = time.perf_counter() - t_eval
    evals = [(start, eval_before), (tr.optimizer_steps(), eval_after)] if my_eval else []
    _write_plot(plot_loss_curve, png_path, history + new, evals)

    # ---- summary ----
    losses = [m["loss"] for m in new if not m["skipped"] and m["loss"] is not None]
    k = max(1, len(losses) // 10)
    first, last = (losses[0], losses[-1]) if losses else (float("nan"), float("nan"))
    first_avg = float(np.mean(losses[:k])) if losses else float("nan")
    last_avg = float(np.mean(losses[-k:])) if losses else float("nan")
    toks = sum(m["tokens"] for m in new)
    tps = toks / train_seconds if train_seconds > 0 else float("nan")
    if my_eval:
        fell, ratio = eval_after < eval_before, eval_after / eval_before
    else:
        fell, ratio = last_avg < first_avg, last_avg / first_avg if losses else float("nan")
    summary = {
        "steps": tr.optimizer_steps(), "steps_this_run": len(new), "first_step": start + 1,
        "sequences": sum(run.grad_accum for _ in new), "tokens": toks, "train_seconds": round(train_seconds, 2),
        "tokens_per_s": round(tps, 1), "first_loss": first, "last_loss": last,
        f"first_{k}_steps_mean_loss": first_avg, f"last_{k}_steps_mean_loss": last_avg,
        "eval_sequences": len(my_eval), "eval_before": eval_before, "eval_after": eval_after,
        "eval_answer_before": answer_before, "eval_answer_after": answer_after,
        "eval_seconds": round(eval_seconds, 2), "loss_fell": bool(fell), "loss_ratio": ratio,
        "metrics": str(metrics_path.resolve()), "plot": str(png_path.resolve()),
        "checkpoint": str(Path(last_ckpt).resolve()) if last_ckpt else None,
    }
    summary = {key: _clean(v) for key, v in summary.items()}
    (rank_dir / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    print()
    print(f"done: {len(new)} optimizer steps (to step {tr.optimizer_steps()}) on {toks} tokens in "
          f"{train_seconds:.1f}s: {tps:.0f} tokens/s")
    if losses:
        print(f"  train loss: step {start + 1} {first:.4f} -> step {tr.optimizer_steps()} {last:.4f}"
              + (f"  (mean of the first {k} steps {first_avg:.4f} -> of the last {k} {last_avg:.4f})" if k > 1 else ""))
    if my_eval:
        print(f"  held-out loss ({data.label}): {eval_before:.4f} before -> {eval_after:.4f} after  "
              f"(x{eval_after / eval_before:.2f}, {len(my_eval)} sequences)")
        if data.has_answers:
            print(f"  held-out loss on the answers only: {answer_before:.4f} before -> {answer_after:.4f} after  "
                  f"(x{answer_after / answer_before:.2f})")
    print(f"  the loss {'fell' if fell else 'DID NOT FALL'}")
    print(f"  metrics: {metrics_path.resolve()}")
    print(f"  loss curve: {png_path.resolve()}")
    if last_ckpt:
        print(f"  checkpoint: {Path(last_ckpt).resolve()}  (Hugging Face model in its model/ directory)")
    print(f"  summary: {(rank_dir / 'summary.json').resolve()}")
    if run.check_loss_drop is not None and len(new):
        if not (ratio <= run.check_loss_drop):
            print(f"error: the {'held-out' if my_eval else 'training'} loss went from "
                  f"{eval_before if my_eval else first_avg:.4f} to {eval_after if my_eval else last_avg:.4f} "
                  f"(x{ratio:.2f}); --check-loss-drop wants at most x{run.check_loss_drop:g}", file=sys.stderr)
            return 1
    return 0


def _write_plot(plot, path: Path, metrics: list[dict], evals) -> None:
    pts = [(m["step"], m["loss"]) for m in metrics if not m.get("skipped") and m.get("loss") is not None]
    try:
        plot(path, [p[0] for p in pts], [p[1] for p in pts], evals=evals, title="training loss")
    except OSError as e:
        print(f"note: could not write {path}: {e}", file=sys.stderr)
