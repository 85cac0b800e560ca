"""Shared fixtures: one wgpu device and engine per test session (lavapipe when there is no GPU)."""
from __future__ import annotations

import numpy as np
import pytest

from lfm2jit import ComputeEngine, WgpuContext


@pytest.fixture(scope="session")
def ctx() -> WgpuContext:
    return WgpuContext.create()


@pytest.fixture(scope="session")
def engine(ctx) -> ComputeEngine:
    return ComputeEngine(ctx)


@pytest.fixture
def rng() -> np.random.Generator:
    return np.random.default_rng(1234)


def rel_err(got, want) -> float:
    """Normwise relative error max|got - want| / max|want|: scale-free, and meaningful near zeros."""
    got = np.asarray(got, dtype=np.float64)
    want = np.asarray(want, dtype=np.float64)
    assert got.shape == want.shape, f"shape {got.shape} != {want.shape}"
    denom = max(np.abs(want).max(initial=0.0), 1e-30)
    return float(np.abs(got - want).max(initial=0.0) / denom)
