"""Runtime behaviour: adapter choice, argument checks, dispatch folding, pooling, timing, recording."""
from __future__ import annotations

import os

import numpy as np
import pytest

from lfm2jit import ComputeEngine, Tensor, WgpuContext, compile_source
from lfm2jit.runtime.context import AdapterError, choose_adapter, native_adapters
from lfm2jit.runtime.recorder import MAX_GROUPS_PER_DIM, fold_workgroups
from lfm2jit.runtime.pool import size_class
from numerics import rel_err


class FakeAdapter:
    def __init__(self, device, adapter_type, backend="Vulkan"):
        self.info = {"device": device, "adapter_type": adapter_type, "backend_type": backend, "vendor": ""}


ADAPTERS = [FakeAdapter("llvmpipe", "CPU"), FakeAdapter("Intel Iris", "IntegratedGPU"),
            FakeAdapter("NVIDIA H200", "DiscreteGPU"), FakeAdapter("NVIDIA H200", "DiscreteGPU", "OpenGL")]


def test_adapter_preference_discrete_then_integrated_then_cpu():
    assert choose_adapter(ADAPTERS, None) is ADAPTERS[2]
    assert choose_adapter(ADAPTERS[:2], None) is ADAPTERS[1]
    assert choose_adapter(ADAPTERS[:1], None) is ADAPTERS[0]


def test_equal_adapters_are_shared_out_by_index():
    """Two GPUs of one kind: LFM2JIT_ADAPTER_INDEX (an MPI rank's local rank) picks one each."""
    two = [FakeAdapter("NVIDIA H200", "DiscreteGPU"), FakeAdapter("NVIDIA H200", "DiscreteGPU"),
           FakeAdapter("llvmpipe", "CPU")]
    assert [choose_adapter(two, None, index=i) for i in range(4)] == [two[0], two[1], two[0], two[1]]
    assert choose_adapter(two, "llvm", index=1) is two[2]            # one match: every index gets it
    assert choose_adapter(ADAPTERS, None, index=3) is ADAPTERS[2]


def test_setup_insists_on_a_native_backend():
    """scripts/setup.sh installs lavapipe unless wgpu lists a Vulkan, Metal or D3D12 adapter: Mesa's
    OpenGL llvmpipe alone (no shader-f16) does not count."""
    gl_only = [FakeAdapter("llvmpipe (LLVM 15)", "CPU", "OpenGL")]
    assert native_adapters(gl_only) == []
    assert native_adapters(ADAPTERS) == ADAPTERS[:3]
    assert native_adapters([FakeAdapter("Apple M3", "IntegratedGPU", "Metal"), FakeAdapter("x", "CPU", "D3D12")])


def test_the_main_job_installs_the_runtime_and_the_tests_add_their_references():
    import subprocess
    from pathlib import Path
    root = Path(__file__).resolve().parents[2]

    def target(*args):
        return subprocess.run(["bash", "scripts/setup.sh", "--print-install", *args], cwd=root, capture_output=True,
                              text=True, check=True).stdout.strip()
    assert target() == "pip install -e ." and target("test") == "pip install -e .[test]"
    assert "bash scripts/setup.sh\n" in (root / "scripts/run-main.sh").read_text()
    assert "bash scripts/setup.sh test\n" in (root / "scripts/run-tests.sh").read_text()


def test_adapter_substring_override_and_error_lists_adapters():
    assert choose_adapter(ADAPTERS, "llvm") is ADAPTERS[0]
    assert choose_adapter(ADAPTERS, "opengl") is ADAPTERS[3]
    with pytest.raises(AdapterError) as e:
        choose_adapter(ADAPTERS, "radeon")
    assert "radeon" in str(e.value) and "Intel Iris" in str(e.value) and "llvmpipe" in str(e.value)
    with pytest.raises(AdapterError, match="mesa-vulkan-drivers"):
        choose_adapter([], None)


def test_context_requests_offered_features(ctx):
    for f in ("shader-f16", "subgroup", "timestamp-query"):
        assert (f in ctx.features) == (f in ctx.adapter.features)
    assert ctx.limits["max-storage-buffer-binding-size"] == ctx.adapter.limits["max-storage-buffer-binding-size"]


