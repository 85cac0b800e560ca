"""The files of a run directory: where each lives (``RunFiles``), metrics lines, the model files
completing a Hugging Face directory (a checkpoint's model/ and the final model), and the check that a
sync directory holds no stale gradient files of the same run id."""
from __future__ import annotations

import json
import math
import re
import shutil
import sys
import time
from pathlib import Path

from .state import Run
from .usage import UsageError


class RunFiles:
    """Where a rank's files go: rank 0's at the top of the run directory, rank r's in rank<r>/; the
    checkpoints (rank 0 writes them) in checkpoints/."""

    def __init__(self, out: Path, rank: int):
        self.dir = out if rank == 0 else out / f"rank{rank}"
        self.checkpoints = out / "checkpoints"
        self.settings = self.dir / "run.json"
        self.metrics = self.dir / "metrics.jsonl"
        self.evals = self.dir / "eval.jsonl"
        self.samples = self.dir / "samples.jsonl"
        self.plot = self.dir / "loss.png"
        self.summary = self.dir / "summary.json"

    def rewind(self, start: int) -> tuple[list[dict], list[dict]]:
        """The metrics and the evaluations of the run's steps up to ``start`` (none for a fresh run),
        with metrics.jsonl and eval.jsonl rewritten to hold only them: lines past the checkpoint are
        from a run that died later. A fresh run's samples.jsonl goes."""
        metrics = [m for m in read_metrics(self.metrics) if m.get("step", 0) <= start] if start else []
        evals = [e for e in read_metrics(self.evals) if 0 < e.get("step", 0) <= start] if start else []
        for path, lines in ((self.metrics, metrics), (self.evals, evals)):
            if path == self.evals and not lines:     # written by the first evaluation of --eval-every, if any
                path.unlink(missing_ok=True)
                continue
            with open(path, "w") as f:
                f.writelines(json.dumps(x) + "\n" for x in lines)
        if not start:
            self.samples.unlink(missing_ok=True)
        return metrics, evals


# The files beside a Hugging Face model's weights that tell transformers how to tokenize, chat and stop.
MODEL_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja",
               "generation_config.json")


def model_files(tokenizer: str, source_model: str | None = None) -> dict[str, bytes]:
    """The files that complete a Hugging Face directory beside its weights and config.json, read once
    at the start of a run (so that no later write depends on a checkpoint that pruning can remove):
    the tokenizer, and its config, the chat template and the generation config from the input model's
    directory (fine-tuning) or beside the tokenizer. Raises OSError naming a file that does not read."""
    src = Path(tokenizer)
    src = src / "tokenizer.json" if src.is_dir() else src
    files = {"tokenizer.json": src.read_bytes()}
    for directory in [d for d in (Path(source_model) if source_model else None, src.parent) if d is not None]:
        for name in MODEL_FILES[1:]:
            if name not in files and (directory / name).is_file():
                files[name] = (directory / name).read_bytes()
    return files


def write_model_files(files: dict[str, bytes], model_dir: Path) -> None:
    """Make ``model_dir`` (weights and config.json written) a complete Hugging Face directory from
    ``files`` (``model_files``); without a generation config among them, one is written from
    config.json with the tokenizer's end of turn (<|im_end|>) as a stop id too, so transformers'
    ``generate`` stops at the end of an answer. Raises OSError."""
    for name, raw in files.items():
        if name == "tokenizer.json" or not (model_dir / name).exists():
            (model_dir / name).write_bytes(raw)
    if not (model_dir / "generation_config.json").exists():
        (model_dir / "generation_config.json").write_text(json.dumps(generation_config(model_dir), indent=2))


def copy_model_files(tokenizer: str, model_dir: Path, source_model: str | None = None) -> None:
    """``write_model_files`` of the files ``model_files`` reads now."""
    write_model_files(model_files(tokenizer, source_model), model_dir)


