"""``python -m trainer``: train a tiny LFM2 from scratch on the shipped data (no arguments), or fine-tune
a Hugging Face LFM2 checkpoint on a chat or text JSONL file (``--model DIR --data FILE``).

Each optimizer step takes the next ``world_size * grad_accum`` sequences of the epoch's shuffled
order; rank r trains on sequences r, r + world_size, ... of that window (one micro-batch per
sequence, as ``Trainer`` runs them), so N ranks with accumulation A see exactly the sequences that
one process with accumulation N*A would. A run directory holds::

    metrics.jsonl            one JSON line per optimizer step (see METRICS_KEYS)
    eval.jsonl               the held-out loss every --eval-every N steps: {"step", "loss", "answer_loss"}
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

import hashlib
import json
import os
import sys
import time
import warnings
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from .cli_options import DEFAULT_CHECKPOINT_MINUTES, DEMO_PRESET, DEMO_SHAPE, Run, UsageError, build_parser, resolve
from .run_dir import (check_sync_dir, clean, copy_model_files, default_out, find_checkpoint, prune_checkpoints,
                      read_checkpoint_meta, read_metrics)

MAX_SKIPPED_IN_A_ROW = 50
# Without --checkpoint-every: after AUTO_CHECKPOINT_AFTER steps, checkpoint every N steps, N such that
# a checkpoint is written about every --checkpoint-minutes (AUTO_CHECKPOINT_SECONDS by default) of
# training at the measured step time.
AUTO_CHECKPOINT_SECONDS = 60 * DEFAULT_CHECKPOINT_MINUTES
AUTO_CHECKPOINT_AFTER = 10

METRICS_KEYS = ("step", "loss", "tokens", "supervised", "tokens_per_s", "lr", "grad_norm", "loss_scale",
                "skipped", "elapsed", "epoch")


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
    held: int = 0          # held-out records before --eval-max (eval holds the first --eval-max of them)


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
    from .data import Batch, DataError
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            batch = Batch.from_jsonl(path, tok, max_len=run.max_len, kind=run.data_kind)
        except (DataError, FileNotFoundError) as e:
            raise UsageError(f"{flag}{e}") from None
        except UnicodeDecodeError as e:
            raise UsageError(f"{flag}{path}: not UTF-8 text ({e.reason} at byte {e.start})") from None
    notes += [str(w.message) for w in caught]
    return batch


def load_data(run: Run, tok) -> Data:
    notes: list[str] = []
    batch = _read_batch(run.data, run, tok, notes)
    empty = sum(1 for s in batch if s.is_empty if run.loss_on == "assistant" or s.length == 0)
    if empty:
        notes.append(f"{empty} record(s) have no supervised token and are skipped")
    cut = sum(1 for s in batch if s.is_empty and s.length > 0) if run.loss_on == "all" else 0
    if cut:
        notes.append(f"--loss-on all: the {cut} record(s) without an assistant token are still trained on, on "
                     "every token they kept (only an --loss-on assistant run skips them)")
    if run.eval_data is not None:
        held = _read_batch(run.eval_data, run, tok, notes, "--eval-data ")
        train = batch
    elif run.eval_fraction > 0:
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
                label="all tokens" if full else "assistant tokens", held=len(held))


def epoch_order(n: int, seed: int, epoch: int) -> np.ndarray:
    """The training order of an epoch: a permutation of 0..n-1 fixed by (seed, epoch)."""
    return np.random.default_rng([seed, epoch]).permutation(n)


# ---------------------------------------------------------------------------------------------
# evaluation
# ---------------------------------------------------------------------------------------------

def evaluate(s: dict, items, answers: bool) -> dict:
    """The held-out metrics of ``items``: loss and perplexity over the supervised tokens and over
    the answers, and with ``answers`` the exact match of greedy answers (up to --eval-answers
    records) with every scored sample (see trainer/evaluation.py)."""
    from .evaluation import answer_cases, exact_match, greedy_answers, held_out_loss, perplexity
    run, data, model = s["run"], s["data"], s["model"]
    loss, answer_loss = held_out_loss(model, s["engine"], items, run.bucket)
    out = {"loss": loss, "perplexity": perplexity(loss), "answer_loss": answer_loss,
           "answer_perplexity": perplexity(answer_loss), "exact_match": None, "answers_scored": 0}
    if answers and run.eval_answers != 0:
        # with several ranks: the one-process run's cases, every world_size-th of them on this rank
        source = data.eval if run.world_size > 1 else items
        cases = answer_cases(source, data.label == "assistant tokens")[:run.eval_answers][run.rank::run.world_size]
        if cases:
            end = s["tok"].token_to_id("<|im_end|>")
            samples = greedy_answers(model, s["tok"], cases, set(model.generation_eos) | ({end} - {None}))
            out.update(exact_match=exact_match(samples), answers_scored=len(samples), samples=samples)
    return _combine_eval(s, out, items) if run.world_size > 1 else out


def _reduce(s: dict, values, what: str) -> list[float]:
    """The sums over the ranks of ``values`` (through the gradient sync); this rank's own alone."""
    sync = s["trainer"].distributed_grad_sync
    if s["run"].world_size == 1:
        return [float(v) for v in values]
    return sync.allreduce_sum(values, what)


