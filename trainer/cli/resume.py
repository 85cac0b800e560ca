"""What --resume reads: the checkpoint a path names (a run directory's newest, or the copy an
interrupted save left aside) and its trainer.json, every key of the run's settings and data
position checked, so that a bad checkpoint is a one-line UsageError."""
from __future__ import annotations

import math
import re
import sys
from pathlib import Path

from .state import Run
from .usage import UsageError

_STEP_DIR = re.compile(r"^step-(\d+)(?:\.old-\d+)?$")


def _problem(d: Path) -> str | None:
    """Which file of a checkpoint ``d`` lacks ("<path> is missing"), or None when it has them all. A
    file present but damaged is not looked into here: loading checks every one, and refuses it by name."""
    m = d / "model"
    for f in (d / "trainer.json", d / "optimizer.safetensors", m / "config.json"):
        if not f.is_file():
            return f"{f} is missing"
    if not (m / "model.safetensors").is_file() and not (m / "model.safetensors.index.json").is_file():
        return f"{m / 'model.safetensors'} is missing"
    return None


def _say(line: str) -> None:
    print(f"note: {line}", file=sys.stderr)


def _aside(ckpt: Path) -> Path | None:
    """What a save killed between moving the previous checkpoint aside and renaming the new one
    into place leaves as the only copy: the newest complete ``<ckpt>.old-<pid>``."""
    from ..checkpoint import aside_copy
    return aside_copy(ckpt)


def find_checkpoint(path: str) -> Path:
    """A checkpoint directory, or the newest checkpoint of a run directory: the directory that
    holds its trainer.json (``step-N.old-<pid>`` when a killed save left only that copy)."""
    p = Path(path)
    if (p / "trainer.json").is_file():
        problem = _problem(p)     # named directly: it is this checkpoint or none
        if problem is not None:
            raise UsageError(f"--resume {path}: not a usable checkpoint: {problem}")
        return p
    if not p.exists():
        aside = _aside(p)
        if aside is not None:
            _say(f"--resume {path}: no such directory; using {aside}, the copy an interrupted save left aside")
            return aside
        raise UsageError(f"--resume {path}: no such directory")
    for base in (p / "checkpoints", p):
        steps: dict[int, str] = {}
        if base.is_dir():
            for d in base.iterdir():
                m = _STEP_DIR.match(d.name)
                if m and d.is_dir():
                    steps[int(m.group(1))] = f"step-{m.group(1)}"
        skipped: list[tuple[Path, str]] = []
        for step in sorted(steps, reverse=True):      # the newest usable one; every one passed over is said
            main = base / steps[step]
            problem = _problem(main) if main.is_dir() else f"{main} is missing"
            if problem is None:
                found = main
            elif (found := _aside(main)) is not None:
                _say(f"--resume {path}: {problem}; using {found.name}, the copy of it an interrupted save "
                     "left aside")
            else:
                skipped.append((main, problem))
                continue
            for d, why in skipped:
                _say(f"--resume {path}: skipped the newer checkpoint {d.name}: {why} (left in place; "
                     "--keep-checkpoints does not count it)")
            return found
        if skipped:
            raise UsageError(f"--resume {path}: no usable checkpoint in {base}: the newest, {skipped[0][0].name}, "
                             f"is not one: {skipped[0][1]}")
    aside = _aside(p)
    if aside is not None:
        return aside              # an interrupted save: the previous checkpoint, moved aside
    raise UsageError(f"--resume {path}: not a checkpoint (no trainer.json) and no checkpoints/step-* inside")


def read_checkpoint_meta(ckpt: Path) -> dict:
    """trainer.json of a checkpoint written by python -m trainer, every key checked (the run
    settings in its data position too): a UsageError names the file, the key and what was expected."""
    from ..checkpoint import read_meta
    from ..errors import TrainError
    f = ckpt / "trainer.json"
    try:
        meta = read_meta(f)
    except TrainError as e:
        raise UsageError(str(e)) from None
    _check_position(f, meta["data_position"])
    return meta


