"""What the tile probes share: a kernel timed at the planner's tiles and at each candidate, every
candidate's result checked against the planner's. Times are the best of 3 rounds of 20 calls (GPU
timestamps; the first round keeps the GPU busy before it is timed)."""
from __future__ import annotations

import sys

import numpy as np

sys.path.insert(0, __file__.rsplit("/", 2)[0])   # benches/, where bench.py is
from bench import time_dispatches  # noqa: E402

WRONG = 1e-2      # largest error, relative to the output's largest value, a candidate may have


def seconds(e, run) -> float:
    return min(sum(t for _, t in time_dispatches(e, run, 20, warm=i == 0)) for i in range(3))


def sweep(e, kern, args: dict, out: str, candidates, what: str) -> dict[str, float]:
    """Seconds per call of ``kern`` with the planner's tiles ("planner") and with each candidate
    (by label) that plans and computes the planner's ``out``; others are left out, a wrong one
    named on stdout with ``what``."""
    want = e.run(kern, **args)[out].numpy().astype(np.float64)
    times = {"planner": seconds(e, lambda: e.run(kern, **args))}
    for cfg in candidates:
        try:
            got = e.run(kern, tiles=cfg, **args)[out].numpy()
        except ValueError:
            continue
        err = float(np.abs(got - want).max() / max(np.abs(want).max(), 1e-30))
        if err > WRONG:
            print(f"  WRONG {what} {cfg.label} err {err:.3g}", flush=True)
            continue
        times[cfg.label] = seconds(e, lambda: e.run(kern, tiles=cfg, **args))
    return times
