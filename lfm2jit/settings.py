"""Every knob lfm2jit reads from the environment, in one place.

LFM2JIT_ADAPTER    substring of the adapter name/vendor/backend to use (default: the best adapter)
LFM2JIT_ADAPTER_INDEX  N: of several equally good adapters (two GPUs of one kind), the N-th (mod
                   their number), in the order the implementation lists them; python -m trainer
                   --distributed mpi sets it to each rank's local rank, one GPU per rank (default 0)
LFM2JIT_CACHE_DIR  directory for the on-disk caches: generated WGSL, the shipped kernels' syntax
                   trees (ast/), the GPU driver's shader cache (driver/) and, with
                   LFM2JIT_DAWN_BLOB_CACHE=on, Dawn's blob cache (blobs/) (default: no disk cache)
LFM2JIT_DUMP_DIR   directory where every WGSL the engine compiles is also written (default: none)
LFM2JIT_TIMING     1 to time every dispatch with GPU timestamp queries (default: off)
LFM2JIT_AUTOTUNE   1 to benchmark the matmul and attention tile candidates (and the slices of long
                   narrow column reductions) once per (adapter, specialization) and keep the
                   fastest; results are kept in LFM2JIT_CACHE_DIR or
                   ~/.cache/lfm2jit (default: off)
LFM2JIT_WEBGPU     the WebGPU implementation: auto (Dawn when it finds a GPU adapter, else
                   wgpu-native, which also reaches lavapipe), dawn or wgpu-native (default: auto)
LFM2JIT_MATRIX_UNITS  auto (the device's subgroup matrices where it has them), off (never: every
                   product on the portable SIMT path) or emulate (the matrix templates with their
                   subgroup-matrix operations written out in plain WGSL on any device with shader-f16:
                   slow, for testing those templates where no matrix units exist, e.g. lavapipe in
                   CI, and for differential tests against the real ones) (default: auto)
LFM2JIT_MATRIX_STAGING  f16 or vec4: how the default tiles of the dense matrix GEMM and the matrix
                   attention kernels stage their f16 operands in workgroup memory, each fetched vec4
                   as four f16 stores, or in one store into vec4-typed tiles whose fragments load in
                   vec4 units (GEMMs: where every operand is read as vec4s); the autotuner tries
                   both (default: f16, until the GPU measures vec4: see docs/design.md)
LFM2JIT_DAWN_ROBUSTNESS  on, or off: devices without Dawn's bounds clamping of every access
                   (disable_robustness). lfm2jit's kernels keep their own reads and writes in
                   bounds, but off trusts that; an opt-in setting, never the default, and slower
                   where measured (docs/journal.md) (default: on)
LFM2JIT_DAWN_BLOB_CACHE  on to give Dawn devices a blob cache in LFM2JIT_CACHE_DIR/blobs (Tint's
                   SPIR-V and the Vulkan pipeline cache kept between processes; the driver's own
                   disk cache keeps binaries either way where it has one) (default: off: the
                   driver's cache already keeps what it would; docs/design.md has the measurement)
LFM2JIT_LIMITS     raised (ask the adapter for its highest storage-binding, buffer, workgroup and
                   storage-buffer-count limits) or default (ask for none: the device has exactly
                   WebGPU's default limits, what browsers and many integrated and mobile GPUs give;
                   for checking that everything still plans and runs there) (default: raised)
LFM2JIT_COMPILE_THREADS  N > 0: threads that make a train window's pipelines, all issued before the
                   first wait, each made synchronously (on Dawn the device is then asked for
                   implicit-device-synchronization, and where the adapter lacks it this is
                   ignored); 0: the implementation's own way, Dawn's asynchronous compiles on its
                   worker pool, wgpu-native's one at a time (default: on Dawn the CPUs, at most 8;
                   on wgpu-native 0, never timed there)
LFM2JIT_HOST_COPY_THREADS  threads that copy large readbacks out of mapped staging memory (one
                   thread reads it at a fraction of the host's memory bandwidth; numpy lets go of
                   the GIL while it copies) and quantize a large weight to NF4 on the host, a
                   range of blocks each (default: the CPUs, at most 4)

Dawn runs with the toggles below: experimental features (subgroup matrices) need allow_unsafe_apis,
NVIDIA drivers below 615.71 get shader-f16 only with vulkan_enable_f16_on_nvidia, and GPU timestamps
are quantized to about 65 us unless timestamp_quantization is off.
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

WEBGPU_IMPLEMENTATIONS = ("auto", "dawn", "wgpu-native")
DAWN_INSTANCE_TOGGLES = ("allow_unsafe_apis", "vulkan_enable_f16_on_nvidia")
DAWN_DEVICE_DISABLED_TOGGLES = ("timestamp_quantization",)
MATRIX_UNIT_MODES = ("auto", "off", "emulate")
MATRIX_STAGINGS = ("f16", "vec4")
LIMIT_MODES = ("raised", "default")
# LFM2JIT_DAWN_ROBUSTNESS -> the Dawn device toggles it enables
DAWN_ROBUSTNESS_TOGGLES = {
    "on": (),
    "off": ("disable_robustness",),
}


class SettingsError(ValueError):
    """An LFM2JIT_ variable with a value it does not take (the message names both and the choices)."""


@dataclass(frozen=True)
class Settings:
    adapter: str | None
    adapter_index: int
    cache_dir: Path | None
    dump_dir: Path | None
    timing: bool
    autotune: bool
    webgpu: str
    dawn_robustness: str          # a DAWN_ROBUSTNESS_TOGGLES key
    matrix_units: str
    matrix_staging: str
    host_copy_threads: int
    limits: str
    compile_threads: int | None   # None: the implementation's default
    dawn_blob_cache: bool


def _path(name: str) -> Path | None:
    value = os.environ.get(name, "").strip()
    return Path(value).expanduser() if value else None


def settings() -> Settings:
    """Read the environment now (not at import), so tests and tools can change it per run."""
    return Settings(
        adapter=os.environ.get("LFM2JIT_ADAPTER", "").strip() or None,
        adapter_index=_index("LFM2JIT_ADAPTER_INDEX"),
        cache_dir=_path("LFM2JIT_CACHE_DIR"),
        dump_dir=_path("LFM2JIT_DUMP_DIR"),
        timing=os.environ.get("LFM2JIT_TIMING", "").strip() in ("1", "true", "yes"),
        autotune=os.environ.get("LFM2JIT_AUTOTUNE", "").strip() in ("1", "true", "yes"),
        webgpu=os.environ.get("LFM2JIT_WEBGPU", "").strip().lower() or "auto",
        dawn_robustness=_choice("LFM2JIT_DAWN_ROBUSTNESS", tuple(DAWN_ROBUSTNESS_TOGGLES)),
        matrix_units=_choice("LFM2JIT_MATRIX_UNITS", MATRIX_UNIT_MODES),
        matrix_staging=_choice("LFM2JIT_MATRIX_STAGING", MATRIX_STAGINGS),
        host_copy_threads=_index("LFM2JIT_HOST_COPY_THREADS", default=min(4, os.cpu_count() or 1), least=1),
        limits=_choice("LFM2JIT_LIMITS", LIMIT_MODES),
        compile_threads=_index("LFM2JIT_COMPILE_THREADS", default=None),
        dawn_blob_cache=_on_off("LFM2JIT_DAWN_BLOB_CACHE", default=False),
    )


def _choice(name: str, choices: tuple[str, ...]) -> str:
    """The variable's value among ``choices`` (the first when unset)."""
    value = os.environ.get(name, "").strip().lower() or choices[0]
    if value not in choices:
        raise SettingsError(f"{name}={value!r}: expected one of {', '.join(choices)}")
    return value


def _index(name: str, default: int | None = 0, least: int = 0) -> int | None:
    value = os.environ.get(name, "").strip()
    if not value:
        return default
    if not value.isdigit() or int(value) < least:
        raise SettingsError(f"{name}={value!r}: expected a whole number >= {least}")
    return int(value)


def _on_off(name: str, default: bool) -> bool:
    value = os.environ.get(name, "").strip().lower()
    if not value:
        return default
    if value not in ("on", "off", "1", "0"):
        raise SettingsError(f"{name}={value!r}: expected on or off")
    return value in ("on", "1")
