"""The WGSL backend table: how each IR op is spelled, and how a DAG becomes a list of `let`s.

Arithmetic runs in the compute type of a value (f16 storage computes in f32); loads and stores
convert. Templates hold the scaffolding; this module only spells expressions.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from ..ir.nodes import Node, toposort
from ..ir.ops import REDUCE, Op

COMPUTE_TYPE = {"f32": "f32", "f16": "f32", "i32": "i32", "u32": "u32", "float": "f32"}

SPELLING: dict[Op, str] = {
    Op.NEG: "-{0}", Op.EXP: "exp({0})", Op.LOG: "log({0})", Op.SQRT: "sqrt({0})",
    Op.RSQRT: "inverseSqrt({0})", Op.ABS: "abs({0})", Op.SIGMOID: "1.0 / (1.0 + exp(-{0}))",
    Op.SILU: "{0} / (1.0 + exp(-{0}))", Op.TANH: "tanh({0})", Op.RECIP: "1.0 / {0}",
    Op.CAST: "{t}({0})",
    Op.ADD: "{0} + {1}", Op.SUB: "{0} - {1}", Op.MUL: "{0} * {1}", Op.DIV: "{0} / {1}",
    Op.POW: "pow({0}, {1})", Op.MAX: "max({0}, {1})", Op.MIN: "min({0}, {1})",
    Op.LT: "{t}({0} < {1})", Op.GT: "{t}({0} > {1})",
    Op.WHERE: "select({2}, {1}, {0} != {c0}(0))",
}

# identity element and combine spelling for each reduction
REDUCE_INIT = {Op.SUM: "0.0", Op.RMAX: "-3.4028234e38"}
REDUCE_COMBINE = {Op.SUM: "{0} + {1}", Op.RMAX: "max({0}, {1})"}


def literal(value: float, ctype: str) -> str:
    """A literal of the consumer's compute type; negative ones parenthesised so `-{0}` stays valid."""
    if ctype in ("i32", "u32"):
        if value != int(value):
            raise ValueError(f"literal {value} is not an integer but is used as {ctype}")
        text = f"{ctype}({int(value)})"
    else:
        text = repr(float(value))
        text = f"f32({text})"
    return f"({text})" if value < 0 else text


@dataclass
class Let:
    name: str
    ctype: str
    expr: str


class ExprEmitter:
    """Turns IR nodes into named WGSL `let`s, each node once per scope.

    ``load(node)`` spells a read of an INPUT node at the current index; ``dims`` gives axis sizes.
    Names already bound (reduction results, row-level values) are passed in ``bound``.
    """

    def __init__(self, load: Callable[[Node], str], dims: dict[str, int], prefix: str = "v"):
        self.load = load
        self.dims = dims
        self.prefix = prefix
        self.count = 0

    def ref(self, src: Node, ctype: str, bound: dict[int, str]) -> str:
        if src.op == Op.CONST:
            return literal(float(src.arg), ctype)
        if src.op == Op.DIMSIZE:
            return literal(float(self.dims[src.arg]), ctype)
        return bound[id(src)]

    def emit(self, roots, bound: dict[int, str]) -> list[Let]:
        """Lets for every unbound node reachable from roots; adds their names to ``bound``."""
        lets: list[Let] = []
        for n in toposort(roots, stop=bound.keys()):
            if id(n) in bound or n.op in (Op.CONST, Op.DIMSIZE):
                continue
            if n.op in REDUCE:
                raise AssertionError(f"reduction {n} must be bound by its schedule before use")
            ctype = COMPUTE_TYPE[n.dtype]
            if n.op == Op.INPUT:
                expr = self.load(n)
            elif n.op == Op.SCALAR:
                expr = f"info.{n.arg}"
            else:
                src_ctype = COMPUTE_TYPE[n.srcs[0].dtype] if n.op != Op.WHERE else COMPUTE_TYPE[n.srcs[1].dtype]
                operand_type = ctype if n.op not in (Op.CAST,) else src_ctype
                args = [self.ref(s, operand_type if i or n.op != Op.WHERE else COMPUTE_TYPE[s.dtype], bound)
                        for i, s in enumerate(n.srcs)]
                c0 = COMPUTE_TYPE[n.srcs[0].dtype] if n.srcs else ctype
                expr = SPELLING[n.op].format(*args, t=ctype, c0=c0)
            name = f"{self.prefix}{self.count}"
            self.count += 1
            bound[id(n)] = name
            lets.append(Let(name, ctype, expr))
        return lets


def store(value: str, value_dtype: str, storage_dtype: str) -> str:
    """Spell the conversion from a computed value to its output buffer's element type."""
    return value if COMPUTE_TYPE[value_dtype] == storage_dtype else f"{storage_dtype}({value})"
