"""Defaults: the kernel a call runs when it leaves out inputs that have a default.

``b: f32[D] = 0`` lets a caller omit ``b``; the kernel then runs with ``b`` fixed to its value (a
literal repeated over b's axes), so the binding disappears and the arithmetic folds. A scalar with a
default becomes that literal.
"""
from __future__ import annotations

from dataclasses import replace

from .nodes import ABSTRACT, KernelIR, Node, substitute, toposort
from .ops import Op


def fix_defaults(ir: KernelIR, omitted: frozenset[str]) -> KernelIR:
    """``ir`` with each input in ``omitted`` (all of which have defaults) replaced by its value."""
    unknown = sorted(set(omitted) - set(ir.defaults))
    if unknown:
        raise ValueError(f"{ir.name}: {unknown} have no default")
    mapping: dict[int, Node] = {}
    for n in toposort(ir.results.values()):
        if n.op in (Op.INPUT, Op.SCALAR) and n.arg in omitted:
            value = Node(Op.CONST, (), (), ABSTRACT, ir.defaults[n.arg])
            mapping[id(n)] = Node(Op.BROADCAST, (value,), n.shape, n.dtype) if n.shape else value
    return replace(ir, inputs=tuple(t for t in ir.inputs if t.name not in omitted),
                   scalars=tuple(s for s in ir.scalars if s not in omitted),
                   defaults={k: v for k, v in ir.defaults.items() if k not in omitted},
                   results=substitute(ir.results, mapping), structure=None)
