"""Training checkpoints: the model (Hugging Face layout), optimizer state, loss scaler, schedule
position, step counters and data position, written so that a crash never leaves a bad checkpoint.

Layout of a checkpoint directory:
    model/config.json, model/model.safetensors   loadable by transformers' Lfm2ForCausalLM
    adapter/ (with LoRA)                         PEFT's adapter_config.json + adapter_model.safetensors
    optimizer.safetensors                        "<parameter name>::step" -> int64, that parameter's
                                                 update count; "<parameter name>::<buffer>" -> state tensor
    trainer.json                                 counters, hyperparameters, scaler, schedule, data position

It is written into a temporary sibling directory and renamed into place; the previous checkpoint
is moved aside first and removed last, and loading falls back to it if the swap was interrupted.
"""
from __future__ import annotations

import glob
import json
import os
import shutil
from pathlib import Path

import numpy as np
from safetensors.numpy import load_file, save_file

from .errors import TrainError
from .schedules import schedule_from_dict

FORMAT = 2      # 2: a step count per parameter; 1 kept only the trainer's step (read as every parameter's)


def save_checkpoint(trainer, directory, data_position: dict | None = None) -> Path:
    if trainer.step_in_accum:
        raise TrainError(f"cannot checkpoint in the middle of an accumulation window "
                         f"({trainer.step_in_accum} of {trainer.grad_accum_steps} sequences done)")
    final = Path(directory)
    if final.exists() and not (final / "trainer.json").is_file() and not (final.is_dir() and not any(final.iterdir())):
        raise TrainError(f"{final} exists and is not a checkpoint (no trainer.json); refusing to replace it")
    final.parent.mkdir(parents=True, exist_ok=True)
    tmp = final.with_name(f"{final.name}.tmp-{os.getpid()}")
    if tmp.exists():
        shutil.rmtree(tmp)
    trainer.model.save_pretrained(tmp / "model")
    if getattr(trainer.model, "lora", None) is not None:
        trainer.model.save_adapter(tmp / "adapter")
    names = {id(t): n for n, t in trainer.model.named_parameters().items()}
    save_file(trainer.optimizer.state_arrays(names), str(tmp / "optimizer.safetensors"))
    meta = {
        "format": FORMAT,
        "optimizer_steps": trainer.optimizer_steps(),
        "optimizer": {"type": trainer.optimizer.kind, **trainer.optimizer.hyperparameters()},
        "grad_accum_steps": trainer.grad_accum_steps,
        "clip_grad_norm": trainer.clip_grad_norm,
        "length_bucket": trainer.length_bucket,
        "scaler": trainer.scaler.state_dict() if trainer.scaler is not None else None,
        "lr_scheduler": trainer.lr_scheduler.to_dict() if trainer.lr_scheduler is not None else None,
        "data_position": data_position or {},
    }
    (tmp / "trainer.json").write_text(json.dumps(meta, indent=2))
    old = final.with_name(f"{final.name}.old-{os.getpid()}")
    if final.exists():
        if old.exists():      # a save of an earlier process with this pid was killed while removing it
            shutil.rmtree(old)
        final.rename(old)
    tmp.rename(final)
    for aside in final.parent.glob(f"{glob.escape(final.name)}.old-*"):   # ours, and any a killed save left
        shutil.rmtree(aside, ignore_errors=True)
    return final


def _resolve(directory: Path) -> Path:
    if (directory / "trainer.json").exists():
        return directory
    aside = sorted(directory.parent.glob(f"{directory.name}.old-*"), key=lambda p: p.stat().st_mtime)
    if aside and (aside[-1] / "trainer.json").exists():
        return aside[-1]          # a save was interrupted between moving the old one aside and renaming
    raise TrainError(f"no checkpoint at {directory} (trainer.json missing)")


def load_checkpoint(trainer, directory) -> dict:
    """Restore weights, optimizer state, scaler, schedule and counters; returns the data position."""
    src = _resolve(Path(directory))
    meta = json.loads((src / "trainer.json").read_text())
    if meta.get("format") not in (1, FORMAT):
        raise TrainError(f"{src}: checkpoint format {meta.get('format')!r}, expected {FORMAT} (or 1)")
    if meta["optimizer"]["type"] != trainer.optimizer.kind:
        raise TrainError(f"{src} holds {meta['optimizer']['type']} state but the trainer uses {trainer.optimizer.kind}")
    from lfm2jit.model.checkpoint import load_checkpoint as load_weights
    trainer.model.load_state(load_weights(src / "model"))
    state = load_file(str(src / "optimizer.safetensors"))
    if meta["format"] == 1:       # one global step: every parameter with state had taken all of them
        for name in {key.rpartition("::")[0] for key in state}:
            state[f"{name}::step"] = np.array(meta["optimizer_steps"], np.int64)
    try:
        trainer.optimizer.load_state_arrays(trainer.engine, trainer.model.named_parameters(), state)
    except ValueError as e:
        raise TrainError(f"{src / 'optimizer.safetensors'}: {e}") from None
    trainer.recorded.clear()          # recorded optimizer steps bound the replaced state buffers
    trainer.set_optimizer_steps(int(meta["optimizer_steps"]))
    if trainer.distributed_grad_sync is not None:
        # a resumed run syncs under its own name, so files a crashed run left behind are never read
        trainer.distributed_grad_sync.resume_from(int(meta["optimizer_steps"]))
    trainer.step_in_accum = 0
    if meta["scaler"] is not None and trainer.scaler is not None:
        trainer.scaler.load_state_dict(meta["scaler"])
    if meta["lr_scheduler"] is not None and trainer.lr_scheduler is None:
        trainer.lr_scheduler = schedule_from_dict(meta["lr_scheduler"])
    return meta.get("data_position", {})
