"""Fixtures for the directories whose tests run on a device with exactly WebGPU's default limits
(LFM2JIT_LIMITS=default: 128 MiB bindings, 16 KiB of workgroup memory, 8 storage buffers a kernel),
so nothing the compiler plans leans on an adapter's raised ones; the matrix-template tests
(``matrix_engine``) keep them. A conftest imports both names."""
from __future__ import annotations

import pytest

from lfm2jit import ComputeEngine


@pytest.fixture(scope="session")
def ctx(default_limits_ctx):
    assert default_limits_ctx.limits["max-storage-buffers-per-shader-stage"] == 8
    return default_limits_ctx


@pytest.fixture(scope="session")
def engine(ctx):
    """Its own engine: a session fixture of the root conftest would be shared with the other
    directories, whichever device it was made for first."""
    return ComputeEngine(ctx)
