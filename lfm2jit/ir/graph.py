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
        # an axis order results follow where they can (autodiff sets the forward node's): adjoints
        # built by merging operands pairwise could otherwise order their axes differently
        self.order: tuple[str, ...] | None = None

    def node(self, op: Op, srcs: tuple[Node, ...], shape, dtype: str, arg=None) -> Node:
        key = (op, tuple(id(s) for s in srcs), tuple(shape), dtype, arg)
        if key not in self.interned:
            self.interned[key] = Node(op, tuple(srcs), tuple(shape), dtype, arg)
        return self.interned[key]

    def const(self, value: float) -> Node:
        return self.node(Op.CONST, (), (), ABSTRACT, float(value))

    def unary(self, op: Op, x: Node) -> Node:
        return self.node(op, (x,), x.shape, x.dtype)

    def layout(self, *shapes: tuple[str, ...]) -> tuple[str, ...]:
        """The broadcast shape of operands: in ``order`` when it has all their axes, else merged."""
        axes = {a for s in shapes for a in s}
        if self.order is not None and axes <= set(self.order):
            return tuple(a for a in self.order if a in axes)
        out: tuple[str, ...] | None = ()
        for s in shapes:
            out = merge(out, s)
            assert out is not None, f"conflicting axis orders {shapes}"
        return out

    def binary(self, op: Op, a: Node, b: Node) -> Node:
        dtype = b.dtype if a.dtype == ABSTRACT else a.dtype
        a, b = self.unbroadcast(a, b)
        return self.node(op, (a, b), self.layout(a.shape, b.shape), dtype)

    def unbroadcast(self, *xs: Node) -> tuple[Node, ...]:
        """Operands with an explicit BROADCAST dropped where the others bring its axes anyway, so
        named broadcasting does the repeating and patterns such as a contraction stay visible."""
        out = list(xs)
        for i, x in enumerate(out):
            if x.op == Op.BROADCAST:
                others = {a for j, y in enumerate(out) if j != i for a in y.shape}
                if set(x.shape) <= others | set(x.srcs[0].shape):
                    out[i] = x.srcs[0]
        return tuple(out)

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
        dtype = b.dtype if a.dtype == ABSTRACT else a.dtype
        c, a, b = self.unbroadcast(c, a, b)
        return self.node(Op.WHERE, (c, a, b), self.layout(c.shape, a.shape, b.shape), dtype)

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
