"""KernelSpec, the scheduler's output, and the helpers every planner shares.

Binding table (the same for every schedule; sizes derive from it):

    group 0, binding 0        uniform Info { t_valid: u32, <each scalar>: f32 }   runtime values, no recompile
    group 0, binding 1..n     the tensor inputs in signature order,  read-only storage
    group 0, binding n+1..    the outputs in signature order,        read-write storage
    group 0, then             scratch buffers (a split-K workspace), read-write storage

Specialization: every axis gets a concrete size baked into the kernel as a constant; the sequence
axis T is rounded up to a multiple of the length bucket, and the real length is ``info.t_valid``,
so one pipeline serves every length in a bucket. No template reads or writes rows past t_valid.
"""
from __future__ import annotations

import functools
import hashlib
import math
from dataclasses import dataclass

from ..dsl.errors import DslError
from ..ir.nodes import SEQ_AXIS, KernelIR, TensorArg
from .code import Bin, Const, Index, IndexLet, SeqLen, Var, add, mul

MAX_WORKGROUP = 256


@dataclass(frozen=True)
class Binding:
    """One storage binding: a tensor (or scratch buffer) by name, its element type and access."""
    tensor: str
    binding: int
    access: str          # "read" | "read_write"
    dtype: str           # element dtype: f32 f16 i32 u32
    vector: int = 1      # 4: the template reads it as 4-vectors of dtype


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


def bucketed(t: int, bucket: int) -> int:
    """Round a sequence length up to a multiple of the bucket."""
    return max(bucket, -(-t // bucket) * bucket)


def bind_dims(ir: KernelIR, dims: dict[str, int], bucket: int) -> dict[str, int]:
    """Concrete sizes for every axis; T is bucketed. Raises ValueError naming a missing or bad size."""
    if not isinstance(bucket, int) or bucket < 1:
        raise ValueError(f"length bucket must be a positive integer, got {bucket!r}")
    sizes = dict(ir.fixed_dims)
    for name, value in dims.items():
        if not isinstance(value, int) or value < 1:
            raise ValueError(f"size of axis {name} for kernel {ir.name!r} must be a positive integer, got {value!r}")
        if name in ir.fixed_dims and ir.fixed_dims[name] != value:
            raise ValueError(f"axis {name} of kernel {ir.name!r} is fixed to {ir.fixed_dims[name]}, got {value}")
        sizes[name] = value
    missing = [a for a in ir.axes if a not in sizes]
    if missing:
        raise ValueError(f"kernel {ir.name!r} needs sizes for axes {', '.join(missing)} "
                         f"(e.g. --dim {missing[0]}=64)")
    if SEQ_AXIS in sizes:
        sizes[SEQ_AXIS] = bucketed(sizes[SEQ_AXIS], bucket)
    return {a: sizes[a] for a in ir.axes}


def schedule_error(ir: KernelIR, message: str, expected: str) -> DslError:
    return DslError(message, filename=ir.filename, line=ir.line, column=1 if ir.line else 0,
                    source=ir.source or None, expected=expected)


def ident(axis: str) -> str:
    """An identifier for an axis; integer axes ("3") become "AX3"."""
    return axis if axis[0].isalpha() or axis[0] == "_" else f"AX{axis}"


def index_vars(axes) -> dict[str, Index]:
    """The index variable of each axis (i_T, i_D, ...)."""
    return {a: Var(f"i_{ident(a)}") for a in axes}


def extent(axis: str, sizes: dict[str, int]) -> Index:
    """How far a loop over ``axis`` runs: the real length for T, the baked size otherwise."""
    return SeqLen() if axis == SEQ_AXIS else Const(sizes[axis])


def strides(shape: tuple[str, ...], sizes: dict[str, int]) -> dict[str, int]:
    out, acc = {}, 1
    for a in reversed(shape):
        out[a] = acc
        acc *= sizes[a]
    return out


def offset(shape: tuple[str, ...], sizes: dict[str, int], index_of: dict[str, Index]) -> Index:
    """The element offset of (index_of[a] for a in shape) in a row-major tensor of ``shape``."""
    st = strides(shape, sizes)
    out: Index = Const(0)
    for a in shape:
        out = add(out, mul(index_of[a], st[a]))
    return out


def unravel(axes: tuple[str, ...], sizes: dict[str, int], flat: Index) -> tuple[IndexLet, ...]:
    """Index variables for ``axes`` from a flat row-major index."""
    st = strides(axes, sizes)
    out = []
    for i, a in enumerate(axes):
        div = Bin("/", flat, Const(st[a])) if st[a] != 1 else flat
        out.append(IndexLet(f"i_{ident(a)}", div if i == 0 else Bin("%", div, Const(sizes[a]))))
    return tuple(out)


def total(axes, sizes) -> int:
    return math.prod(sizes[a] for a in axes)
