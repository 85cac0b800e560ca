"""Reduction schedules.

rowreduce: reductions over the last axis; one workgroup per row, a strided pass per reduction
           and a tree in workgroup memory.
colreduce: reductions over another axis (e.g. summing a weight gradient over T); one invocation
           per output element, looping over the reduced axis.

Both evaluate the kernel in phases: values without the reduced axis are computed once ("outer"),
values with it inside each phase's loop, so the same planner serves both.
"""
from __future__ import annotations

from ..codegen.wgsl import REDUCE_COMBINE, REDUCE_INIT, store
from ..ir.nodes import SEQ_AXIS, KernelIR, Node
from ..ir.ops import REDUCE, Op
from .spec import MAX_WORKGROUP, extent, index_names, make_emitter, offset, schedule_error, store_entry, total, unravel


def _phases(ir: KernelIR, sizes, order: list[Node], reductions: list[Node], axis: str, index_of: dict,
            combine_tree: bool):
    """Lets before the first reduction, one phase per reduction, and the bound outer values."""
    emitter = make_emitter(sizes, index_of)
    bound: dict[int, str] = {}

    def outer(n: Node) -> bool:      # computable once: no reduced axis, every reduction under it done
        return axis not in n.shape and n.op not in REDUCE and \
            all(id(s) in bound or s.op in (Op.CONST, Op.DIMSIZE) or outer(s) for s in n.srcs)

    def outer_lets():
        todo = [n for n in order if id(n) not in bound and n.op not in (Op.CONST, Op.DIMSIZE) and outer(n)]
        return [vars(x) for x in emitter.emit(todo, bound)]

    pre = outer_lets()
    phases = []
    for r in reductions:
        scoped = dict(bound)    # inner lets live inside this phase's loop only
        inner = [vars(x) for x in emitter.emit([r.srcs[0]], scoped)]
        arg = scoped[id(r.srcs[0])]
        name = f"r{len(phases)}"
        emitter.bind(bound, r, name)
        phase = {"result": name, "init": REDUCE_INIT[r.op], "lets": inner,
                 "combine": REDUCE_COMBINE[r.op].format(f"acc_{name}", arg)}
        if combine_tree:
            phase["combine_tree"] = REDUCE_COMBINE[r.op].format("red[lid]", "red[lid + s]")
        phase["after"] = outer_lets()
        phases.append(phase)
    return emitter, bound, pre, phases


def plan_rows(ir: KernelIR, sizes, space, order, reductions, accumulate: frozenset[str]):
    col_axis = space[-1]
    row_axes = space[:-1]
    for o in ir.outputs:
        if o.shape not in (space, row_axes):
            raise schedule_error(ir, f"output {o.name!r} has shape [{', '.join(o.shape)}]",
                                 f"[{', '.join(space)}] or one value per row [{', '.join(row_axes)}]")
    index_of = index_names(space)
    index_of[col_axis] = "c"
    emitter, bound, pre, phases = _phases(ir, sizes, order, reductions, col_axis, index_of, combine_tree=True)
    final_scope = dict(bound)
    elem_outputs = [o for o in ir.outputs if o.shape == space]
    row_outputs = [o for o in ir.outputs if o.shape != space]
    final_lets = [vars(x) for x in emitter.emit([ir.results[o.name] for o in elem_outputs], final_scope)]
    wg = min(MAX_WORKGROUP, max(32, 1 << (sizes[col_axis] - 1).bit_length()))
    rows = total(row_axes, sizes)
    row_index = index_names(row_axes)

    def stores(outs, scope, idx):
        return [store_entry(o.name, offset(o.shape, sizes, idx), store(scope[id(ir.results[o.name])],
                            ir.results[o.name].dtype, o.dtype), o.name in accumulate) for o in outs]

    ctx = {
        "workgroup_size": wg,
        "rows": rows,
        "cols": extent(col_axis, sizes),
        "indices": unravel(row_axes, sizes, "row"),
        "seq_in_rows": SEQ_AXIS in row_axes,
        "pre": pre,
        "phases": phases,
        "final_lets": final_lets,
        "elem_stores": stores(elem_outputs, final_scope, index_of),
        "row_stores": stores(row_outputs, bound, row_index),
    }
    return "rowreduce", ctx, rows


def plan_columns(ir: KernelIR, sizes, space, order, reductions, accumulate: frozenset[str]):
    axis = reductions[0].arg
    if any(r.arg != axis for r in reductions):
        raise schedule_error(ir, "reductions over different axes in one kernel",
                             "one reduced axis per kernel (split the kernel)")
    out_axes = tuple(a for a in space if a != axis)
    for o in ir.outputs:
        if o.shape != out_axes:
            raise schedule_error(ir, f"output {o.name!r} has shape [{', '.join(o.shape)}]",
                                 f"[{', '.join(out_axes)}], the iteration space without {axis}")
    index_of = index_names(space)
    index_of[axis] = "r"
    emitter, bound, pre, phases = _phases(ir, sizes, order, reductions, axis, index_of, combine_tree=False)
    final_lets = [vars(x) for x in emitter.emit([ir.results[o.name] for o in ir.outputs], bound)]
    n = total(out_axes, sizes)
    ctx = {
        "workgroup_size": 64,
        "total": n,
        "extent": extent(axis, sizes),
        "indices": unravel(out_axes, sizes, "gid"),
        "seq_in_outputs": SEQ_AXIS in out_axes,
        "pre": pre,
        "phases": phases,
        "final_lets": final_lets,
        "stores": [store_entry(o.name, "gid", store(bound[id(ir.results[o.name])], ir.results[o.name].dtype, o.dtype),
                               o.name in accumulate) for o in ir.outputs],
    }
    return "colreduce", ctx, -(-n // 64)
