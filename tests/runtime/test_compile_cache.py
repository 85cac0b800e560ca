"""Compiled pipelines persist between processes: a second process compiles nothing the first one
compiled (counted: kernel sources parsed, WGSL renders, driver compiles, autotune trials), and a damaged cache entry is
compiled again, never used (Mesa checks the CRC32 of each of its entries and compiles again on a
mismatch, leaving the entry as it is). Dawn's blob cache (not on lavapipe, which Dawn does not
list) is held to the same rules through its store and its cffi callbacks."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import warnings
from pathlib import Path

import pytest

from lfm2jit.runtime import driver_cache
from lfm2jit.runtime.blob_cache import BlobCache
from lfm2jit.runtime.dawn_cache import DawnCacheDescriptor, ffi

ROOT = Path(__file__).resolve().parents[2]
WORKER = ROOT / "tests" / "compile_cache_worker.py"


def fresh_process(cache: Path) -> dict:
    """The worker's counts, run in a new process on wgpu-native with ``cache`` as LFM2JIT_CACHE_DIR."""
    env = {**os.environ, "LFM2JIT_CACHE_DIR": str(cache), "LFM2JIT_AUTOTUNE": "1", "LFM2JIT_WEBGPU": "wgpu-native",
           "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    for name in driver_cache.variables(cache):      # the test's own cache directory, not the caller's
        env.pop(name, None)
    done = subprocess.run([sys.executable, str(WORKER)], env=env, cwd=ROOT, capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0, done.stderr
    counts = json.loads(done.stdout.strip().splitlines()[-1])
    assert counts["correct"]
    return counts


def flip_bytes(path: Path) -> bytes:
    data = bytearray(path.read_bytes())
    middle = len(data) // 2
    data[middle:middle + 16] = bytes(b ^ 0xFF for b in data[middle:middle + 16])
    path.write_bytes(bytes(data))
    return bytes(data)


def test_a_second_process_compiles_nothing_and_a_damaged_entry_is_compiled_again(ctx, tmp_path):
    if "llvmpipe" not in ctx.name:
        pytest.skip(f"the driver's disk cache is counted on lavapipe (Mesa's cache); this adapter is {ctx.name}")
    cache = tmp_path / "cache"
    cache.mkdir(mode=0o700)
    drivers = cache / driver_cache.SUBDIR

    first = fresh_process(cache)
    compiled = driver_cache.snapshot(drivers)
    assert first["misses"] == 2 and first["disk_hits"] == 0 and first["trials"] == 1
    assert first["parsed"] > 2 and first["read_back"] == 0       # the shipped kernels and the worker's own
    assert len(compiled) >= 2           # lavapipe kept its machine code of both pipelines

    second = fresh_process(cache)
    assert second["disk_hits"] == second["misses"]               # every WGSL read back, none rendered
    assert second["trials"] == 0                                  # the tiles chosen by the first process
    # every shipped kernel's syntax tree read back; the worker's own source is compiled without a cache
    assert second["parsed"] == 1 and second["read_back"] == first["parsed"] - 1
    assert driver_cache.written_since(compiled, driver_cache.snapshot(drivers)) == 0   # no driver compile

    flip_bytes(sorted(cache.glob("scale-*.wgsl"))[0])
    flip_bytes(sorted((cache / "ast").glob("*.pickle"))[0])
    for name in compiled:                 # every binary of the driver's cache damaged
        flip_bytes(drivers / name)
    third = fresh_process(cache)          # its results still match numpy: no damaged binary ran
    assert third["disk_hits"] == third["misses"] - 1               # the damaged WGSL was rendered again
    assert third["parsed"] == 2                                    # and the damaged syntax tree parsed again


def test_blob_cache_hands_back_only_intact_entries(tmp_path):
    cache = BlobCache(tmp_path, "dawn test | adapter A")
    cache.store(b"key", b"spirv and pipeline data")
    assert cache.load(b"key") == b"spirv and pipeline data"
    assert cache.load(b"other") is None
    assert BlobCache(tmp_path, "dawn test | adapter B").load(b"key") is None      # another adapter's scope

    flip_bytes(cache.path(b"key"))
    with pytest.warns(UserWarning, match="contents do not match their checksum"):
        assert cache.load(b"key") is None
    cache.store(b"key", b"value one")
    cache.store(b"moved", b"value two")
    cache.path(b"moved").replace(cache.path(b"key"))      # one key's entry under another's name
    with pytest.warns(UserWarning, match="belongs to another key"):
        assert cache.load(b"key") is None
    assert cache.stats.as_dict() == {"hits": 1, "misses": 3, "stores": 3, "rejected": 2}


def test_blob_cache_leaves_a_directory_others_may_write(tmp_path):
    shared = tmp_path / "shared"
    shared.mkdir(mode=0o777)
    shared.chmod(0o777)
    cache = BlobCache(shared, "scope")
    cache.store(b"key", b"value")
    assert cache.refused and cache.load(b"key") is None and not any(shared.rglob("*.bin"))


def test_dawn_descriptor_answers_dawns_two_step_load_through_its_cffi_callbacks(tmp_path):
    """The callbacks as Dawn's 2026 dawn.json declares them: (key size, key, value size, value,
    userdata1, userdata2), in callback-info structs after the isolation key."""
    descriptor = DawnCacheDescriptor(BlobCache(tmp_path, "scope"))
    struct = descriptor.struct
    assert struct.chain.sType == 0x00050007 and ffi.string(struct.isolationKey.data) == b"scope"
    assert ffi.offsetof("WGPUDawnCacheDeviceDescriptor", "loadDataCallbackInfo") == 32
    assert ffi.offsetof("WGPUDawnCacheDeviceDescriptor", "storeDataCallbackInfo") == 64
    assert ffi.sizeof("WGPUDawnCacheDeviceDescriptor") == 96
    load, store = struct.loadDataCallbackInfo.callback, struct.storeDataCallbackInfo.callback
    key = ffi.new("uint8_t[]", b"shader")
    store(6, key, 6, ffi.new("uint8_t[]", b"binary"), ffi.NULL, ffi.NULL)
    assert load(6, key, 0, ffi.NULL, ffi.NULL, ffi.NULL) == 6             # the size first
    value = ffi.new("uint8_t[6]")
    assert load(6, key, 6, value, ffi.NULL, ffi.NULL) == 6
    assert ffi.buffer(value)[:] == b"binary"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        flip_bytes(descriptor.cache.path(b"shader"))
        assert load(6, key, 0, ffi.NULL, ffi.NULL, ffi.NULL) == 0          # a damaged entry: a miss
    assert load(5, ffi.new("uint8_t[]", b"other"), 0, ffi.NULL, ffi.NULL, ffi.NULL) == 0
