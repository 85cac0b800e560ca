"""Everything a training run builds before its first step, in order: settings (and the checkpoint
of --resume), tokenizer, the model's config, data, device, model, trainer, restored state, run
directory. Anything the user can fix is a ``UsageError`` raised before the GPU does any work on it."""
from __future__ import annotations

import os
import sys
from pathlib import Path

from ..packing import resolve_mode
from .options import DEMO_PRESET, DEMO_SHAPE
from .resolve import resolve
from .resume import find_checkpoint, read_checkpoint_meta
from .run_dir import check_out, check_sync_dir, clear_out, default_out, model_files
from .splits import load_data
from .state import Data, Run, Session, lora_base_dtype
from .usage import UsageError

FRESH_POSITION = {"epoch": 0, "next": 0, "elapsed": 0.0, "tokens": 0}


def prepare(args, argv_empty: bool) -> Session:
    """The run's ``Session``, from the parsed flags (``argv_empty``: no flags at all were given)."""
    ckpt, meta, run = _settings(args, argv_empty)
    out = _out_dir(run, ckpt)
    check_out(out, run, ckpt)                  # before any work: a fresh run never lands on another run's files
    tok = _tokenizer(run)
    try:                                       # kept for every model directory the run writes
        files = model_files(run.tokenizer, run.model)
    except OSError as e:
        raise UsageError(f"tokenizer: {e}") from None
    cfg = _model_config(run, tok, ckpt)        # before any GPU work, so a vocabulary mismatch is reported first
    data = load_data(run, tok)
    for note in data.notes:
        print(f"note: {note}", file=sys.stderr)
    _resolve_length(run, len(data.train))
    schedule = make_schedule(run, run.steps)
    ctx, engine = _device(run)
    run.packing = resolve_mode(run.packing, ctx)      # "auto": the adapter's; run.json says which ran
    model = _model(run, cfg, ckpt, ctx, engine)
    model.router_aux_loss_coef = run.router_aux_loss_coef     # checked: an MoE model, a finite C >= 0
    params = _attach_lora_and_choose(run, model, ckpt)
    tr = _trainer(run, model, ctx, engine, schedule)
    position = _restore(run, tr, ckpt, meta, schedule, data) if ckpt is not None else dict(FRESH_POSITION)
    if run.world_size > 1:
        if run.distributed == "file":
            check_sync_dir(run, tr.distributed_grad_sync.run_id)
        # every rank agrees on the run (world size, ranks, parameters) before any of them writes a file
        tr.sync_handshake(params)
    removed = clear_out(out, run, ckpt)
    if removed:
        print(f"note: --overwrite: removed the earlier run's {', '.join(removed)} from {out}", file=sys.stderr)
    run.out = str(out)
    return Session(run=run, tok=tok, data=data, ctx=ctx, engine=engine, model=model, trainer=tr, out=out,
                   position=position, ckpt=ckpt, params=params, model_files=files)


def _settings(args, argv_empty: bool) -> tuple[Path | None, dict | None, Run]:
    """The checkpoint of --resume and its trainer.json (or None), and the resolved settings, whose
    notes are printed and whose device choice goes into the environment."""
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
    if run.gpu is not None:
        os.environ["LFM2JIT_ADAPTER"] = run.gpu
    if run.distributed == "mpi" and "LFM2JIT_ADAPTER_INDEX" not in os.environ:
        from ..mpi_sync import local_rank
        os.environ["LFM2JIT_ADAPTER_INDEX"] = str(local_rank())     # one GPU per rank on a multi-GPU host
    return ckpt, meta, run


def _tokenizer(run: Run):
    """The tokenizer of --tokenizer (a tokenizer.json or its directory)."""
    from ..data import load_tokenizer
    try:
        return load_tokenizer(run.tokenizer)
    except (ValueError, FileNotFoundError) as e:
        raise UsageError(f"tokenizer: {e}") from None


