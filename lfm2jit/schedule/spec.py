"""KernelSpec and the helpers every schedule shares: axis sizes, names, offsets, loads, stores."""
from __future__ import annotations

import functools
import hashlib
import json
import math
from dataclasses import dataclass, field

from ..codegen.wgsl import COMPUTE_TYPE, ExprEmitter
from ..dsl.errors import DslError
from ..ir.nodes import SEQ_AXIS, KernelIR, Node

MAX_WORKGROUP = 256


@dataclass(frozen=True, eq=False)
class KernelSpec:
    """Everything that determines one kernel's WGSL. ``key`` is derived from all of it."""
    kernel: str
    template: str
    context: dict
    workgroups: int | tuple[int, int, int]   # an int is folded into 2-D at dispatch
    inputs: tuple[str, ...]
    outputs: tuple[tuple[str, str, tuple[int, ...]], ...]   # (name, dtype, padded shape)
    scalars: tuple[str, ...]
    dims: dict = field(default_factory=dict)

    @functools.cached_property
    def key(self) -> str:
        blob = json.dumps({"template": self.template, "context": self.context}, sort_keys=True)
        return hashlib.sha256(blob.encode()).hexdigest()[:24]


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
    return DslError(message, filename=ir.filename, line=ir.line, column=1, source=ir.source, expected=expected)


def ident(axis: str) -> str:
    """A WGSL identifier for an axis; integer axes ("3") become "AX3"."""
    return axis if axis[0].isalpha() or axis[0] == "_" else f"AX{axis}"


def index_names(axes: tuple[str, ...]) -> dict[str, str]:
    return {a: f"i_{ident(a)}" for a in axes}


def extent(axis: str, sizes: dict[str, int]) -> str:
    """How far a loop over ``axis`` runs: the real length for T, the baked size otherwise."""
    return "info.t_valid" if axis == SEQ_AXIS else f"{sizes[axis]}u"


def strides(shape: tuple[str, ...], sizes: dict[str, int]) -> dict[str, int]:
    out, acc = {}, 1
    for a in reversed(shape):
        out[a] = acc
        acc *= sizes[a]
    return out


def offset(shape: tuple[str, ...], sizes: dict[str, int], index_of: dict[str, str]) -> str:
    st = strides(shape, sizes)
    terms = [index_of[a] if st[a] == 1 else f"{index_of[a]} * {st[a]}u" for a in shape]
    return " + ".join(terms) if terms else "0u"


def unravel(axes: tuple[str, ...], sizes: dict[str, int], flat: str) -> list[dict]:
    """Index variables for ``axes`` from a flat row-major index."""
    st = strides(axes, sizes)
    out = []
    for i, a in enumerate(axes):
        div = f"{flat} / {st[a]}u" if st[a] != 1 else flat
        out.append({"var": f"i_{ident(a)}", "expr": div if i == 0 else f"({div}) % {sizes[a]}u"})
    return out


def load(n: Node, sizes: dict[str, int], index_of: dict[str, str]) -> str:
    value = f"{buffer_var(n.arg)}[{offset(n.shape, sizes, index_of)}]"
    return value if COMPUTE_TYPE[n.dtype] == n.dtype else f"{COMPUTE_TYPE[n.dtype]}({value})"


def buffer_var(name: str) -> str:
    """The WGSL variable of a tensor parameter: suffixed, so a user's name can never collide with a
    WGSL keyword or builtin, or with a template's own variables (none of which ends in '_')."""
    return f"{name}_"


def make_emitter(sizes: dict[str, int], index_of: dict[str, str]) -> ExprEmitter:
    return ExprEmitter(sizes, index_of, lambda axis: extent(axis, sizes),
                       lambda n, idx: load(n, sizes, idx))


def store_entry(name: str, off: str, value: str, accumulate: bool) -> dict:
    return {"name": buffer_var(name), "offset": off, "value": value, "accumulate": accumulate}


def total(axes, sizes) -> int:
    return math.prod(sizes[a] for a in axes)
