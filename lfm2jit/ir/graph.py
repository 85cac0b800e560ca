"""GraphBuilder: makes IR nodes, interning duplicates, with shapes and dtypes by the DSL's rules.

The type checker builds the forward graph through it and the gradient rules the backward one, so
both follow one broadcasting rule (``shapes.merge``) and one dtype rule (a literal takes the dtype
of the value it meets).
"""
from __future__ import annotations

from .nodes import ABSTRACT, Node
from .ops import Op
from .shapes import merge


class GraphBuilder:
    def __init__(self):
        self.interned: dict[tuple, Node] = {}

    def node(self, op: Op, srcs: tuple[Node, ...], shape, dtype: str, arg=None) -> Node:
        key = (op, tuple(id(s) for s in srcs), tuple(shape), dtype, arg)
        if key not in self.interned:
            self.interned[key] = Node(op, tuple(srcs), tuple(shape), dtype, arg)
        return self.interned[key]

    def const(self, value: float) -> Node:
        return self.node(Op.CONST, (), (), ABSTRACT, float(value))

    def unary(self, op: Op, x: Node) -> Node:
        return self.node(op, (x,), x.shape, x.dtype)

    def binary(self, op: Op, a: Node, b: Node) -> Node:
        shape = merge(a.shape, b.shape)
        assert shape is not None, f"conflicting axis orders {a} {b}"
        dtype = b.dtype if a.dtype == ABSTRACT else a.dtype
        return self.node(op, (a, b), shape, dtype)

    def add(self, a, b):
        return self.binary(Op.ADD, a, b)

    def sub(self, a, b):
        return self.binary(Op.SUB, a, b)

    def mul(self, a, b):
        return self.binary(Op.MUL, a, b)

    def div(self, a, b):
        return self.binary(Op.DIV, a, b)

    def neg(self, a):
        return self.unary(Op.NEG, a)

    def where(self, c, a, b):
        shape = merge(merge(c.shape, a.shape), b.shape)
        dtype = b.dtype if a.dtype == ABSTRACT else a.dtype
        return self.node(Op.WHERE, (c, a, b), shape, dtype)

    def cast(self, x: Node, dtype: str) -> Node:
        return x if x.dtype == dtype else self.node(Op.CAST, (x,), x.shape, dtype, dtype)

    def sum(self, x: Node, axis: str) -> Node:
        return self.node(Op.SUM, (x,), tuple(a for a in x.shape if a != axis), x.dtype, axis)

    def sum_to(self, x: Node, shape: tuple[str, ...]) -> Node:
        """Undo broadcasting: sum ``x`` over every axis it has beyond ``shape``."""
        for axis in [a for a in x.shape if a not in shape]:
            x = self.sum(x, axis)
        return x

    def broadcast(self, x: Node, shape: tuple[str, ...]) -> Node:
        """``x`` repeated over the axes of ``shape`` it lacks (explicit, where an op needs them)."""
        return x if x.shape == tuple(shape) else self.node(Op.BROADCAST, (x,), shape, x.dtype)
