"""The train command's flags resolved into a ``Run``: defaults that depend on the mode (from scratch or
fine-tuning), settings restored by ``--resume``, and validation with one-line errors (``UsageError``)."""
from __future__ import annotations

import argparse
import math
from pathlib import Path

from lfm2jit.model.lora import DEFAULT_TARGETS

from ..packing import PACKING_CHOICES
from ..trainer import DEFAULT_PACK_TOKENS, DEFAULT_REPLAY_PASSES
from .options import (DEFAULT_ACCUM, DEFAULT_BETA, DEFAULT_CHECKPOINT_MINUTES, DEFAULT_EVAL_FRACTION, DEFAULT_EVAL_MAX, DEFAULT_KEEP,
                      DEFAULT_MAX_LEN, DEFAULT_SAMPLES, DEMO_CHECK_LOSS_DROP, DEMO_LR, DEMO_PRESET, DEMO_STEPS,
                      FINETUNE_LR, MIN_EVAL_SEQUENCES)
from .state import AS_YOU_LIKE, RESUMABLE, Run
from .usage import UsageError



def default_eval_max(steps: int | None, per_step: int) -> int:
    """Held-out sequences to evaluate without --eval-max: DEFAULT_EVAL_MAX, but for a run of a given
    number of steps no more than it trains on (at least MIN_EVAL_SEQUENCES), so that a short run's
    evaluation before and after does not outlast its training (by hours, on a CPU driver)."""
    if steps is None:
        return DEFAULT_EVAL_MAX
    return min(DEFAULT_EVAL_MAX, max(MIN_EVAL_SEQUENCES, steps * per_step))

def _given(args: argparse.Namespace) -> dict:
    return {k: v for k, v in vars(args).items() if v is not None}


