"""Matmul autotuning: each candidate TileConfig is benchmarked once per (adapter, shape) and the
fastest kept, in memory and in a JSON file, so later runs skip the search. A candidate that fails
to compile or run scores infinity instead of stopping the program.
"""
from __future__ import annotations

import json
import math
import os
import time
from dataclasses import asdict
from pathlib import Path

from .schedule.contraction import CANDIDATES, TileConfig
from .settings import settings

REPEATS = 3


def cache_file() -> Path:
    root = settings().cache_dir or Path(os.path.expanduser("~/.cache/lfm2jit"))
    return root / "autotune.json"


class MatmulTuner:
    def __init__(self, engine, path: Path | None = None):
        self.engine = engine
        self.path = path or cache_file()
        self.best: dict[str, dict] = {}
        if self.path.exists():
            try:
                self.best = json.loads(self.path.read_text())
            except json.JSONDecodeError:
                self.best = {}          # a damaged cache is only lost time, never an error
        self.trials = 0

    def key(self, kernel, dims, bucket, accumulate) -> str:
        spec = kernel.specialize(dims, bucket, accumulate)
        return f"{self.engine.ctx.name}|{spec.key}"

    def tiles(self, kernel, dims: dict[str, int], bucket: int, accumulate: frozenset[str]) -> TileConfig:
        key = self.key(kernel, dims, bucket, accumulate)
        if key not in self.best:
            scores = {c: self._score(kernel, dims, bucket, accumulate, c) for c in CANDIDATES}
            winner = min(scores, key=scores.get)
            self.best[key] = {"tiles": asdict(winner), "seconds": {str(asdict(c)): s for c, s in scores.items()}}
            self._save()
        return TileConfig(**self.best[key]["tiles"])

    def _score(self, kernel, dims, bucket, accumulate, tiles: TileConfig) -> float:
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
