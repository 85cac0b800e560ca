"""Defaults: the kernel a call runs when it leaves out inputs that have a default.

``b: f32[D] = 0`` lets a caller omit ``b``; the kernel then runs with ``b`` fixed to its value (a
literal repeated over b's axes), so the binding disappears and the arithmetic folds: adding a zero,
subtracting one, multiplying or dividing by a one leaves the other operand (``linear``'s omitted
residual makes it the plain GEMM again, bit for bit, with no epilogue). A scalar with a default
becomes that literal.
"""
from __future__ import annotations

from dataclasses import replace

from .nodes import ABSTRACT, KernelIR, Node, substitute, toposort
from .ops import Op

# op -> (the literal that leaves the other operand unchanged, the operand positions it may take)
IDENTITIES = {Op.ADD: (0.0, (0, 1)), Op.SUB: (0.0, (1,)), Op.MUL: (1.0, (0, 1)), Op.DIV: (1.0, (1,))}


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
                   results=fold_identities(substitute(ir.results, mapping)), structure=None)


def fold_identities(results: dict[str, Node]) -> dict[str, Node]:
    """The graph under ``results`` with every x + 0, 0 + x, x - 0, x * 1, 1 * x and x / 1 replaced
    by x (repeated over the node's axes where x has fewer). Exact in IEEE arithmetic, except that
    -0 + 0 gives +0 where x stays -0."""
    memo: dict[int, Node] = {}
    for n in toposort(results.values()):
        srcs = tuple(memo.get(id(s), s) for s in n.srcs)
        out = n if all(a is b for a, b in zip(srcs, n.srcs)) else Node(n.op, srcs, n.shape, n.dtype, n.arg)
        neutral, sides = IDENTITIES.get(n.op, (None, ()))
        for i in sides:
            other = srcs[1 - i]
            if _literal(srcs[i]) == neutral and other.dtype == n.dtype:
                out = other if other.shape == n.shape else Node(Op.BROADCAST, (other,), n.shape, n.dtype)
                break
        memo[id(n)] = out
    return {k: memo[id(v)] for k, v in results.items()}


def _literal(n: Node):
    """The literal a node repeats (a CONST, or a BROADCAST of one), else None."""
    while n.op == Op.BROADCAST:
        n = n.srcs[0]
    return n.arg if n.op == Op.CONST else None
