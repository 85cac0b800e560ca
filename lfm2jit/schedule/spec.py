"""KernelSpec, the scheduler's output, and the types planners build it from (Plan, Target, ...).
The sizes and index helpers every planner shares are in layout.py.

Binding table (the same for every schedule; sizes derive from it):

    group 0, binding 0        uniform Info { t_valid: u32, <each scalar>: f32 }   runtime values, no recompile
    group 0, binding 1..n     the tensor inputs in signature order,  read-only storage
    group 0, binding n+1..    the outputs in signature order,        read-write storage
    group 0, then             scratch buffers (a split-K workspace), read-write storage
"""
from __future__ import annotations

import functools
import hashlib
from dataclasses import dataclass

from ..ir.nodes import TensorArg

MAX_WORKGROUP = 256      # WebGPU's default maxComputeInvocationsPerWorkgroup


@dataclass(frozen=True)
class Binding:
    """One storage binding: a tensor (or scratch buffer) by name, its element type and access."""
    tensor: str
    binding: int
    access: str          # "read" | "read_write"
    dtype: str           # element dtype: f32 f16 i32 u32
    vector: int = 1      # 4: the template reads it as 4-vectors of dtype
    pieces: int = 1      # bound as this many consecutive bindings (schedule/pieces.py), each ...
    piece_bytes: int = 0  # ... this many bytes long but the last

    @property
    def slots(self) -> int:
        """The storage bindings it takes."""
        return self.pieces


@dataclass(frozen=True)
class EntryPoint:
    """A compute entry point and its dispatch grid; an int grid is folded into 2-D by the runtime."""
    name: str
    grid: int | tuple[int, int, int]


@dataclass(frozen=True)
class Scratch:
    """A buffer the template needs beside its tensors (bound after the outputs), elements of dtype."""
    tensor: str
    dtype: str
    elements: int


@dataclass(frozen=True, eq=False)
class KernelSpec:
    """Everything that determines one kernel: its template and typed parameters, bindings, entry
    points with their grids and scratch buffers. ``key`` is derived from all of it."""
    kernel: str
    template: str
    params: object                                  # the template's typed parameters (a frozen dataclass)
    bindings: tuple[Binding, ...]
    entry_points: tuple[EntryPoint, ...]
    scratch: tuple[Scratch, ...]
    dims: tuple[tuple[str, int], ...]               # every axis and its baked size
    scalars: tuple[str, ...]
    inputs: tuple[str, ...]                         # tensors bound read-only, in binding order
    outputs: tuple[tuple[str, str, tuple[int, ...]], ...]   # (name, dtype, padded shape)

    @functools.cached_property
    def key(self) -> str:
        blob = repr((self.kernel, self.template, self.params, self.bindings, self.entry_points, self.scratch,
                     self.dims, self.scalars))
        return hashlib.sha256(blob.encode()).hexdigest()[:24]

    @property
    def sizes(self) -> dict[str, int]:
        return dict(self.dims)


@dataclass(frozen=True)
class Plan:
    """What a planner returns: its template, typed parameters, entry points and scratch buffers,
    and the tensors it reads as vectors."""
    template: str
    params: object
    entry_points: tuple[EntryPoint, ...]
    scratch: tuple[Scratch, ...] = ()
    vectors: tuple[tuple[str, int], ...] = ()


@dataclass(frozen=True)
class MatrixConfig:
    """One subgroup-matrix shape the device multiplies: left M x K times right K x N of
    ``component`` into a ``result`` accumulator."""
    m: int
    n: int
    k: int
    component: str
    result: str


@dataclass(frozen=True)
class Target:
    """What the device offers the planners beyond portable WebGPU: subgroup matrices (the matrix
    units) and the subgroup size they run at. The portable target has none."""
    matrix_configs: tuple[MatrixConfig, ...] = ()
    subgroup_size: int = 0
    workgroup_bytes: int = 16384       # the device's maxComputeWorkgroupStorageSize
    emulated: bool = False             # the subgroup matrices are written out in plain WGSL (testing)
    vec4_staging: bool = False         # default matrix tiles (GEMM, attention) stage vec4s (LFM2JIT_MATRIX_STAGING)
    storage_buffers: int = 8           # maxStorageBuffersPerShaderStage: storage bindings one kernel may have
    binding_bytes: int = 128 << 20     # maxStorageBufferBindingSize: larger tensors are bound in pieces
    binding_align: int = 256           # minStorageBufferOffsetAlignment: where a piece may start
    subgroups: str = ""                # the device's subgroup feature: "subgroups" (Dawn: WGSL enables it),
                                       # "subgroup" (wgpu-native: naga takes the builtins as they are), "" none

    def matrix(self, component: str, result: str) -> MatrixConfig | None:
        """The largest config of these types (16x16x16 before 16x8x16 ...), or None."""
        fits = [c for c in self.matrix_configs if (c.component, c.result) == (component, result)]
        return max(fits, key=lambda c: (c.m * c.n * c.k, c.m, c.n), default=None)


PORTABLE = Target()

# What an emulated target offers: the f16 -> f32 shapes an NVIDIA GPU lists under Dawn, at a nominal
# subgroup of 32 invocations (in emulation a "subgroup" is 32 consecutive invocations of the workgroup).
EMULATED_MATRIX_CONFIGS = (MatrixConfig(16, 16, 16, "f16", "f32"), MatrixConfig(16, 8, 16, "f16", "f32"),
                           MatrixConfig(16, 8, 8, "f16", "f32"))
EMULATED_SUBGROUP = 32


@dataclass(frozen=True)
class IntrinsicCall:
    """One intrinsic call as its planner sees it: operands and outputs with names, concrete sizes."""
    name: str
    operands: tuple[TensorArg, ...]          # kernel inputs, in the intrinsic's parameter order
    outputs: tuple[TensorArg | None, ...]    # kernel outputs per intrinsic output (None: not kept)
    sizes: dict[str, int]
    accumulate: frozenset[str] = frozenset()
    tiles: object = None                     # the caller's tiles override (of the planner's tiles class)
    axes: tuple[str, ...] = ()               # the call's axis arguments (topk's K, bucket_sort's V)
    computed: tuple = ()                     # (operand name, IR node) of operands computed in the fetch