def resolve(args: argparse.Namespace, argv_empty: bool, saved: dict | None = None, ckpt: Path | None = None) -> Run:
    """Fill in defaults (or, with --resume, the checkpoint's settings), then validate."""
    from ..data import default_dataset
    g = _given(args)
    if "adapter" in g:      # --adapter is a LoRA directory (generate, eval); never reread as the GPU
        raise UsageError(f"--adapter {g['adapter']}: the GPU is chosen with --gpu SUBSTRING (--adapter is a LoRA "
                         "adapter directory, for generate and eval)")
    notes: list[str] = []
    objective = _check_objective(g, saved, ckpt)
    if "reward" in g:                   # --reward SPEC (repeated): the run's list of reward functions
        g["rewards"] = g.pop("reward")
    # under MPI (given, or the resumed run's) the rank and world size come from MPI, never from the checkpoint
    if g.get("distributed", (saved or {}).get("distributed")) == "mpi":
        g.update(_mpi_world(g))
    if saved is not None:
        g = _with_saved(g, saved, ckpt, notes)
        source = g["source"]
    else:
        source = "model" if "model" in g else "scratch"
        if source == "model" and "preset" in g:
            raise UsageError("--preset is for training from scratch; --model DIR brings its own config.json")
    builtin_data = "data" not in g
    if objective == "dpo" and builtin_data:
        raise UsageError("python -m trainer dpo needs --data FILE.jsonl: preference records "
                         '({"prompt", "chosen", "rejected"}, see python -m trainer dpo --help)')
    if objective == "grpo" and builtin_data:
        raise UsageError('python -m trainer grpo needs --prompts FILE.jsonl: {"prompt": ..., "answer": ...} records '
                         "(see python -m trainer grpo --help)")
    model_dir = g.get("model")
    if source == "model" and saved is None:
        _check_model_dir(model_dir)
    tokenizer = _tokenizer_path(g.get("tokenizer"), source, model_dir, ckpt)
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
        eval_max=g.get("eval_max", default_eval_max(steps, g.get("grad_accum", DEFAULT_ACCUM) * world)), seed=g.get("seed", 0), optimizer=optimizer, lr=lr,
        weight_decay=g.get("weight_decay", 0.01 if optimizer == "adamw" else 0.0), momentum=g.get("momentum", 0.9),
        schedule=g.get("schedule", "cosine"), warmup_steps=g.get("warmup_steps"), min_lr=g.get("min_lr", lr / 10),
        grad_accum=g.get("grad_accum", DEFAULT_ACCUM), pack_tokens=g.get("pack_tokens", DEFAULT_PACK_TOKENS),
        packing=g.get("packing", "auto"),
        replay=g.get("replay", DEFAULT_REPLAY_PASSES), recompute_mlp=bool(g.get("recompute_mlp", False)),
        checkpoint_layers=_checkpoint_layers(g.get("checkpoint_layers")),
        clip=g.get("clip", 1.0), bucket=g.get("bucket", 64),
        scaler=bool(g.get("scaler", False) or g.get("f16", False)), f16=bool(g.get("f16", False)),
        steps=steps, epochs=epochs, out=g.get("out"),
        checkpoint_every=g.get("checkpoint_every"),
        checkpoint_minutes=g.get("checkpoint_minutes", DEFAULT_CHECKPOINT_MINUTES),
        keep_checkpoints=g.get("keep_checkpoints", DEFAULT_KEEP),
        check_loss_drop=g.get("check_loss_drop", DEMO_CHECK_LOSS_DROP if argv_empty else None),
        progress=not g.get("no_progress", False), sync_dir=g.get("sync_dir"), rank=g.get("rank", 0),
        world_size=world, run_id=g.get("run_id", "run"), sync_timeout=g.get("sync_timeout", 600.0),
        gpu=g.get("gpu"), resume=g.get("resume"), builtin_data=builtin_data, notes=notes,
        overwrite=bool(g.get("overwrite", False)),
        lora_r=g.get("lora_r"), lora_alpha=g.get("lora_alpha", 2.0 * g["lora_r"] if "lora_r" in g else None),
        lora_targets=g.get("lora_targets", list(DEFAULT_TARGETS) if "lora_r" in g else None),
        lora_dropout=g.get("lora_dropout", 0.0), lora_target_parameters=g.get("lora_target_parameters"),
        lora_f16_base=bool(g.get("lora_f16_base", False)), base_dtype=g.get("base_dtype"), router_aux_loss_coef=g.get("router_aux_loss_coef", 0.0),
        merge_lora=bool(g.get("merge_lora", False)), train_only=g.get("train_only"), freeze=g.get("freeze"),
        eval_every=g.get("eval_every", 0), save_dtype=g.get("save_dtype"), eval_data=g.get("eval_data"),
        eval_answers=g.get("eval_answers"), samples=g.get("samples", DEFAULT_SAMPLES),
        report_to=list(dict.fromkeys(g.get("report_to") or [])), distributed=g.get("distributed", "file"),
        objective=objective, beta=g.get("beta", 0.0 if objective == "grpo" else DEFAULT_BETA),
        loss_type=g.get("loss_type", "dapo" if objective == "grpo" else "sigmoid"),
        label_smoothing=g.get("label_smoothing", 0.0), rewards=list(g.get("rewards") or ["exact_match"]),
        num_generations=g.get("num_generations", 8), max_completion_length=g.get("max_completion_length", 512),
        temperature=g.get("temperature", 1.0), top_p=g.get("top_p", 1.0), epsilon=g.get("epsilon", 0.2),
        epsilon_high=g.get("epsilon_high"), num_iterations=g.get("num_iterations", 1),
        scale_rewards=g.get("scale_rewards", "group"), eval_generations=g.get("eval_generations", 0),
        reference_model=g.get("reference_model", model_dir if objective == "grpo" else None),
        derived={k for k in ("min_lr", "warmup_steps", "tokenizer", "data") if k not in g})
    _validate(run)
    for key in ("model", "tokenizer", "data", "eval_data", "sync_dir", "reference_model"):   # kept in checkpoints: independent of the cwd
        if getattr(run, key) is not None:
            setattr(run, key, str(Path(getattr(run, key)).resolve()))
    return run


# the train command's flags that mean nothing to DPO (which scores completion tokens and generates no answers)
NOT_FOR_DPO = {"data_kind": "records are preference pairs", "loss_on": "only completion tokens are scored",
               "eval_answers": "DPO's evaluation scores pairs, not generated answers",
               "samples": "DPO's evaluation generates no answers"}