@pytest.mark.parametrize("dtype,np_dtype", [("f32", np.float32), ("f16", np.float16), ("i32", np.int32),
                                            ("u32", np.uint32)])
@pytest.mark.parametrize("n", [1, 3, 1001])
def test_tensor_round_trip(ctx, dtype, np_dtype, n):
    arr = (np.arange(n) * 7 - 3).astype(np_dtype) if dtype != "u32" else np.arange(n, dtype=np_dtype) * 7
    t = Tensor.from_numpy(ctx, arr)
    assert t.dtype == dtype and t.shape == (n,) and t.grad is None
    np.testing.assert_array_equal(t.numpy(), arr)


def test_tensor_rejects_unsupported_dtype(ctx):
    with pytest.raises(ValueError, match="complex128"):
        Tensor.from_numpy(ctx, np.zeros(3, np.complex128))


def test_fold_workgroups():
    assert fold_workgroups(1) == (1, 1)
    assert fold_workgroups(MAX_GROUPS_PER_DIM) == (MAX_GROUPS_PER_DIM, 1)
    for total in (MAX_GROUPS_PER_DIM + 1, 10 ** 6, 3 * MAX_GROUPS_PER_DIM + 7):
        x, y = fold_workgroups(total)
        assert x <= MAX_GROUPS_PER_DIM and y <= MAX_GROUPS_PER_DIM and x * y >= total
    with pytest.raises(ValueError):
        fold_workgroups(MAX_GROUPS_PER_DIM ** 2 + 1)


def test_dispatch_beyond_65535_workgroups(engine, rng):
    """70000 rows: one workgroup per row needs a 2-D grid; every row must still be computed."""
    x = rng.standard_normal((70000, 2)).astype(np.float32)
    w = np.ones(2, np.float32)
    y = engine.run("rmsnorm", x=engine.tensor(x), w=engine.tensor(w), eps=1e-6)["y"].numpy()
    x64 = x.astype(np.float64)
    assert rel_err(y, x64 / np.sqrt((x64 ** 2).mean(-1, keepdims=True) + 1e-6)) < 1e-5


def test_bad_arguments_raise_before_gpu_work(engine, rng):
    x = engine.tensor(rng.standard_normal((4, 8)).astype(np.float32))
    w = engine.tensor(np.ones(8, np.float32))
    before = engine.dispatches
    with pytest.raises(TypeError, match=r"missing arguments \['w'\]"):
        engine.run("rmsnorm", x=x, eps=1e-5)
    with pytest.raises(TypeError, match="unknown arguments"):
        engine.run("rmsnorm", x=x, w=w, eps=1e-5, gamma=w)
    with pytest.raises(ValueError, match=r"input 'w' has D=9 but input 'x' says D=8"):
        engine.run("rmsnorm", x=x, w=engine.tensor(np.ones(9, np.float32)), eps=1e-5)
    with pytest.raises(ValueError, match="dtype f16, expected f32"):
        engine.run("rmsnorm", x=x, w=engine.tensor(np.ones(8, np.float16)), eps=1e-5)
    with pytest.raises(ValueError, match="expected 2 axes"):
        engine.run("rmsnorm", x=w, w=w, eps=1e-5)
    with pytest.raises(ValueError, match="scalar 'eps' must be a finite number"):
        engine.run("rmsnorm", x=x, w=w, eps=float("nan"))
    with pytest.raises(TypeError, match="must be a Tensor"):
        engine.run("rmsnorm", x=np.zeros((4, 8)), w=w, eps=1e-5)
    with pytest.raises(KeyError, match="no shipped kernel named 'rmsnrom'"):
        engine.run("rmsnrom", x=x)
    assert engine.dispatches == before


def test_dispatches_are_recorded_then_submitted_together(ctx, rng):
    eng = ComputeEngine(ctx)
    x = eng.tensor(rng.standard_normal((6, 5)).astype(np.float32))
    y = x
    for _ in range(10):
        y = eng.run("scale", bucket=8, x=y, alpha=1.5)["y"]
    assert len(eng._commands) == 10      # nothing submitted yet
    got = y.numpy()                      # reading flushes everything, in order
    assert not eng._commands
    assert rel_err(got, x.numpy().astype(np.float64) * 1.5 ** 10) < 1e-5


