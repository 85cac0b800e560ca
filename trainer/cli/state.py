"""The typed state of a training run: ``Run``, its resolved settings (run.json, and what a checkpoint
keeps for --resume); ``Data``, the training and held-out sequences; ``Session``, everything built
before the first step; ``History``, what the run has measured so far."""
from __future__ import annotations

import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from .options import DEFAULT_SAMPLES

# Settings whose change on --resume does not alter the training itself (a changed --steps shows up as a
# changed schedule, noted separately).
AS_YOU_LIKE = {"steps", "checkpoint_every", "checkpoint_minutes", "eval_every", "keep_checkpoints",
               "eval_max", "sync_timeout", "check_loss_drop", "eval_answers", "samples", "eval_generations"}

# Settings a checkpoint carries and --resume restores (flags given with --resume override them).
RESUMABLE = ("tokenizer", "data", "data_kind", "loss_on", "max_len", "eval_fraction", "eval_max", "seed",
             "optimizer", "lr", "weight_decay", "momentum", "schedule", "warmup_steps", "min_lr",
             "grad_accum", "pack_tokens", "packing", "clip", "bucket", "scaler", "f16", "steps", "checkpoint_every",
             "checkpoint_minutes", "keep_checkpoints", "world_size", "sync_dir", "run_id", "sync_timeout",
             "check_loss_drop", "source", "preset", "lora_r", "lora_alpha", "lora_targets", "lora_dropout",
             "lora_target_parameters", "lora_f16_base", "base_dtype", "merge_lora", "train_only", "freeze", "eval_every",
             "save_dtype", "eval_data", "eval_answers", "samples", "distributed", "router_aux_loss_coef",
             "objective", "beta", "loss_type", "label_smoothing", "rewards", "num_generations",
             "max_completion_length", "temperature", "top_p", "epsilon", "epsilon_high", "num_iterations",
             "scale_rewards", "eval_generations", "reference_model")


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
    packing: str                    # "pad", "concat" or "auto" until the device is known (trainer/packing.py)
    replay: int
    recompute_mlp: bool
    checkpoint_layers: int | str    # 0 (off), the first N decoder layers, or "all"
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
    gpu: str | None                 # --gpu: a substring of the GPU adapter's name (LFM2JIT_ADAPTER)
    resume: str | None
    overwrite: bool = False         # --overwrite: a fresh run may clear the run files of another in --out
    lora_r: int | None = None
    lora_alpha: float | None = None
    lora_targets: list[str] | None = None
    lora_dropout: float = 0.0
    router_aux_loss_coef: float = 0.0   # an MoE model's load-balancing loss weight (0: off)
    lora_target_parameters: list[str] | None = None     # an MoE model's expert tensors (PEFT's target_parameters)
    lora_f16_base: bool = False
    base_dtype: str | None = None     # --base-dtype; None: f16 with --lora-f16-base, else f32
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
    objective: str = "sft"            # "sft" (python -m trainer), "dpo" or "grpo" (python -m trainer dpo/grpo)
    beta: float = 0.1                 # DPO's beta, loss type and label smoothing (trainer/dpo.py's DpoConfig);
    loss_type: str = "sigmoid"        # GRPO's beta (default 0) and loss type (default dapo) too
    label_smoothing: float = 0.0
    rewards: list[str] = field(default_factory=lambda: ["exact_match"])   # GRPO: --reward specs (load_reward)
    num_generations: int = 8          # GRPO's settings (trainer/grpo.py's GrpoConfig)
    max_completion_length: int = 512
    temperature: float = 1.0
    top_p: float = 1.0
    epsilon: float = 0.2
    epsilon_high: float | None = None
    num_iterations: int = 1
    scale_rewards: str = "group"
    eval_generations: int = 0         # GRPO: completions sampled per held-out prompt (0: greedy only)
    reference_model: str | None = None   # GRPO: the --model directory the run started from (kept for --resume)
    notes: list[str] = field(default_factory=list)
    derived: set = field(default_factory=set)     # settings left to defaults that follow others

    def saved(self) -> dict:
        """The settings a checkpoint keeps. Defaults derived from other settings (min_lr = lr / 10,
        warmup = 5% of the steps) are kept as None, so they follow an overridden lr or steps."""
        return {k: None if k in self.derived else getattr(self, k) for k in RESUMABLE}


