"""Writing safetensors weights as one file or as shards with ``model.safetensors.index.json``,
named as transformers names them (``model-00001-of-00003.safetensors``) so its ``from_pretrained``
and lfm2jit's own reader (checkpoint.load_checkpoint) load either.

Every file is written beside itself and renamed into place (safefiles.replace_with /
write_atomic); the index is written after all its shards, so a reader never finds an index naming a
shard that is not there yet. Weight files of an earlier save that the new one does not use (a
single file replaced by shards, shards of another count, a stale index) are removed last.
"""
from __future__ import annotations

import json
import re
from pathlib import Path

import numpy as np
from safetensors import TensorSpec, serialize_file

from ..safefiles import replace_with, write_atomic

SINGLE, INDEX = "model.safetensors", "model.safetensors.index.json"
_SHARD = re.compile(r"model-\d{5}-of-\d{5}\.safetensors")
_NUMPY_TO_SAFETENSORS = {np.dtype(np.float32): "float32", np.dtype(np.float16): "float16",
                         np.dtype(np.float64): "float64"}


def _spec(a: np.ndarray, dtype: str | None) -> TensorSpec:
    name = dtype or _NUMPY_TO_SAFETENSORS.get(a.dtype)
    if name is None:
        raise ValueError(f"cannot store a numpy {a.dtype} array; expected float32, float16 or float64 "
                         "(bf16 as uint16 bits with its dtype named)")
    return TensorSpec(dtype=name, shape=a.shape, data_ptr=a.ctypes.data, data_len=a.nbytes)


def plan_shards(sizes: dict[str, int], max_shard_bytes: int) -> list[list[str]]:
    """Tensor names grouped in order into shards of at most ``max_shard_bytes`` each (a tensor larger
    than the limit gets a shard of its own), as transformers' save_pretrained groups them."""
    if not isinstance(max_shard_bytes, int) or isinstance(max_shard_bytes, bool) or max_shard_bytes < 1:
        raise ValueError(f"max_shard_size must be a positive number of bytes, got {max_shard_bytes!r}")
    shards: list[list[str]] = []
    used = 0
    for name, size in sizes.items():
        if not shards or (used + size > max_shard_bytes and shards[-1]):
            shards.append([])
            used = 0
        shards[-1].append(name)
        used += size
    return shards


def parse_size(size) -> int:
    """A shard size as bytes: an int, or a string such as "5GB", "500MB", "2GiB" (transformers' spelling)."""
    if isinstance(size, int) and not isinstance(size, bool):
        return size
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([KMGT]i?B)?\s*", str(size), re.IGNORECASE)
    if not m:
        raise ValueError(f"max_shard_size must be a byte count or a size such as '5GB', got {size!r}")
    unit = (m.group(2) or "B").upper()
    scale = {"B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12,
             "KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "TIB": 2**40}[unit]
    return int(float(m.group(1)) * scale)


def write_weights(directory, arrays: dict[str, np.ndarray], max_shard_size=None,
                  dtypes: dict[str, str] | None = None, metadata: dict[str, str] | None = None) -> list[Path]:
    """Writes ``arrays`` (contiguous numpy arrays, by tensor name) as ``model.safetensors`` when they
    fit one shard (or ``max_shard_size`` is None), else as shards plus the index. ``dtypes``: the
    safetensors dtype of a tensor whose numpy dtype does not say it (bf16 stored as uint16 bits).
    Returns the weight files written."""
    d = Path(directory)
    d.mkdir(parents=True, exist_ok=True)
    dtypes = dtypes or {}
    metadata = {"format": "pt", **(metadata or {})}
    arrays = {n: np.ascontiguousarray(a) for n, a in arrays.items()}
    specs = {n: _spec(a, dtypes.get(n)) for n, a in arrays.items()}
    sizes = {n: a.nbytes for n, a in arrays.items()}
    groups = [list(arrays)] if max_shard_size is None else plan_shards(sizes, parse_size(max_shard_size))
    if len(groups) <= 1:
        replace_with(d / SINGLE, lambda tmp: serialize_file(specs, tmp, metadata))
        written = [d / SINGLE]
        (d / INDEX).unlink(missing_ok=True)         # a stale index would be read before the new file
    else:
        written, weight_map = [], {}
        for k, names in enumerate(groups, 1):
            path = d / f"model-{k:05d}-of-{len(groups):05d}.safetensors"
            part = {n: specs[n] for n in names}
            replace_with(path, lambda tmp, part=part: serialize_file(part, tmp, metadata))
            written.append(path)
            weight_map.update({n: path.name for n in names})
        index = {"metadata": {"total_size": sum(sizes.values())}, "weight_map": weight_map}
        write_atomic(d / INDEX, json.dumps(index, indent=2) + "\n")
        (d / SINGLE).unlink(missing_ok=True)
    keep = {p.name for p in written}
    for stale in d.iterdir():
        if _SHARD.fullmatch(stale.name) and stale.name not in keep:
            stale.unlink(missing_ok=True)
    return written
