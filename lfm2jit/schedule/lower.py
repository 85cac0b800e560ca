"""Lowering IR values to per-invocation code: each node becomes a typed Let, once per scope.

``index_of`` maps each axis to the index expression of the current element along it. Reading a
source at another index (SHIFT, TAKE, GATHER) lowers it again under a changed map; only values
that do not vary along the changed axis are reused from the outer scope.
"""
from __future__ import annotations

from ..ir.nodes import SEQ_AXIS, Node, toposort
from ..ir.ops import REDUCE, Op
from .code import (COMPUTE_TYPE, Apply, Bin, Compare, Const, Guard, Index, IndexValue, Let, Lit, Load, Ref,
                   ScalarArg, SeqLen, Var, add)
from .spec import extent, offset

# Ops that change where their source is evaluated, lowered by ``indexing``.
INDEXING = frozenset({Op.SHIFT, Op.TAKE, Op.EMBED, Op.GATHER, Op.INDEX})


def _same_index_sources(n: Node) -> tuple[Node, ...]:
    """The sources evaluated at the node's own index (the others are lowered under a moved index)."""
    if n.op in (Op.TAKE, Op.SHIFT):
        return ()
    if n.op == Op.GATHER:
        return n.srcs[1:]
    return n.srcs


class Lowerer:
    def __init__(self, sizes: dict[str, int], index_of: dict[str, Index], prefix: str = "v",
                 counter: list[int] | None = None):
        self.sizes = sizes
        self.index_of = index_of
        self.prefix = prefix
        self.counter = counter if counter is not None else [0]
        self.nodes: dict[int, Node] = {}

    def bind(self, bound: dict[int, str], node: Node, name: str) -> None:
        """Record a value computed outside the lowerer (a reduction's result)."""
        bound[id(node)] = name
        self.nodes[id(node)] = node

    def ref(self, src: Node, ctype: str, bound: dict[int, str]):
        if src.op == Op.CONST:
            return Lit(float(src.arg), ctype)
        if src.op == Op.DIMSIZE:        # mean over T divides by the real length, not the padded one
            if src.arg == SEQ_AXIS:
                return IndexValue(SeqLen(), ctype)
            return Lit(float(self.sizes[src.arg]), ctype)
        return Ref(bound[id(src)])

    def load(self, n: Node, index_of: dict[str, Index]) -> Load:
        return Load(n.arg, offset(n.shape, self.sizes, index_of), n.dtype)

    def fresh(self) -> str:
        self.counter[0] += 1
        return f"{self.prefix}{self.counter[0] - 1}"

    def moved(self, axis: str, index: Index, bound: dict[int, str]) -> tuple["Lowerer", dict[int, str]]:
        """A lowerer for the same values evaluated at another index along ``axis``."""
        child = Lowerer(self.sizes, {**self.index_of, axis: index}, self.prefix, self.counter)
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
                raise AssertionError(f"the reduction {n} reached lowering unbound: partition() cuts such values")
            if n.op == Op.BROADCAST and n.srcs[0].op not in (Op.CONST, Op.DIMSIZE):
                self.bind(bound, n, bound[id(n.srcs[0])])    # the source's value, repeated
                continue
            ctype = COMPUTE_TYPE[n.dtype]
            if n.op == Op.BROADCAST:
                value = self.ref(n.srcs[0], ctype, bound)
            elif n.op in INDEXING:
                value = self.indexing(n, ctype, bound, lets)
            elif n.op == Op.INPUT:
                value = self.load(n, self.index_of)
            elif n.op == Op.SCALAR:
                value = ScalarArg(n.arg)
            else:
                value = self.apply(n, ctype, bound)
            name = self.fresh()
            self.bind(bound, n, name)
            lets.append(Let(name, ctype, value))
        return lets

    def apply(self, n: Node, ctype: str, bound: dict[int, str]) -> Apply:
        if n.op == Op.WHERE:               # the condition keeps its own type, the branches take the result's
            types = (COMPUTE_TYPE[n.srcs[0].dtype], ctype, ctype)
        elif n.op == Op.CAST:
            types = (COMPUTE_TYPE[n.srcs[0].dtype],)
        else:
            types = (ctype,) * len(n.srcs)
        args = tuple(self.ref(s, t, bound) for s, t in zip(n.srcs, types))
        return Apply(n.op, args, ctype, types)

    def indexing(self, n: Node, ctype: str, bound: dict[int, str], lets: list[Let]):
        """Lower SHIFT/TAKE/EMBED/GATHER/INDEX, emitting any re-evaluated sources into ``lets``."""
        if n.op == Op.INDEX:
            return IndexValue(self.index_of[n.arg], ctype)
        if n.op == Op.EMBED:
            axis, at = n.arg
            lets.extend(self.emit([n.srcs[0]], bound))
            return Guard(Compare("==", self.index_of[axis], Const(at)), self.ref(n.srcs[0], ctype, bound), ctype)
        if n.op == Op.TAKE:
            axis, at = n.arg
            child, scope = self.moved(axis, Const(at), bound)
            lets.extend(child.emit([n.srcs[0]], scope))
            return child.ref(n.srcs[0], ctype, scope)
        if n.op == Op.SHIFT:
            axis, off = n.arg
            here = self.index_of[axis]
            if off < 0:
                valid, moved = Compare(">=", here, Const(-off)), Bin("-", here, Const(-off))
            else:
                valid, moved = Compare("<", add(here, Const(off)), extent(axis, self.sizes)), add(here, Const(off))
            child, scope = self.moved(axis, moved, bound)
            lets.extend(child.emit([n.srcs[0]], scope))
            return Guard(valid, child.ref(n.srcs[0], ctype, scope), ctype)
        # GATHER: the table is read at the row the id names
        table, ids = n.srcs
        lets.extend(self.emit([ids], bound))
        row_name = self.fresh()
        lets.append(Let(row_name, "u32", Apply(Op.CAST, (self.ref(ids, COMPUTE_TYPE[ids.dtype], bound),), "u32",
                                               (COMPUTE_TYPE[ids.dtype],))))
        return self.load(table, {**self.index_of, table.shape[0]: Var(row_name)})
