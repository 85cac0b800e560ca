"""The two WebGPU implementations behind one runtime: wgpu-native (wgpu-py) and Dawn (wgpudawn).

Both packages present wgpu-py's API (their enums and flags have the same values), so everything
but finding adapters and making a device is shared. Dawn reaches the matrix units through its
experimental subgroup matrices; wgpu-native reaches Mesa's lavapipe, which Dawn does not list.
Compiled pipelines persist between processes through the driver's own disk cache
(runtime/driver_cache.py) and, with LFM2JIT_DAWN_BLOB_CACHE=on, Dawn's blob cache (``binary_cache``).
"""
from __future__ import annotations

import contextlib
import functools
import os
import time

from ..settings import DAWN_DEVICE_DISABLED_TOGGLES, DAWN_INSTANCE_TOGGLES, DAWN_ROBUSTNESS_TOGGLES, settings
from .blob_cache import BlobCache
from .cffi_types import parse_only_named_typedefs

SUBGROUP_MATRIX = "chromium-experimental-subgroup-matrix"
SETTLE_POLL_S = 0.0005     # between Dawn's event ticks while pipelines compile


class WgpuNative:
    name = "wgpu-native"
    # Whether mapping a buffer waits only for the submissions that used it, so one staged buffer
    # is read while later submissions still run. wgpu-native 0.32 mapped a staging buffer before
    # the copy into it that a long submission ended with had run (tests/trainer/test_sync.py read the last
    # window's gradients); its reads wait for the whole queue first.
    maps_after_last_use = False
    compiles_async = False      # its create_compute_pipeline_async compiles on the calling thread
    threads_need: frozenset[str] = frozenset()      # its devices may be called from any thread
    default_compile_threads = 0     # its compile threads were never timed against one at a time

    @functools.cached_property
    def module(self):
        import wgpu
        from wgpu.backends.wgpu_native._ffi import ffi
        parse_only_named_typedefs(ffi)
        return wgpu

    def adapters(self) -> list:
        return list(self.module.gpu.enumerate_adapters_sync())

    def binary_cache(self, adapter, cache_dir):
        """None: wgpu-native 0.32 exports no pipeline-cache functions (its PipelineCache feature has
        no create call), so only the driver's disk cache keeps its pipelines."""
        return None

    def request_device(self, adapter, features, limits, binaries=None):
        return adapter.request_device_sync(required_features=sorted(features), required_limits=limits)

    def subgroup_matrix_configs(self, adapter) -> tuple[dict, ...]:
        return ()


class Dawn:
    name = "dawn"
    maps_after_last_use = True     # Dawn's MapAsync waits for the buffer's last usage serial
    compiles_async = True          # CreateComputePipelineAsync compiles on Dawn's worker threads (a few)
    # a Dawn device is safe to call from several threads (compile threads) only with this feature
    threads_need = frozenset({"implicit-device-synchronization"})
    # compile threads beat Dawn's own two-task worker pool: the CPUs, at most 8
    default_compile_threads = min(8, os.cpu_count() or 1)

    @functools.cached_property
    def module(self):
        import wgpudawn
        from wgpudawn.backends.dawn import extras
        extras.set_instance_extras(enable_toggles=DAWN_INSTANCE_TOGGLES)    # before the instance exists
        return wgpudawn

    @property
    def extras(self):
        from wgpudawn.backends.dawn import extras
        return extras

    def available(self) -> bool:
        try:
            self.module
        except ImportError:
            return False
        return True

    def adapters(self) -> list:
        return list(self.module.gpu.enumerate_adapters_sync()) if self.available() else []

    def settle(self, promises) -> None:
        """Return once every promise has its result. Dawn hands a finished asynchronous pipeline to
        its callback when the device is ticked, so a sync_wait on each in turn waited out wgpudawn's
        100 ms wait chunks (about 0.1 s a pipeline on the H100); this ticks Dawn until none is pending."""
        while any(p._state == "pending" for p in promises):      # wgpudawn's GPUPromise state
            self.extras.process_events()
            time.sleep(SETTLE_POLL_S)

    def binary_cache(self, adapter, cache_dir):
        """A DawnCacheDescriptor over a BlobCache in ``cache_dir`` scoped to this Dawn build, adapter
        and driver (None unless LFM2JIT_DAWN_BLOB_CACHE=on, or without a cache directory of this
        user's own)."""
        if cache_dir is None or not settings().dawn_blob_cache:
            return None
        from .dawn_cache import DawnCacheDescriptor
        cache = BlobCache(cache_dir, self.scope(adapter))
        return None if cache.refused else DawnCacheDescriptor(cache)

    def scope(self, adapter) -> str:
        """What a compiled artefact is valid for: Dawn's build, the adapter and its driver (Vulkan's
        driver UUID where Dawn gives it) and the device toggles lfm2jit varies."""
        from wgpudawn._lib import dawn_version
        info = adapter.info
        uuids = self.extras.get_adapter_properties(adapter).get("vulkan_uuids", {})
        return " | ".join([f"dawn {dawn_version}, wgpudawn {self.module.__version__}",
                           *(str(info.get(k, "")) for k in ("vendor", "architecture", "device", "description",
                                                           "backend_type", "adapter_type")),
                           uuids.get("driver_uuid", b"").hex(), uuids.get("device_uuid", b"").hex(),
                           f"robustness {settings().dawn_robustness}"])

    def request_device(self, adapter, features, limits, binaries=None):
        robustness = DAWN_ROBUSTNESS_TOGGLES[settings().dawn_robustness]
        with binaries.chained_to_device_requests() if binaries is not None else contextlib.nullcontext():
            return self.extras.request_device_sync(adapter, required_features=sorted(features),
                                                   required_limits=limits, enable_toggles=robustness,
                                                   disable_toggles=DAWN_DEVICE_DISABLED_TOGGLES)

    def subgroup_matrix_configs(self, adapter) -> tuple[dict, ...]:
        """The adapter's subgroup-matrix shapes and types, as Dawn lists them (none without the feature)."""
        if SUBGROUP_MATRIX not in adapter.features:
            return ()
        return tuple(self.extras.get_adapter_properties(adapter).get("subgroup_matrix_configs", ()))


IMPLEMENTATIONS = {"wgpu-native": WgpuNative(), "dawn": Dawn()}


def is_gpu(adapter) -> bool:
    return adapter.info.get("adapter_type") not in ("CPU", "cpu")