@dataclass
class Data:
    """The run's training and held-out sequences, as trainer/cli/splits.py reads and splits them."""
    train: list            # (input_ids, target_ids, loss_mask) with at least one supervised target; DPO: PreferencePairs;
    eval: list             # (input_ids, target_ids, loss_mask, answer_mask or None); DPO: PreferencePairs; GRPO:
                           # PromptRecords (trainer/grpo.py), both
    sha1: str
    notes: list[str]
    has_answers: bool      # eval holds chat records trained on all tokens: also report the answer loss
    label: str = "all tokens"    # which targets the loss counts, for the summary
    held: int = 0          # held-out records before --eval-max (eval holds the first --eval-max of them)


@dataclass
class Session:
    """Everything a training run builds before its first step (trainer/cli/prepare.py)."""
    run: Run
    tok: Any                 # the tokenizers.Tokenizer of run.tokenizer
    data: Data
    ctx: Any                 # lfm2jit.WgpuContext
    engine: Any              # lfm2jit.ComputeEngine
    model: Any               # lfm2jit.model.Lfm2Model
    trainer: Any             # trainer.Trainer
    out: Path                # the run directory
    position: dict           # the checkpoint's data position (epoch, next, elapsed, tokens, evals), or a fresh one
    ckpt: Path | None        # the checkpoint of --resume
    params: list             # the parameters trained
    model_files: dict = field(default_factory=dict)   # tokenizer etc. beside every model directory (run_dir.model_files)

    def sum_over_ranks(self, values, what: str) -> list[float]:
        """The sums over the ranks of ``values`` (through the gradient sync); this rank's own alone."""
        if self.run.world_size == 1:
            return [float(v) for v in values]
        return self.trainer.distributed_grad_sync.allreduce_sum(values, what)

    def finish_sync(self) -> None:
        """The ranks ended together (done, or stopped after the same step by a signal): the sync's files
        go, so that the same command can run again and --resume finds no earlier run's files."""
        from .. import TrainError
        if self.run.world_size > 1 and hasattr(self.trainer.distributed_grad_sync, "finish"):
            try:
                self.trainer.distributed_grad_sync.finish()
            except TrainError as e:
                print(f"note: {e}", file=sys.stderr)


@dataclass
class History:
    """What the run has measured, its earlier segments (before a --resume) included."""
    start: int                    # the optimizer step this segment started after
    elapsed_before: float         # training seconds of the earlier segments
    metrics_before: list[dict]    # metrics.jsonl lines of the earlier segments
    evals_during: list[dict]      # the --eval-every evaluations (eval.jsonl's lines)
    evals_at_ends: list[dict]     # held-out losses at the segments' starts and ends (kept in checkpoints)
    metrics: list[dict] = field(default_factory=list)     # this segment's metrics.jsonl lines
    eval_before: dict = field(default_factory=dict)       # this segment's first evaluation ({}: no held-out data)

    @property
    def whole(self) -> list[dict]:
        """Every metrics line of the run."""
        return self.metrics_before + self.metrics

    def evals(self) -> list[dict]:
        """Every evaluation of the run, by step."""
        return sorted(self.evals_at_ends + self.evals_during, key=lambda e: e["step"])


def lora_base_dtype(run) -> str:
    """The dtype a LoRA run holds its frozen base's linear weights in (--base-dtype, --lora-f16-base)."""
    if run.lora_r is None:
        return "f32"
    return run.base_dtype or ("f16" if run.lora_f16_base else "f32")