def _combine_eval(s: dict, out: dict, items) -> dict:
    """This rank's held-out metrics of its share ``items`` made the whole held-out set's: the loss
    sums and token counts, correct answers and answers scored, added over the ranks."""
    from .evaluation import perplexity
    n_tok = float(sum(m.sum() for _, _, m, _ in items if m.any()))
    n_ans = float(sum(a.sum() for *_, a in items if a is not None and a.any()))
    correct = sum(bool(x["correct"]) for x in out.get("samples", []))
    t = _reduce(s, [out["loss"] * n_tok if n_tok else 0.0, n_tok,
                    out["answer_loss"] * n_ans if n_ans else 0.0, n_ans, correct, out["answers_scored"]],
                "the held-out sums")
    loss = t[0] / t[1] if t[1] else float("nan")
    answer_loss = t[2] / t[3] if t[3] else float("nan")
    return {**out, "loss": loss, "perplexity": perplexity(loss), "answer_loss": answer_loss,
            "answer_perplexity": perplexity(answer_loss), "exact_match": t[4] / t[5] if t[5] else None,
            "answers_scored": int(t[5])}


def _fell(ratio: float) -> bool:
    """Whether a loss ratio shown as x{ratio:.2f} shows a fall (x1.00 does not)."""
    return bool(np.isfinite(ratio)) and float(f"{ratio:.2f}") < 1.0


def _print_samples(samples: list[dict], k: int, write) -> None:
    from .evaluation import last_user_turn
    for x in samples[:k]:
        write(f"    {'ok ' if x['correct'] else 'BAD'} {last_user_turn(x['prompt'])!r} -> {x['answer']!r}"
              + ("" if x["correct"] else f" (expected {x['expected']!r})"))


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
    if argv[:1] == ["generate"]:
        from .generate_cli import main as generate_main
        return generate_main(argv[1:])
    if argv[:1] == ["eval"]:
        from .eval_cli import main as eval_main
        return eval_main(argv[1:])
    args = build_parser().parse_args(argv)
    from .errors import TrainError
    try:
        setup = prepare(args, argv_empty=not argv)
    except UsageError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except TrainError as e:           # the sync handshake: another rank disagrees, or none answered
        print(f"error: {e}", file=sys.stderr)
        return 1
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
    if run.distributed == "mpi" and "LFM2JIT_ADAPTER_INDEX" not in os.environ:
        from .mpi_sync import local_rank
        os.environ["LFM2JIT_ADAPTER_INDEX"] = str(local_rank())     # one GPU per rank on a multi-GPU host

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
            model = (Lfm2Model.from_pretrained(ckpt / "model", ctx, engine, dtype, run.recompute_mlp)
                     if cfg is not None else None)
            if model is None:
                raise UsageError(f"{ckpt}: no model/ directory")
        elif run.source == "model":
            model = Lfm2Model.from_pretrained(run.model, ctx, engine, dtype, run.recompute_mlp)
        else:
            model = Lfm2Model(cfg, ctx, engine, seed=run.seed, activation_dtype=dtype, recompute_mlp=run.recompute_mlp)
    except (CheckpointError, ConfigError) as e:
        where = ckpt / "model" if ckpt is not None else run.model
        raise UsageError(f"model: {e}" if where is None or str(where) in str(e) else f"model {where}: {e}") from None
    params = _attach_lora_and_choose(run, model, ckpt)

    from . import AdamW, SGD, FileGradSyncConfig, GradScaler, TrainError, Trainer
    opt = (AdamW(lr=run.lr, weight_decay=run.weight_decay) if run.optimizer == "adamw"
           else SGD(lr=run.lr, momentum=run.momentum, weight_decay=run.weight_decay))
    tr = (Trainer(model, opt, ctx, engine).with_length_bucket(run.bucket)
          .with_clip_grad_norm(run.clip if run.clip > 0 else None).with_grad_accum_steps(run.grad_accum)
          .with_packing(run.pack_tokens).with_replay(run.replay)
          .with_lr_scheduler(schedule))
    if run.scaler:
        tr.with_grad_scaler(GradScaler())
    if run.world_size > 1 and run.distributed == "mpi":
        tr.with_mpi_grad_sync(timeout_s=run.sync_timeout, run_id=run.run_id)
    elif run.world_size > 1:        # before loading a checkpoint, which renames the sync files of a resumed run
        tr.with_file_grad_sync(FileGradSyncConfig(dir=run.sync_dir, rank=run.rank, world_size=run.world_size,
                                                  timeout_s=run.sync_timeout, run_id=run.run_id))
    position = {"epoch": 0, "next": 0, "elapsed": 0.0, "tokens": 0}
    if ckpt is not None:
        try:
            position = tr.load_checkpoint(ckpt)
        except (TrainError, CheckpointError, ConfigError, KeyError) as e:
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
        if run.distributed == "file":
            check_sync_dir(run, tr.distributed_grad_sync.run_id)
        # every rank agrees on the run (world size, ranks, parameters) before any of them writes a file
        tr.sync_handshake(params)
    if run.out:
        out = Path(run.out)
    elif ckpt is not None:              # resume into the run directory the checkpoint lives in
        out = ckpt.parent.parent if ckpt.parent.name == "checkpoints" else default_out(run)
    else:
        out = default_out(run)
    run.out = str(out)
    return dict(run=run, tok=tok, data=data, ctx=ctx, engine=engine, model=model, trainer=tr, out=out,
                position=position, ckpt=ckpt, steps_per_epoch=steps_per_epoch, params=params)


