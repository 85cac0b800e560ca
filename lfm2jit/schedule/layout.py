"""Sizes and indices, as every planner computes them: bucketed and bound sizes, strides, extents,
offsets and index variables of row-major tensors.

Specialization: every axis gets a concrete size baked into the kernel as a constant; the sequence
axis T is rounded up to a multiple of the length bucket, and the real length is ``info.t_valid``,
so one pipeline serves every length in a bucket. No template reads or writes rows past t_valid.
"""
from __future__ import annotations

import math

from ..ir.nodes import SEQ_AXIS, KernelIR
from ..ir.shapes import derived_size
from .code import Bin, Const, Index, IndexLet, SeqLen, Var, add, mul


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
    for a in ir.axes:
        if a not in sizes and derived_size(a, sizes) is not None:
            sizes[a] = derived_size(a, sizes)
    missing = [a for a in ir.axes if a not in sizes]
    if missing:
        raise ValueError(f"kernel {ir.name!r} needs sizes for axes {', '.join(missing)} "
                         f"(e.g. --dim {missing[0]}=64)")
    for a in ir.axes:
        if derived_size(a, sizes) not in (None, sizes[a]):
            raise ValueError(f"axis {a} of kernel {ir.name!r} has size {sizes[a]}, expected {derived_size(a, sizes)}")
    if SEQ_AXIS in sizes:
        sizes[SEQ_AXIS] = bucketed(sizes[SEQ_AXIS], bucket)
    return {a: sizes[a] for a in ir.axes}


def ident(axis: str) -> str:
    """An identifier for an axis; integer axes ("3") become "AX3", one past an axis ("V+1") "V_p1"."""
    axis = axis.replace("+", "_p")
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
