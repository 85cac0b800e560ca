"""Compiled pipeline artefacts an implementation hands out as opaque (key, value) blobs, kept on disk.

Dawn gives its blob cache this way (runtime/dawn_cache.py): the SPIR-V Tint made from a shader's
WGSL and the Vulkan pipeline cache data holding the driver's binary. Entries live under
``LFM2JIT_CACHE_DIR/blobs/<scope>/``, where the scope is a hash of what makes a binary valid (the
implementation and its version, the adapter, the driver): another driver or Dawn build never sees
them. Each file holds the sha256 of its key and of its value: an entry damaged or moved under
another key's name is ignored with a warning and compiled again, never handed to the driver. The
directory follows the WGSL cache's rule: one another user may write is neither read nor written.
"""
from __future__ import annotations

import hashlib
import threading
import warnings
from dataclasses import dataclass
from pathlib import Path

from ..safefiles import read_own_file, untrusted_reason, write_atomic

SUBDIR = "blobs"
MAGIC = b"lfm2jit blob 1\n"
DIGEST = 32


@dataclass
class BlobStats:
    hits: int = 0        # values found and handed back
    misses: int = 0      # keys asked for and not there: the implementation compiles
    stores: int = 0      # values written (each a compile the cache did not answer)
    rejected: int = 0    # entries found damaged or under the wrong key, ignored

    def as_dict(self) -> dict:
        return dict(vars(self))


class BlobCache:
    def __init__(self, cache_dir: Path, scope: str):
        self.scope = scope
        self.root = Path(cache_dir) / SUBDIR / hashlib.sha256(scope.encode()).hexdigest()[:32]
        self.refused = untrusted_reason(Path(cache_dir))
        self.stats = BlobStats()
        self._lock = threading.Lock()      # Dawn may call from its pipeline-compiling threads

    def path(self, key: bytes) -> Path:
        return self.root / (hashlib.sha256(key).hexdigest()[:40] + ".bin")

    def load(self, key: bytes) -> bytes | None:
        """The value stored under ``key``, or None (a miss, or an entry that fails its checks)."""
        raw = None if self.refused else read_own_file(self.path(key))
        problem = None if raw is None else _problem(raw, key)
        with self._lock:
            if raw is None or problem:
                self.stats.misses += 1
                self.stats.rejected += bool(problem)
            else:
                self.stats.hits += 1
        if problem:
            warnings.warn(f"compiled-pipeline cache entry {self.path(key)} is ignored ({problem}); the pipeline "
                          "is compiled again and the entry rewritten", stacklevel=2)
            return None
        return None if raw is None else raw[len(MAGIC) + 2 * DIGEST:]

    def store(self, key: bytes, value: bytes) -> None:
        if self.refused:
            return
        write_atomic(self.path(key), MAGIC + hashlib.sha256(key).digest() + hashlib.sha256(value).digest() + value,
                     mode=0o600)
        with self._lock:
            self.stats.stores += 1


def _problem(raw: bytes, key: bytes) -> str | None:
    """What is wrong with an entry read for ``key``, or None."""
    head = len(MAGIC) + 2 * DIGEST
    if len(raw) < head or not raw.startswith(MAGIC):
        return "not an lfm2jit cache entry"
    if raw[len(MAGIC):len(MAGIC) + DIGEST] != hashlib.sha256(key).digest():
        return "it belongs to another key"
    if raw[len(MAGIC) + DIGEST:head] != hashlib.sha256(raw[head:]).digest():
        return "its contents do not match their checksum"
    return None