def _attach_lora_and_choose(run: Run, model, ckpt: Path | None) -> list:
    """With --lora-r: the checkpoint's adapter (on --resume) or a new one; then the parameters to train."""
    from lfm2jit.model.lora import AdapterError, LoraConfig
    from .subsets import trainable
    if run.lora_r is not None:
        base = "f16" if run.lora_f16_base else "f32"
        try:
            if ckpt is not None:
                if not (ckpt / "adapter").is_dir():
                    raise UsageError(f"--resume {ckpt}: the run trains LoRA adapters but the checkpoint has no adapter/")
                model.load_adapter(ckpt / "adapter", base_dtype=base, seed=run.seed)
            else:
                model.add_lora(LoraConfig(r=run.lora_r, alpha=run.lora_alpha, target_modules=tuple(run.lora_targets),
                                          dropout=run.lora_dropout), seed=run.seed, base_dtype=base)
        except (AdapterError, ValueError) as e:
            raise UsageError(f"LoRA: {e}") from None
    return trainable(model, run.lora_r is not None, run.train_only, run.freeze)


def auto_checkpoint_every(step_seconds: list[float], target: float = AUTO_CHECKPOINT_SECONDS) -> int:
    """Steps between checkpoints so that one is written about every ``target`` seconds: from the median
    time of the measured steps, leaving out the first two (they compile the kernels) when there are more."""
    times = step_seconds[2:] if len(step_seconds) > 2 else step_seconds
    per = float(np.median(times)) if times else 0.0
    return max(1, int(round(target / per))) if per > 0 and np.isfinite(per) else 1


class _Interrupted(Exception):
    """SIGINT/SIGTERM arrived: the loop stops at the next step boundary."""


def _saved_evals(pos: dict, start: int) -> list[dict]:
    """The held-out evaluations at the starts and ends of the earlier segments of a resumed run (kept in
    the checkpoint's data position as "evals"); anything malformed is left out."""
    out = []
    for e in pos.get("evals") or [] if isinstance(pos.get("evals"), list) else []:
        if (isinstance(e, dict) and type(e.get("step")) is int and 0 <= e["step"] <= start
                and isinstance(e.get("loss"), (int, float)) and not isinstance(e.get("loss"), bool)):
            out.append({k: e[k] for k in ("step", "loss", "answer_loss", "exact_match") if k in e})
    return out


def _resume_command(run: Run, out: Path) -> str:
    """How this run continues: under mpiexec as it was launched, with the file sync every rank with its --rank."""
    cmd = f"{sys.executable} -m trainer --resume {out}"
    if run.world_size > 1 and run.distributed == "mpi":
        return f"mpiexec -n {run.world_size} {cmd}"
    return f"{cmd} --rank R (every rank R of {run.world_size})" if run.world_size > 1 else cmd


