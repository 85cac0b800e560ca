"""Timing GPU work fairly.

An idle GPU lowers its clocks, and a kernel timed in a short burst after idling (or after a
compile) measures the clock ramp more than the kernel (docs/journal.md has the measurement). So
work is first repeated until the GPU has been busy for a while, and then timed back to back.
"""
from __future__ import annotations

import math
import time

WARM_SECONDS = 0.2        # back-to-back work before timing: enough for a GPU to reach its clocks
BATCH_SECONDS = 0.02      # a timed batch lasts about this long (many short calls, few long ones)
MAX_BATCH = 256


def warm_up(engine, record, seconds: float = WARM_SECONDS) -> None:
    """Run ``record()`` (which records GPU work) back to back until ``seconds`` of wall time passed."""
    engine.synchronize()
    start, n = time.perf_counter(), 1
    while True:
        for _ in range(n):
            record()
        engine.synchronize()
        if time.perf_counter() - start >= seconds:
            return
        n = min(2 * n, MAX_BATCH)


def seconds_per_call(engine, record, warm_seconds: float = WARM_SECONDS) -> float:
    """Wall seconds per ``record()`` on a warm GPU, calls submitted back to back (best of two batches)."""
    warm_up(engine, record, warm_seconds)
    start = time.perf_counter()
    record()
    engine.synchronize()
    one = time.perf_counter() - start
    n = max(1, min(MAX_BATCH, math.ceil(BATCH_SECONDS / max(one, 1e-7))))
    best = math.inf
    for _ in range(2):
        start = time.perf_counter()
        for _ in range(n):
            record()
        engine.synchronize()
        best = min(best, (time.perf_counter() - start) / n)
    return best
