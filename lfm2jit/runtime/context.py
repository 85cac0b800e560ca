"""WgpuContext: one adapter and device, chosen and configured for compute, on one of the two
WebGPU implementations (runtime/implementations.py; LFM2JIT_WEBGPU picks)."""
from __future__ import annotations

import contextlib
import functools
import os
import sys
import weakref

from ..settings import WEBGPU_IMPLEMENTATIONS, settings
from . import driver_cache
from .implementations import IMPLEMENTATIONS, SUBGROUP_MATRIX, is_gpu

# Preference order: a discrete GPU beats an integrated one, which beats a CPU rasterizer.
_TYPE_RANK = {"DiscreteGPU": 0, "IntegratedGPU": 1, "VirtualGPU": 2, "CPU": 3}
_BACKEND_RANK = {"Vulkan": 0, "Metal": 0, "D3D12": 0, "OpenGL": 2}
OPTIONAL_FEATURES = ("shader-f16", "subgroup", "subgroups", "timestamp-query", SUBGROUP_MATRIX)
RAISED_LIMITS = ("max-storage-buffer-binding-size", "max-buffer-size", "max-compute-workgroup-storage-size",
                 "max-storage-buffers-per-shader-stage", "max-compute-invocations-per-workgroup",
                 "max-compute-workgroup-size-x", "max-compute-workgroup-size-y")
# WebGPU's default limits (the spec's "Limits" table), which LFM2JIT_LIMITS=default asks for
# explicitly: an implementation may hand out its adapter's own limits when asked for none.
WEBGPU_DEFAULT_LIMITS = {
    "max-storage-buffer-binding-size": 128 << 20, "max-buffer-size": 256 << 20,
    "max-compute-workgroup-storage-size": 16384, "max-compute-invocations-per-workgroup": 256,
    "max-compute-workgroup-size-x": 256, "max-compute-workgroup-size-y": 256, "max-compute-workgroup-size-z": 64,
    "max-compute-workgroups-per-dimension": 65535, "max-storage-buffers-per-shader-stage": 8,
    "max-bind-groups": 4, "max-uniform-buffer-binding-size": 65536, "min-storage-buffer-offset-alignment": 256,
}
NO_ADAPTER_HELP = ("WebGPU found no adapter. Without a GPU, install Mesa's Vulkan CPU driver: "
                   "apt-get install -y mesa-vulkan-drivers libvulkan1")


class AdapterError(RuntimeError):
    """No adapter, or none matching LFM2JIT_ADAPTER."""


@functools.lru_cache(maxsize=1)
def ensure_runtime_dir() -> None:
    """Give the process a valid XDG_RUNTIME_DIR before a driver opens (Mesa's lavapipe prints
    "XDG_RUNTIME_DIR is invalid" for every device it opens without one), as scripts/env.sh does for
    the scripts: a private directory of this user under the temp directory."""
    if os.name != "posix" or os.path.isdir(os.environ.get("XDG_RUNTIME_DIR", "")):
        return
    import stat
    import tempfile
    path = os.path.join(tempfile.gettempdir(), f"lfm2jit-runtime-{os.getuid()}")
    try:
        os.makedirs(path, mode=0o700, exist_ok=True)
        info = os.lstat(path)
        if not stat.S_ISDIR(info.st_mode) or info.st_uid != os.getuid() or info.st_mode & 0o077:
            path = tempfile.mkdtemp(prefix="lfm2jit-runtime-")       # someone else's: a fresh private one
    except OSError:
        path = tempfile.mkdtemp(prefix="lfm2jit-runtime-")
    os.environ["XDG_RUNTIME_DIR"] = path


def dawn_has_gpu() -> bool:
    """Whether Dawn lists a GPU adapter here. Asked once, and quietly: on a machine where it finds
    none (lavapipe) Dawn prints why on stderr, which is no news to someone who did not ask for it."""
    with _quiet_stderr():
        return any(is_gpu(a) for a in IMPLEMENTATIONS["dawn"].adapters())


@contextlib.contextmanager
def _quiet_stderr():
    """Native code's writes to file descriptor 2 go to /dev/null while inside."""
    sys.stderr.flush()
    saved = os.dup(2)
    devnull = os.open(os.devnull, os.O_WRONLY)
    try:
        os.dup2(devnull, 2)
        yield
    finally:
        os.dup2(saved, 2)
        os.close(saved)
        os.close(devnull)


def choose_implementation(name: str):
    """The implementation for LFM2JIT_WEBGPU ``name``; "auto" is Dawn when it finds a GPU adapter."""
    if name == "auto":
        return IMPLEMENTATIONS["dawn" if dawn_has_gpu() else "wgpu-native"]
    if name == "dawn" and not IMPLEMENTATIONS["dawn"].available():
        raise AdapterError("LFM2JIT_WEBGPU=dawn, but wgpudawn is not installed (pip install wgpudawn)")
    if name not in IMPLEMENTATIONS:
        raise AdapterError(f"LFM2JIT_WEBGPU={name!r}: expected one of {', '.join(WEBGPU_IMPLEMENTATIONS)}")
    return IMPLEMENTATIONS[name]


NATIVE_BACKENDS = ("Vulkan", "Metal", "D3D12")


def native_adapters(adapters) -> list:
    """The adapters of a native backend (what setup insists on): an OpenGL one (Mesa's GL llvmpipe)
    has no shader-f16 and is not what the tests run on."""
    return [a for a in adapters if a.info.get("backend_type") in NATIVE_BACKENDS]


def describe(adapter) -> str:
    info = adapter.info
    return f"{info.get('device', '?')} ({info.get('adapter_type', '?')}, {info.get('backend_type', '?')})"