def generation_config(model_dir: Path) -> dict:
    """bos, pad and the stop ids: config.json's eos_token_id, and <|im_end|> where the tokenizer has it."""
    from tokenizers import Tokenizer
    cfg = json.loads((model_dir / "config.json").read_text())
    eos = cfg.get("eos_token_id")
    stops = list(eos) if isinstance(eos, list) else [eos] if eos is not None else []
    im_end = Tokenizer.from_file(str(model_dir / "tokenizer.json")).token_to_id("<|im_end|>")
    if im_end is not None and im_end not in stops:
        stops.append(im_end)
    out = {"bos_token_id": cfg.get("bos_token_id"), "pad_token_id": cfg.get("pad_token_id"),
           "eos_token_id": stops[0] if len(stops) == 1 else stops}
    return {k: v for k, v in out.items() if v is not None}


def clean(v):
    """A metrics value as JSON can hold it: non-finite floats become null."""
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


# What a run writes in its directory (RunFiles, a DPO run's reference log-probs, the final model or adapter and what a killed write of
# them leaves, the reporters' files, the other ranks' directories): a directory holding any of these
# holds another run, whose files a fresh run would overwrite or mix its own with.
_RUN_ENTRY = re.compile(r"^(?:run\.json|metrics\.jsonl|eval\.jsonl|samples\.jsonl|loss\.png|summary\.json|reference_logps\.npz|checkpoints"
                        r"|(?:model|adapter)(?:\.(?:tmp|old)-\d+)?|tensorboard|wandb|mlflow\.db|mlruns|rank\d+)$")
_CHECKPOINT_ENTRY = re.compile(r"^step-\d+(?:\.(?:tmp|old)-\d+)?$")


def _foreign(out: Path) -> list[str]:
    """What in ``out`` no run writes (checkpoints/ and the rank directories looked into as well)."""
    found = [e.name for e in out.iterdir() if not _RUN_ENTRY.match(e.name)]
    for e in out.iterdir():
        if e.name == "checkpoints" and e.is_dir():
            found += [f"checkpoints/{c.name}" for c in e.iterdir() if not _CHECKPOINT_ENTRY.match(c.name)]
        elif re.match(r"^rank\d+$", e.name) and e.is_dir():
            found += [f"{e.name}/{c.name}" for c in e.iterdir() if not _RUN_ENTRY.match(c.name) or c.name.startswith("rank")]
        elif re.match(r"^rank\d+$", e.name) or (e.name == "checkpoints" and not e.is_dir()):
            found.append(e.name)
    return sorted(found)


def check_out(out: Path, run: Run, ckpt: Path | None) -> None:
    """Refuse an ``out`` that holds another run (any file or directory a run writes there), unless the
    run continues there (--resume of a checkpoint in out/checkpoints) or --overwrite is given and ``out``
    holds nothing but a run's files, which ``clear_out`` then removes. Every rank decides the same: they
    all look before the sync handshake, and no rank writes a file before it."""
    resumed_here = (ckpt is not None and ckpt.parent.name == "checkpoints"
                    and ckpt.parent.parent.resolve() == out.resolve())
    if resumed_here:
        if run.overwrite:
            raise UsageError(f"--overwrite would remove the run in {out} that --resume continues: leave "
                             "--overwrite out to continue it, or give another --out")
        return
    if not out.exists():
        return
    if not out.is_dir():
        raise UsageError(f"--out {out}: exists and is not a directory")
    entries = sorted(e.name for e in out.iterdir() if _RUN_ENTRY.match(e.name))
    if not entries:
        return
    if not run.overwrite:
        listed = ", ".join(entries[:3]) + (", ..." if len(entries) > 3 else "")
        raise UsageError(f"--out {out} holds another run ({listed}): continue it with --resume {out}, choose "
                         "another --out, or pass --overwrite to remove that run's files first")
    foreign = _foreign(out)
    if foreign:
        listed = ", ".join(foreign[:3]) + (", ..." if len(foreign) > 3 else "")
        raise UsageError(f"--overwrite: --out {out} also holds files no run writes ({listed}); refusing to "
                         "clear it: move them away or choose another --out")


