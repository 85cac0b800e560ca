"""IR + concrete sizes -> a KernelSpec: which template, with which parameters, launched how.

Binding table (the same for every schedule; sizes derive from it):

    group 0, binding 0        uniform Info { t_valid: u32, <each scalar>: f32 }   runtime values, no recompile
    group 0, binding 1..n     the tensor inputs in signature order,  var<storage, read>
    group 0, binding n+1..    the outputs in signature order,        var<storage, read_write>

Specialization: every axis gets a concrete size baked into the WGSL as a `const`; the sequence
axis T is rounded up to a multiple of the length bucket, and the real length is `info.t_valid`, so
one pipeline serves every length in a bucket. No template reads or writes rows past `t_valid`.
"""
from __future__ import annotations

from ..ir.nodes import SEQ_AXIS, KernelIR, Node, toposort
from ..ir.ops import REDUCE, Op
from ..ir.partition import schedule_class
from ..ir.shapes import merge
from . import contraction, intrinsic, pointwise, reduce
from .intrinsic import check_tiles_kind
from .spec import KernelSpec, bind_dims, bucketed, buffer_var, ident, schedule_error

__all__ = ["KernelSpec", "bind_dims", "bucketed", "specialize"]


def _iteration_space(ir: KernelIR, order: list[Node]) -> tuple[str, ...]:
    """The axes the kernel loops over: outputs' and reduced values' axes, merged by name."""
    space: tuple[str, ...] = ()
    for shape in [o.shape for o in ir.outputs] + [n.srcs[0].shape for n in order if n.op in REDUCE]:
        merged = merge(space, shape) if len(space) >= len(shape) else merge(shape, space)
        if merged is None:
            raise schedule_error(ir, f"axes [{', '.join(space)}] and [{', '.join(shape)}] are ordered differently",
                                 "one axis order across outputs and reduced values")
        space = merged
    return space


def _reindexed_sources(order: list[Node]) -> set[int]:
    """Values that may have axes the iteration space lacks: those read at a fixed or looked-up
    index (under TAKE, a GATHER's table) and an intrinsic's operands (its template indexes them)."""
    out: set[int] = set()
    for n in order:
        if n.op in (Op.TAKE, Op.INTRINSIC):
            out.update(id(s) for s in n.srcs)
        elif n.op == Op.GATHER:
            out.add(id(n.srcs[0]))
    return out


def specialize(ir: KernelIR, dims: dict[str, int], bucket: int = 1,
               accumulate: frozenset[str] = frozenset(), tiles=None) -> KernelSpec:
    """Choose the schedule for a kernel and fill in its template parameters.

    ``accumulate`` names outputs whose existing contents the kernel adds to (gradient accumulation).
    ``tiles`` overrides the schedule's own tile choice (the autotuner tries several): a TileConfig
    for a contraction, the intrinsic's class (AttentionTiles) for an intrinsic; None elsewhere.
    """
    unknown = set(accumulate) - {o.name for o in ir.outputs}
    if unknown:
        raise ValueError(f"{ir.name}: cannot accumulate into {sorted(unknown)}: not outputs")
    sizes = bind_dims(ir, dims, bucket)
    order = toposort(ir.results.values())
    for n in order:
        if n.op in (Op.TAKE, Op.EMBED) and n.arg[1] >= sizes[n.arg[0]]:
            raise schedule_error(ir, f"index {n.arg[1]} is out of range for axis {n.arg[0]} of size "
                                 f"{sizes[n.arg[0]]}", f"{n.arg[0]} larger than {n.arg[1]}")
    classes = {schedule_class(ir.results[o.name]) for o in ir.outputs}
    acc = frozenset(accumulate)
    if "intrinsic" in classes:             # templates with their own layouts
        template, ctx, groups = intrinsic.plan(ir, sizes, acc, tiles)
    elif "contraction" in classes:
        check_tiles_kind(ir, tiles, contraction.TileConfig, "matmul")
        template, ctx, groups = contraction.plan(ir, sizes, acc, tiles)
    else:                                  # generated loops over one iteration space
        check_tiles_kind(ir, tiles, None, "pointwise or reduction")
        space = _iteration_space(ir, order)
        for n in toposort(ir.results.values(), stop=_reindexed_sources(order)):
            if n.shape and not all(a in space for a in n.shape):
                raise schedule_error(ir, f"value {n} does not fit the iteration space [{', '.join(space)}]",
                                     "every value's axes within the largest output's")
        reductions = [n for n in order if n.op in REDUCE]
        if "colreduce" in classes:
            template, ctx, groups = reduce.plan_columns(ir, sizes, space, order, reductions, acc)
        elif reductions:
            template, ctx, groups = reduce.plan_rows(ir, sizes, space, order, reductions, acc)
        else:
            template, ctx, groups = pointwise.plan(ir, sizes, space, acc)
    if ir.inouts and template != "pointwise":
        raise schedule_error(ir, f"in-place outputs {list(ir.inouts)} in a {template} kernel",
                             "in-place updates only in elementwise kernels")
    ctx.update(_common(ir, sizes, ctx.pop("vec4_bindings", {}), ctx.pop("extra_bindings", ())))
    ctx["template"] = template
    outputs = tuple((o.name, o.dtype, tuple(sizes[a] for a in o.shape)) for o in ir.outputs)
    inputs = tuple(t.name for t in ir.inputs if t.name not in ir.inouts)
    return KernelSpec(ir.name, template, ctx, groups, inputs, outputs, ir.scalars, sizes)


def _common(ir: KernelIR, sizes: dict[str, int], vec4_bindings: dict[str, str] | None = None,
            extra_bindings=()) -> dict:
    """Template parameters every schedule shares; ``vec4_bindings`` maps tensors read as vectors
    to their element type (e.g. "vec4<f32>"); ``extra_bindings`` are scratch buffers the engine
    provides after the outputs (a split-K workspace)."""
    vec4_bindings = vec4_bindings or {}
    tensors = [(t, "read") for t in ir.inputs if t.name not in ir.inouts] + [(t, "read_write") for t in ir.outputs]
    return {
        "kernel": ir.name,
        "dims": [{"name": ident(a), "size": s} for a, s in sizes.items()],
        "has_seq": SEQ_AXIS in sizes,
        "scalars": list(ir.scalars),
        "uses_f16": any(t.dtype == "f16" for t, _ in tensors),
        "bindings": [{"name": buffer_var(t.name), "binding": i + 1, "access": acc,
                      "elem": vec4_bindings.get(t.name, t.dtype)}
                     for i, (t, acc) in enumerate(tensors)]
                    + [dict(b, binding=len(tensors) + 1 + i, access="read_write") for i, b in enumerate(extra_bindings)],
    }
