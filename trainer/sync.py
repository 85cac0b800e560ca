"""Gradient averaging across processes through a shared directory (no network library needed).

At the end of every accumulation window (a sync round) every rank writes its gradients to
``<run_id>.round<n>.rank<r>.safetensors`` (written under a temporary name, then renamed, so a
reader never sees half a file), waits until all ranks' files of round n exist, and replaces its
gradients by their mean. Files are numbered by round, not by optimizer step: a window whose step
is skipped (a loss-scale overflow, decided on the averaged gradients, so by every rank alike) does
not advance the step, and the next window must not read a peer's file of the skipped one. A rank
deletes its own file of round n-2 at round n: every peer that reached round n-1 has read it.
Files carry the run id, so leftovers of an earlier run with another id are never read; a run
resumed from a checkpoint of optimizer step k syncs as ``<run_id>.from<k>``.
"""
from __future__ import annotations

import os
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from safetensors.numpy import load_file, save_file

from .errors import TrainError


@dataclass
class FileGradSyncConfig:
    dir: str | os.PathLike
    rank: int
    world_size: int
    timeout_s: float = 600.0
    run_id: str = "run"
    poll_s: float = 0.02

    def __post_init__(self):
        if not isinstance(self.world_size, int) or self.world_size < 1:
            raise ValueError(f"world_size must be a positive integer, got {self.world_size!r}")
        if not isinstance(self.rank, int) or not 0 <= self.rank < self.world_size:
            raise ValueError(f"rank must be in 0..{self.world_size - 1}, got {self.rank!r}")
        if not self.timeout_s > 0:
            raise ValueError(f"timeout_s must be positive, got {self.timeout_s!r}")
        if not self.run_id or any(c in str(self.run_id) for c in "/\\"):
            raise ValueError(f"run_id must be a non-empty name without slashes, got {self.run_id!r}")


class FileGradSync:
    def __init__(self, config: FileGradSyncConfig):
        self.config = config
        self.dir = Path(config.dir)
        self.dir.mkdir(parents=True, exist_ok=True)
        self.rounds = 0          # sync rounds completed: one per accumulation window, skipped or not
        self.run_id = config.run_id

    def resume_from(self, step: int) -> None:
        """Sync as run ``<run_id>.from<step>`` from round 1: every rank resumes from the same
        checkpoint, so all pick the same name, and the interrupted run's files are left unread."""
        self.run_id = f"{self.config.run_id}.from{step}"
        self.rounds = 0

    def path(self, round_: int, rank: int) -> Path:
        return self.dir / f"{self.run_id}.round{round_:08d}.rank{rank}.safetensors"

    def average(self, engine, names: list[str], params: list, step: int) -> None:
        """Replace each parameter's .grad by the mean over all ranks of this window's gradients
        (the window that would be optimizer step ``step``; named in errors)."""
        cfg = self.config
        if cfg.world_size == 1:
            return
        n_round = self.rounds + 1
        mine = {n: p.grad.numpy() for n, p in zip(names, params)}
        target = self.path(n_round, cfg.rank)
        tmp = target.with_name(target.name + f".tmp{os.getpid()}")
        save_file(mine, str(tmp))
        tmp.replace(target)
        peers = [r for r in range(cfg.world_size) if r != cfg.rank]
        deadline = time.monotonic() + cfg.timeout_s
        waiting = list(peers)
        while waiting:
            waiting = [r for r in waiting if not self.path(n_round, r).exists()]
            if not waiting:
                break
            if time.monotonic() > deadline:
                raise TrainError(f"gradient sync timed out after {cfg.timeout_s:g}s at optimizer step {step}: "
                                 f"rank(s) {waiting} of {cfg.world_size} did not write their gradients to "
                                 f"{self.dir}; nothing was applied")
            time.sleep(cfg.poll_s)
        total = {n: a.astype(np.float64) for n, a in mine.items()}
        for r in peers:
            theirs = load_file(str(self.path(n_round, r)))
            if set(theirs) != set(total):
                raise TrainError(f"rank {r} synced different parameters at step {step} "
                                 f"({sorted(set(theirs) ^ set(total))[:3]}...); nothing was applied")
            for n in total:
                total[n] += theirs[n]
        for n, p in zip(names, params):
            p.grad.write((total[n] / cfg.world_size).astype(np.float32))
        self.rounds = n_round
        old = self.path(n_round - 2, cfg.rank)
        if old.exists():
            old.unlink()
