"""The kernel cache: one compile per specialization, distinct keys, an on-disk WGSL cache."""
from __future__ import annotations

import itertools

import numpy as np
import pytest

from lfm2jit import ComputeEngine, library
from lfm2jit.driver import compiler_fingerprint
from lfm2jit.schedule import bucketed


def test_second_run_of_same_bucket_compiles_nothing(ctx, rng):
    eng = ComputeEngine(ctx)
    w = eng.tensor(np.ones(64, np.float32))
    for T in (40, 64, 33, 50):   # all in bucket 64
        x = eng.tensor(rng.standard_normal((T, 64)).astype(np.float32))
        eng.run("rmsnorm", bucket=64, x=x, w=w, eps=1e-5)["y"].numpy()
    assert eng.stats.misses == 1 and eng.stats.hits == 3
    assert eng.stats.compile_seconds > 0
    x = eng.tensor(rng.standard_normal((65, 64)).astype(np.float32))   # next bucket: one more compile
    eng.run("rmsnorm", bucket=64, x=x, w=w, eps=1e-5)
    assert eng.stats.misses == 2


def test_bucketing():
    assert [bucketed(t, 64) for t in (1, 63, 64, 65, 128)] == [64, 64, 64, 128, 128]
    assert [bucketed(t, 1) for t in (1, 7)] == [1, 7]


def test_different_specializations_never_share_a_key():
    keys = {}
    for name, (T, D), bucket in itertools.product(["rmsnorm", "softmax", "scale_add"],
                                                  [(1, 1), (8, 64), (64, 64), (8, 65)], [1, 8, 64]):
        spec = library.get(name).specialize({"T": T, "D": D}, bucket)
        ident = (name, bucketed(T, bucket), D)
        if spec.key in keys:
            assert keys[spec.key] == ident, f"{ident} and {keys[spec.key]} share key {spec.key}"
        keys[spec.key] = ident
    assert len(set(keys.values())) == len(keys)


def test_same_specialization_same_key_and_wgsl():
    k = library.get("softmax")
    a, b = k.specialize({"T": 10, "D": 32}, 16), k.specialize({"T": 16, "D": 32}, 16)
    assert a.key == b.key and k.wgsl({"T": 10, "D": 32}, 16) == k.wgsl({"T": 16, "D": 32}, 16)


def test_disk_cache_reuses_wgsl_and_tracks_compiler_source(ctx, tmp_path, monkeypatch, rng):
    monkeypatch.setenv("LFM2JIT_CACHE_DIR", str(tmp_path))
    x = rng.standard_normal((4, 16)).astype(np.float32)
    first = ComputeEngine(ctx)
    first.run("softmax", x=first.tensor(x))["y"].numpy()
    files = sorted(tmp_path.glob("*.wgsl"))
    assert len(files) == 1 and "@compute" in files[0].read_text()
    second = ComputeEngine(ctx)
    second.run("softmax", x=second.tensor(x))["y"].numpy()
    assert second.stats.disk_hits == 1 and second.stats.misses == 1
    path_now = second.disk.path(library.get("softmax").specialize({"T": 4, "D": 16}))
    compiler_fingerprint.cache_clear()
    monkeypatch.setattr("lfm2jit.driver.compiler_fingerprint", lambda: "edited-compiler")
    assert second.disk.path(library.get("softmax").specialize({"T": 4, "D": 16})) != path_now


def test_dump_dir_receives_every_compiled_kernel(ctx, tmp_path, monkeypatch, rng):
    monkeypatch.setenv("LFM2JIT_DUMP_DIR", str(tmp_path))
    eng = ComputeEngine(ctx)
    eng.run("scale", x=eng.tensor(np.ones((2, 3), np.float32)), alpha=1.0)
    assert [p.name.split("-")[0] for p in tmp_path.glob("*.wgsl")] == ["scale"]


@pytest.mark.parametrize("bucket", [1, 16, 64, 256])
def test_every_shipped_kernel_compiles_on_the_adapter(ctx, bucket):
    """wgpu's shader compiler (naga + the driver) accepts every generated WGSL, of each part of a
    kernel the partitioner splits (attention_decode's reductions)."""
    eng = ComputeEngine(ctx)
    parts = [part for kernel in library.kernels().values() for part in kernel.kernels]
    for part in parts:
        dims = {a: 16 for a in part.ir.axes if a not in part.ir.fixed_dims and not a.endswith("+1")}   # V + 1 follows V
        dims["T"] = bucket + 3
        eng.compile(part, dims, bucket)
    assert eng.stats.misses == len(parts) > len(library.kernels())
