"""Compiled pipeline artefacts an implementation hands out as opaque (key, value) blobs, kept on disk.

Dawn gives its blob cache this way (runtime/dawn_cache.py): the SPIR-V Tint made from a shader's
WGSL and the Vulkan pipeline cache data holding the driver's binary. Entries live under
``LFM2JIT_CACHE_DIR/blobs/<scope>/``, where the scope is a hash of what makes a binary valid (the
implementation and its version, the adapter, the driver): another driver or Dawn build never sees
them. Each entry is a checked file (safefiles.CheckedFiles) holding the sha256 of its key before
the value: an entry damaged, or moved under another key's name, is ignored with a warning and
compiled again, never handed to the driver. A directory other users may write is not used.
"""
from __future__ import annotations

import hashlib
import threading
import warnings
from dataclasses import dataclass
from pathlib import Path

from ..safefiles import CheckedFiles

SUBDIR = "blobs"


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
        self.files = CheckedFiles.inside(cache_dir, f"{SUBDIR}/{hashlib.sha256(scope.encode()).hexdigest()[:32]}")
        self.stats = BlobStats()
        self._lock = threading.Lock()      # Dawn calls from its pipeline-compiling threads

    @property
    def refused(self) -> str | None:
        return self.files.refused

    def path(self, key: bytes) -> Path:
        return self.files.root / self._name(key)

    @staticmethod
    def _name(key: bytes) -> str:
        return hashlib.sha256(key).hexdigest()[:40] + ".bin"

    def load(self, key: bytes) -> bytes | None:
        """The value stored under ``key``, or None (a miss, or an entry that fails its checks)."""
        body, damaged = self.files.read(self._name(key))
        problem = ("its contents do not match their checksum" if damaged
                   else "it belongs to another key" if body is not None and body[:32] != hashlib.sha256(key).digest()
                   else None)
        found = None if body is None or problem else body[32:]
        with self._lock:
            self.stats.hits += found is not None
            self.stats.misses += found is None
            self.stats.rejected += problem is not None
        if problem:
            warnings.warn(f"compiled-pipeline cache entry {self.path(key)} is ignored ({problem}); the pipeline "
                          "is compiled again and the entry rewritten", stacklevel=2)
        return found

    def store(self, key: bytes, value: bytes) -> None:
        if self.refused:
            return
        self.files.store(self._name(key), hashlib.sha256(key).digest() + value)
        with self._lock:
            self.stats.stores += 1
