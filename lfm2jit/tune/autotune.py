"""Autotuning of the tiled templates: matmul (TileConfig, MatrixTiles), attention (AttentionTiles,
MatrixAttentionTiles) and the slices of long narrow column reductions (ColumnTiles).

Each candidate of a specialization's template is benchmarked once per (adapter, specialization)
and the fastest kept, in memory and in autotune.json, so later runs skip the search. A candidate
that fails to plan, compile or run scores infinity instead of stopping the program.
"""
from __future__ import annotations

import json
import math
import os
from dataclasses import asdict
from pathlib import Path

import numpy as np

from ..safefiles import read_own_file, untrusted_reason, write_atomic
from ..schedule.matmul import Grouping
from ..settings import settings
from . import candidates
from .tiles import AttentionTiles, ColumnTiles, MatrixAttentionTiles, MatrixTiles, TileConfig
from .timing import WARM_SECONDS, seconds_per_call, warm_up

CANDIDATE_WARM_SECONDS = 0.02   # after the search's warm-up, each candidate runs this long before it is timed
ROUNDS = 3     # every candidate timed this many times, in turn, its fastest kept: a GPU whose clocks dip
               # slows some timings several-fold, never speeds one up (results/h100_busy_robustness.log)

KINDS = {cls.__name__: cls for cls in (TileConfig, MatrixTiles, AttentionTiles,
                                       MatrixAttentionTiles, ColumnTiles)}   # how saved tiles name their class


def cache_file() -> Path:
    root = settings().cache_dir or Path(os.path.expanduser("~/.cache/lfm2jit"))
    return root / "autotune.json"


def _decode(entry) -> object | None:
    """Saved tiles as their class again; None for an entry this version cannot read (it is re-tuned)."""
    try:
        return KINDS[entry["kind"]](**entry["tiles"])
    except (KeyError, TypeError, ValueError):
        return None


def routed_ends(params, dims: dict[str, int]) -> np.ndarray:
    """A grouped GEMM's ``ends`` [E] with its rows (the slots: M, or K for the weight gradient; see
    schedule/grouped.py's axes) routed as a router with no preference routes them: each row to an
    expert drawn at random (seeded, so every tuning sees the same counts). Not an even split: the
    experts' counts then spread, and most experts end in a partly filled tile row, whose cost
    decides between tall and short tiles as it does in training."""
    group = params.group
    rows = dims[params.axes[0] if group.over == "m" else params.axes[2]]
    counts = np.random.default_rng(0).multinomial(rows, np.full(group.experts, 1.0 / group.experts))
    return np.cumsum(counts).astype(np.int32)


class Tuner:
    def __init__(self, engine, path: Path | None = None):
        self.engine = engine
        self.path = path or cache_file()
        self.best: dict[str, dict] = {}      # what autotune.json holds: key -> kind, tiles, seconds
        raw = read_own_file(self.path) if untrusted_reason(self.path.parent) is None else None
        if raw is not None:         # another user's directory or file is not read (see safefiles.py)
            try:
                best = json.loads(raw)
                self.best = best if isinstance(best, dict) else {}
            except (json.JSONDecodeError, UnicodeDecodeError):
                self.best = {}          # a damaged cache is only lost time, never an error
        self._chosen: dict[str, object] = {}  # key -> tiles, decoded once (compile asks on every run)
        self.trials = 0
        self.warm_seconds = WARM_SECONDS     # a search keeps the GPU busy this long before timing candidates

    def tiles(self, kernel, dims: dict[str, int], bucket: int, accumulate: frozenset[str]):
        """The fastest candidate for this specialization (searched once), or None if it has none."""
        spec = kernel.specialize(dims, bucket, accumulate, target=self.engine.target)
        options = candidates.for_spec(spec)
        if not options:
            return None
        key = f"{self.engine.ctx.name}|{spec.key}"
        if key not in self._chosen:
            saved = _decode(self.best.get(key))
            if saved not in options:            # none yet, or from a version with other candidates
                saved = self._search(key, kernel, dims, bucket, accumulate, options, spec.params)
            self._chosen[key] = saved
        return self._chosen[key]

    def _search(self, key: str, kernel, dims, bucket, accumulate, options: tuple, params):
        """Score every candidate, keep the fastest (the first on ties), and save all the scores
        (``params``: the untuned specialization's, whose routing a grouped GEMM is timed on).
        All are compiled first and then timed one after another on a GPU kept busy throughout,
        so no candidate is timed while the clocks ramp up after a compile; ROUNDS rounds of that,
        each candidate's fastest timing its score."""
        engine = self.engine
        def scratch(t):
            return engine.zero_(engine.empty(tuple(dims[a] if a in dims else int(a) for a in t.shape), t.dtype))

        args = {t.name: scratch(t) for t in kernel.ir.inputs}       # shared: the tiles do not change them
        if isinstance(getattr(params, "group", None), Grouping):     # a grouped GEMM's work is its routing: a random one
            args[params.group.ends] = engine.tensor(routed_ends(params, dims))
        out = {t.name: scratch(t) for t in kernel.ir.outputs if t.name in accumulate}
        runs = {c: self._compiled_run(kernel, dims, bucket, accumulate, c, args, out) for c in options}
        ready = [run for run in runs.values() if run is not None]
        if ready:
            warm_up(engine, ready[0], self.warm_seconds)
        scores = {c: math.inf for c in runs}
        for _ in range(ROUNDS):
            for c, run in runs.items():
                scores[c] = min(scores[c], self._seconds(run))
        winner = min(scores, key=scores.get)
        self.best[key] = {"kind": type(winner).__name__, "tiles": asdict(winner),
                          "seconds": {str(asdict(c)): s for c, s in scores.items()}}
        self._save()
        return winner

    def _compiled_run(self, kernel, dims, bucket, accumulate, tiles, args, out):
        """A function recording one run of this candidate, after running it once (None if it fails)."""
        engine = self.engine

        def once() -> None:
            engine.run(kernel, bucket=bucket, dims=dims, out=out, accumulate=accumulate, tiles=tiles, **args)
        try:
            once()
            engine.synchronize()
        except Exception:  # noqa: BLE001 - a failing candidate must not stop the search
            return None
        self.trials += 1
        return once

    def _seconds(self, run) -> float:
        """Seconds per run on the warm GPU (inf for a candidate that failed)."""
        if run is None:
            return math.inf
        try:
            return seconds_per_call(self.engine, run, warm_seconds=CANDIDATE_WARM_SECONDS)
        except Exception:  # noqa: BLE001
            return math.inf

    def _save(self) -> None:
        try:
            if untrusted_reason(self.path.parent) is None:
                write_atomic(self.path, json.dumps(self.best, indent=1))
        except OSError:
            pass                       # tuning results are an optimisation; an unwritable cache is not fatal
