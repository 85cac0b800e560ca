"""Split a kernel whose outputs need different schedules into several kernels.

Autodiff yields one backward IR per forward kernel, but its outputs rarely share a loop
structure: rmsnorm's dx reduces each row while dw reduces over T. Outputs are grouped by the
schedule they need; each group becomes a kernel with only the inputs it reads.
"""
from __future__ import annotations

from .nodes import KernelIR, Node, toposort
from .ops import REDUCE, Op


def is_contraction(n: Node) -> bool:
    """SUM over K of a product of two operands that each have an axis the other lacks."""
    if n.op != Op.SUM or n.srcs[0].op != Op.MUL:
        return False
    a, b = n.srcs[0].srcs
    k = n.arg
    return k in a.shape and k in b.shape and bool(set(a.shape) - set(b.shape)) and bool(set(b.shape) - set(a.shape))


def schedule_class(node: Node) -> str:
    """'intrinsic', 'contraction', 'colreduce', 'rowreduce' or 'pointwise' for the graph computing ``node``."""
    if node.op == Op.PROJ:
        return "intrinsic"
    reduces = [n for n in toposort([node]) if n.op in REDUCE]
    if any(is_contraction(r) for r in reduces):
        return "contraction"
    if any(r.arg != r.srcs[0].shape[-1] for r in reduces):
        return "colreduce"
    return "rowreduce" if reduces else "pointwise"


def partition(ir: KernelIR) -> list[KernelIR]:
    """One kernel per group of outputs that can share a schedule (contractions and column
    reductions get a kernel each; row reductions and elementwise outputs group by shape)."""
    groups: dict[tuple, list[str]] = {}
    for out in ir.outputs:
        node = ir.results[out.name]
        cls = schedule_class(node)
        if cls == "intrinsic":
            key = (cls, id(node.srcs[0]))       # every output of one call in one kernel
        elif cls in ("contraction", "colreduce"):
            key = (cls, out.name)
        else:
            key = ("fused", _space(node, out.shape))
        groups.setdefault(key, []).append(out.name)
    if len(groups) == 1:
        return [ir]
    kernels = []
    for names in groups.values():
        results = {n: ir.results[n] for n in names}
        used = {n.arg for n in toposort(results.values()) if n.op in (Op.INPUT, Op.SCALAR)}
        kernels.append(KernelIR(
            f"{ir.name}_{'_'.join(names)}", tuple(t for t in ir.inputs if t.name in used),
            tuple(s for s in ir.scalars if s in used), tuple(o for o in ir.outputs if o.name in names),
            results, ir.source, ir.filename, ir.line, dict(ir.fixed_dims)))
    return kernels


def _space(node: Node, out_shape: tuple[str, ...]) -> tuple[str, ...]:
    """The iteration space a fused group is keyed by: the largest shape in the output's graph."""
    space = out_shape
    for n in toposort([node]):
        if len(n.shape) > len(space):
            space = n.shape
    return space
