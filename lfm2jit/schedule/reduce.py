"""Reduction schedules.

rowreduce: reductions over the last axis of the space; one workgroup per row, a strided pass per
           reduction and a tree in workgroup memory.
colreduce: reductions over other axes (e.g. summing a weight gradient over T); each workgroup owns
           a few outputs, and several invocations share each output's loop over the reduced axes.
           Few outputs over a long loop (a norm weight's gradient: 64 outputs over T x heads) split
           the loop into slices, summed into a workspace that a second pass combines in slice
           order (deterministic), so that enough workgroups run to fill the GPU.

Both evaluate the kernel in phases: values without a reduced axis are computed once ("outer"),
values with one inside each phase's loop, so the same planner serves both.
"""
from __future__ import annotations

from dataclasses import dataclass

from ..ir.nodes import SEQ_AXIS, KernelIR, Node, toposort
from ..ir.ops import REDUCE, Op
from ..ir.partition import is_inline, reduction_chain, use_counts
from ..tune import heuristics
from .code import Bin, Compare, Const, Index, IndexLet, Let, SeqLen, Store, Var
from .layout import extent, index_vars, offset, total, unravel
from .lower import Lowerer
from .pointwise import result_store
from .spec import MAX_WORKGROUP, EntryPoint, Plan, Scratch

COLUMN_THREADS = 256
REDUCE_THREADS = 256   # invocations per workgroup of the pass that combines the slices
MAX_GROUPS_X = 65535   # a split reduction's output groups run along x alone (its slices along z)


@dataclass(frozen=True)
class Phase:
    """One accumulation loop: ``result`` = the ``op`` reduction of ``value`` (computed by ``lets``
    at every reduced index), then the outer values it makes computable (``after``)."""
    result: str
    op: Op
    lets: tuple[Let, ...]
    value: object
    after: tuple[Let, ...]


@dataclass(frozen=True)
class RowReduceParams:
    workgroup_size: int
    rows: int
    cols: Index                          # the reduced axis' extent
    indices: tuple[IndexLet, ...]        # row axes from the row number
    guard: Compare | None                # rows past the real length return early
    pre: tuple[Let, ...]
    phases: tuple[Phase, ...]
    final_lets: tuple[Let, ...]          # element outputs, inside a last loop over the row
    elem_stores: tuple[Store, ...]
    row_stores: tuple[Store, ...]        # one value per row, stored by invocation 0
    unroll: int = 1                      # strides per loop trip: loads in flight per invocation


@dataclass(frozen=True)
class ColReduceParams:
    workgroup_size: int
    outs: int                            # outputs per workgroup
    lanes: int                           # invocations sharing one output's loop
    total: int
    extent: Index                        # the flattened loop over the reduced axes
    loop_indices: tuple[IndexLet, ...]   # the reduced axes from the loop counter r
    indices: tuple[IndexLet, ...]        # output axes from the output number gid
    guard: Compare | None                # outputs past the real length store nothing
    pre: tuple[Let, ...]
    phases: tuple[Phase, ...]
    final_lets: tuple[Let, ...]
    stores: tuple[Store, ...]
    split: int = 1                       # slices of the reduced loop (> 1: pass 2 "reduce" combines them)
    reduce_threads: int = REDUCE_THREADS


def _phases(ir: KernelIR, sizes, axes: tuple[str, ...], index_of: dict):
    """Lets before the first reduction, one phase per reduction (nested sums over several axes,
    as undoing a broadcast makes, are one loop over all of them), and the bound outer values.
    Inline reductions (a conv's taps) are not phases: each invocation loops over them itself."""
    order = toposort(ir.results.values())
    users = use_counts(ir.results.values())
    scheduled = [r for r in order if r.op in REDUCE and not is_inline(r)]
    links = {id(x) for r in scheduled for x in reduction_chain(r, users)[2]}
    reductions = [r for r in scheduled if id(r) not in links]
    lower = Lowerer(sizes, index_of)
    bound: dict[int, str] = {}

    def outer(n: Node, reduced=frozenset(axes)) -> bool:
        """Computable once, outside the loops: no reduced axis, every reduction under it done. A
        fixed index (x[:, 0] of a reduced axis) pins the axis for what it reads, and an inline
        reduction loops over its own axis itself."""
        inner = reduced - {n.arg[0]} if n.op == Op.TAKE else reduced - {n.arg} if n.op in REDUCE else reduced
        return not reduced & set(n.shape) and (n.op not in REDUCE or is_inline(n)) and \
            all(id(s) in bound or s.op in (Op.CONST, Op.DIMSIZE) or outer(s, inner) for s in n.srcs)

    def outer_lets():   # values over the kernel's own axes (those inside an inline loop stay there)
        todo = [n for n in order if id(n) not in bound and n.op not in (Op.CONST, Op.DIMSIZE)
                and set(n.shape) <= set(index_of) and outer(n)]
        return tuple(lower.emit(todo, bound))

    pre = outer_lets()
    phases = []
    for red in reductions:
        _, source, _ = reduction_chain(red, users)
        scoped = dict(bound)    # inner lets live inside this phase's loop only
        inner = tuple(lower.emit([source], scoped))
        value = lower.ref(source, "f32", scoped)
        name = f"r{len(phases)}"
        lower.bind(bound, red, name)
        phases.append(Phase(name, red.op, inner, value, outer_lets()))
    return lower, bound, pre, tuple(phases)


