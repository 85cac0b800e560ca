"""The GPU driver's own shader disk cache, kept in the run's cache directory.

The driver turns each pipeline's SPIR-V (or DXIL, MSL) into machine code; that is most of a
pipeline's compile time, and the drivers can keep the result on disk themselves. lfm2jit points
them at ``LFM2JIT_CACHE_DIR/driver`` before a driver loads: Mesa's drivers (lavapipe, RADV, ANV)
through MESA_SHADER_CACHE_DIR, NVIDIA's through __GL_SHADER_DISK_CACHE=1 (said to be off for root
by default; it was on for root on the lent H100) and __GL_SHADER_DISK_CACHE_PATH. A variable the user set is left as it is. The drivers
key their entries by the shader's binary, the device and the driver's build, and check each entry's
checksum (Mesa: CRC32) before use: a changed kernel is a new entry, a damaged one is compiled again.
"""
from __future__ import annotations

import os
from pathlib import Path

from ..safefiles import untrusted_reason

SUBDIR = "driver"


def variables(root: Path) -> dict[str, str]:
    """What each driver reads to keep its shader cache under ``root``."""
    return {"MESA_SHADER_CACHE_DIR": str(root),
            "__GL_SHADER_DISK_CACHE": "1",
            "__GL_SHADER_DISK_CACHE_PATH": str(root),
            "__GL_SHADER_DISK_CACHE_SKIP_CLEANUP": "1"}    # NVIDIA trims the cache at its size limit


def enable(cache_dir: Path | None) -> Path | None:
    """Point the drivers' disk caches under ``cache_dir`` (LFM2JIT_CACHE_DIR) and return the
    directory, or None where there is no cache directory or it is not this user's alone (the rule
    of the WGSL cache: a planted entry would run as this user's code). Takes effect only before the
    process first loads a driver; the variables pass to child processes."""
    if cache_dir is None or untrusted_reason(Path(cache_dir)) is not None:
        return None
    root = Path(cache_dir) / SUBDIR
    root.mkdir(mode=0o700, exist_ok=True)
    for name, value in variables(root).items():
        os.environ.setdefault(name, value)
    return root


def snapshot(root: Path) -> dict[str, tuple[int, int]]:
    """Each entry file under ``root`` -> (inode, modification time): a driver that compiles a shader
    writes its entry anew (a new file, or one replacing a damaged entry), so comparing two
    snapshots counts the compiles in between that the cache did not answer."""
    entries = {}
    for path in Path(root).rglob("*"):
        if path.is_file() and path.name != "index":     # Mesa's index is rewritten on every put
            info = path.stat()
            entries[str(path.relative_to(root))] = (info.st_ino, info.st_mtime_ns)
    return entries


def written_since(before: dict, after: dict) -> int:
    """Entries new or rewritten between two snapshots."""
    return sum(1 for name, stamp in after.items() if before.get(name) != stamp)
