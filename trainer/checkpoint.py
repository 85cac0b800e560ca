"""Training checkpoints: the model (Hugging Face layout), optimizer state, loss scaler, schedule
position, step counters and data position, written so that a crash never leaves a bad checkpoint.

Layout of a checkpoint directory:
    model/config.json, model/model.safetensors   loadable by transformers' Lfm2ForCausalLM
    adapter/ (with LoRA)                         PEFT's adapter_config.json + adapter_model.safetensors
    optimizer.safetensors                        "<parameter name>::step" -> int64, that parameter's
                                                 update count; "<parameter name>::<buffer>" -> state tensor
    trainer.json                                 counters, hyperparameters, scaler, schedule, data position,
                                                 and the size and CRC-32 of every safetensors file

It is written into a temporary sibling directory ``<name>.tmp-<pid>`` (with whatever ``fill`` adds,
e.g. the tokenizer, and trainer.json last) and renamed into place: a checkpoint is complete before
it is visible. The previous checkpoint is moved aside (``<name>.old-<pid>``) first and removed last,
and loading falls back to it if the swap was interrupted. Leftovers of killed processes (a dead
pid's ``.tmp-`` directory; its ``.old-`` one, renamed back into place when it is the only copy)
are cleaned up at the next save into the same parent directory.

Loading checks everything it reads (trainer.json's keys and types, the model's config.json against
the trainer's model, every safetensors header and offset against its file, the optimizer state's
names, buffers and shapes against the model, the schedule and scaler, the recorded checksums)
before it changes anything: a bad checkpoint raises a TrainError naming the file, the key and what
was expected, and leaves weights, optimizer state and counters as they were.
"""
from __future__ import annotations

import glob
import json
import math
import os
import re
import shutil
import zlib
from pathlib import Path
from typing import Callable

import numpy as np
from safetensors.numpy import save_file

from lfm2jit.safefiles import replace_with

from .errors import TrainError
from .schedules import schedule_from_dict

FORMAT = 2      # 2: a step count per parameter; 1 kept only the trainer's step (read as every parameter's)
CHECKSUMMED = ("model/model.safetensors", "optimizer.safetensors", "adapter/adapter_model.safetensors")
_ENTRIES = {"model", "adapter", "optimizer.safetensors", "trainer.json"}   # what a checkpoint directory holds
_ASIDE = re.compile(r"^(?P<name>.+)\.(?P<kind>tmp|old)-(?P<pid>\d+)$")


# ---- saving ----
def save_checkpoint(trainer, directory, data_position: dict | None = None,
                    fill: Callable[[Path], None] | None = None) -> Path:
    """Write a checkpoint atomically. ``fill(tmp_dir)``, if given, runs after the model and the
    optimizer state are written into the temporary directory and before trainer.json: what it adds
    there (the tokenizer beside the weights, say) is in the checkpoint when it appears."""
    if trainer.step_in_accum:
        raise TrainError(f"cannot checkpoint in the middle of an accumulation window "
                         f"({trainer.step_in_accum} of {trainer.grad_accum_steps} sequences done)")
    final = Path(directory)
    if final.exists() and not (final / "trainer.json").is_file() and not (final.is_dir() and not any(final.iterdir())):
        raise TrainError(f"{final} exists and is not a checkpoint (no trainer.json); refusing to replace it")
    final.parent.mkdir(parents=True, exist_ok=True)
    clean_stale(final.parent)
    tmp = final.with_name(f"{final.name}.tmp-{os.getpid()}")
    if tmp.exists():
        shutil.rmtree(tmp)
    trainer.model.save_pretrained(tmp / "model")
    if getattr(trainer.model, "lora", None) is not None:
        trainer.model.save_adapter(tmp / "adapter")
    names = {id(t): n for n, t in trainer.model.named_parameters().items()}
    state = trainer.optimizer.state_arrays(names)     # a full disk: an OSError naming the file, not a SafetensorError
    replace_with(tmp / "optimizer.safetensors", lambda name: save_file(state, name))
    if fill is not None:
        fill(tmp)
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
        "files": {rel: _sums((tmp / rel).read_bytes()) for rel in CHECKSUMMED if (tmp / rel).is_file()},
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


def _sums(raw: bytes) -> dict:
    return {"bytes": len(raw), "crc32": f"{zlib.crc32(raw):08x}"}


def _pid_alive(pid: int) -> bool:
    if pid == os.getpid():
        return True
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except (PermissionError, OSError, OverflowError):
        return True           # another user's process, or not ours to judge: leave its files alone
    return True


