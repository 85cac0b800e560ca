"""Large host-side copies and arithmetic cut into ranges that a few threads run at once.

One thread reads a GPU's mapped staging memory at a fraction of the host's bandwidth, and numpy
lets go of the GIL while it copies or runs a ufunc over plain float arrays, so threads help
(benches/results/h200_readback.json: four threads read it about 2.5x faster than one).
"""
from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from functools import lru_cache

import numpy as np

from ..settings import settings

RANGE_BYTES = 2 << 20     # bytes per thread at least: smaller work stays on the caller's thread


@lru_cache(maxsize=None)
def _pool(threads: int) -> ThreadPoolExecutor:
    return ThreadPoolExecutor(max_workers=threads, thread_name_prefix="lfm2jit-host")


def in_ranges(fn, size: int, nbytes: int, threads: int | None = None) -> None:
    """``fn(start, stop)`` over consecutive ranges of ``range(size)`` (``nbytes`` of work in all),
    up to ``threads`` at once (default: LFM2JIT_HOST_COPY_THREADS); returns when all are done."""
    threads = settings().host_copy_threads if threads is None else threads
    parts = max(1, min(threads, nbytes // RANGE_BYTES, size))
    if parts == 1:
        fn(0, size)
        return
    step = -(-size // parts)
    list(_pool(parts).map(lambda at: fn(at, min(size, at + step)), range(0, size, step)))


def copy_out(out: np.ndarray, src: np.ndarray, threads: int | None = None) -> np.ndarray:
    """``np.copyto(out, src)`` for 1-D arrays (converting the dtype), in ranges over threads."""
    in_ranges(lambda a, b: np.copyto(out[a:b], src[a:b]), out.size, src.nbytes, threads)
    return out
