"""A WgpuContext whose device was requested without the shader-f16 feature, on the adapter the tests
run on (lavapipe has shader-f16, so this is how CI meets an adapter that lacks it), and that counts
the GPU work done through it, so a test can assert that a refusal came before any."""
from __future__ import annotations

from collections import Counter

from lfm2jit import WgpuContext
from lfm2jit.runtime.context import OPTIONAL_FEATURES, choose_adapter, ensure_runtime_dir
from lfm2jit.runtime.implementations import IMPLEMENTATIONS
from lfm2jit.settings import settings

# what counts as GPU work: a buffer, shader or pipeline made, data written, commands submitted
GPU_WORK = ("create_buffer", "create_shader_module", "create_compute_pipeline", "write_buffer", "submit")


class Counting:
    """``target`` (a device or its queue) with its GPU_WORK calls counted into ``calls``."""

    def __init__(self, target, calls: Counter):
        self._target, self._calls = target, calls

    def __getattr__(self, name):
        value = getattr(self._target, name)
        if name == "queue":
            return Counting(value, self._calls)
        if name in GPU_WORK:
            def counted(*args, **kwargs):
                self._calls[name] += 1
                return value(*args, **kwargs)
            return counted
        return value


def context_without_f16() -> tuple[WgpuContext, Counter]:
    """A fresh context on the adapter WgpuContext.create picks (wgpu-native's, as LFM2JIT_WEBGPU=auto
    picks on a machine without a GPU), its device requested with every optional feature the adapter
    has but shader-f16, and the counter of the GPU work done through it."""
    ensure_runtime_dir()
    impl = IMPLEMENTATIONS["wgpu-native"]
    adapter = choose_adapter(impl.adapters(), settings().adapter, impl.name, settings().adapter_index)
    features = frozenset(f for f in OPTIONAL_FEATURES if f in adapter.features and f != "shader-f16")
    calls: Counter = Counter()
    device = Counting(impl.request_device(adapter, features, {}), calls)
    return WgpuContext(adapter, device, features, impl.name), calls