def clean_stale(parent: Path) -> list[str]:
    """Remove what saves killed midway left in ``parent``: ``<name>.tmp-<pid>`` directories, and
    ``<name>.old-<pid>`` ones beside a complete ``<name>`` (an ``.old-`` one that is the only copy
    is renamed back to ``<name>``), for pids that no longer run, and only directories that hold
    nothing but checkpoint files. Returns what it did, one line each."""
    done = []
    try:
        entries = list(Path(parent).iterdir())
    except OSError:
        return done
    for d in sorted(entries):
        m = _ASIDE.match(d.name)
        if not m or not d.is_dir() or d.is_symlink() or _pid_alive(int(m.group("pid"))):
            continue
        try:
            if not all(e.name in _ENTRIES or e.name.startswith(".tmp") for e in d.iterdir()):
                continue          # not a checkpoint's: not ours to remove (.tmp*: a file save_file was writing)
            target = d.with_name(m.group("name"))
            if m.group("kind") == "old" and is_complete(d) and not target.exists():
                d.rename(target)
                done.append(f"restored {target} from {d.name}")
                continue
            shutil.rmtree(d)
            done.append(f"removed {d}")
        except OSError:
            continue
    return done


# ---- reading and checking ----
def _got(v) -> str:
    kind = {str: "a string", list: "a list", dict: "an object", bool: "a boolean", type(None): "null",
            int: "an integer", float: "a number"}.get(type(v), type(v).__name__)
    text = repr(v)
    return f"{kind} {text if len(text) <= 60 else text[:57] + '...'}" if v is not None else kind