@pytest.mark.parametrize("seed", range(3))
def test_work_recorded_on_an_engine_let_go_of_still_runs(ctx, seed):
    """An engine dropped with recorded, unsubmitted work (one per call, say) is held by its context
    until that work is submitted: its tensors read what it computed, not what a later engine's
    reused memory holds."""
    rng = np.random.default_rng(seed)
    inputs = [rng.standard_normal((int(rng.integers(1, 70)), 5)).astype(np.float32) for _ in range(int(rng.integers(2, 5)))]
    outs = []
    for x in inputs:
        eng = ComputeEngine(ctx)
        outs.append(eng.run("scale", bucket=8, x=eng.tensor(x), alpha=-2.0)["y"])
        del eng
    for x, y in zip(inputs, outs):
        np.testing.assert_array_equal(y.numpy(), x * np.float32(-2.0))


def test_out_argument_writes_in_place_and_is_checked(engine, rng):
    x = engine.tensor(rng.standard_normal((3, 4)).astype(np.float32))
    target = engine.empty((3, 4))
    out = engine.run("scale", x=x, alpha=2.0, out={"y": target})
    assert out["y"] is target
    assert rel_err(target.numpy(), 2.0 * x.numpy()) < 1e-6
    with pytest.raises(ValueError, match=r"out\['y'\] is f32\[3, 5\]"):
        engine.run("scale", x=x, alpha=2.0, out={"y": engine.empty((3, 5))})


def test_f16_names_the_tensors_a_call_stores_as_f16(engine, rng):
    """``f16=`` is part of what a call specializes: the named tensors are stored as f16 (the rest as
    declared), the kernel computes in f32; a name the kernel lacks is refused before GPU work."""
    if not engine.ctx.has_f16:
        pytest.skip("adapter lacks shader-f16")
    x = rng.standard_normal((3, 4)).astype(np.float32)
    y = engine.run("scale", x=engine.tensor(x, "f16"), alpha=2.0, f16={"x", "y"})["y"]
    assert y.dtype == "f16" and rel_err(y.numpy(), 2.0 * x.astype(np.float16)) < 1e-3
    mixed = engine.run("scale", x=engine.tensor(x, "f16"), alpha=2.0, f16={"x"})["y"]
    assert mixed.dtype == "f32" and rel_err(mixed.numpy(), 2.0 * x.astype(np.float16)) < 1e-6
    with pytest.raises(ValueError, match=r"cannot store \['z'\] as f16"):
        engine.run("scale", x=engine.tensor(x), alpha=2.0, f16={"z"})


def test_pool_reuses_freed_buffers(ctx, rng):
    eng = ComputeEngine(ctx)
    x = eng.tensor(rng.standard_normal((32, 64)).astype(np.float32))
    for _ in range(5):
        eng.run("scale", x=x, alpha=2.0)["y"].numpy()   # output freed after each read
    assert eng.pool.reused >= 3
    assert eng.pool.allocated_bytes <= 3 * size_class(32 * 64 * 4)


def test_size_classes_bound_waste():
    for n in (1, 255, 257, 1000, 4096, 10 ** 6 + 3, 3 * 2 ** 20):
        c = size_class(n)
        assert c >= n and (n <= 256 or c <= n * 1.125 + 16)


def test_gpu_timing_records_each_dispatch(ctx, rng):
    if not ctx.has_timestamps:
        pytest.skip("adapter has no timestamp-query")
    eng = ComputeEngine(ctx, timing=True)
    x = eng.tensor(rng.standard_normal((64, 256)).astype(np.float32))
    w = eng.tensor(np.ones(256, np.float32))
    eng.run("rmsnorm", x=x, w=w, eps=1e-5)
    eng.run("softmax", x=x)
    eng.flush()
    assert [k for k, _ in eng.timings] == ["rmsnorm", "softmax"]
    assert all(s >= 0 for _, s in eng.timings)


