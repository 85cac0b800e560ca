"""Elementwise schedule: each invocation computes ``per_invocation`` elements, a workgroup's width
apart (so every load stays coalesced), and issues their loads together.

One element per invocation keeps too few bytes in flight per thread to reach a big GPU's memory
bandwidth (docs/journal.md, 2026-12-04). Interior workgroups (all their elements
inside the space and before the real sequence length, one workgroup-uniform test) run the
unrolled elements without guards; the last workgroup walks them one by one, guarded."""
from __future__ import annotations

from dataclasses import dataclass

from ..ir.nodes import SEQ_AXIS, KernelIR
from ..tune import heuristics
from .code import COMPUTE_TYPE, Bin, Compare, Const, IndexLet, Let, SeqLen, Store, Var
from .layout import index_vars, total, unravel
from .lower import Lowerer
from .spec import MAX_WORKGROUP, EntryPoint, Plan


@dataclass(frozen=True)
class PointwiseParams:
    workgroup_size: int
    total: int
    indices: tuple[IndexLet, ...]       # each axis' index from the flat invocation index gid
    guard: Compare | None               # rows past the real length return early
    lets: tuple[Let, ...]
    stores: tuple[Store, ...]
    per_invocation: int = 1             # elements an invocation computes, workgroup_size apart
    interior: tuple[Compare, ...] = ()  # all a workgroup's elements (from "first") are in the space and the real length


def plan(ir: KernelIR, sizes: dict[str, int], accumulate: frozenset[str], tiles=None, target=None) -> Plan:
    space = ir.structure.space
    index_of = index_vars(space)
    lower = Lowerer(sizes, index_of)
    bound: dict[int, str] = {}
    lets = lower.emit(ir.results.values(), bound)
    n = total(space, sizes)
    stores = tuple(result_store(lower, ir, o, Var("gid"), bound, accumulate) for o in ir.outputs)
    # a guard on T may stop an invocation's later elements only when T is the outermost axis
    # (then a later element's row is never earlier)
    unrolls = n >= heuristics.UNROLL_MIN_ELEMENTS and (SEQ_AXIS not in space or space[0] == SEQ_AXIS)
    per = heuristics.PER_INVOCATION if unrolls else 1
    span = MAX_WORKGROUP * per
    last = Bin("+", Var("first"), Const(span - 1))
    interior = (Compare("<", last, Const(n)),) + (
        (Compare("<", Bin("/", last, Const(total(space[1:], sizes))), SeqLen()),) if SEQ_AXIS in space else ())
    params = PointwiseParams(MAX_WORKGROUP, n, unravel(space, sizes, Var("gid")),
                             Compare("<", index_of[SEQ_AXIS], SeqLen()) if SEQ_AXIS in space else None,
                             tuple(lets), stores, per, interior if per > 1 else ())
    return Plan("pointwise", params, (EntryPoint("main", -(-n // span)),))


def result_store(lower: Lowerer, ir: KernelIR, out, at, bound: dict[int, str], accumulate) -> Store:
    """The store of output ``out``'s value (bound in ``bound``) at offset ``at``."""
    node = ir.results[out.name]
    ctype = COMPUTE_TYPE[node.dtype]
    return Store(out.name, at, lower.ref(node, ctype, bound), ctype, out.dtype, out.name in accumulate)
