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
