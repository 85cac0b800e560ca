"""Elementwise schedule: one invocation per element of the iteration space."""
from __future__ import annotations

from dataclasses import dataclass

from ..ir.nodes import SEQ_AXIS, KernelIR
from .code import COMPUTE_TYPE, Compare, IndexLet, Let, SeqLen, Store, Var
from .lower import Lowerer
from .spec import MAX_WORKGROUP, EntryPoint, Plan, index_vars, total, unravel


@dataclass(frozen=True)
class PointwiseParams:
    workgroup_size: int
    total: int
    indices: tuple[IndexLet, ...]       # each axis' index from the flat invocation index gid
    guard: Compare | None               # rows past the real length return early
    lets: tuple[Let, ...]
    stores: tuple[Store, ...]


def plan(ir: KernelIR, sizes: dict[str, int], accumulate: frozenset[str], tiles=None, target=None) -> Plan:
    space = ir.structure.space
    index_of = index_vars(space)
    lower = Lowerer(sizes, index_of)
    bound: dict[int, str] = {}
    lets = lower.emit(ir.results.values(), bound)
    n = total(space, sizes)
    stores = tuple(result_store(lower, ir, o, Var("gid"), bound, accumulate) for o in ir.outputs)
    params = PointwiseParams(MAX_WORKGROUP, n, unravel(space, sizes, Var("gid")),
                             Compare("<", index_of[SEQ_AXIS], SeqLen()) if SEQ_AXIS in space else None,
                             tuple(lets), stores)
    return Plan("pointwise", params, (EntryPoint("main", -(-n // MAX_WORKGROUP)),))


def result_store(lower: Lowerer, ir: KernelIR, out, at, bound: dict[int, str], accumulate) -> Store:
    """The store of output ``out``'s value (bound in ``bound``) at offset ``at``."""
    node = ir.results[out.name]
    ctype = COMPUTE_TYPE[node.dtype]
    return Store(out.name, at, lower.ref(node, ctype, bound), ctype, out.dtype, out.name in accumulate)
