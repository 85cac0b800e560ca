"""Elementwise schedule: one invocation per element of the iteration space."""
from __future__ import annotations

from ..codegen.wgsl import store
from ..ir.nodes import KernelIR
from .spec import MAX_WORKGROUP, index_names, make_emitter, schedule_error, store_entry, total, unravel


def plan(ir: KernelIR, sizes: dict[str, int], space: tuple[str, ...], accumulate: frozenset[str]):
    for o in ir.outputs:
        if o.shape != space:
            raise schedule_error(ir, f"output {o.name!r} has shape [{', '.join(o.shape)}] but the kernel iterates "
                                 f"over [{', '.join(space)}]", "all outputs of an elementwise kernel share one shape")
    index_of = index_names(space)
    emitter = make_emitter(sizes, index_of)
    bound: dict[int, str] = {}
    lets = emitter.emit(ir.results.values(), bound)
    n = total(space, sizes)
    ctx = {
        "workgroup_size": MAX_WORKGROUP,
        "total": n,
        "indices": unravel(space, sizes, "gid"),
        "lets": [vars(x) for x in lets],
        "stores": [store_entry(o.name, "gid", store(bound[id(ir.results[o.name])], ir.results[o.name].dtype, o.dtype),
                               o.name in accumulate) for o in ir.outputs],
    }
    return "pointwise", ctx, -(-n // MAX_WORKGROUP)
