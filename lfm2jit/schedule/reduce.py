"""Reduction schedules.

rowreduce: reductions over the last axis; one workgroup per row, a strided pass per reduction
           and a tree in workgroup memory.
colreduce: reductions over another axis (e.g. summing a weight gradient over T); one invocation
           per output element, looping over the reduced axis.

Both evaluate the kernel in phases: values without the reduced axis are computed once ("outer"),
values with it inside each phase's loop, so the same planner serves both.
"""
from __future__ import annotations

from dataclasses import dataclass

from ..codegen.wgsl import REDUCE_COMBINE, REDUCE_INIT, store
from ..ir.nodes import SEQ_AXIS, KernelIR, Node
from ..ir.ops import REDUCE, Op
from .spec import MAX_WORKGROUP, extent, index_names, make_emitter, offset, schedule_error, store_entry, total, unravel


COLUMN_THREADS = 256


@dataclass(frozen=True)
class Reduction:
    """One accumulation loop: ``node``'s value is ``source`` reduced over ``axes`` (nested sums
    over several axes, as undoing a broadcast produces, become one loop over all of them)."""
    node: Node
    axes: tuple[str, ...]
    source: Node


def merge_nested(reductions: list[Node], order: list[Node]) -> list[Reduction]:
    """Fold SUM(SUM(x, a), b) into one reduction over (a, b) when the inner sum has no other use."""
    users: dict[int, int] = {}
    for n in order:
        for s in n.srcs:
            users[id(s)] = users.get(id(s), 0) + 1
    inner = {id(r.srcs[0]) for r in reductions if r.srcs[0].op == r.op == Op.SUM and users[id(r.srcs[0])] == 1}
    out = []
    for r in reductions:
        if id(r) in inner:
            continue
        axes, src = (r.arg,), r.srcs[0]
        while id(src) in inner:
            axes, src = (src.arg,) + axes, src.srcs[0]
        out.append(Reduction(r, axes, src))
    return out


def _phases(sizes, order: list[Node], reductions: list[Reduction], axes: tuple[str, ...], index_of: dict,
            partner: str):
    """Lets before the first reduction, one phase per reduction, and the bound outer values."""
    emitter = make_emitter(sizes, index_of)
    bound: dict[int, str] = {}

    def outer(n: Node) -> bool:      # computable once: no reduced axis, every reduction under it done
        return not set(axes) & set(n.shape) and n.op not in REDUCE and \
            all(id(s) in bound or s.op in (Op.CONST, Op.DIMSIZE) or outer(s) for s in n.srcs)

    def outer_lets():
        todo = [n for n in order if id(n) not in bound and n.op not in (Op.CONST, Op.DIMSIZE) and outer(n)]
        return [vars(x) for x in emitter.emit(todo, bound)]

    pre = outer_lets()
    phases = []
    for red in reductions:
        scoped = dict(bound)    # inner lets live inside this phase's loop only
        inner = [vars(x) for x in emitter.emit([red.source], scoped)]
        arg = scoped[id(red.source)]
        name = f"r{len(phases)}"
        emitter.bind(bound, red.node, name)
        phase = {"result": name, "init": REDUCE_INIT[red.node.op], "lets": inner,
                 "combine": REDUCE_COMBINE[red.node.op].format(f"acc_{name}", arg)}
        phase["combine_tree"] = REDUCE_COMBINE[red.node.op].format("red[lid]", f"red[{partner}]")
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
    plan = [Reduction(r, (r.arg,), r.srcs[0]) for r in reductions]
    emitter, bound, pre, phases = _phases(sizes, order, plan, (col_axis,), index_of, partner="lid + s")
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
    plan = merge_nested(reductions, order)
    axes = plan[0].axes
    if any(set(r.axes) != set(axes) for r in plan):
        raise schedule_error(ir, "reductions over different axes in one kernel",
                             "one set of reduced axes per kernel (split the kernel)")
    axes = tuple(a for a in space if a in axes)          # loop in the space's order
    plan = [Reduction(r.node, axes, r.source) for r in plan]
    out_axes = tuple(a for a in space if a not in axes)
    for o in ir.outputs:
        if o.shape != out_axes:
            raise schedule_error(ir, f"output {o.name!r} has shape [{', '.join(o.shape)}]",
                                 f"[{', '.join(out_axes)}], the iteration space without {', '.join(axes)}")
    index_of = index_names(space)
    # one loop over the reduced axes together: r runs over their product, the first outermost
    inner = [a for a in axes[1:]]
    loop_indices = []
    stride = 1
    for a in reversed(inner):
        loop_indices.insert(0, {"var": index_of[a], "expr": f"(r / {stride}u) % {sizes[a]}u" if stride > 1
                                else f"r % {sizes[a]}u"})
        stride *= sizes[a]
    loop_indices.insert(0, {"var": index_of[axes[0]], "expr": f"r / {stride}u" if stride > 1 else "r"})
    extent_expr = extent(axes[0], sizes) + (f" * {stride}u" if stride > 1 else "")
    emitter, bound, pre, phases = _phases(sizes, order, plan, axes, index_of, partner="lid + s * OUTS")
    final_lets = [vars(x) for x in emitter.emit([ir.results[o.name] for o in ir.outputs], bound)]
    n = total(out_axes, sizes)
    # Each workgroup owns OUTS outputs, with LANES invocations sharing each one's loop: few outputs
    # (a norm weight's gradient) still spread their long reduction over many invocations.
    outs = 4 if n <= 4096 else 16
    ctx = {
        "workgroup_size": COLUMN_THREADS,
        "outs": outs,
        "lanes": COLUMN_THREADS // outs,
        "total": n,
        "extent": extent_expr,
        "loop_indices": loop_indices,
        "indices": unravel(out_axes, sizes, "gid"),
        "seq_in_outputs": SEQ_AXIS in out_axes,
        "pre": pre,
        "phases": phases,
        "final_lets": final_lets,
        "stores": [store_entry(o.name, "gid", store(bound[id(ir.results[o.name])], ir.results[o.name].dtype, o.dtype),
                               o.name in accumulate) for o in ir.outputs],
    }
    return "colreduce", ctx, -(-n // outs)
