"""Fixtures for the pytest-benchmark suites (not part of tests/): one device and engine per session.

    pytest benches/                                  # lavapipe without a GPU; LFM2JIT_ADAPTER picks one
    pytest benches/ --benchmark-json out.json        # pytest-benchmark's own options apply

Each benchmark times host wall clock around record + submit + wait (``engine.synchronize``), so
it includes the per-dispatch host cost; ``python -m lfm2jit.bench`` reports GPU timestamps too.
"""
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
    return np.random.default_rng(0)


def run_synced(benchmark, engine, record, rounds: int = 5):
    """Benchmark ``record()`` plus a full synchronisation, after one warm-up (which compiles)."""
    def call():
        out = record()
        engine.synchronize()
        return out
    return benchmark.pedantic(call, rounds=rounds, iterations=1, warmup_rounds=1)
