"""Host work in ranges over threads (lfm2jit/runtime/host_threads.py): the ranges cover every index
once whatever the size and thread count, copies over threads equal numpy's copy (dtype conversion
included), and LFM2JIT_HOST_COPY_THREADS is checked."""
from __future__ import annotations

import threading

import numpy as np
import pytest

from lfm2jit.runtime.host_threads import RANGE_BYTES, copy_out, in_ranges
from lfm2jit.settings import settings


def test_ranges_cover_every_index_once():
    rng = np.random.default_rng(3)
    for size in [0, 1, 2, 7, 1000, 1 << 20, 3 * (1 << 20) + 5] + [int(n) for n in rng.integers(1, 1 << 22, 6)]:
        for threads in (1, 2, 3, 4, 7):
            seen, lock, names = [], threading.Lock(), set()

            def record(a, b):
                with lock:
                    seen.append((a, b))
                    names.add(threading.current_thread().name)
            in_ranges(record, size, 4 * size, threads)
            seen.sort()
            assert seen[0][0] == 0 and seen[-1][1] == size, (size, threads, seen)
            assert all(b0 == a1 for (_, b0), (a1, _) in zip(seen, seen[1:])), (size, threads, seen)
            parts = max(1, min(threads, 4 * size // RANGE_BYTES, size))
            assert len(seen) == parts, (size, threads, seen)
            if parts > 1:
                assert all(n.startswith("lfm2jit-host") for n in names), names


def test_copies_over_threads_equal_numpy():
    rng = np.random.default_rng(5)
    for size in (0, 5, 1 << 19, (3 << 20) + 11):
        src = rng.standard_normal(size).astype(np.float32)
        for dtype in (np.float32, np.float64):
            for threads in (1, 3, 4):
                out = np.full(size, np.nan, dtype)
                assert copy_out(out, src, threads) is out
                np.testing.assert_array_equal(out, src.astype(dtype))


@pytest.mark.parametrize("value", ["0", "-1", "two", "1.5"])
def test_bad_thread_counts_are_refused(monkeypatch, value):
    monkeypatch.setenv("LFM2JIT_HOST_COPY_THREADS", value)
    with pytest.raises(ValueError, match=f"LFM2JIT_HOST_COPY_THREADS={value!r}: expected a whole number >= 1"):
        settings()


def test_thread_count_default_and_override(monkeypatch):
    monkeypatch.delenv("LFM2JIT_HOST_COPY_THREADS", raising=False)
    assert 1 <= settings().host_copy_threads <= 4
    monkeypatch.setenv("LFM2JIT_HOST_COPY_THREADS", "6")
    assert settings().host_copy_threads == 6
