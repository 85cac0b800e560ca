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


@pytest.fixture(scope="session")
def matrix_engine(ctx, engine) -> ComputeEngine:
    """An engine whose f16 products run on the matrix templates: the device's subgroup matrices where
    it has them, else the same templates with those operations emulated in plain WGSL
    (LFM2JIT_MATRIX_UNITS=emulate), so that lavapipe in CI tests them too."""
    if engine.target.matrix_configs:
        return engine
    if not ctx.has_f16:
        pytest.skip(f"{ctx.name} has no shader-f16, which the matrix templates need")
    mp = pytest.MonkeyPatch()
    mp.setenv("LFM2JIT_MATRIX_UNITS", "emulate")
    try:
        emulated = ComputeEngine(ctx)
    finally:
        mp.undo()
    assert emulated.target.emulated
    return emulated


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