# data position keys the CLI writes -> (check, what it must be)
def _nonneg_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool) and v >= 0


_POSITION = {
    "epoch": (_nonneg_int, "an integer >= 0"),
    "next": (_nonneg_int, "an integer >= 0"),
    "tokens": (_nonneg_int, "an integer >= 0"),
    "n_train": (_nonneg_int, "an integer >= 0"),
    "elapsed": (lambda v: isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v) and v >= 0,
                "a number >= 0"),
    "data_sha1": (lambda v: v is None or isinstance(v, str), "a string"),
    "run": (lambda v: v is None or isinstance(v, dict), "an object of run settings"),
}


def _check_position(f: Path, pos: dict) -> None:
    for key, (ok, what) in _POSITION.items():
        if key in pos and not ok(pos[key]):
            raise UsageError(f"{f}: key 'data_position.{key}' must be {what}, got {pos[key]!r:.60}")
    run = pos.get("run")
    if run is None:
        return
    from .options import build_parser
    from .state import RESUMABLE
    kinds = _run_kinds()
    choices = {a.dest: a.choices for a in build_parser()._actions if a.choices}
    for key in RESUMABLE:
        if key not in run or run[key] is None:
            continue
        v = run[key]
        allowed = kinds.get(key)
        if allowed is not None and not _of_kind(v, allowed):
            words = {"int": "an integer", "float": "a number", "str": "a string", "bool": "true or false",
                     "list[str]": "a list of strings"}
            raise UsageError(f"{f}: key 'data_position.run.{key}' must be "
                             f"{' or '.join(words[k] for k in sorted(allowed))}, "
                             f"got {type(v).__name__} {v!r:.60}")
        if key in choices and v not in choices[key]:
            raise UsageError(f"{f}: key 'data_position.run.{key}' must be one of "
                             f"{', '.join(map(str, choices[key]))}, got {v!r:.60}")
    if run.get("source") not in ("scratch", "model"):
        raise UsageError(f"{f}: key 'data_position.run.source' must be 'scratch' or 'model', "
                         f"got {run.get('source')!r:.60}")


def _run_kinds() -> dict[str, set[str]]:
    """Run's fields -> the JSON kinds their annotation allows ("int", "float", "str", "bool", "list[str]")."""
    from dataclasses import fields
    out = {}
    for f in fields(Run):
        kinds = {k.strip() for k in str(f.type).split("|")} - {"None"}
        if kinds and kinds <= {"int", "float", "str", "bool", "list[str]"}:
            out[f.name] = kinds
    return out


def _of_kind(v, kinds: set[str]) -> bool:
    if isinstance(v, bool):
        return "bool" in kinds
    if isinstance(v, int):
        return bool(kinds & {"int", "float"})
    if isinstance(v, float):
        return "float" in kinds and math.isfinite(v)
    if isinstance(v, str):
        return "str" in kinds
    if isinstance(v, list):
        return "list[str]" in kinds and all(isinstance(x, str) for x in v)
    return False


def saved_evals(position: dict, start: int) -> list[dict]:
    """The held-out evaluations at the starts and ends of the earlier segments of a resumed run (kept in
    the checkpoint's data position as "evals"); anything malformed is left out."""
    out = []
    for e in position.get("evals") or [] if isinstance(position.get("evals"), list) else []:
        if (isinstance(e, dict) and type(e.get("step")) is int and 0 <= e["step"] <= start
                and any(isinstance(e.get(k), (int, float)) and not isinstance(e.get(k), bool)
                        for k in ("loss", "reward"))):        # a GRPO run's: no loss, a reward
            out.append({k: e[k] for k in ("step", "loss", "answer_loss", "exact_match", "reward", "answers_scored",
                                           "sampled/reward", "sampled/exact_match")
                        if k in e})
    return out
