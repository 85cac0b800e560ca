"""Autotuning of the tiled templates: matmul (TileConfig) and attention (AttentionTiles).

Each candidate of a specialization's template is benchmarked once per (adapter, specialization)
and the fastest kept, in memory and in autotune.json, so later runs skip the search. A candidate
that fails to plan, compile or run scores infinity instead of stopping the program.
"""
from __future__ import annotations

import json
import math
import os
import time
from dataclasses import asdict
from pathlib import Path

from .intrinsics.attention import TEMPLATES as ATTENTION_TEMPLATES, AttentionTiles, attention_candidates
from .schedule import KernelSpec
from .schedule.contraction import CANDIDATES, TileConfig
from .settings import settings

REPEATS = 3
KINDS = {cls.__name__: cls for cls in (TileConfig, AttentionTiles)}   # how saved tiles name their class


def cache_file() -> Path:
    root = settings().cache_dir or Path(os.path.expanduser("~/.cache/lfm2jit"))
    return root / "autotune.json"


def candidates(spec: KernelSpec) -> tuple:
    """The tiles worth trying for an (untuned) specialization; empty where its template has no knobs."""
    if spec.template == "matmul":
        return CANDIDATES
    if spec.template in ATTENTION_TEMPLATES:
        return attention_candidates(spec.context["mode"], spec.context["head_dim"])
    return ()


def _decode(entry) -> object | None:
    """Saved tiles as their class again; None for an entry this version cannot read (it is re-tuned)."""
    try:
        return KINDS[entry["kind"]](**entry["tiles"])
    except (KeyError, TypeError, ValueError):
        return None


class Tuner:
    def __init__(self, engine, path: Path | None = None):
        self.engine = engine
        self.path = path or cache_file()
        self.best: dict[str, dict] = {}      # what autotune.json holds: key -> kind, tiles, seconds
        if self.path.exists():
            try:
                self.best = json.loads(self.path.read_text())
            except json.JSONDecodeError:
                self.best = {}          # a damaged cache is only lost time, never an error
        self._chosen: dict[str, object] = {}  # key -> tiles, decoded once (compile asks on every run)
        self.trials = 0

    def tiles(self, kernel, dims: dict[str, int], bucket: int, accumulate: frozenset[str]):
        """The fastest candidate for this specialization (searched once), or None if it has none."""
        spec = kernel.specialize(dims, bucket, accumulate)
        options = candidates(spec)
        if not options:
            return None
        key = f"{self.engine.ctx.name}|{spec.key}"
        if key not in self._chosen:
            saved = _decode(self.best.get(key))
            if saved not in options:            # none yet, or from a version with other candidates
                saved = self._search(key, kernel, dims, bucket, accumulate, options)
            self._chosen[key] = saved
        return self._chosen[key]

    def _search(self, key: str, kernel, dims, bucket, accumulate, options: tuple):
        """Score every candidate, keep the fastest (the first on ties), and save all the scores."""
        scores = {c: self._score(kernel, dims, bucket, accumulate, c) for c in options}
        winner = min(scores, key=scores.get)
        self.best[key] = {"kind": type(winner).__name__, "tiles": asdict(winner),
                          "seconds": {str(asdict(c)): s for c, s in scores.items()}}
        self._save()
        return winner

    def _score(self, kernel, dims, bucket, accumulate, tiles) -> float:
        """Seconds per run of this candidate on scratch buffers (inf if it fails)."""
        engine = self.engine
        try:
            def scratch(t):
                return engine.zero_(engine.empty(tuple(dims[a] if a in dims else int(a) for a in t.shape), t.dtype))

            args = {t.name: scratch(t) for t in kernel.ir.inputs}
            out = {t.name: scratch(t) for t in kernel.ir.outputs if t.name in accumulate}
            def once() -> float:
                engine.synchronize()
                start = time.perf_counter()
                engine.run(kernel, bucket=bucket, dims=dims, out=out, accumulate=accumulate, tiles=tiles, **args)
                engine.synchronize()
                return time.perf_counter() - start

            once()                                 # compiles and warms up
            self.trials += 1
            return min(once() for _ in range(REPEATS))
        except Exception:  # noqa: BLE001 - a failing candidate must not stop the search
            return math.inf

    def _save(self) -> None:
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            tmp = self.path.with_suffix(f".tmp{os.getpid()}")
            tmp.write_text(json.dumps(self.best, indent=1))
            tmp.replace(self.path)
        except OSError:
            pass                       # tuning results are an optimisation; an unwritable cache is not fatal