def _rank(adapter) -> tuple[int, int]:
    info = adapter.info
    return (_TYPE_RANK.get(info.get("adapter_type"), 4), _BACKEND_RANK.get(info.get("backend_type"), 1))


def choose_adapter(adapters, wanted: str | None, implementation: str = "wgpu-native", index: int = 0):
    """The best adapter, or the best one whose name/vendor/backend contains ``wanted``; of several
    equally good ones (two GPUs of one kind) the ``index``-th (mod their number), in list order."""
    if not adapters:
        if implementation == "dawn":
            raise AdapterError("LFM2JIT_WEBGPU=dawn, but Dawn found no adapter (it does not list Mesa's lavapipe; "
                               "LFM2JIT_WEBGPU=auto or wgpu-native reaches it)")
        raise AdapterError(NO_ADAPTER_HELP)
    pool = list(adapters)
    if wanted:
        def text(a):
            i = a.info
            return " ".join(str(i.get(k, "")) for k in ("device", "vendor", "description", "backend_type",
                                                          "adapter_type")).lower()
        pool = [a for a in pool if wanted.lower() in text(a)]
        if not pool:
            listing = "\n".join(f"  - {describe(a)}" for a in adapters)
            raise AdapterError(f"LFM2JIT_ADAPTER={wanted!r} matches none of the adapters:\n{listing}")
    best = _rank(min(pool, key=_rank))
    ties = [a for a in pool if _rank(a) == best]
    return ties[index % len(ties)]


class WgpuContext:
    """The device everything runs on, with the optional features it offers and raised limits."""

    def __init__(self, adapter, device, features: frozenset[str], implementation: str = "wgpu-native",
                 subgroup_matrix_configs: tuple[dict, ...] = (), compile_threads: int = 0, binaries=None):
        """``compile_threads``: threads that make pipelines synchronously, a window's all at once
        (0: the implementation's own way); the implementation's device must be safe to call from
        several threads (``IMPLEMENTATIONS[...].threads_need``)."""
        self.adapter = adapter
        self.device = device
        self.queue = device.queue
        self.features = features
        self.limits = dict(device.limits)
        self.info = dict(adapter.info)
        self.implementation = implementation
        self.maps_after_last_use = IMPLEMENTATIONS[implementation].maps_after_last_use
        self.compiles_async = IMPLEMENTATIONS[implementation].compiles_async
        if self.compiles_async:
            self.settle_compiles = IMPLEMENTATIONS[implementation].settle
        self.compile_threads = compile_threads
        self.binaries = binaries      # Dawn's blob cache (runtime/dawn_cache.py) where one is in use
        self.subgroup_matrix_configs = subgroup_matrix_configs
        self._engines: weakref.WeakSet = weakref.WeakSet()
        self._holding: set = set()      # engines with recorded, unsubmitted work: kept until it is submitted

    @classmethod
    def create(cls, adapter_substring: str | None = None, webgpu: str | None = None) -> "WgpuContext":
        """The best adapter (or the best matching ``adapter_substring`` / LFM2JIT_ADAPTER) of the
        implementation ``webgpu`` / LFM2JIT_WEBGPU: "dawn", "wgpu-native", or "auto" (Dawn when it
        lists a GPU, else wgpu-native)."""
        ensure_runtime_dir()
        opts = settings()
        driver_cache.enable(opts.cache_dir)         # before a driver loads: it reads its cache's place once
        wanted = adapter_substring if adapter_substring is not None else opts.adapter
        impl = choose_implementation(webgpu or opts.webgpu)
        adapter = choose_adapter(impl.adapters(), wanted, impl.name, opts.adapter_index)
        features = frozenset(f for f in OPTIONAL_FEATURES if f in adapter.features)
        # compile threads only where the device may be called from several threads (Dawn: with a feature)
        threads = impl.default_compile_threads if opts.compile_threads is None else opts.compile_threads
        threaded = threads and impl.threads_need <= set(adapter.features)
        if threaded:
            features |= impl.threads_need
        limits = ({k: adapter.limits[k] for k in RAISED_LIMITS if k in adapter.limits} if opts.limits == "raised"
                  else {k: v for k, v in WEBGPU_DEFAULT_LIMITS.items() if k in adapter.limits})
        binaries = impl.binary_cache(adapter, opts.cache_dir)     # kept alive with the device
        device = impl.request_device(adapter, features, limits, binaries)
        return cls(adapter, device, features, impl.name, impl.subgroup_matrix_configs(adapter),
                   threads if threaded else 0, binaries)

    @functools.cached_property
    def name(self) -> str:
        """The adapter's description (it keys pipeline caches, so it is computed once)."""
        return describe(self.adapter) + (", Dawn" if self.implementation == "dawn" else "")

    @property
    def has_subgroup_matrix(self) -> bool:
        return bool(self.subgroup_matrix_configs)

    @property
    def has_f16(self) -> bool:
        return "shader-f16" in self.features

    @property
    def has_timestamps(self) -> bool:
        return "timestamp-query" in self.features

    def register(self, engine) -> None:
        self._engines.add(engine)

    def hold(self, engine) -> None:
        self._holding.add(engine)

    def release(self, engine) -> None:
        self._holding.discard(engine)

    def flush(self) -> None:
        """Submit every engine's recorded work, so a host read or write of a tensor sees it in order.
        Inside engine.capture() that raises: a replay could not repeat the read or write."""
        engines = list(self._engines)
        if any(e.capturing is not None for e in engines):
            raise RuntimeError("a tensor was read or written on the host inside engine.capture(); a replayed "
                               "program cannot repeat host reads or writes: do them before or after the capture")
        for engine in engines:
            engine.flush()