def _model_config(run: Run, tok, ckpt: Path | None):
    """The config of the model to train (None for a checkpoint without model/), checked against the
    tokenizer's vocabulary."""
    from lfm2jit.model import ConfigError, Lfm2Config
    from lfm2jit.model.moe_config import read_model_config
    from ..data import BOS_TOKEN, EOS_TOKEN, PAD_TOKEN
    tok_vocab = tok.get_vocab_size(with_added_tokens=True)
    try:
        if ckpt is not None:
            cfg = read_model_config(ckpt / "model" / "config.json") if (ckpt / "model").is_dir() else None
        elif run.source == "model":                   # a dense lfm2 or an lfm2_moe model
            cfg = read_model_config(Path(run.model) / "config.json")
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
    if run.router_aux_loss_coef and cfg is not None and not hasattr(cfg, "num_experts"):
        raise UsageError(f"--router-aux-loss-coef {run.router_aux_loss_coef:g}: the model is a dense LFM2, which has "
                         "no router to balance (an lfm2_moe model has)")
    layers = run.checkpoint_layers
    if cfg is not None and layers != "all" and layers > len(cfg.layer_types):
        raise UsageError(f"--checkpoint-layers {layers}: the model has {len(cfg.layer_types)} decoder layers "
                         f"(--checkpoint-layers all checkpoints every one)")
    return cfg


def _resolve_length(run: Run, n_train: int) -> None:
    """--steps from --epochs (1 by default) and the warmup from the steps, now that the data is known."""
    steps_per_epoch = n_train // (run.world_size * run.grad_accum)
    if steps_per_epoch == 0:
        raise UsageError(f"{n_train} training {'prompt' if run.objective == 'grpo' else 'sequence'}(s) are fewer "
                         f"than one {'generation batch' if run.objective == 'grpo' else 'optimizer step'} needs "
                         f"(--world-size {run.world_size} x --grad-accum {run.grad_accum})")
    if run.objective == "grpo":         # each generation batch makes --num-iterations optimizer steps
        steps_per_epoch *= run.num_iterations
    if run.steps is None:
        run.steps = max(1, round((run.epochs if run.epochs is not None else 1.0) * steps_per_epoch))
    if run.warmup_steps is None:
        run.warmup_steps = 0 if run.schedule == "constant" else round(0.05 * run.steps)


def make_schedule(run: Run, total: int):
    """The learning-rate schedule of --schedule over ``total`` optimizer steps."""
    from ..schedules import ConstantLR, CosineWithWarmup, LinearDecay, LinearWarmup
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


def _device(run: Run):
    """The WebGPU context (the adapter --gpu names, else the best) and its compute engine.

    --f16 and --lora-f16-base on an adapter without the shader-f16 feature are refused here, before
    the engine or the model exists, rather than run in f32: both ask for half the memory, which an
    f32 run would quietly double (and the run's checkpoints would say f16 where it was not)."""
    from lfm2jit import ComputeEngine, WgpuContext
    from lfm2jit.runtime.context import AdapterError
    try:
        ctx = WgpuContext.create()
    except AdapterError as e:
        raise UsageError(str(e)) from None
    if not ctx.has_f16:
        if run.f16:
            raise UsageError(f"--f16 (f16 activations): adapter {ctx.name!r} lacks the shader-f16 feature; "
                             "train without --f16")
        if lora_base_dtype(run) == "f16":
            flag = "--base-dtype f16" if run.base_dtype == "f16" else "--lora-f16-base"
            raise UsageError(f"{flag} (f16 base weights): adapter {ctx.name!r} lacks the shader-f16 "
                             f"feature; train without {flag}")
    return ctx, ComputeEngine(ctx)