DPO_FLAGS = ("beta", "loss_type", "label_smoothing")
# ... and to GRPO (whose completions the reward functions score; its loss is no measure of progress)
NOT_FOR_GRPO = {"data_kind": "records are prompts", "loss_on": "the reward functions score the completions",
                "label_smoothing": "it is DPO's (python -m trainer dpo)",
                "eval_answers": "GRPO's evaluation completes every evaluated prompt (--eval-max N evaluates fewer)",
                "check_loss_drop": "GRPO's loss is no measure of progress (the summary says whether the held-out "
                                   "reward rose)"}
GRPO_FLAGS = ("reward", "num_generations", "max_completion_length", "temperature", "top_p", "epsilon",
              "epsilon_high", "num_iterations", "scale_rewards", "eval_generations")
COMMAND_OF = {"sft": "python -m trainer", "dpo": "python -m trainer dpo", "grpo": "python -m trainer grpo"}
RUN_OF = {"sft": "a supervised (python -m trainer)", "dpo": "a DPO (preference tuning)", "grpo": "a GRPO"}


def _flag(key: str) -> str:
    return "--" + key.replace("_", "-")


def _check_objective(g: dict, saved: dict | None, ckpt: Path | None) -> str:
    """The command's objective ("sft": python -m trainer, "dpo": python -m trainer dpo, "grpo": python -m
    trainer grpo): its flags only with it, and a resumed checkpoint's run of the same objective."""
    objective = g.get("objective", "sft")
    given = [k for k in GRPO_FLAGS if k in g] if objective != "grpo" else []
    if given:
        value = g[given[0]][0] if given[0] == "reward" else g[given[0]]
        raise UsageError(f"{_flag(given[0])} is a GRPO flag: use python -m trainer grpo ... {_flag(given[0])} {value}")
    if objective == "sft":
        given = [k for k in DPO_FLAGS if k in g]
        if given:
            flag = _flag(given[0])
            raise UsageError(f"{flag} is a preference-tuning (DPO) flag: use python -m trainer dpo ... {flag} "
                             f"{g[given[0]]}" + (" (or python -m trainer grpo)" if given[0] != "label_smoothing" else ""))
    else:
        refused = NOT_FOR_DPO if objective == "dpo" else NOT_FOR_GRPO
        given = [k for k in refused if k in g]
        if given:
            raise UsageError(f"{_flag(given[0])} does not apply to {COMMAND_OF[objective]}: {refused[given[0]]}")
    if saved is not None:
        was = saved.get("objective") or "sft"
        if was != objective:
            raise UsageError(f"--resume {ckpt}: the checkpoint is of {RUN_OF.get(was, repr(was))} run; continue it "
                             f"with {COMMAND_OF.get(was, 'python -m trainer')} --resume"
                             + ("" if objective == "sft" else f"; to train its model with {objective}, start a new "
                                f"run with {COMMAND_OF[objective]} --model "
                                f"{Path(ckpt) / 'model' if ckpt else 'DIR'}"))
    return objective


def _with_saved(g: dict, saved: dict, ckpt: Path | None, notes: list[str]) -> dict:
    """--resume: the checkpoint's settings, overridden by the flags given (a note lists the changes)."""
    for flag in ("model", "preset"):
        if flag in g:
            raise UsageError(f"--{flag} cannot be combined with --resume: the model comes from the checkpoint")
    base = {k: v for k, v in saved.items() if v is not None}
    if "adapter" in base:           # older runs' name for the GPU substring (now --gpu)
        gpu = base.pop("adapter")
        base.setdefault("gpu", gpu)
    if "gpu" in g:
        base.pop("gpu", None)
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
    return g


def _checkpoint_layers(value: str | None) -> int | str:
    """--checkpoint-layers all|N as Lfm2Model takes it (0 when not given); N is checked against the
    model's layers once its config is read (prepare._model_config)."""
    if value is None:
        return 0
    if value == "all":
        return "all"
    if not (value.isascii() and value.isdigit() and int(value) >= 1):
        raise UsageError(f"--checkpoint-layers must be all or a number of decoder layers >= 1, got {value!r}")
    return int(value)


def _check_model_dir(model_dir: str) -> None:
    """--model names a Hugging Face LFM2 directory: config.json and safetensors weights."""
    md = Path(model_dir)
    if not md.is_dir():
        raise UsageError(f"--model {model_dir}: no such directory")
    if not (md / "config.json").is_file():
        raise UsageError(f"--model {model_dir}: no config.json (a Hugging Face LFM2 checkpoint directory holds "
                         "config.json, model.safetensors and tokenizer.json)")
    if not any(md.glob("*.safetensors")) and not (md / "model.safetensors.index.json").is_file():
        raise UsageError(f"--model {model_dir}: no *.safetensors weights")


