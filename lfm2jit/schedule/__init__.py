"""A partitioned kernel's part + concrete sizes -> a KernelSpec: which template, with which typed
parameters, bindings, entry points and scratch buffers.

Every part carries the Structure partition() gave it; the table below maps a structure to the
planner that implements it, and to the class of tiles a caller may choose for it (the autotuner
tries several).
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable

from ..dsl.errors import DslError
from ..ir.nodes import KernelIR, toposort
from ..ir.ops import Op
from ..tune.tiles import ColumnTiles, MatrixTiles, TileConfig
from . import intrinsic, matmul, pieces, pointwise, reduce
from .layout import bind_dims, bucketed
from .spec import EMULATED_MATRIX_CONFIGS, EMULATED_SUBGROUP, PORTABLE, Binding, KernelSpec, MatrixConfig, Plan, Target

__all__ = ["EMULATED_MATRIX_CONFIGS", "EMULATED_SUBGROUP", "PORTABLE", "KernelSpec", "MatrixConfig", "Target", "bind_dims", "bucketed", "specialize", "tiles_class"]


@dataclass(frozen=True)
class Schedule:
    plan: Callable[..., Plan]
    tiles: type | tuple[type, ...] | None = None


SCHEDULES: dict[str, Schedule] = {
    "pointwise": Schedule(pointwise.plan),
    "rowreduce": Schedule(reduce.plan_rows),
    "colreduce": Schedule(reduce.plan_columns, ColumnTiles),
    # SIMT tiles, or subgroup-matrix tiles (the matrix units, where the target has them)
    "contraction": Schedule(matmul.plan, (TileConfig, MatrixTiles)),
    "intrinsic": Schedule(intrinsic.plan),
}


def tiles_class(ir: KernelIR) -> type | tuple[type, ...] | None:
    """The class(es) of tiles ``specialize`` accepts for this part (None: its layout is fixed)."""
    if ir.structure.kind == "intrinsic":
        return intrinsic.PLANNERS[intrinsic.call_of(ir).arg].tiles
    return SCHEDULES[ir.structure.kind].tiles


class DeviceLimitError(DslError, ValueError):
    """A kernel this device's limits cannot bind (located at the kernel; a ValueError as every
    refusal of a specialization is, so the autotuner scores such a candidate out)."""


def schedule_error(ir: KernelIR, message: str, expected: str, cls: type[DslError] = DslError) -> DslError:
    return cls(message, filename=ir.filename, line=ir.line, column=1 if ir.line else 0,
               source=ir.source or None, expected=expected)


def specialize(ir: KernelIR, dims: dict[str, int], bucket: int = 1,
               accumulate: frozenset[str] = frozenset(), tiles=None, target: Target = PORTABLE) -> KernelSpec:
    """Plan one part at concrete sizes for a device (``target``: what it offers beyond portable
    WebGPU). ``accumulate`` names outputs whose existing contents the kernel adds to (gradient
    accumulation); ``tiles`` overrides the planner's own tile choice."""
    if ir.structure is None:
        raise ValueError(f"{ir.name}: specialize() takes the parts partition() makes, not a whole kernel")
    unknown = set(accumulate) - {o.name for o in ir.outputs}
    if unknown:
        raise ValueError(f"{ir.name}: cannot accumulate into {sorted(unknown)}: not outputs")
    kind = tiles_class(ir)
    if tiles is not None and (kind is None or not isinstance(tiles, kind)):
        names = " or ".join(k.__name__ for k in (kind if isinstance(kind, tuple) else (kind,))) if kind else ""
        expected = f"{names} or None" if kind else "None (its layout is fixed)"
        raise ValueError(f"{ir.name}: tiles={tiles!r} do not apply to a {ir.structure.kind} kernel; expected {expected}")
    sizes = bind_dims(ir, dims, bucket)
    for n in toposort(ir.results.values()):
        if n.op in (Op.TAKE, Op.EMBED) and n.arg[1] >= sizes[n.arg[0]]:
            raise schedule_error(ir, f"index {n.arg[1]} is out of range for axis {n.arg[0]} of size "
                                 f"{sizes[n.arg[0]]}", f"{n.arg[0]} larger than {n.arg[1]}")
    if ir.inouts and ir.structure.kind != "pointwise":
        raise schedule_error(ir, f"in-place outputs {list(ir.inouts)} in a {ir.structure.kind} kernel",
                             "in-place updates only in elementwise kernels")
    plan = SCHEDULES[ir.structure.kind].plan(ir, sizes, frozenset(accumulate), tiles, target=target)
    vectors = dict(plan.vectors)
    tensors = [(t, "read") for t in ir.inputs if t.name not in ir.inouts] + [(t, "read_write") for t in ir.outputs]
    bindings = tuple(Binding(t.name, i + 1, access, t.dtype, vectors.get(t.name, 1))
                     for i, (t, access) in enumerate(tensors))
    bindings += tuple(Binding(s.tensor, len(tensors) + 1 + i, "read_write", s.dtype)
                      for i, s in enumerate(plan.scratch))
    elements = {t.name: math.prod(sizes[a] for a in t.shape) for t, _ in tensors}
    elements.update((s.tensor, s.elements) for s in plan.scratch)
    try:
        bindings = pieces.assign(ir.name, plan.template, bindings, elements, target,
                                 frozenset(s.tensor for s in plan.scratch))
    except pieces.BindingLimitError as e:
        raise schedule_error(ir, str(e), "a kernel within the device's storage-binding limits",
                             DeviceLimitError) from None
    outputs = tuple((o.name, o.dtype, tuple(sizes[a] for a in o.shape)) for o in ir.outputs)
    inputs = tuple(t.name for t in ir.inputs if t.name not in ir.inouts)
    return KernelSpec(ir.name, plan.template, plan.params, bindings, plan.entry_points, plan.scratch,
                      tuple(sizes.items()), ir.scalars, inputs, outputs)
