"""The code a generated kernel runs per invocation, as typed data: planners build it, codegen spells it.

Index expressions are unsigned integers (the template's own variables, axis indices, constants,
the real sequence length); values are computed in a compute type (f32 for f32 and f16 storage,
i32, u32), with loads widening and stores narrowing. Nothing here is WGSL text: the same objects
could be spelled for another shading language.
"""
from __future__ import annotations

from dataclasses import dataclass

from ..ir.ops import Op

COMPUTE_TYPE = {"f32": "f32", "f16": "f32", "i32": "i32", "u32": "u32", "float": "f32"}


# ---- index expressions (u32) ----

@dataclass(frozen=True)
class Var:
    """A variable the template or an earlier index binding defines (gid, lid, c, r, row, i_T ...)."""
    name: str


@dataclass(frozen=True)
class Const:
    value: int


@dataclass(frozen=True)
class SeqLen:
    """The real length of the sequence axis T (a runtime value: one pipeline serves a bucket)."""


@dataclass(frozen=True)
class Bin:
    op: str            # "+", "-", "*", "/", "%", "|" (of disjoint bits: a lane of an aligned vec4), "max", "min"
    a: "Index"
    b: "Index"


Index = Var | Const | SeqLen | Bin


def add(a: Index, b: Index) -> Index:
    if isinstance(b, Const) and b.value == 0:
        return a
    if isinstance(a, Const) and a.value == 0:
        return b
    return Bin("+", a, b)


def mul(a: Index, k: int) -> Index:
    return a if k == 1 else Bin("*", a, Const(k))


@dataclass(frozen=True)
class Compare:
    """A condition on indices: ``a op b`` with op one of "<", ">=", "=="."""
    op: str
    a: Index
    b: Index


# ---- values ----

@dataclass(frozen=True)
class Lit:
    value: float
    ctype: str


@dataclass(frozen=True)
class Ref:
    """The value bound by an earlier Let (or a reduction's result)."""
    name: str


@dataclass(frozen=True)
class Load:
    """Element ``offset`` of a tensor binding stored as ``dtype``, widened to its compute type."""
    tensor: str
    offset: Index
    dtype: str


@dataclass(frozen=True)
class ScalarArg:
    """A runtime scalar of the kernel (one f32 of the info block)."""
    name: str


@dataclass(frozen=True)
class IndexValue:
    """An index expression as a value of ``ctype`` (index(AXIS), the real length in mean(x, T))."""
    index: Index
    ctype: str


@dataclass(frozen=True)
class Apply:
    """``op`` applied to values: ``ctype`` is the result's type, ``arg_types`` the operands'."""
    op: Op
    args: tuple
    ctype: str
    arg_types: tuple[str, ...]


@dataclass(frozen=True)
class Guard:
    """``value`` where ``cond`` holds, else zero (a shifted read outside the axis, an embedded entry)."""
    cond: Compare
    value: "Value"
    ctype: str


Value = Lit | Ref | Load | ScalarArg | IndexValue | Apply | Guard


@dataclass(frozen=True)
class Let:
    name: str
    ctype: str
    value: Value


@dataclass(frozen=True)
class Store:
    """tensor[offset] (+)= value, converted from ``value_type`` to the binding's ``dtype``."""
    tensor: str
    offset: Index
    value: Value
    value_type: str
    dtype: str
    accumulate: bool


@dataclass(frozen=True)
class Fold:
    """``name`` = the ``op`` reduction of ``value`` over ``var`` in 0..extent-1, computed by ``lets``
    at each index: a reduction each invocation runs itself (a conv's taps)."""
    name: str
    op: Op
    var: str
    extent: Index
    lets: tuple
    value: "Value"


@dataclass(frozen=True)
class IndexLet:
    """``let <var> = <index>``: an axis index computed from the template's flat index."""
    var: str
    index: Index
