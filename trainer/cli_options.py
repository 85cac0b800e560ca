"""The flags of ``python -m trainer`` and their resolution into a ``Run``: defaults that depend on
the mode (from scratch or fine-tuning), settings restored by ``--resume``, and validation with
one-line errors (``UsageError``, exit status 2)."""
from __future__ import annotations

import argparse
import math
from dataclasses import dataclass, field
from pathlib import Path

from lfm2jit.model.lora import DEFAULT_TARGETS

from .report import BACKENDS
from .trainer import DEFAULT_PACK_TOKENS, DEFAULT_REPLAY_PASSES

# Defaults of the run `python -m trainer` does with no arguments: a small model trained from
# scratch on the shipped chat data (measured on lavapipe, 2 CPU cores: about 2.5 minutes, most
# held-out answers right). initializer_range 0.05 (transformers' default is 0.02): at this width
# the larger start learned the lookups sooner in PyTorch trials of this data.
DEMO_PRESET = "demo"
DEMO_SHAPE = dict(hidden_size=64, intermediate_size=192, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, layer_types=["conv", "full_attention"], block_multiple_of=16,
                  initializer_range=0.05)
DEMO_STEPS = 2500
DEMO_LR = 3e-3
DEMO_CHECK_LOSS_DROP = 0.5     # with no arguments: exit 1 unless eval loss after <= 0.5 * before

FINETUNE_LR = 5e-5
DEFAULT_ACCUM = 4
DEFAULT_MAX_LEN = 512
DEFAULT_EVAL_FRACTION = 0.05
DEFAULT_EVAL_MAX = 200
DEFAULT_KEEP = 2
DEFAULT_CHECKPOINT_MINUTES = 10.0
DEFAULT_SAMPLES = 5

SCHEDULES = ("constant", "warmup", "cosine", "linear")


class UsageError(Exception):
    """Bad flags or inputs: reported as one line, exit status 2."""