def _finish_sync(run: Run, tr) -> None:
    """The ranks ended together (done, or stopped after the same step by a signal): the sync's files
    go, so that the same command can run again and --resume finds no earlier run's files."""
    from . import TrainError
    if run.world_size > 1 and hasattr(tr.distributed_grad_sync, "finish"):
        try:
            tr.distributed_grad_sync.finish()
        except TrainError as e:
            print(f"note: {e}", file=sys.stderr)


def train(s: dict) -> int:
    import signal
    import threading
    from . import TrainError
    from .progress import Progress
    from .plot import plot_run
    from .report import Reporters
    run: Run = s["run"]
    data: Data = s["data"]
    model, engine, tr, out = s["model"], s["engine"], s["trainer"], s["out"]
    rank_dir = out if run.rank == 0 else out / f"rank{run.rank}"
    rank_dir.mkdir(parents=True, exist_ok=True)
    ckpt_root = out / "checkpoints"
    metrics_path, png_path = rank_dir / "metrics.jsonl", rank_dir / "loss.png"
    eval_path = rank_dir / "eval.jsonl"
    (rank_dir / "run.json").write_text(json.dumps({k: v for k, v in vars(run).items() if k not in ("notes", "derived")}, indent=2))

    start = tr.optimizer_steps()
    history = [m for m in read_metrics(metrics_path) if m.get("step", 0) <= start] if start else []
    with open(metrics_path, "w") as f:        # drop steps past the checkpoint (a run that died later)
        f.writelines(json.dumps(m) + "\n" for m in history)
    evals_mid = [e for e in read_metrics(eval_path) if 0 < e.get("step", 0) <= start] if start else []
    with open(eval_path, "w") as f:
        f.writelines(json.dumps(e) + "\n" for e in evals_mid)

    cfg = model.cfg
    n_params = sum(int(np.prod(t.shape)) for t in model.parameters())
    params = s["params"]
    n_trained = sum(int(np.prod(t.shape)) for t in params)
    what = (f"resuming {s['ckpt']}" if s["ckpt"] else f"fine-tuning {run.model}" if run.source == "model"
            else f"training from scratch (preset {run.preset})")
    print(f"lfm2jit trainer: {what} on {s['ctx'].name}")
    print(f"  model: {_fmt_count(n_params)} parameters, hidden {cfg.hidden_size}, {cfg.num_hidden_layers} layers "
          f"({', '.join(cfg.layer_types)}), vocab {cfg.vocab_size}")
    if n_trained != n_params:
        lora = (f"LoRA r {run.lora_r} alpha {run.lora_alpha:g} on {', '.join(run.lora_targets)}"
                + (", f16 base" if run.lora_f16_base else "") if run.lora_r is not None else "a subset")
        print(f"  training {_fmt_count(n_trained)} of them ({100 * n_trained / n_params:.2f}%): {lora}")
    print(f"  data: {run.data}: {len(data.train)} training sequences, {data.held} held out"
          + (f" ({len(data.eval)} of them evaluated: --eval-max {run.eval_max})" if len(data.eval) < data.held else "")
          + (f"; rank {run.rank} of {run.world_size}" if run.world_size > 1 else ""))
    print(f"  steps {start + 1}..{run.steps}: {run.grad_accum} sequence(s) per step"
          + (f" per rank x {run.world_size} ranks" if run.world_size > 1 else "")
          + f", {run.optimizer} lr {run.lr:g} ({run.schedule}), clip {run.clip:g}, bucket {run.bucket}"
          + (", loss scaling" if run.scaler else "") + (", f16 activations" if run.f16 else ""))
    print(f"  output: {out.resolve()}")
    sys.stdout.flush()
    reporters = Reporters(run.report_to if run.rank == 0 else [], out, first_step=start + 1,
                          warn=lambda line: print(line, file=sys.stderr))
    reporters.start(json.loads((rank_dir / "run.json").read_text()))

    my_eval = data.eval[run.rank::run.world_size]
    nan = float("nan")
    samples_path = rank_dir / "samples.jsonl"
    if not start:
        samples_path.unlink(missing_ok=True)
    t_eval = time.perf_counter()
    before = evaluate(s, my_eval, answers=False) if data.eval else {}
    eval_before, answer_before = before.get("loss", nan), before.get("answer_loss", nan)
    if data.eval:
        print(f"  held-out loss before training: {eval_before:.4f}"
              + (f" (answer tokens only: {answer_before:.4f})" if data.has_answers else "")
              + f"; {len(data.eval)} sequences, {time.perf_counter() - t_eval:.1f}s")
        sys.stdout.flush()
        reporters.log_eval(start, before)

    pos = s["position"]
    # the evaluations at the starts and ends of the run's segments, kept in every checkpoint
    run_evals = _saved_evals(pos, start)
    if data.eval and not any(e["step"] == start for e in run_evals):
        run_evals.append({"step": start, "loss": clean(eval_before), "answer_loss": clean(answer_before)})
    epoch, nxt = int(pos.get("epoch", 0)), int(pos.get("next", 0))
    elapsed0, tokens_seen = float(pos.get("elapsed", 0.0)), int(pos.get("tokens", 0))
    n = len(data.train)
    per_step = run.world_size * run.grad_accum
    order = epoch_order(n, run.seed, epoch)
    new: list[dict] = []
    skipped_in_a_row = zero_in_a_row = 0      # windows in a row without a finite, nonzero step; of them, zero-norm steps
    last_ckpt = None
    t0 = time.perf_counter()
    bar = Progress(total=run.steps, initial=start, enabled=run.progress, file=sys.stderr, desc="train")

    def save(step: int) -> Path:
        path = ckpt_root / f"step-{step:06d}"
        position = {"epoch": epoch, "next": nxt, "elapsed": elapsed0 + time.perf_counter() - t0,
                    "tokens": tokens_seen, "data_sha1": data.sha1, "n_train": n, "run": run.saved(),
                    "evals": run_evals}
        # the tokenizer and the other model files go in before the checkpoint becomes visible
        tr.save_checkpoint(path, position, fill=lambda tmp: copy_model_files(run.tokenizer, tmp / "model", run.model))
        prune_checkpoints(ckpt_root, run.keep_checkpoints)
        return path

    # SIGINT/SIGTERM: the current step finishes, then a checkpoint is saved (a second signal abandons the step).
    # With several ranks the signal may reach one rank, or reach them at different steps: each step's
    # reduction carries a stop vote, so every rank stops after the same step and rank 0 saves it.
    stop: list[int] = []
    agreed_stop = False

    def on_signal(signum, frame):
        if stop:
            raise KeyboardInterrupt
        stop.append(signum)
        bar.write(f"\n{signal.Signals(signum).name}: finishing the current step, then saving a checkpoint "
                  "(send it again to stop at once without one)", file=sys.stderr)

    handlers = ({sig: signal.signal(sig, on_signal) for sig in (signal.SIGINT, signal.SIGTERM)}
                if threading.current_thread() is threading.main_thread() else {})
    every = run.checkpoint_every            # None: chosen from the step time after AUTO_CHECKPOINT_AFTER steps
    step_seconds: list[float] = []
    try:
        with open(metrics_path, "a") as mf:
            while tr.optimizer_steps() < run.steps:
                if agreed_stop or (stop and run.world_size == 1):
                    raise _Interrupted
                if nxt + per_step > n:
                    epoch, nxt = epoch + 1, 0
                    order = epoch_order(n, run.seed, epoch)
                window = order[nxt:nxt + per_step][run.rank::run.world_size]
                t_step = time.perf_counter()
                stats = tr.train_sequences([data.train[i] for i in window], params)
                nxt += per_step
                last = stats[-1]
                dt = time.perf_counter() - t_step
                # the window's numbers over all ranks: the mean loss of its sequences, its tokens; stop votes
                loss_sum, n_seq, toks, supervised, votes = _reduce(
                    s, [sum(float(x.loss) for x in stats), len(stats), sum(len(data.train[i][0]) for i in window),
                        sum(x.tokens for x in stats), float(bool(stop))], "the step's loss and tokens")
                agreed_stop = votes > 0
                toks = int(toks)
                tokens_seen += toks
                step = tr.optimizer_steps() if last.stepped else tr.optimizer_steps() + 1
                rec = {"step": step, "loss": loss_sum / n_seq, "tokens": toks,
                       "supervised": int(supervised), "tokens_per_s": toks / dt if dt > 0 else None,
                       "lr": last.lr, "grad_norm": last.grad_norm, "loss_scale": last.loss_scale,
                       "skipped": bool(last.skipped), "elapsed": round(elapsed0 + time.perf_counter() - t0, 3),
                       "epoch": epoch}
                rec = {k: clean(v) for k, v in rec.items()}
                mf.write(json.dumps(rec) + "\n")
                mf.flush()
                new.append(rec)
                reporters.log(step, rec)
                # The guard counts windows without a finite, nonzero step: skipped ones (overflow) and
                # steps whose gradient norm is 0 (under a loss scale, gradients that underflowed to zero)
                lost = last.skipped or not (last.grad_norm and np.isfinite(last.grad_norm))
                skipped_in_a_row, zero_in_a_row = ((skipped_in_a_row + 1, zero_in_a_row + (not last.skipped))
                                                   if lost else (0, 0))
                if skipped_in_a_row >= MAX_SKIPPED_IN_A_ROW:
                    raise TrainError(
                        f"{skipped_in_a_row} windows in a row took no finite, nonzero step: "
                        f"{skipped_in_a_row - zero_in_a_row} overflowed (inf/NaN gradients) and were skipped, "
                        f"{zero_in_a_row} had a gradient norm of 0 (all-zero gradients"
                        + (", the loss scale underflowed" if tr.scaler is not None else "")
                        + f"); the loss scale is down to {last.loss_scale:g}")
                if last.skipped:
                    continue
                bar.set_postfix_str(f"loss={rec['loss'] if rec['loss'] is None else round(rec['loss'], 3)} "
                                    f"tok/s={rec['tokens_per_s'] or 0:.0f} lr={last.lr:.2e}", refresh=False)
                bar.update(1)
                k = tr.optimizer_steps()
                step_seconds.append(dt)
                if every is None and len(step_seconds) >= min(AUTO_CHECKPOINT_AFTER, run.steps - start):
                    every = auto_checkpoint_every(step_seconds, 60 * run.checkpoint_minutes)
                    if run.rank == 0 and k + every < run.steps:
                        bar.write(f"  checkpointing every {every} steps (about every {run.checkpoint_minutes:g} "
                                  "minutes at the measured step time; --checkpoint-every N chooses)", file=sys.stderr)
                if run.rank == 0 and every and k % every == 0 and k < run.steps:
                    last_ckpt = save(k)
                if run.eval_every and data.eval and k % run.eval_every == 0 and k < run.steps and not agreed_stop:
                    ev = _record_eval(k, evaluate(s, my_eval, answers=True), eval_path, samples_path, run.samples)
                    evals_mid.append(ev)
                    reporters.log_eval(k, ev)
                    bar.write(f"  step {k}: held-out loss {ev['loss']:.4f}"
                              + (f" (answers {ev['answer_loss']:.4f})" if data.has_answers else "")
                              + (f", exact match {ev['exact_match']:.0%} of {ev['answers_scored']}"
                                 if ev["exact_match"] is not None else ""), file=sys.stderr)
                    if ev["exact_match"] is not None:
                        _print_samples(ev["samples"], run.samples, lambda line: bar.write(line, file=sys.stderr))
                    del ev["samples"]
    except _Interrupted:
        bar.close()
        k = tr.optimizer_steps()
        if run.rank == 0 and k > start and (last_ckpt is None or Path(last_ckpt).name != f"step-{k:06d}"):
            last_ckpt = save(k)
        last_ckpt = last_ckpt or s["ckpt"]
        _restore_handlers(handlers)
        _write_plot(plot_run, png_path, history + new, sorted(run_evals + evals_mid, key=lambda e: e["step"]))
        reporters.finish("interrupted")
        _finish_sync(run, tr)            # every rank stopped after the same step: the run can resume or rerun
        sig = signal.Signals(stop[0]).name if stop else "another rank's signal"
        if run.rank == 0 and last_ckpt:
            print(f"\n{sig}: stopped after step {k}; checkpoint {Path(last_ckpt).resolve()}\n"
                  f"  continue with: {_resume_command(run, out)}", file=sys.stderr)
        else:
            print(f"\n{sig}: stopped after step {k}"
                  + ("" if run.rank == 0 else " (rank 0 writes the checkpoint)"), file=sys.stderr)
        return 130
    except (TrainError, KeyboardInterrupt) as e:
        bar.close()
        _restore_handlers(handlers)
        _write_plot(plot_run, png_path, history + new, evals_mid)
        reporters.finish("interrupted" if isinstance(e, KeyboardInterrupt) else "failed")
        where = (f"the newest checkpoint is {last_ckpt.resolve()} (continue with --resume {out})" if last_ckpt
                 else "no checkpoint was written (--checkpoint-every N writes them during the run)")
        if isinstance(e, KeyboardInterrupt):
            print(f"\ninterrupted at step {tr.optimizer_steps() + 1}; {where}", file=sys.stderr)
            return 130
        print(f"error: training failed at step {tr.optimizer_steps() + 1}: {e}\n  {where}", file=sys.stderr)
        return 1
    except BaseException:
        _restore_handlers(handlers)
        reporters.finish("failed")
        raise
    bar.close()
    _restore_handlers(handlers)
    train_seconds = time.perf_counter() - t0

    t_eval = time.perf_counter()
    final_eval = evaluate(s, my_eval, answers=True) if data.eval else {}
    eval_after, answer_after = final_eval.get("loss", nan), final_eval.get("answer_loss", nan)
    eval_seconds = time.perf_counter() - t_eval
    if data.eval:                 # into the final checkpoint, so that a resumed run's summary and plot show it
        reporters.log_eval(tr.optimizer_steps(), final_eval)
        run_evals = [e for e in run_evals if e["step"] != tr.optimizer_steps()] + [
            {"step": tr.optimizer_steps(), "loss": clean(eval_after), "answer_loss": clean(answer_after),
             "exact_match": clean(final_eval.get("exact_match"))}]
    if run.rank == 0 and (new or last_ckpt is None):
        last_ckpt = save(tr.optimizer_steps()) if (new or not s["ckpt"]) else s["ckpt"]
    final_samples = final_eval.pop("samples", [])
    if final_samples:          # every scored answer of the last evaluation
        with open(samples_path, "a") as f:
            f.writelines(json.dumps({"step": tr.optimizer_steps(), **x}) + "\n" for x in final_samples)
    final = _write_final_model(run, model, out) if run.rank == 0 else None
    # the whole run's evaluations: the segments' starts and ends (run_evals) and those during training
    evals = sorted(run_evals + evals_mid, key=lambda e: e["step"]) if data.eval else []
    _write_plot(plot_run, png_path, history + new, evals)
    _finish_sync(run, tr)

    # ---- summary: the whole run (the earlier segments of a resumed run too) ----
    whole = history + new
    if run_evals and run_evals[0]["step"] < start:       # the held-out loss at the run's start
        eval_before = run_evals[0]["loss"] if run_evals[0]["loss"] is not None else nan
        answer_before = run_evals[0].get("answer_loss")
        answer_before = nan if answer_before is None else answer_before
    seg_toks, seg_seconds = sum(m["tokens"] for m in new), train_seconds
    losses = [m["loss"] for m in whole if not m["skipped"] and m["loss"] is not None]
    loss_steps = [m["step"] for m in whole if not m["skipped"] and m["loss"] is not None]
    k = max(1, len(losses) // 10)
    first, last = (losses[0], losses[-1]) if losses else (float("nan"), float("nan"))
    first_avg = float(np.mean(losses[:k])) if losses else float("nan")
    last_avg = float(np.mean(losses[-k:])) if losses else float("nan")
    toks = sum(m["tokens"] for m in new)
    tps = toks / train_seconds if train_seconds > 0 else float("nan")
    run_toks, run_seconds = sum(m["tokens"] for m in whole), elapsed0 + train_seconds
    if data.eval:
        ratio = eval_after / eval_before
    else:
        ratio = last_avg / first_avg if losses else float("nan")
    fell = _fell(ratio)
    summary = {
        "steps": tr.optimizer_steps(), "steps_this_run": len(new), "first_step": start + 1,
        "sequences": run.grad_accum * run.world_size * len(whole), "tokens": run_toks,
        "train_seconds": round(run_seconds, 2),
        "tokens_per_s": round(run_toks / run_seconds, 1) if run_seconds > 0 else None,
        "tokens_this_run": seg_toks, "train_seconds_this_run": round(seg_seconds, 2),
        "tokens_per_s_this_run": round(tps, 1), "first_loss": first, "last_loss": last,
        f"first_{k}_steps_mean_loss": first_avg, f"last_{k}_steps_mean_loss": last_avg,
        "eval_sequences": len(data.eval), "eval_before": eval_before, "eval_after": eval_after,
        "eval_answer_before": answer_before, "eval_answer_after": answer_after,
        "eval_perplexity_after": final_eval.get("perplexity"), "eval_answer_perplexity_after": final_eval.get(
            "answer_perplexity"), "eval_exact_match": final_eval.get("exact_match"),
        "eval_answers_scored": final_eval.get("answers_scored", 0),
        "eval_seconds": round(eval_seconds, 2), "loss_fell": bool(fell), "loss_ratio": ratio,
        "evals_during": evals_mid,
        "metrics": str(metrics_path.resolve()), "plot": str(png_path.resolve()),
        "checkpoint": str(Path(last_ckpt).resolve()) if last_ckpt else None,
    }
    summary = {key: clean(v) for key, v in summary.items()}
    (rank_dir / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    reporters.finish("finished")
    print()
    print(f"done: {len(new)} optimizer steps (to step {tr.optimizer_steps()}) on {toks} tokens in "
          f"{train_seconds:.1f}s: {tps:.0f} tokens/s")
    if losses:
        print(f"  train loss: step {loss_steps[0]} {first:.4f} -> step {loss_steps[-1]} {last:.4f}"
              + (f"  (mean of the first {k} steps {first_avg:.4f} -> of the last {k} {last_avg:.4f})" if k > 1 else ""))
    if data.eval:
        print(f"  held-out loss ({data.label}): {eval_before:.4f} before -> {eval_after:.4f} after  "
              f"(x{eval_after / eval_before:.2f}, {len(data.eval)} sequences)")
        if data.has_answers:
            print(f"  held-out loss on the answers only: {answer_before:.4f} before -> {answer_after:.4f} after  "
                  f"(x{answer_after / answer_before:.2f})")
        if final_eval.get("exact_match") is not None:
            print(f"  held-out answers exactly right: {final_eval['exact_match']:.0%} of "
                  f"{final_eval['answers_scored']} (greedy; all in {samples_path.resolve()}), for example:")
            _print_samples(final_samples, run.samples, print)
    print(f"  the {'held-out' if data.eval else 'training'} loss {'fell' if fell else 'DID NOT FALL'} "
          f"(x{ratio:.2f})")
    print(f"  metrics: {metrics_path.resolve()}")
    print(f"  loss curve: {png_path.resolve()}")
    if last_ckpt:
        print(f"  checkpoint: {Path(last_ckpt).resolve()}  (Hugging Face model in its model/ directory"
              + (", the LoRA adapter in adapter/)" if run.lora_r is not None else ")"))
    if final is not None:
        print(f"  {final}")
    print(f"  summary: {(rank_dir / 'summary.json').resolve()}")
    if run.check_loss_drop is not None and len(new):
        if not (ratio <= run.check_loss_drop):
            print(f"error: the {'held-out' if data.eval else 'training'} loss went from "
                  f"{eval_before if data.eval else first_avg:.4f} to {eval_after if data.eval else last_avg:.4f} "
                  f"(x{ratio:.2f}); --check-loss-drop wants at most x{run.check_loss_drop:g}", file=sys.stderr)
            return 1
    return 0


def _restore_handlers(handlers: dict) -> None:
    import signal
    for sig, h in handlers.items():
        signal.signal(sig, h)
    handlers.clear()


def _record_eval(step: int, ev: dict, eval_path: Path, samples_path: Path, k: int) -> dict:
    """Append an evaluation during the run to eval.jsonl (and its first k samples to samples.jsonl)."""
    rec = {"step": step, **{key: clean(v) for key, v in ev.items() if key != "samples"}}
    with open(eval_path, "a") as f:
        f.write(json.dumps(rec) + "\n")
    if ev.get("samples") and k:
        with open(samples_path, "a") as f:
            f.writelines(json.dumps({"step": step, **x}) + "\n" for x in ev["samples"][:k])
    return {**rec, "samples": ev.get("samples", [])}


def _write_final_model(run: Run, model, out: Path) -> str:
    """The run's result beside its checkpoints: OUT/model, in --save-dtype (merged, with --merge-lora),
    or OUT/adapter for LoRA without merging. Merging changes the model in place, so it happens after
    the last checkpoint was written."""
    if run.lora_r is None or run.merge_lora:
        if run.lora_r is not None:
            model.merge_lora()
        dtype = _save_dtype(run)
        model.save_pretrained(out / "model", dtype)
        copy_model_files(run.tokenizer, out / "model", run.model)
        what = "merged model" if run.lora_r is not None else "model"
        return f"{what} ({dtype}): {(out / 'model').resolve()} (transformers' Lfm2ForCausalLM loads it)"
    model.save_adapter(out / "adapter", base_model=run.model)
    return (f"LoRA adapter: {(out / 'adapter').resolve()} (PeftModel.from_pretrained(base, dir) loads it"
            + (f" on {run.model})" if run.model else ")"))


def _save_dtype(run: Run) -> str:
    if run.save_dtype is not None:
        return run.save_dtype
    if run.source == "model" and Path(run.model).is_dir():
        from lfm2jit.model.checkpoint import stored_dtype
        return stored_dtype(Path(run.model))
    return "f32"


def _write_plot(plot, path: Path, metrics: list[dict], evals: list[dict]) -> None:
    try:
        plot(path, metrics, evals, title=f"training: {path.parent.name}")
    except OSError as e:
        print(f"note: could not write {path}: {e}", file=sys.stderr)
