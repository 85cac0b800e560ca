"""Error measures the tests compare with."""
from __future__ import annotations

import numpy as np


def rel_err(got, want) -> float:
    """Normwise relative error max|got - want| / max|want|: scale-free, and meaningful near zeros."""
    got = np.asarray(got, dtype=np.float64)
    want = np.asarray(want, dtype=np.float64)
    assert got.shape == want.shape, f"shape {got.shape} != {want.shape}"
    denom = max(np.abs(want).max(initial=0.0), 1e-30)
    return float(np.abs(got - want).max(initial=0.0) / denom)


def worst(got: dict[str, np.ndarray], want: dict[str, np.ndarray]) -> tuple[float, str]:
    """The largest per-parameter relative error. A gradient that is exactly zero in the reference (e.g.
    q/k projections at T=1: softmax over one key has no derivative) has no scale of its own; its f32
    rounding noise is measured against the largest gradient of the model instead."""
    assert set(got) == set(want), f"parameter names differ: {sorted(set(got) ^ set(want))}"
    scale = max(float(np.abs(w).max(initial=0.0)) for w in want.values())
    return max((rel_err(got[n], want[n]) if want[n].any() else
                float(np.abs(got[n]).max(initial=0.0)) / scale, n) for n in want)