def _model(run: Run, cfg, ckpt: Path | None, ctx, engine):
    """The model: the checkpoint's, the --model directory's, or a new one of ``cfg`` seeded by --seed.
    With --lora-f16-base its base is f16 as it is uploaded: it never exists in f32 on the device."""
    from lfm2jit.model import CheckpointError, ConfigError, Lfm2Model
    dtype = "f16" if run.f16 else "f32"
    base = lora_base_dtype(run)
    try:
        if ckpt is not None:
            if cfg is None:
                raise UsageError(f"{ckpt}: no model/ directory")
            return Lfm2Model.from_pretrained(ckpt / "model", ctx, engine, dtype, run.recompute_mlp, base,
                                             run.checkpoint_layers)
        if run.source == "model":
            return Lfm2Model.from_pretrained(run.model, ctx, engine, dtype, run.recompute_mlp, base,
                                             run.checkpoint_layers)
        return Lfm2Model(cfg, ctx, engine, seed=run.seed, activation_dtype=dtype, recompute_mlp=run.recompute_mlp,
                         base_dtype=base, checkpoint_layers=run.checkpoint_layers)
    except (CheckpointError, ConfigError) as e:
        where = ckpt / "model" if ckpt is not None else run.model
        raise UsageError(f"model: {e}" if where is None or str(where) in str(e) else f"model {where}: {e}") from None


def _attach_lora_and_choose(run: Run, model, ckpt: Path | None) -> list:
    """With --lora-r: the checkpoint's adapter (on --resume) or a new one; then the parameters to train."""
    from lfm2jit.model.lora import AdapterError, LoraConfig
    from ..subsets import trainable
    if run.lora_r is not None:
        base = lora_base_dtype(run)
        try:
            if ckpt is not None:
                if not (ckpt / "adapter").is_dir():
                    raise UsageError(f"--resume {ckpt}: the run trains LoRA adapters but the checkpoint has no adapter/")
                model.load_adapter(ckpt / "adapter", base_dtype=base, seed=run.seed)
            else:
                model.add_lora(LoraConfig(r=run.lora_r, alpha=run.lora_alpha, target_modules=tuple(run.lora_targets),
                                          dropout=run.lora_dropout,
                                          target_parameters=tuple(run.lora_target_parameters or ())),
                               seed=run.seed, base_dtype=base)
        except (AdapterError, ValueError) as e:
            raise UsageError(f"LoRA: {e}") from None
    return trainable(model, run.lora_r is not None, run.train_only, run.freeze)


def _trainer(run: Run, model, ctx, engine, schedule):
    """The Trainer the settings describe: optimizer, schedule, clipping, accumulation, loss scaling, sync."""
    from .. import SGD, AdamW, FileGradSyncConfig, GradScaler, Trainer
    opt = (AdamW(lr=run.lr, weight_decay=run.weight_decay) if run.optimizer == "adamw"
           else SGD(lr=run.lr, momentum=run.momentum, weight_decay=run.weight_decay))
    tr = (Trainer(model, opt, ctx, engine).with_length_bucket(run.bucket)
          .with_clip_grad_norm(run.clip if run.clip > 0 else None).with_grad_accum_steps(run.grad_accum)
          .with_replay(run.replay).with_lr_scheduler(schedule).with_packing(run.pack_tokens, run.packing))
    if run.scaler:
        tr.with_grad_scaler(GradScaler())
    if run.world_size > 1 and run.distributed == "mpi":
        tr.with_mpi_grad_sync(timeout_s=run.sync_timeout, run_id=run.run_id)
    elif run.world_size > 1:        # before loading a checkpoint, which renames the sync files of a resumed run
        tr.with_file_grad_sync(FileGradSyncConfig(dir=run.sync_dir, rank=run.rank, world_size=run.world_size,
                                                  timeout_s=run.sync_timeout, run_id=run.run_id))
    return tr


def _restore(run: Run, tr, ckpt: Path, meta: dict, schedule, data: Data) -> dict:
    """Load the checkpoint into the trainer; its data position. Notes say what differs from it."""
    from lfm2jit.model import CheckpointError, ConfigError
    from .. import TrainError
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
    return position


def _out_dir(run: Run, ckpt: Path | None) -> Path:
    """--out, else the run directory the resumed checkpoint lives in, else a new one under runs/."""
    if run.out:
        return Path(run.out)
    if ckpt is not None and ckpt.parent.name == "checkpoints":
        return ckpt.parent.parent
    return default_out(run)
