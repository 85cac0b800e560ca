"""Kernel caches: pipelines in memory per (spec key, adapter), generated WGSL on disk.

The disk key hashes the compiler's own source (Python modules, grammar, templates) together with
the spec, so editing the compiler invalidates every kernel it generated before.
"""
from __future__ import annotations

import hashlib
import os
import time
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path

from .codegen.render import render, templates_dir
from .schedule import KernelSpec

PACKAGE_DIR = Path(__file__).resolve().parent


@lru_cache(maxsize=1)
def compiler_fingerprint() -> str:
    h = hashlib.sha256()
    files = sorted(PACKAGE_DIR.rglob("*.py")) + sorted(PACKAGE_DIR.rglob("*.lark")) \
        + sorted(templates_dir().glob("*.wgsl.j2"))
    for f in files:
        h.update(f.name.encode())
        h.update(f.read_bytes())
    return h.hexdigest()[:16]


@dataclass
class CacheStats:
    hits: int = 0
    misses: int = 0
    disk_hits: int = 0
    compile_seconds: float = 0.0

    def as_dict(self) -> dict:
        return dict(vars(self))


class WgslDiskCache:
    """Generated WGSL as files named by a hash of (compiler fingerprint, spec key)."""

    def __init__(self, root: Path):
        self.root = Path(root)

    def path(self, spec: KernelSpec) -> Path:
        digest = hashlib.sha256(f"{compiler_fingerprint()}:{spec.key}".encode()).hexdigest()[:32]
        return self.root / f"{spec.kernel}-{digest}.wgsl"

    def load(self, spec: KernelSpec) -> str | None:
        p = self.path(spec)
        return p.read_text() if p.exists() else None

    def store(self, spec: KernelSpec, wgsl: str) -> None:
        p = self.path(spec)
        p.parent.mkdir(parents=True, exist_ok=True)
        tmp = p.with_suffix(f".tmp{os.getpid()}")
        tmp.write_text(wgsl)
        tmp.replace(p)    # atomic: a reader never sees half a file


def generate_wgsl(spec: KernelSpec, disk: WgslDiskCache | None, stats: CacheStats) -> str:
    if disk is not None:
        cached = disk.load(spec)
        if cached is not None:
            stats.disk_hits += 1
            return cached
    wgsl = render(spec)
    if disk is not None:
        disk.store(spec, wgsl)
    return wgsl


class Timer:
    def __enter__(self):
        self.start = time.perf_counter()
        return self

    def __exit__(self, *exc):
        self.seconds = time.perf_counter() - self.start
