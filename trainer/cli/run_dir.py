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


def copy_model_files(tokenizer: str, model_dir: Path, source_model: str | None = None) -> None:
    """Make ``model_dir`` (weights and config.json written) a complete Hugging Face directory: the
    tokenizer and its config, chat template and generation config, from the input model's directory
    (fine-tuning) or beside the tokenizer; without a generation config there, one is written from
    config.json with the tokenizer's end of turn (<|im_end|>) as a stop id too, so transformers'
    ``generate`` stops at the end of an answer."""
    src = Path(tokenizer)
    src = src / "tokenizer.json" if src.is_dir() else src
    try:
        shutil.copyfile(src, model_dir / "tokenizer.json")
        for directory in [d for d in (Path(source_model) if source_model else None, src.parent) if d is not None]:
            for name in MODEL_FILES[1:]:
                if (directory / name).is_file() and not (model_dir / name).exists():
                    shutil.copyfile(directory / name, model_dir / name)
        if not (model_dir / "generation_config.json").exists():
            (model_dir / "generation_config.json").write_text(json.dumps(generation_config(model_dir), indent=2))
    except OSError as e:
        print(f"note: could not complete the model directory {model_dir}: {e}", file=sys.stderr)


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


def default_out(run: Run) -> Path:
    if run.world_size > 1:
        return Path("runs") / run.run_id
    base = Path("runs") / time.strftime("%Y%m%d-%H%M%S")
    out, i = base, 1
    while out.exists():
        out, i = base.with_name(f"{base.name}-{i}"), i + 1
    return out


def write_final_model(run: Run, model, out: Path) -> str:
    """The run's result beside its checkpoints: OUT/model, in --save-dtype (merged, with --merge-lora),
    or OUT/adapter for LoRA without merging; the line that says where. Merging changes the model in
    place, so it happens after the last checkpoint was written."""
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
