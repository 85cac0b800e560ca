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
    Op.LT: "{t}({0} < {1})", Op.GT: "{t}({0} > {1})", Op.EQ: "{t}({0} == {1})",
    Op.COS: "cos({0})", Op.SIN: "sin({0})",
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


# Ops the emitter spells itself because they change where their source is evaluated.
INDEXING = frozenset({Op.SHIFT, Op.TAKE, Op.EMBED, Op.GATHER, Op.INDEX})


def _same_index_sources(n: Node) -> tuple[Node, ...]:
    """The sources evaluated at the node's own index (the others are emitted under a moved index)."""
    if n.op in (Op.TAKE, Op.SHIFT):
        return ()
    if n.op == Op.GATHER:
        return n.srcs[1:]
    return n.srcs


class ExprEmitter:
    """Turns IR nodes into named WGSL `let`s, each node once per scope.

    ``index_of`` maps each axis to the WGSL expression of the current index along it, and
    ``extent_of`` to the WGSL expression of the axis' valid length (``info.t_valid`` for T).
    Reading a source at another index (SHIFT, TAKE, GATHER) evaluates it again under a changed
    map; only values that do not vary along the changed axis are reused from the outer scope.
    """

    def __init__(self, sizes: dict[str, int], index_of: dict[str, str], extent_of: Callable[[str], str],
                 load: Callable[[Node, dict[str, str]], str], prefix: str = "v", counter: list[int] | None = None):
        self.sizes = sizes
        self.index_of = index_of
        self.extent_of = extent_of
        self.load = load
        self.prefix = prefix
        self.counter = counter if counter is not None else [0]
        self.nodes: dict[int, Node] = {}

    def bind(self, bound: dict[int, str], node: Node, name: str) -> None:
        """Record a value computed outside the emitter (a reduction result)."""
        bound[id(node)] = name
        self.nodes[id(node)] = node

    def ref(self, src: Node, ctype: str, bound: dict[int, str]) -> str:
        if src.op == Op.CONST:
            return literal(float(src.arg), ctype)
        if src.op == Op.DIMSIZE:
            return literal(float(self.sizes[src.arg]), ctype)
        return bound[id(src)]

    def fresh(self) -> str:
        self.counter[0] += 1
        return f"{self.prefix}{self.counter[0] - 1}"

    def moved(self, axis: str, index: str, bound: dict[int, str]) -> tuple["ExprEmitter", dict[int, str]]:
        """An emitter for the same code evaluated at another index along ``axis``."""
        child = ExprEmitter(self.sizes, {**self.index_of, axis: index}, self.extent_of, self.load, self.prefix,
                            self.counter)
        child.nodes = self.nodes
        kept = {k: v for k, v in bound.items() if k in self.nodes and axis not in self.nodes[k].shape}
        return child, kept

    def emit(self, roots, bound: dict[int, str]) -> list[Let]:
        """Lets for every unbound node reachable from roots; adds their names to ``bound``."""
        lets: list[Let] = []
        for n in toposort(roots, stop=bound.keys(), children=_same_index_sources):
            if id(n) in bound or n.op in (Op.CONST, Op.DIMSIZE):
                continue
            if n.op in REDUCE:
                raise ValueError(f"the reduction {n} is needed where it cannot be computed "
                                 "(e.g. read at a shifted position); compute it in a separate kernel")
            ctype = COMPUTE_TYPE[n.dtype]
            if n.op in INDEXING:
                expr = self.indexing(n, ctype, bound, lets)
            elif n.op == Op.INPUT:
                expr = self.load(n, self.index_of)
            elif n.op == Op.SCALAR:
                expr = f"info.{n.arg}"
            else:
                src_ctype = COMPUTE_TYPE[n.srcs[0].dtype] if n.op != Op.WHERE else COMPUTE_TYPE[n.srcs[1].dtype]
                operand_type = ctype if n.op not in (Op.CAST, Op.LT, Op.GT, Op.EQ) else src_ctype
                args = [self.ref(s, operand_type if i or n.op != Op.WHERE else COMPUTE_TYPE[s.dtype], bound)
                        for i, s in enumerate(n.srcs)]
                c0 = COMPUTE_TYPE[n.srcs[0].dtype] if n.srcs else ctype
                expr = SPELLING[n.op].format(*args, t=ctype, c0=c0)
            name = self.fresh()
            bound[id(n)] = name
            self.nodes[id(n)] = n
            lets.append(Let(name, ctype, expr))
        return lets

    def indexing(self, n: Node, ctype: str, bound: dict[int, str], lets: list[Let]) -> str:
        """Spell SHIFT/TAKE/EMBED/GATHER/INDEX, emitting any re-evaluated sources into ``lets``."""
        if n.op == Op.INDEX:
            return f"{ctype}({self.index_of[n.arg]})"
        if n.op == Op.EMBED:
            axis, at = n.arg
            lets.extend(self.emit([n.srcs[0]], bound))
            value = self.ref(n.srcs[0], ctype, bound)
            return f"select({ctype}(0), {value}, {self.index_of[axis]} == {at}u)"
        if n.op == Op.TAKE:
            axis, at = n.arg
            child, scope = self.moved(axis, f"{at}u", bound)
            lets.extend(child.emit([n.srcs[0]], scope))
            return child.ref(n.srcs[0], ctype, scope)
        if n.op == Op.SHIFT:
            axis, off = n.arg
            here = self.index_of[axis]
            if off < 0:
                valid, moved = f"{here} >= {-off}u", f"({here} - {-off}u)"
            else:
                valid, moved = f"{here} + {off}u < {self.extent_of(axis)}", f"({here} + {off}u)"
            child, scope = self.moved(axis, moved, bound)
            lets.extend(child.emit([n.srcs[0]], scope))
            return f"select({ctype}(0), {child.ref(n.srcs[0], ctype, scope)}, {valid})"
        # GATHER: the table is read at the row the id names
        table, ids = n.srcs
        lets.extend(self.emit([ids], bound))
        row = f"u32({self.ref(ids, COMPUTE_TYPE[ids.dtype], bound)})"
        return self.load(table, {**self.index_of, table.shape[0]: row})


def store(value: str, value_dtype: str, storage_dtype: str) -> str:
    """Spell the conversion from a computed value to its output buffer's element type."""
    return value if COMPUTE_TYPE[value_dtype] == storage_dtype else f"{storage_dtype}({value})"