def _tokenizer_path(tokenizer: str | None, source: str, model_dir: str | None, ckpt: Path | None) -> str:
    """--tokenizer, else the copy a checkpoint carries, the --model directory's, or the shipped one."""
    from ..data import default_tokenizer
    if tokenizer is None and ckpt is not None and (ckpt / "model" / "tokenizer.json").is_file():
        tokenizer = str(ckpt / "model" / "tokenizer.json")      # the copy every checkpoint carries
    if tokenizer is None:
        if source == "model":
            tokenizer = str(Path(model_dir) / "tokenizer.json")
            if not Path(tokenizer).is_file():
                raise UsageError(f"--model {model_dir}: no tokenizer.json (pass --tokenizer FILE)")
        else:
            tokenizer = str(default_tokenizer())
    return tokenizer


def _mpi_world(g: dict) -> dict:
    """--distributed mpi: this process's rank and the world size, from MPI's COMM_WORLD."""
    given = [f"--{k.replace('_', '-')}" for k in ("rank", "world_size", "sync_dir") if k in g]
    if given:
        raise UsageError(f"--distributed mpi takes the rank and world size from MPI (mpiexec -n N); drop "
                         f"{', '.join(given)}")
    from ..errors import TrainError
    from ..mpi_sync import load_mpi
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
    from ..sync import run_id_problem
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
    if r.packing not in PACKING_CHOICES:
        raise UsageError(f"--packing must be pad, concat or auto, got {r.packing!r}")
    if r.distributed not in ("file", "mpi"):         # a checkpoint's value: the flag's choices are argparse's
        raise UsageError(f"--distributed must be file or mpi, got {r.distributed!r}")
    for name in ("lr", "min_lr", "weight_decay", "momentum", "clip", "eval_fraction", "sync_timeout",
                 "checkpoint_minutes"):
        positive(name, getattr(r, name), allow_zero=name not in ("sync_timeout", "checkpoint_minutes"))
    for name in ("grad_accum", "bucket", "max_len", "eval_max", "world_size"):
        positive(name, getattr(r, name))
    for name in ("checkpoint_every", "keep_checkpoints", "warmup_steps", "pack_tokens", "replay", "eval_every",
                 "eval_answers", "samples", "eval_generations"):
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
                                "lora_dropout"), ("lora-target-parameters", "lora_target_parameters"), ("lora-f16-base", "lora_f16_base"), ("base-dtype", "base_dtype"), ("merge-lora", "merge_lora"))
                 if getattr(r, v) and r.lora_r is None]
    if lora_only:
        raise UsageError(f"--{lora_only[0]} needs --lora-r R (the rank of the adapters to train)")
    if r.lora_f16_base and r.base_dtype not in (None, "f16"):
        raise UsageError(f"--lora-f16-base and --base-dtype {r.base_dtype} ask for two base dtypes; give one")
    positive("lora_r", r.lora_r)
    positive("lora_alpha", r.lora_alpha)
    if not (0.0 <= r.lora_dropout < 1.0):
        raise UsageError(f"--lora-dropout must be in [0, 1), got {r.lora_dropout:g}")
    if not (math.isfinite(r.router_aux_loss_coef) and r.router_aux_loss_coef >= 0):
        raise UsageError(f"--router-aux-loss-coef must be a finite number >= 0, got {r.router_aux_loss_coef:g}")
    if r.objective not in ("sft", "dpo", "grpo"):          # a checkpoint's value
        raise UsageError(f"objective must be sft, dpo or grpo, got {r.objective!r}")
    if r.objective == "dpo":
        _validate_dpo(r)
    if r.objective == "grpo":
        _validate_grpo(r)
    from .report import missing
    for name in r.report_to:
        if missing(name):
            raise UsageError(f"--report-to {name}: {missing(name)}")
    from ..sync import run_id_problem
    if run_id_problem(r.run_id):
        raise UsageError(f"--run-id {run_id_problem(r.run_id)}")
    for flag, value in (("out", r.out), ("sync-dir", r.sync_dir)):
        if value is not None and _dir_problem(value):
            raise UsageError(f"--{flag} {_dir_problem(value)}")