def test_kernel_with_fixed_and_integer_axes(engine, rng):
    mod = compile_source("""
kernel mix(x: f32[T, 3, D], w: f32[3, D]) -> (y: f32[T, 3, D]) {
    y = x * w + 1
}""")
    x = rng.standard_normal((5, 3, 7)).astype(np.float32)
    w = rng.standard_normal((3, 7)).astype(np.float32)
    got = engine.run(mod.mix, bucket=4, x=engine.tensor(x), w=engine.tensor(w))["y"].numpy()
    assert rel_err(got, x.astype(np.float64) * w + 1) < 1e-6
    with pytest.raises(ValueError, match="size 4 on axis 3, expected 3"):
        engine.run(mod.mix, x=engine.tensor(np.zeros((5, 4, 7), np.float32)), w=engine.tensor(w))


def test_views_share_the_buffer_and_run_kernels(engine, rng):
    a = rng.standard_normal((128, 64)).astype(np.float32)
    t = engine.tensor(a)
    v = t.view(128, 2, 32)
    np.testing.assert_array_equal(v.numpy(), a.reshape(128, 2, 32))
    part = t.rows(64, 128)
    np.testing.assert_array_equal(part.numpy(), a[64:])
    out = engine.run("scale", x=part, alpha=2.0)["y"].numpy()
    np.testing.assert_array_equal(out, 2.0 * a[64:])
    other = engine.tensor(np.zeros((128, 64), np.float32))
    engine.run("scale", x=t.rows(0, 64), alpha=0.5, out={"y": other.rows(64, 128)})   # into a second half
    np.testing.assert_array_equal(other.numpy()[64:], 0.5 * a[:64])
    with pytest.raises(ValueError, match="shares a buffer with input 'x'"):
        engine.run("scale", x=t.rows(0, 64), alpha=0.5, out={"y": part})
    with pytest.raises(ValueError, match="cannot view"):
        t.view(3, 5)
    with pytest.raises(ValueError, match="out of range"):
        t.rows(10, 200)


def test_synchronize_waits_for_recorded_work(ctx, rng):
    eng = ComputeEngine(ctx)
    x = eng.tensor(rng.standard_normal((8, 8)).astype(np.float32))
    y = eng.run("scale", x=x, alpha=3.0)["y"]
    eng.synchronize()
    assert not eng._commands
    assert rel_err(y.numpy(), 3.0 * x.numpy()) < 1e-6


@pytest.mark.parametrize("name", ["red", "info", "row", "lid", "main", "WG", "exp", "let", "v0", "acc_r0", "s", "c"])
def test_parameter_names_never_collide_with_generated_code(engine, rng, name):
    """A tensor named like a WGSL word or a template variable still compiles and computes."""
    mod = compile_source(f"kernel k({name}: f32[T, D]) -> (y: f32[T]) {{ y = sum(exp({name}), D) }}")
    x = rng.standard_normal((3, 5)).astype(np.float32)
    got = engine.run(mod.k, **{name: engine.tensor(x)})["y"].numpy()
    assert rel_err(got, np.exp(x.astype(np.float64)).sum(-1)) < 1e-6


@pytest.mark.parametrize("dtype", ["f32", "f16", "i32"])
def test_copy_rows_moves_rows_in_order_with_dispatches_and_replays(ctx, rng, dtype):
    """Rows copied between tensors at any row (no binding alignment), after the dispatch that
    wrote the source and before the one that reads the destination; a capture replays them."""
    if dtype == "f16" and not ctx.has_f16:
        pytest.skip("no shader-f16")
    e = ComputeEngine(ctx)
    np_dtype = {"f32": np.float32, "f16": np.float16, "i32": np.int32}[dtype]
    src = (rng.standard_normal((7, 6)) * 10).astype(np_dtype)
    dst = np.zeros((9, 6), np_dtype)
    a, b = e.tensor(src), e.tensor(dst)
    with e.capture() as program:
        e.copy_rows(a, b, 3, src_start=2, dst_start=5)
    want = dst.copy()
    want[5:8] = src[2:5]
    np.testing.assert_array_equal(b.numpy(), want)
    a.write(src[::-1].copy())
    program.replay()
    want[5:8] = src[::-1][2:5]
    np.testing.assert_array_equal(b.numpy(), want)


