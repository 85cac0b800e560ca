"""Two WebGPU implementations behind one runtime: LFM2JIT_WEBGPU picks Dawn, wgpu-native or (auto)
Dawn when it lists a GPU. On a machine where Dawn lists none (lavapipe) auto is wgpu-native and an
explicit dawn says why it cannot; where it does (the H200), the same assertions hold the other way."""
from __future__ import annotations

import numpy as np
import pytest

from lfm2jit import ComputeEngine, WgpuContext
from lfm2jit.runtime.context import AdapterError, dawn_has_gpu


def test_auto_is_dawn_exactly_when_dawn_lists_a_gpu(monkeypatch):
    monkeypatch.setenv("LFM2JIT_WEBGPU", "auto")
    ctx = WgpuContext.create()
    assert ctx.implementation == ("dawn" if dawn_has_gpu() else "wgpu-native")
    assert ctx.name.endswith(", Dawn") == (ctx.implementation == "dawn")


def test_wgpu_native_on_request_runs_a_kernel(monkeypatch):
    monkeypatch.setenv("LFM2JIT_WEBGPU", "wgpu-native")
    ctx = WgpuContext.create()
    assert ctx.implementation == "wgpu-native" and ctx.subgroup_matrix_configs == ()
    engine = ComputeEngine(ctx)
    x = np.arange(12, dtype=np.float32).reshape(3, 4)
    y = engine.run("scale", x=engine.tensor(x), alpha=2.0)["y"].numpy()
    assert np.array_equal(y, 2 * x)


def test_dawn_on_request(monkeypatch):
    monkeypatch.setenv("LFM2JIT_WEBGPU", "dawn")
    if not dawn_has_gpu():
        with pytest.raises(AdapterError, match="Dawn found no adapter"):
            WgpuContext.create()
        return
    ctx = WgpuContext.create()
    assert ctx.implementation == "dawn" and "timestamp-query" in ctx.features
    engine = ComputeEngine(ctx)
    x = np.arange(12, dtype=np.float32).reshape(3, 4)
    assert np.array_equal(engine.run("scale", x=engine.tensor(x), alpha=2.0)["y"].numpy(), 2 * x)


def test_an_unknown_implementation_is_named(monkeypatch):
    monkeypatch.setenv("LFM2JIT_WEBGPU", "vulkan")
    with pytest.raises(AdapterError, match="LFM2JIT_WEBGPU='vulkan': expected one of auto, dawn, wgpu-native"):
        WgpuContext.create()


def test_dawn_robustness_is_on_or_off(monkeypatch):
    """LFM2JIT_DAWN_ROBUSTNESS=off asks Dawn for a device without bounds clamping; any other value
    but on is refused by name before a device is made. Where Dawn lists a GPU the device's toggles
    are checked."""
    monkeypatch.setenv("LFM2JIT_DAWN_ROBUSTNESS", "maybe")
    with pytest.raises(ValueError, match="LFM2JIT_DAWN_ROBUSTNESS='maybe': expected one of on, off"):
        WgpuContext.create()
    if not dawn_has_gpu():
        return
    from wgpudawn.backends.dawn.extras import get_toggles
    from lfm2jit.settings import DAWN_ROBUSTNESS_TOGGLES
    monkeypatch.setenv("LFM2JIT_WEBGPU", "dawn")
    every = {t for toggles in DAWN_ROBUSTNESS_TOGGLES.values() for t in toggles}
    for value, toggles in DAWN_ROBUSTNESS_TOGGLES.items():
        monkeypatch.setenv("LFM2JIT_DAWN_ROBUSTNESS", value)
        ctx = WgpuContext.create()
        assert every & set(get_toggles(ctx.device)) == set(toggles), value
        engine, x = ComputeEngine(ctx), np.arange(12, dtype=np.float32).reshape(3, 4)
        assert np.array_equal(engine.run("scale", x=engine.tensor(x), alpha=2.0)["y"].numpy(), 2 * x)