def _validate_dpo(r: Run) -> None:
    """--beta, --loss-type and --label-smoothing, as trainer/dpo.py's DpoConfig takes them."""
    from ..dpo import LOSS_TYPES, DpoConfig
    if r.loss_type not in LOSS_TYPES:
        raise UsageError(f"--loss-type must be {' or '.join(LOSS_TYPES)}, got {r.loss_type!r}")
    if isinstance(r.beta, bool) or not isinstance(r.beta, (int, float)) or not (math.isfinite(r.beta) and r.beta > 0):
        raise UsageError(f"--beta must be a finite number > 0, got {r.beta}")
    eps = r.label_smoothing
    if isinstance(eps, bool) or not isinstance(eps, (int, float)) or not 0.0 <= eps < 0.5:
        raise UsageError(f"--label-smoothing must be in [0, 0.5), got {eps}")
    if eps and r.loss_type != "sigmoid":
        raise UsageError(f"--label-smoothing {eps:g} applies to the sigmoid loss only, not --loss-type {r.loss_type}")
    try:
        DpoConfig(beta=r.beta, loss_type=r.loss_type, label_smoothing=r.label_smoothing)
    except ValueError as e:
        raise UsageError(f"dpo: {e}") from None


def _validate_grpo(r: Run) -> None:
    """GRPO's settings as trainer/grpo.py's GrpoConfig takes them, each --reward loaded (load_reward), and
    a reference to load when --beta > 0."""
    from ..grpo import LOSS_TYPES, GrpoConfig, load_reward
    if r.loss_type not in LOSS_TYPES:
        raise UsageError(f"--loss-type must be {', '.join(LOSS_TYPES[:-1])} or {LOSS_TYPES[-1]}, got {r.loss_type!r}")
    try:
        grpo_config(r)
    except ValueError as e:            # GrpoConfig names the field: say the flag
        name = str(e).split(" ", 1)[0]
        raise UsageError(f"--{name.replace('_', '-')}{str(e)[len(name):]}") from None
    if not isinstance(r.rewards, list) or not r.rewards or not all(isinstance(x, str) for x in r.rewards):
        raise UsageError(f"rewards must be a list of reward function names, got {r.rewards!r}")
    specs = []
    for spec in r.rewards:
        where, sep, name = spec.rpartition(":")
        if sep and not spec.startswith("regex:") and where.endswith(".py") and Path(where).is_file():     # kept in checkpoints: independent of the cwd
            spec = f"{Path(where).resolve()}:{name}"
        try:
            load_reward(spec)
        except ValueError as e:
            raise UsageError(f"--reward {e}") from None
        specs.append(spec)
    r.rewards = specs
    if r.beta and r.lora_r is None and r.reference_model is None:
        raise UsageError(f"--beta {r.beta:g} needs a reference model: the starting --model DIR (or a LoRA run's base); "
                         "a model trained from scratch (--preset) has none. Pass --beta 0, --lora-r R, or --model DIR")
    if r.reference_model is not None and r.beta and r.lora_r is None and not Path(r.reference_model).is_dir():
        raise UsageError(f"--beta {r.beta:g}: the reference model {r.reference_model} (the run's starting --model) "
                         "is no longer there")


def grpo_config(r: Run):
    """The run's trainer/grpo.py GrpoConfig (ValueError naming a bad field)."""
    from ..grpo import GrpoConfig
    return GrpoConfig(num_generations=r.num_generations, max_completion_length=r.max_completion_length,
                      temperature=r.temperature, top_p=r.top_p, beta=r.beta, epsilon=r.epsilon,
                      epsilon_high=r.epsilon_high, loss_type=r.loss_type, num_iterations=r.num_iterations,
                      scale_rewards=r.scale_rewards)


def reward_display_names(specs: list[str]) -> list[str]:
    """The names of --reward functions in metrics (rewards/<name>/mean) and the banner: a user function's own
    name, as TRL names them (its whole spec where two share one); exact_match and regex:PATTERN as given."""
    short = [spec.rpartition(":")[2] if ":" in spec and not spec.startswith("regex:") else spec for spec in specs]
    return [name if short.count(name) == 1 else spec for name, spec in zip(short, specs)]
