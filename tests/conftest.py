"""Shared fixtures: one wgpu device and engine per test session (lavapipe when there is no GPU)."""
from __future__ import annotations

import numpy as np
import pytest

from lfm2jit import ComputeEngine, WgpuContext


def with_env(name: str, value: str, make):
    """``make()`` with one environment variable set while it runs (settings are read at creation)."""
    mp = pytest.MonkeyPatch()
    mp.setenv(name, value)
    try:
        return make()
    finally:
        mp.undo()


@pytest.fixture(scope="session")
def raised_ctx() -> WgpuContext:
    """The device as lfm2jit opens it by default: the adapter's raised limits."""
    return WgpuContext.create()


@pytest.fixture(scope="session")
def default_limits_ctx() -> WgpuContext:
    """The same adapter with exactly WebGPU's default limits (LFM2JIT_LIMITS=default)."""
    return with_env("LFM2JIT_LIMITS", "default", WgpuContext.create)


@pytest.fixture(scope="session")
def ctx(raised_ctx) -> WgpuContext:
    """The tests' device; the kernel tests (tests/compiler, tests/ops) override it with default limits."""
    return raised_ctx


@pytest.fixture(scope="session")
def engine(ctx) -> ComputeEngine:
    return ComputeEngine(ctx)


@pytest.fixture(scope="session")
def matrix_engine(raised_ctx) -> ComputeEngine:
    """An engine whose f16 products run on the matrix templates: the device's subgroup matrices where
    it has them, else the same templates with those operations emulated in plain WGSL
    (LFM2JIT_MATRIX_UNITS=emulate), so that lavapipe in CI tests them too. With the raised limits:
    the templates' larger tiles need more than the default 16 KiB of workgroup memory."""
    engine = ComputeEngine(raised_ctx)
    if engine.target.matrix_configs:
        return engine
    if not raised_ctx.has_f16:
        pytest.skip(f"{raised_ctx.name} has no shader-f16, which the matrix templates need")
    emulated = with_env("LFM2JIT_MATRIX_UNITS", "emulate", lambda: ComputeEngine(raised_ctx))
    assert emulated.target.emulated
    return emulated


@pytest.fixture
def rng() -> np.random.Generator:
    return np.random.default_rng(1234)