def test_copy_rows_refuses_what_webgpu_cannot_copy(engine):
    a, b = engine.empty((4, 3), "f16"), engine.empty((4, 3), "f32")
    with pytest.raises(ValueError, match="same dtype and row size"):
        engine.copy_rows(a, b)
    c = engine.empty((4, 3), "f16")
    with pytest.raises(ValueError, match="whole 4-byte words"):
        engine.copy_rows(a, c, 1)                   # 6 bytes
    f = engine.empty((4, 2))
    with pytest.raises(ValueError, match="out of range"):
        engine.copy_rows(f, engine.empty((2, 2)), 3)
    with pytest.raises(ValueError, match="overlap"):
        engine.copy_rows(f, f, 2, 0, 1)


def test_no_runtime_dir_noise_outside_the_scripts(tmp_path):
    """Run as the README's `.venv/bin/python -m ...` commands are, with no XDG_RUNTIME_DIR: the
    context gives the process a private one before a driver opens, so lavapipe prints nothing."""
    import os
    import subprocess
    import sys
    env = {k: v for k, v in os.environ.items() if k != "XDG_RUNTIME_DIR"}
    env["TMPDIR"] = str(tmp_path)
    code = ("import os, numpy as np; from lfm2jit import WgpuContext, ComputeEngine; c = WgpuContext.create(); "
            "e = ComputeEngine(c); print(e.run('scale', x=e.tensor(np.ones((2, 3), np.float32)), alpha=2.0)['y']"
            ".numpy().sum(), os.environ['XDG_RUNTIME_DIR'])")
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    total, runtime_dir = done.stdout.split()
    assert float(total) == 12.0 and runtime_dir == str(tmp_path / f"lfm2jit-runtime-{os.getuid()}")
    assert os.stat(runtime_dir).st_mode & 0o777 == 0o700
    assert "XDG_RUNTIME_DIR" not in done.stderr


def test_a_binding_over_the_adapters_limit_is_refused_before_gpu_work(ctx, rng, monkeypatch):
    """wgpu would fail inside the dispatch (or the device be lost); the engine names the tensor first."""
    e = ComputeEngine(ctx)
    x = e.tensor(rng.standard_normal((64, 32)).astype(np.float32))
    monkeypatch.setitem(e.ctx.limits, "max-storage-buffer-binding-size", 4096)    # 64 x 32 f32 = 8192 bytes
    before = e.dispatches
    with pytest.raises(ValueError, match=r"softmax: x binds 8192 bytes \(f32\[64, 32\]\); the adapter binds at most 4096"):
        e.run("softmax", x=x)
    assert e.dispatches == before
    monkeypatch.setitem(e.ctx.limits, "max-storage-buffer-binding-size", 8192)
    assert e.run("softmax", x=x)["y"].shape == (64, 32)


def test_async_compiles_are_all_issued_before_the_first_wait(ctx, monkeypatch):
    """As on Dawn: build() issues each pipeline and returns; the periodic flush waits while compiles
    are pending, so the first submission comes after every kernel of the recorded work was issued."""
    from lfm2jit.runtime import recorder
    monkeypatch.setattr(recorder, "SUBMIT_EVERY", 2)
    engine = ComputeEngine(ctx)
    engine.compiles_async, engine.compile_threads = True, 0    # wgpu-native's ..._async hands back promises
    module = compile_source("\n".join(f"kernel add{k}(x: f32[N]) -> (y: f32[N]) {{ y = x + {k}.0 }}"
                                       for k in range(1, 5)))
    x = np.arange(4, dtype=np.float32)
    t = engine.tensor(x)
    for kernel in module:                   # four kernels: four pipelines issued
        t = engine.run(kernel, x=t)["y"]
    assert len(engine._compiling) == 4 and all(c.pending for c in engine._compiling)
    assert engine.dispatches == 4 and len(engine._commands) == 4       # nothing submitted yet
    np.testing.assert_array_equal(t.numpy(), x + 10)
    assert not engine._compiling