def _is_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_real(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


# key -> (check, what it must be); every key is required
_META = {
    "format": (lambda v: v in (1, FORMAT) and _is_int(v), f"{FORMAT} (or 1)"),
    "optimizer_steps": (lambda v: _is_int(v) and v >= 0, "an integer >= 0"),
    "optimizer": (lambda v: isinstance(v, dict) and isinstance(v.get("type"), str),
                  'an object with the optimizer\'s "type" (e.g. "AdamW")'),
    "grad_accum_steps": (lambda v: _is_int(v) and v >= 1, "an integer >= 1"),
    "clip_grad_norm": (lambda v: v is None or (_is_real(v) and v > 0), "null or a positive number"),
    "length_bucket": (lambda v: _is_int(v) and v >= 1, "an integer >= 1"),
    "scaler": (lambda v: v is None or isinstance(v, dict), "null or an object (the loss scaler's state)"),
    "lr_scheduler": (lambda v: v is None or isinstance(v, dict), "null or an object (the schedule's description)"),
    "data_position": (lambda v: isinstance(v, dict), "an object"),
}
_OPTIONAL = {"files": (lambda v: isinstance(v, dict), "an object of file -> {bytes, crc32}")}


def read_meta(path: Path) -> dict:
    """trainer.json, every key checked: a TrainError names the file, the key and what was expected."""
    try:
        meta = json.loads(Path(path).read_text())
    except FileNotFoundError:
        raise TrainError(f"no checkpoint at {Path(path).parent} (trainer.json missing)") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise TrainError(f"{path}: not valid JSON ({e})") from None
    except OSError as e:
        raise TrainError(f"{path}: cannot be read ({e.strerror or e})") from None
    if not isinstance(meta, dict):
        raise TrainError(f"{path}: expected a JSON object of checkpoint settings, got {_got(meta)}")
    if "format" in meta and meta["format"] not in (1, FORMAT):
        raise TrainError(f"{path}: checkpoint format {meta['format']!r}, expected {FORMAT} (or 1)")
    missing = [k for k in _META if k not in meta]
    if missing:
        raise TrainError(f"{path}: missing key(s) {', '.join(map(repr, missing))} (expected "
                         + "; ".join(f"{k}: {_META[k][1]}" for k in missing) + ")")
    unknown = sorted(set(meta) - set(_META) - set(_OPTIONAL))
    if unknown:
        raise TrainError(f"{path}: unknown key(s) {', '.join(map(repr, unknown))}; expected "
                         f"{', '.join([*_META, *_OPTIONAL])}")
    for key, (ok, what) in {**_META, **_OPTIONAL}.items():
        if key in meta and not ok(meta[key]):
            raise TrainError(f"{path}: key {key!r} must be {what}, got {_got(meta[key])}")
    for rel, rec in meta.get("files", {}).items():
        if (rel not in CHECKSUMMED or not isinstance(rec, dict) or set(rec) != {"bytes", "crc32"}
                or not _is_int(rec["bytes"]) or rec["bytes"] < 0 or not isinstance(rec["crc32"], str)
                or not re.fullmatch(r"[0-9a-f]{8}", rec["crc32"])):
            raise TrainError(f"{path}: key 'files': entry {rel!r}: {_got(rec)}; expected one of "
                             f"{', '.join(CHECKSUMMED)} -> {{\"bytes\": size, \"crc32\": 8 hex digits}}")
    return meta


def _check_scaler(path: Path, state) -> None:
    if state is None:
        return
    from .scaler import GradScaler
    if not (_is_real(state.get("scale")) and state["scale"] > 0):
        raise TrainError(f"{path}: key 'scaler.scale' must be a positive finite number, got {_got(state.get('scale'))}")
    if not (_is_int(state.get("growth_tracker")) and state["growth_tracker"] >= 0):
        raise TrainError(f"{path}: key 'scaler.growth_tracker' must be an integer >= 0, "
                         f"got {_got(state.get('growth_tracker'))}")
    import dataclasses
    fields = {f.name for f in dataclasses.fields(GradScaler)}
    unknown = sorted(set(state) - fields - {"scale", "growth_tracker"})
    if unknown:
        raise TrainError(f"{path}: key 'scaler' has unknown entries {unknown}; expected "
                         f"{sorted(fields | {'scale', 'growth_tracker'})}")
    try:
        GradScaler(**{k: v for k, v in state.items() if k in fields})
    except (TypeError, ValueError) as e:
        raise TrainError(f"{path}: key 'scaler': {e}") from None


def _check_schedule(path: Path, desc, steps: int):
    if desc is None:
        return None
    try:
        sched = schedule_from_dict(desc)
        sched.lr_at(steps + 1)
    except (TypeError, ValueError, ArithmeticError) as e:
        raise TrainError(f"{path}: key 'lr_scheduler': {e}") from None
    return sched


def _check_config(src: Path, model_cfg) -> None:
    from lfm2jit.model import ConfigError
    from lfm2jit.model.moe_config import read_model_config
    try:
        cfg = read_model_config(src / "model" / "config.json")
    except ConfigError as e:
        raise TrainError(str(e)) from None
    ours, theirs = model_cfg.to_dict(), cfg.to_dict()
    differ = [k for k in ours if k != "initializer_range" and ours[k] != theirs.get(k)]
    if differ:
        raise TrainError(f"{src / 'model' / 'config.json'} describes another model than the trainer's: "
                         + ", ".join(f"{k} {theirs.get(k)!r} (the model has {ours[k]!r})" for k in differ[:4])
                         + (f" and {len(differ) - 4} more" if len(differ) > 4 else ""))


def _read_weights(src: Path, cfg) -> tuple[dict[str, np.ndarray], dict[str, bytes]]:
    from lfm2jit.model.checkpoint import CheckpointError, load_checkpoint as load_weights, read_file_bytes, read_safetensors
    from lfm2jit.model.moe_checkpoint import check_model_tensors
    model_dir, raw = src / "model", {}
    try:
        if (model_dir / "model.safetensors").is_file() or not (model_dir / "model.safetensors.index.json").exists():
            path = model_dir / "model.safetensors"
            raw["model/model.safetensors"] = read_file_bytes(path)
            tensors = read_safetensors(path, raw=raw["model/model.safetensors"])
        else:
            path = model_dir
            tensors = load_weights(model_dir)
        return check_model_tensors(cfg, tensors), raw
    except CheckpointError as e:
        text = str(e)
        raise TrainError(text if str(model_dir) in text else f"{path}: {text}") from None


def _read_optimizer_state(src: Path, meta: dict, optimizer, params: dict) -> tuple[dict[str, np.ndarray], bytes]:
    """optimizer.safetensors, checked as Optimizer.load_state_arrays checks it (so that applying it
    cannot fail), and refused when it names parameters this model does not have."""
    from lfm2jit.model.checkpoint import CheckpointError, read_file_bytes, read_safetensors_raw
    path = src / "optimizer.safetensors"
    try:
        raw = read_file_bytes(path)
        stored = read_safetensors_raw(path, ("F32", "F16", "BF16", "F64", "I64", "I32"), raw)
    except CheckpointError as e:
        raise TrainError(str(e)) from None
    state = {}
    for key, arr in stored.items():
        if arr.dtype == np.uint16:                                   # BF16
            arr = (arr.astype(np.uint32) << 16).view(np.float32)
        state[key] = arr
    if meta["format"] == 1:       # one global step: every parameter with state had taken all of them
        for name in {key.rpartition("::")[0] for key in state}:
            state[f"{name}::step"] = np.array(meta["optimizer_steps"], np.int64)
    names = {key.rpartition("::")[0] for key in state}
    unknown = sorted(n for n in names if n not in params)
    if unknown:
        first = next(k for k in sorted(state) if k.rpartition("::")[0] == unknown[0])
        lacking = [n for n in params if n not in names]
        raise TrainError(f"{path}: optimizer state {first!r} names no parameter of this model: state of another "
                         f"model? Refusing partial optimizer state. Unknown: {_few(unknown)}"
                         + (f"; the model's parameters without state: {_few(lacking)}" if lacking else ""))
    try:
        optimizer.check_state_arrays(params, state)
    except ValueError as e:
        raise TrainError(f"{path}: {e}") from None
    return state, raw


def _few(names: list[str], k: int = 4) -> str:
    return ", ".join(names[:k]) + (f" and {len(names) - k} more" if len(names) > k else "")


def _check_sums(src: Path, meta: dict, raw: dict[str, bytes]) -> None:
    for rel, want in meta.get("files", {}).items():
        path = src / rel
        data = raw.get(rel)
        if data is None:
            if not path.is_file():
                raise TrainError(f"{path}: missing (trainer.json records it)")
            data = path.read_bytes()
        got = _sums(data)
        if got != want:
            raise TrainError(f"{path}: {got['bytes']} bytes with CRC-32 {got['crc32']}, but trainer.json records "
                             f"{want['bytes']} bytes with CRC-32 {want['crc32']}: the file was damaged or replaced "
                             "after the checkpoint was written")


def is_complete(d: Path) -> bool:
    """Whether ``d`` holds every file of a checkpoint (not, say, a half-removed ``.old-`` copy)."""
    m = d / "model"
    return ((d / "trainer.json").is_file() and (d / "optimizer.safetensors").is_file()
            and (m / "config.json").is_file()
            and ((m / "model.safetensors").is_file() or (m / "model.safetensors.index.json").is_file()))


def aside_copy(directory: Path) -> Path | None:
    """The newest complete ``<directory>.old-<pid>``: the previous checkpoint, moved aside by a save
    that was killed before it renamed the new one into place."""
    found = [d for d in directory.parent.glob(f"{glob.escape(directory.name)}.old-*") if is_complete(d)]
    return max(found, key=lambda d: (d / "trainer.json").stat().st_mtime) if found else None


def _resolve(directory: Path) -> Path:
    if (directory / "trainer.json").exists():
        return directory
    aside = aside_copy(directory)
    if aside is not None:
        return aside              # a save was interrupted between moving the old one aside and renaming
    raise TrainError(f"no checkpoint at {directory} (trainer.json missing)")


def load_checkpoint(trainer, directory) -> dict:
    """Restore weights, optimizer state, scaler, schedule and counters; returns the data position.
    Everything is read and checked first: on any error nothing has changed."""
    src = _resolve(Path(directory))
    meta_path = src / "trainer.json"
    meta = read_meta(meta_path)
    if meta["optimizer"]["type"] != trainer.optimizer.kind:
        raise TrainError(f"{meta_path}: key 'optimizer.type': the checkpoint holds {meta['optimizer']['type']} state "
                         f"but the trainer uses {trainer.optimizer.kind}")
    steps = meta["optimizer_steps"]
    _check_scaler(meta_path, meta["scaler"])
    schedule = _check_schedule(meta_path, meta["lr_scheduler"], steps)
    _check_config(src, trainer.model.cfg)
    tensors, raw = _read_weights(src, trainer.model.cfg)
    params = trainer.model.named_parameters()
    state, raw["optimizer.safetensors"] = _read_optimizer_state(src, meta, trainer.optimizer, params)
    if meta["format"] >= 2:
        _check_sums(src, meta, raw)

    # everything is checked: apply (the optimizer's own check runs again and cannot fail now)
    try:
        trainer.optimizer.load_state_arrays(trainer.engine, params, state)
    except ValueError as e:
        raise TrainError(f"{src / 'optimizer.safetensors'}: {e}") from None
    trainer.model.load_state(tensors)
    trainer.recorded.clear()          # recorded optimizer steps bound the replaced state buffers
    trainer.set_optimizer_steps(steps)
    if trainer.distributed_grad_sync is not None:
        # a resumed run syncs under its own name, so files a crashed run left behind are never read
        trainer.distributed_grad_sync.resume_from(steps)
    trainer.step_in_accum = 0
    if meta["scaler"] is not None and trainer.scaler is not None:
        trainer.scaler.load_state_dict(meta["scaler"])
    if schedule is not None and trainer.lr_scheduler is None:
        trainer.lr_scheduler = schedule
    return meta["data_position"]