def plan_rows(ir: KernelIR, sizes, accumulate: frozenset[str], tiles=None, target=None) -> Plan:
    space = ir.structure.space
    col_axis, row_axes = space[-1], space[:-1]
    index_of = index_vars(space)
    index_of[col_axis] = Var("c")
    lower, bound, pre, phases = _phases(ir, sizes, (col_axis,), index_of)
    final_scope = dict(bound)
    elem_outputs = [o for o in ir.outputs if o.shape == space]
    row_outputs = [o for o in ir.outputs if o.shape != space]
    final_lets = tuple(lower.emit([ir.results[o.name] for o in elem_outputs], final_scope))
    wg = min(MAX_WORKGROUP, max(32, 1 << (sizes[col_axis] - 1).bit_length()))
    rows = total(row_axes, sizes)
    row_index = index_vars(row_axes)
    params = RowReduceParams(
        wg, rows, extent(col_axis, sizes), unravel(row_axes, sizes, Var("row")),
        Compare("<", index_of[SEQ_AXIS], SeqLen()) if SEQ_AXIS in row_axes else None,
        pre, phases, final_lets,
        tuple(result_store(lower, ir, o, offset(o.shape, sizes, index_of), final_scope, accumulate)
              for o in elem_outputs),
        tuple(result_store(lower, ir, o, offset(o.shape, sizes, row_index), bound, accumulate) for o in row_outputs),
        strided_unroll(extent(col_axis, sizes), wg))
    return Plan("rowreduce", params, (EntryPoint("main", rows),))


def strided_unroll(cols: Index, wg: int) -> int:
    """Workgroup strides per trip of a row loop: the largest power of two up to heuristics.ROW_UNROLL
    that the row's whole strides divide, so the unrolled trip needs no bound check and its loads
    issue together (one load in flight per invocation leaves a row pass short of the bandwidth).
    A row whose length is only known at run time keeps one stride per trip."""
    if not isinstance(cols, Const) or cols.value % wg:
        return 1
    u = heuristics.ROW_UNROLL
    while (cols.value // wg) % u:
        u //= 2
    return u


def plan_columns(ir: KernelIR, sizes, accumulate: frozenset[str], tiles=None, target=None) -> Plan:
    out_axes = ir.structure.space
    # T outermost: the loop then runs to its real length (an inner axis runs to its baked size)
    axes = tuple(sorted(ir.structure.reduced, key=lambda a: a != SEQ_AXIS))
    index_of = index_vars(out_axes + axes)
    # one loop over the reduced axes together: r runs over their product, the first outermost
    loop_indices = []
    stride = 1
    for a in reversed(axes[1:]):
        var = index_of[a].name
        loop_indices.insert(0, IndexLet(var, Bin("%", Bin("/", Var("r"), Const(stride)) if stride > 1 else Var("r"),
                                                 Const(sizes[a]))))
        stride *= sizes[a]
    loop_indices.insert(0, IndexLet(index_of[axes[0]].name, Bin("/", Var("r"), Const(stride)) if stride > 1 else Var("r")))
    loop_extent = extent(axes[0], sizes)
    if stride > 1:
        loop_extent = Bin("*", loop_extent, Const(stride))
    lower, bound, pre, phases = _phases(ir, sizes, axes, index_of)
    final_lets = tuple(lower.emit([ir.results[o.name] for o in ir.outputs], bound))
    n = total(out_axes, sizes)
    # Each workgroup owns OUTS outputs, with LANES invocations sharing each one's loop: few outputs
    # (a norm weight's gradient) still spread their long reduction over many invocations.
    outs = 4 if n <= 4096 else 16
    groups = -(-n // outs)
    split = tiles.split if tiles is not None else heuristics.column_split(groups, total(axes, sizes), len(phases))
    if split > 1 and (len(phases) != 1 or groups > MAX_GROUPS_X):
        raise ValueError(f"{ir.name}: tiles={tiles!r}: only a single reduction of at most "
                         f"{MAX_GROUPS_X * outs} outputs splits its loop (this one has {len(phases)} "
                         f"reductions, {n} outputs)")
    params = ColReduceParams(
        COLUMN_THREADS, outs, COLUMN_THREADS // outs, n, loop_extent, tuple(loop_indices),
        unravel(out_axes, sizes, Var("gid")),
        Compare("<", index_of[SEQ_AXIS], SeqLen()) if SEQ_AXIS in out_axes else None,
        pre, phases, final_lets,
        tuple(result_store(lower, ir, o, Var("gid"), bound, accumulate) for o in ir.outputs), split)
    if split == 1:
        return Plan("colreduce", params, (EntryPoint("main", groups),))
    return Plan("colreduce", params, (EntryPoint("main", (groups, 1, split)),
                                      EntryPoint("reduce", -(-n // REDUCE_THREADS))),
                (Scratch("ws", "f32", split * n),))
