"""When and how the training loop checkpoints: every --checkpoint-every steps, or, without it, every
N steps with N chosen from the measured step time so that one is written about every
--checkpoint-minutes; each checkpoint a complete Hugging Face model directory plus the run's
position, the older ones pruned to --keep-checkpoints."""
from __future__ import annotations

import re
import shutil
from pathlib import Path

import numpy as np

from .options import DEFAULT_CHECKPOINT_MINUTES
from .run_dir import write_model_files
from .state import Run

AUTO_CHECKPOINT_SECONDS = 60 * DEFAULT_CHECKPOINT_MINUTES
AUTO_CHECKPOINT_AFTER = 10      # steps measured before the interval is chosen


def auto_checkpoint_every(step_seconds: list[float], target: float = AUTO_CHECKPOINT_SECONDS) -> int:
    """Steps between checkpoints so that one is written about every ``target`` seconds: from the median
    time of the measured steps, leaving out the first two (they compile the kernels) when there are more."""
    times = step_seconds[2:] if len(step_seconds) > 2 else step_seconds
    per = float(np.median(times)) if times else 0.0
    return max(1, int(round(target / per))) if per > 0 and np.isfinite(per) else 1


class Cadence:
    """Whether a step is due a checkpoint (only rank 0 writes them; never the last step, which the
    end of the run checkpoints); ``say`` announces an interval chosen from the step time."""

    def __init__(self, run: Run, start: int, say):
        self.run, self.start, self.say = run, start, say
        self.every = run.checkpoint_every       # None: chosen after AUTO_CHECKPOINT_AFTER steps
        self.step_seconds: list[float] = []
        self.last = start                       # the step of the last window seen

    def due(self, step: int, seconds: float) -> bool:
        """After optimizer step ``step``, which took ``seconds`` (a GRPO window of several optimizer steps:
        they did, shared evenly; it is due when it passed a multiple of the interval)."""
        run = self.run
        n = max(step - self.last, 1)
        before, self.last = self.last, step
        self.step_seconds += [seconds / n] * n
        if self.every is None and len(self.step_seconds) >= min(AUTO_CHECKPOINT_AFTER, run.steps - self.start):
            self.every = auto_checkpoint_every(self.step_seconds, 60 * run.checkpoint_minutes)
            if run.rank == 0 and step + self.every < run.steps:
                self.say(f"  checkpointing every {self.every} steps (about every {run.checkpoint_minutes:g} "
                         "minutes at the measured step time; --checkpoint-every N chooses)")
        return run.rank == 0 and bool(self.every) and step // self.every > before // self.every and step < run.steps


def save(trainer, run: Run, root: Path, step: int, position: dict, files: dict[str, bytes]) -> Path:
    """Checkpoint ``trainer`` at ``step`` under ``root`` with the data ``position``; the tokenizer and
    the other model files (``files``, read at the start of the run) go in before the checkpoint becomes
    visible."""
    path = root / f"step-{step:06d}"
    trainer.save_checkpoint(path, position, fill=lambda tmp: write_model_files(files, tmp / "model"))
    prune_checkpoints(root, run.keep_checkpoints)
    return path


def prune_checkpoints(root: Path, keep: int) -> None:
    """Delete all but the newest ``keep`` complete checkpoints under ``root`` (0 keeps all). One that
    lacks a file (``--resume`` says it skips it) is neither counted nor deleted: it stays for a look
    until a save of the same step replaces it."""
    from ..checkpoint import is_complete
    if keep <= 0 or not root.is_dir():
        return
    found = sorted((int(m.group(1)), d) for d in root.iterdir()
                   if (m := re.match(r"^step-(\d+)$", d.name)) and d.is_dir() and is_complete(d))
    for _, d in found[:-keep]:
        shutil.rmtree(d, ignore_errors=True)