EPILOG = """\
examples:
  python -m trainer                                   # the main job: tiny LFM2 from scratch, a few minutes on CPU
  python -m trainer --preset tiny --steps 50 --out runs/tiny
  python -m trainer --model DIR --data chat.jsonl --lr 2e-5 --epochs 1 --grad-accum 8
  python -m trainer --resume runs/tiny --steps 100    # continue a run from its latest checkpoint
  python -m trainer generate --model runs/tiny/model --prompt "What is 3 + 4?"   # talk to it (generate --help)
  python -m trainer eval --model runs/tiny/model --data held_out.jsonl            # score it alone (eval --help)
  python -m trainer --model DIR --data d.jsonl --sync-dir /shared/sync --rank 0 --world-size 2 --out runs/x &
  python -m trainer --model DIR --data d.jsonl --sync-dir /shared/sync --rank 1 --world-size 2 --out runs/x

defaults that depend on the mode:
  from scratch (no --model): --preset demo --lr 3e-3 --loss-on all, and on the built-in data --steps 2500
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
    m.add_argument("--eval-data", metavar="FILE",
                   help="held-out records from this JSONL file (same format as --data) instead of a fraction of "
                        "--data")
    m.add_argument("--eval-answers", type=int, metavar="N",
                   help="score the greedy answers of up to N held-out chat records (their last assistant turn) "
                        "for exact match at each evaluation; 0 disables (default: every evaluated record)")
    m.add_argument("--samples", type=int, metavar="K",
                   help=f"print K sample answers beside the expected ones at each evaluation (default {DEFAULT_SAMPLES})")
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
    o.add_argument("--replay", type=int, metavar="N",
                   help="record the forward/backward pass of up to N input shapes and replay them (with the norm "
                        "and optimizer steps) instead of running Python per kernel; each kept pass holds its "
                        f"activations; 0 = off. Same results either way (default {DEFAULT_REPLAY_PASSES})")
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
    o.add_argument("--recompute-mlp", action="store_true", default=None,
                   help="backward recomputes each layer's MLP up-projections instead of keeping them: the largest "
                        "activations, for two more matmuls per layer. Same results"),
    length = o.add_mutually_exclusive_group()
    length.add_argument("--steps", type=int, metavar="N",
                        help="train until optimizer step N (total, counting steps before a --resume)")
    length.add_argument("--epochs", type=float, metavar="E",
                        help="train for E passes over the training split (E may be fractional; default 1 unless "
                             "--steps is given or the built-in run is done)")

    lo = p.add_argument_group("LoRA and frozen parameters (by default every parameter is trained)")
    lo.add_argument("--lora-r", type=int, metavar="R",
                    help="train LoRA adapters of rank R (PEFT's LoraConfig) instead of the whole model; the base "
                         "weights stay frozen")
    lo.add_argument("--lora-alpha", type=float, metavar="A", help="LoRA alpha; the update is scaled by A / R "
                    "(default 2 R: Liquid's recipe uses R 8, alpha 16)")
    lo.add_argument("--lora-targets", nargs="+", metavar="NAME",
                    help=f"linear layers that get adapters, matched as PEFT matches target_modules (a module name "
                         f"or its last part); default LFM2's every linear layer: {' '.join(DEFAULT_TARGETS)}")
    lo.add_argument("--lora-dropout", type=float, metavar="P",
                    help="LoRA dropout probability, PEFT's lora_dropout: each adapter's input elements dropped "
                         "with probability P in training (masks drawn on the GPU; default 0)")
    lo.add_argument("--lora-f16-base", action="store_true", default=None,
                    help="keep the frozen base's linear weights as f16: half their memory")
    lo.add_argument("--merge-lora", action="store_true", default=None,
                    help="at the end, fold the adapters into the base and write the merged model to OUT/model "
                         "(default: the adapter alone, to OUT/adapter, which PeftModel.from_pretrained loads)")
    lo.add_argument("--train-only", nargs="+", metavar="PATTERN",
                    help="train only the parameters whose transformers names match one of these shell patterns "
                         "(e.g. 'lm_head.weight' 'model.layers.15.*'); with --lora-r, train these too")
    lo.add_argument("--freeze", nargs="+", metavar="PATTERN",
                    help="do not train the parameters whose names match one of these shell patterns")

    c = p.add_argument_group("output, checkpoints, resume")
    c.add_argument("--out", metavar="DIR",
                   help="run directory for metrics.jsonl, loss.png, summary.json, run.json and checkpoints/ "
                        "(default runs/<date>-<time>; with --world-size > 1 runs/<run-id>; with --resume the run "
                        "directory holding the checkpoint, whose metrics.jsonl is continued)")
    c.add_argument("--checkpoint-every", type=int, metavar="N",
                   help="also checkpoint every N optimizer steps; 0: only at the end (and on Ctrl-C/SIGTERM). "
                        "Default: N chosen from the measured step time after the first 10 steps so that a "
                        "checkpoint is written about every --checkpoint-minutes of training (none in runs shorter "
                        "than that)")
    c.add_argument("--checkpoint-minutes", type=float, metavar="M",
                   help="without --checkpoint-every: checkpoint about every M minutes of training "
                        f"(default {DEFAULT_CHECKPOINT_MINUTES:g})")
    c.add_argument("--keep-checkpoints", type=int, metavar="K",
                   help=f"keep only the newest K checkpoints of the run; 0 keeps all (default {DEFAULT_KEEP})")
    c.add_argument("--resume", metavar="DIR",
                   help="continue from a checkpoint (DIR/trainer.json) or a run directory's newest checkpoint: "
                        "weights, optimizer, scaler, schedule, data position and the run's settings")
    c.add_argument("--save-dtype", choices=("f32", "bf16", "f16"),
                   help="dtype of the final model written to OUT/model (default: the input model's, f32 from "
                        "scratch); checkpoints stay f32 so that --resume is exact")
    c.add_argument("--eval-every", type=int, metavar="N",
                   help="also score the held-out split every N optimizer steps: printed, written to eval.jsonl and "
                        "drawn in loss.png (default 0: before and after training only)")
    c.add_argument("--check-loss-drop", type=float, metavar="F",
                   help="exit with status 1 unless the held-out loss after training is at most F times the loss "
                        f"before (default: off; {DEMO_CHECK_LOSS_DROP} for the no-argument run)")
    c.add_argument("--no-progress", action="store_true", default=None, help="no progress bar")
    c.add_argument("--report-to", nargs="+", choices=BACKENDS, metavar="BACKEND",
                   help="also log the settings, every step's metrics.jsonl scalars (train/KEY) and the evaluations "
                        "(eval/KEY) to tensorboard (event files in OUT/tensorboard; pip install tensorboardX), "
                        "wandb (files in OUT/wandb) and/or mlflow (MLFLOW_TRACKING_URI, else the SQLite store OUT/mlflow.db) "
                        "(default: none)")

    s = p.add_argument_group("multi-process gradient sync (FileGradSync or MPI) and device")
    s.add_argument("--distributed", choices=("file", "mpi"),
                   help="how ranks average their gradients: file (through --sync-dir, the default) or mpi (launch "
                        "with mpiexec -n N python -m trainer ... --distributed mpi: rank and world size from MPI; "
                        "pip install mpi4py mpich)")
    s.add_argument("--sync-dir", metavar="DIR",
                   help="shared directory through which --world-size processes average their gradients every "
                        "optimizer step; start one process per rank with the same flags")
    s.add_argument("--rank", type=int, metavar="R", help="this process's rank, 0 .. world-size - 1 (default 0)")
    s.add_argument("--world-size", type=int, metavar="N", help="number of processes (default 1)")
    s.add_argument("--run-id", metavar="ID",
                   help="name of the run's sync files, so files of another run are never mixed in: 1 to 64 letters, "
                        "digits, '.', '_', '-', starting with a letter or digit (default run)")
    s.add_argument("--sync-timeout", type=float, metavar="S",
                   help="seconds to wait for the other ranks at a step before failing (default 600)")
    s.add_argument("--adapter", metavar="SUBSTRING",
                   help="use the wgpu adapter whose name/vendor/backend contains SUBSTRING (sets LFM2JIT_ADAPTER)")
    return p


# Settings whose change on --resume does not alter the training itself (a changed --steps shows up as a
# changed schedule, noted separately).
AS_YOU_LIKE = {"steps", "checkpoint_every", "checkpoint_minutes", "eval_every", "keep_checkpoints", "eval_max", "sync_timeout", "check_loss_drop",
               "eval_answers", "samples"}

# Settings a checkpoint carries and --resume restores (flags given with --resume override them).
RESUMABLE = ("tokenizer", "data", "data_kind", "loss_on", "max_len", "eval_fraction", "eval_max", "seed", "optimizer", "lr",
             "weight_decay", "momentum", "schedule", "warmup_steps", "min_lr", "grad_accum", "pack_tokens", "clip", "bucket",
             "scaler", "f16", "steps", "checkpoint_every", "checkpoint_minutes", "keep_checkpoints", "world_size", "sync_dir", "run_id",
             "sync_timeout", "check_loss_drop", "source", "preset", "lora_r", "lora_alpha", "lora_targets",
             "lora_dropout", "lora_f16_base", "merge_lora", "train_only", "freeze", "eval_every", "save_dtype",
             "eval_data", "eval_answers", "samples", "distributed")


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
    replay: int
    recompute_mlp: bool
    clip: float
    bucket: int
    scaler: bool
    f16: bool
    steps: int | None
    epochs: float | None
    out: str | None
    checkpoint_every: int | None    # None: chosen from the measured step time (about every checkpoint_minutes)
    checkpoint_minutes: float
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
    lora_r: int | None = None
    lora_alpha: float | None = None
    lora_targets: list[str] | None = None
    lora_dropout: float = 0.0
    lora_f16_base: bool = False
    merge_lora: bool = False
    train_only: list[str] | None = None
    freeze: list[str] | None = None
    eval_every: int = 0
    eval_data: str | None = None
    eval_answers: int | None = None   # None: every evaluated record
    samples: int = DEFAULT_SAMPLES
    save_dtype: str | None = None     # None: the input model's (resolved in prepare), f32 from scratch
    report_to: list[str] = field(default_factory=list)   # --report-to backends (not kept in checkpoints)
    distributed: str = "file"                             # how ranks average gradients: "file" or "mpi"
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
    # under MPI (given, or the resumed run's) the rank and world size come from MPI, never from the checkpoint
    if g.get("distributed", (saved or {}).get("distributed")) == "mpi":
        g.update(_mpi_world(g))
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
        cmd = dict(g)
        base.update({k: v for k, v in g.items() if k in RESUMABLE})
        g = {**g, **base}
        _confirm_resumed_sync(cmd, g, ckpt, notes)
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
    if g.get("eval_data") is not None and not Path(g["eval_data"]).is_file():
        raise UsageError(f"--eval-data {g['eval_data']}: no such file")
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
        grad_accum=g.get("grad_accum", DEFAULT_ACCUM), pack_tokens=g.get("pack_tokens", DEFAULT_PACK_TOKENS),
        replay=g.get("replay", DEFAULT_REPLAY_PASSES), recompute_mlp=bool(g.get("recompute_mlp", False)), clip=g.get("clip", 1.0), bucket=g.get("bucket", 64),
        scaler=bool(g.get("scaler", False) or g.get("f16", False)), f16=bool(g.get("f16", False)),
        steps=steps, epochs=epochs, out=g.get("out"),
        checkpoint_every=g.get("checkpoint_every"), checkpoint_minutes=g.get("checkpoint_minutes", DEFAULT_CHECKPOINT_MINUTES),
        keep_checkpoints=g.get("keep_checkpoints", DEFAULT_KEEP),
        check_loss_drop=g.get("check_loss_drop", DEMO_CHECK_LOSS_DROP if argv_empty else None),
        progress=not g.get("no_progress", False), sync_dir=g.get("sync_dir"), rank=g.get("rank", 0),
        world_size=world, run_id=g.get("run_id", "run"), sync_timeout=g.get("sync_timeout", 600.0),
        adapter=g.get("adapter"), resume=g.get("resume"), builtin_data=builtin_data, notes=notes,
        lora_r=g.get("lora_r"), lora_alpha=g.get("lora_alpha", 2.0 * g["lora_r"] if "lora_r" in g else None),
        lora_targets=g.get("lora_targets", list(DEFAULT_TARGETS) if "lora_r" in g else None),
        lora_dropout=g.get("lora_dropout", 0.0), lora_f16_base=bool(g.get("lora_f16_base", False)),
        merge_lora=bool(g.get("merge_lora", False)), train_only=g.get("train_only"), freeze=g.get("freeze"),
        eval_every=g.get("eval_every", 0), save_dtype=g.get("save_dtype"), eval_data=g.get("eval_data"),
        eval_answers=g.get("eval_answers"), samples=g.get("samples", DEFAULT_SAMPLES),
        report_to=list(dict.fromkeys(g.get("report_to") or [])), distributed=g.get("distributed", "file"),
        derived={k for k in ("min_lr", "warmup_steps", "tokenizer", "data") if k not in g})
    _validate(run)
    for key in ("model", "tokenizer", "data", "eval_data", "sync_dir"):   # kept in checkpoints: independent of the cwd
        if getattr(run, key) is not None:
            setattr(run, key, str(Path(getattr(run, key)).resolve()))
    return run


def _mpi_world(g: dict) -> dict:
    """--distributed mpi: this process's rank and the world size, from MPI's COMM_WORLD."""
    given = [f"--{k.replace('_', '-')}" for k in ("rank", "world_size", "sync_dir") if k in g]
    if given:
        raise UsageError(f"--distributed mpi takes the rank and world size from MPI (mpiexec -n N); drop "
                         f"{', '.join(given)}")
    from .errors import TrainError
    from .mpi_sync import load_mpi
    try:
        MPI = load_mpi()
    except TrainError as e:
        raise UsageError(str(e)) from None
    return {"rank": MPI.COMM_WORLD.Get_rank(), "world_size": MPI.COMM_WORLD.Get_size(), "sync_dir": None}


def _confirm_resumed_sync(cmd: dict, g: dict, ckpt: Path | None, notes: list[str]) -> None:
    """The sync settings a resumed run takes from the checkpoint's trainer.json alone (not from the
    command line) are checked, confirmed against the command line and reported in a note: a crafted
    or moved checkpoint must not decide silently where the run writes its gradient files."""
    import os
    from .sync import run_id_problem
    if g.get("distributed") == "mpi":            # rank and world from MPI, no directory
        return
    src = f"--resume {ckpt}: {Path(ckpt) / 'trainer.json' if ckpt is not None else 'trainer.json'}"
    world = g.get("world_size", 1)
    if "world_size" not in cmd and (type(world) is not int or world < 1):
        raise UsageError(f"{src}: world_size must be a positive integer, got {world!r}")
    if "sync_timeout" not in cmd and "sync_timeout" in g and (type(g["sync_timeout"]) not in (int, float)
                                                              or not g["sync_timeout"] > 0):
        raise UsageError(f"{src}: sync_timeout must be a positive number, got {g['sync_timeout']!r}")
    if "run_id" not in cmd and "run_id" in g and run_id_problem(g["run_id"]):
        raise UsageError(f"{src}: run_id {run_id_problem(g['run_id'])}")
    if "sync_dir" not in cmd and "sync_dir" in g and not isinstance(g["sync_dir"], str):
        raise UsageError(f"{src}: sync_dir must be a string, got {g['sync_dir']!r}")
    if type(world) is not int or world <= 1:
        return
    taken = [k for k in ("world_size", "sync_dir", "run_id") if k in g and k not in cmd]
    if not taken:
        return
    if not any(k in cmd for k in ("rank", "world_size", "sync_dir")):
        raise UsageError(f"{src} holds rank 0 of a {world}-process run syncing through {g.get('sync_dir')!r}: to "
                         "continue it, start every rank with --resume and its --rank R (add --sync-dir DIR to sync "
                         "elsewhere), or pass --world-size 1 to continue in one process")
    if "sync_dir" not in cmd:
        d = g.get("sync_dir")
        if not d or not os.path.isabs(d) or not Path(d).is_dir():
            raise UsageError(f"{src} names the sync directory {d!r}, which is not an existing directory given by an "
                             "absolute path; pass --sync-dir DIR (the same to every rank)")
    notes.append(f"--resume: gradients are synced through {g.get('sync_dir')} as run {g.get('run_id', 'run')!r} "
                 f"({', '.join(taken)} from {Path(ckpt) / 'trainer.json' if ckpt is not None else 'trainer.json'}; "
                 "pass --sync-dir and --run-id to choose others)")


def _dir_problem(value) -> str | None:
    """Why ``value`` cannot be (or become) a directory: empty, or it or a parent is an existing non-directory."""
    if not str(value).strip():
        return "must name a directory, got ''"
    p = Path(value)
    for q in (p, *p.parents):
        if q.is_dir():
            return None
        if q.exists() or q.is_symlink():
            return f"{value}: {'exists' if q == p else f'{q} exists'} and is not a directory"
    return None


def _validate(r: Run) -> None:
    def positive(name, value, allow_zero=False):
        if value is None:
            return
        if not math.isfinite(value) or value < 0 or (value == 0 and not allow_zero):
            raise UsageError(f"--{name.replace('_', '-')} must be {'>= 0' if allow_zero else '> 0'}, got {value}")
    if r.distributed not in ("file", "mpi"):         # a checkpoint's value: the flag's choices are argparse's
        raise UsageError(f"--distributed must be file or mpi, got {r.distributed!r}")
    for name in ("lr", "min_lr", "weight_decay", "momentum", "clip", "eval_fraction", "sync_timeout",
                 "checkpoint_minutes"):
        positive(name, getattr(r, name), allow_zero=name not in ("sync_timeout", "checkpoint_minutes"))
    for name in ("grad_accum", "bucket", "max_len", "eval_max", "world_size"):
        positive(name, getattr(r, name))
    for name in ("checkpoint_every", "keep_checkpoints", "warmup_steps", "pack_tokens", "replay", "eval_every",
                 "eval_answers", "samples"):
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
    if r.world_size > 1 and not r.sync_dir and r.distributed != "mpi":
        raise UsageError("--world-size > 1 needs --sync-dir DIR, a directory every rank can read and write "
                         "(or launch under mpiexec with --distributed mpi)")
    lora_only = [f for f, v in (("lora-alpha", "lora_alpha"), ("lora-targets", "lora_targets"), ("lora-dropout",
                                "lora_dropout"), ("lora-f16-base", "lora_f16_base"), ("merge-lora", "merge_lora"))
                 if getattr(r, v) and r.lora_r is None]
    if lora_only:
        raise UsageError(f"--{lora_only[0]} needs --lora-r R (the rank of the adapters to train)")
    positive("lora_r", r.lora_r)
    positive("lora_alpha", r.lora_alpha)
    if not (0.0 <= r.lora_dropout < 1.0):
        raise UsageError(f"--lora-dropout must be in [0, 1), got {r.lora_dropout:g}")
    from .report import missing
    for name in r.report_to:
        if missing(name):
            raise UsageError(f"--report-to {name}: {missing(name)}")
    from .sync import run_id_problem
    if run_id_problem(r.run_id):
        raise UsageError(f"--run-id {run_id_problem(r.run_id)}")
    for flag, value in (("out", r.out), ("sync-dir", r.sync_dir)):
        if value is not None and _dir_problem(value):
            raise UsageError(f"--{flag} {_dir_problem(value)}")