@pytest.mark.parametrize("way", ["async", "threads"])
def test_a_refused_pipeline_fails_its_flush_and_is_not_kept(ctx, monkeypatch, way):
    """Dawn reports a refused asynchronous compile when it is waited for, and a compile thread when
    its future is read: that flush raises, the work recorded with it is dropped, and the next call
    compiles the kernel again."""
    from lfm2jit.runtime.recorder import ShaderCompileError

    def refuse(**kw):
        raise RuntimeError("create_compute_pipeline failed: workgroup too large")

    class Refused:
        def sync_wait(self):
            refuse()
    engine = ComputeEngine(ctx)
    engine.compiles_async, engine.compile_threads = (True, 0) if way == "async" else (False, 2)
    kernel = compile_source("kernel twice(x: f32[N]) -> (y: f32[N]) { y = x * 2.0 }").twice
    x = engine.tensor(np.arange(3, dtype=np.float32))
    with monkeypatch.context() as m:
        if way == "async":
            m.setattr(engine.device, "create_compute_pipeline_async", lambda **kw: Refused())
        else:
            m.setattr(engine.device, "create_compute_pipeline", refuse)
        engine.run(kernel, x=x)
        with pytest.raises(ShaderCompileError, match="(?s)refused a pipeline for kernel 'twice'.*workgroup too large"):
            engine.flush()
    assert not engine._commands
    np.testing.assert_array_equal(engine.run(kernel, x=x)["y"].numpy(), [0, 2, 4])


def test_compile_threads_make_a_windows_pipelines_at_once(ctx, monkeypatch):
    """LFM2JIT_COMPILE_THREADS: build() hands each pipeline to a compile thread and returns; the flush
    waits for all of them; the results are those of pipelines made one at a time."""
    from lfm2jit.runtime import recorder
    from lfm2jit.runtime.recorder import ThreadMade
    monkeypatch.setattr(recorder, "SUBMIT_EVERY", 2)
    serial, threaded = ComputeEngine(ctx), ComputeEngine(ctx)
    threaded.compiles_async, threaded.compile_threads = False, 3
    module = compile_source("\n".join(f"kernel mul{k}(x: f32[N]) -> (y: f32[N]) {{ y = x * {k}.0 + 1.0 }}"
                                       for k in range(1, 6)))
    x = np.random.default_rng(2).standard_normal(37).astype(np.float32)
    outs = []
    for engine in (serial, threaded):
        t = engine.tensor(x)
        for kernel in module:
            t = engine.run(kernel, x=t)["y"]
        outs.append(t)
    assert len(threaded._compiling) == 5 and all(isinstance(p, ThreadMade) for c in threaded._compiling for p in c.made)
    assert not serial._compiling
    np.testing.assert_array_equal(outs[1].numpy(), outs[0].numpy())
    assert not threaded._compiling
    threads = {t.name for t in __import__("threading").enumerate()}
    assert any(name.startswith("lfm2jit-compile") for name in threads)


def test_compile_threads_setting(ctx, monkeypatch):
    from lfm2jit.runtime.implementations import IMPLEMENTATIONS
    from lfm2jit.settings import SettingsError, settings
    monkeypatch.setenv("LFM2JIT_COMPILE_THREADS", "8")
    assert settings().compile_threads == 8
    made = WgpuContext.create(webgpu=ctx.implementation)
    # threads where the implementation's device takes calls from any thread (Dawn: with the feature)
    safe = IMPLEMENTATIONS[ctx.implementation].threads_need <= set(made.adapter.features)
    assert made.compile_threads == (8 if safe else 0)
    assert ComputeEngine(made).compile_threads == made.compile_threads
    # unset: Dawn makes pipelines on the CPUs' threads (at most 8), wgpu-native one at a time
    monkeypatch.delenv("LFM2JIT_COMPILE_THREADS")
    assert settings().compile_threads is None
    assert IMPLEMENTATIONS["dawn"].default_compile_threads == min(8, os.cpu_count() or 1)
    assert IMPLEMENTATIONS["wgpu-native"].default_compile_threads == 0
    default = WgpuContext.create(webgpu=ctx.implementation)
    assert default.compile_threads == (IMPLEMENTATIONS[ctx.implementation].default_compile_threads if safe else 0)
    monkeypatch.setenv("LFM2JIT_COMPILE_THREADS", "0")
    assert WgpuContext.create(webgpu=ctx.implementation).compile_threads == 0
    monkeypatch.setenv("LFM2JIT_COMPILE_THREADS", "-1")
    with pytest.raises(SettingsError, match="LFM2JIT_COMPILE_THREADS='-1': expected a whole number >= 0"):
        settings()