def clear_out(out: Path, run: Run, ckpt: Path | None) -> list[str]:
    """With --overwrite (``check_out`` passed), remove the earlier run's files from ``out``: rank 0 the top
    level's (and the directories of ranks this run does not have), rank r its own rank<r>/. After the
    sync handshake, so that every rank has looked first. The names removed."""
    if not run.overwrite or not out.is_dir() or (ckpt is not None and ckpt.parent.name == "checkpoints"
                                                 and ckpt.parent.parent.resolve() == out.resolve()):
        return []
    if run.rank == 0:
        mine = [e for e in out.iterdir() if _RUN_ENTRY.match(e.name)
                and not (re.match(r"^rank(\d+)$", e.name) and 0 < int(e.name[4:]) < run.world_size)]
    else:
        mine = [e for e in out.iterdir() if e.name == f"rank{run.rank}"]
    for e in sorted(mine):
        if e.is_dir() and not e.is_symlink():
            shutil.rmtree(e)
        else:
            e.unlink()
    return sorted(e.name for e in mine)


def default_out(run: Run) -> Path:
    if run.world_size > 1:
        return Path("runs") / run.run_id
    base = Path("runs") / time.strftime("%Y%m%d-%H%M%S")
    out, i = base, 1
    while out.exists():
        out, i = base.with_name(f"{base.name}-{i}"), i + 1
    return out


def _write_atomically(final: Path, fill) -> bool:
    """Write a directory whole or not at all: ``fill(tmp)`` writes ``final.tmp-<pid>``, which then
    replaces ``final`` (moved aside first, removed after). A failure is said in one line, the previous
    ``final`` (if any) left as it was; whether it was written."""
    import os
    tmp = final.with_name(f"{final.name}.tmp-{os.getpid()}")
    old = final.with_name(f"{final.name}.old-{os.getpid()}")
    try:
        for d in (tmp, old):
            if d.exists():
                shutil.rmtree(d)
        fill(tmp)
        if final.exists():
            final.rename(old)
        tmp.rename(final)
        shutil.rmtree(old, ignore_errors=True)
        return True
    except OSError as e:
        shutil.rmtree(tmp, ignore_errors=True)
        if old.exists() and not final.exists():
            old.rename(final)
        print(f"error: could not write {final}: {e}; the run's checkpoints hold its weights", file=sys.stderr)
        return False


def write_final_model(run: Run, model, out: Path, files: dict[str, bytes]) -> str:
    """The run's result beside its checkpoints: OUT/model, in --save-dtype (merged, with --merge-lora),
    with ``files`` (``model_files``, read at the start) beside the weights, or OUT/adapter for LoRA
    without merging, each written whole or not at all; the line that says where. Merging changes the
    model in place, so it happens after the last checkpoint was written."""
    if run.lora_r is None or run.merge_lora:
        if run.lora_r is not None:
            model.merge_lora()
        dtype = _save_dtype(run)

        def fill(tmp: Path) -> None:
            model.save_pretrained(tmp, dtype)
            write_model_files(files, tmp)
        what = "merged model" if run.lora_r is not None else "model"
        if not _write_atomically(out / "model", fill):
            return f"{what}: not written"
        return f"{what} ({dtype}): {(out / 'model').resolve()} (transformers' Lfm2ForCausalLM loads it)"
    if not _write_atomically(out / "adapter", lambda tmp: model.save_adapter(tmp, base_model=run.model)):
        return "LoRA adapter: not written"
    return (f"LoRA adapter: {(out / 'adapter').resolve()} (PeftModel.from_pretrained(base, dir) loads it"
            + (f" on {run.model})" if run.model else ")"))


def _save_dtype(run: Run) -> str:
    if run.save_dtype is not None:
        return run.save_dtype
    if run.source == "model" and run.model is not None and Path(run.model).is_dir():   # None: a resumed run
        from lfm2jit.model.checkpoint import stored_dtype
        return stored_dtype(Path(run.model))
    return "f32"
