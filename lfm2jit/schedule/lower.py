"""Lowering IR values to per-invocation code: each node becomes a typed Let, once per scope.

``index_of`` maps each axis to the index expression of the current element along it. Reading a
source at another index (SHIFT, TAKE, GATHER) lowers it again under a changed map; only values
that do not vary along the changed axis are reused from the outer scope.
"""
from __future__ import annotations

from ..ir.nodes import SEQ_AXIS, Node, toposort
from ..ir.ops import REDUCE, Op
from .code import (COMPUTE_TYPE, Apply, Bin, Compare, Const, Fold, Guard, Index, IndexValue, Let, Lit, Load, Ref,
                   ScalarArg, SeqLen, Var, add)
from .layout import extent, offset

# Ops that change where their source is evaluated, lowered by ``indexing``.
INDEXING = frozenset({Op.SHIFT, Op.TAKE, Op.EMBED, Op.GATHER, Op.INDEX, Op.WINDOW, Op.FLIP})


def _same_index_sources(n: Node) -> tuple[Node, ...]:
    """The sources evaluated at the node's own index (the others are lowered under a moved index,
    or inside a reduction's own loop)."""
    if n.op in (Op.TAKE, Op.SHIFT, Op.WINDOW, Op.FLIP) or n.op in REDUCE:
        return ()
    if n.op == Op.GATHER:
        return n.srcs[1:]
    return n.srcs


def _moved(here: Index, step: Index, sign: int, end: Index) -> tuple[Compare, Index]:
    """Where ``here + sign * step`` is inside 0..end-1, and that index clamped into the axis, so a
    read masked away is still a read in bounds (no reliance on the device's robustness)."""
    if sign < 0:
        return Compare(">=", here, step), Bin("-", Bin("max", here, step), step)
    return Compare("<", add(here, step), end), Bin("min", add(here, step), Bin("-", end, Const(1)))


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
            if n.op in REDUCE:         # a reduction the planner did not schedule: each invocation loops
                self.fold(n, bound, lets)
                continue
            if n.op in (Op.BROADCAST, Op.MATERIALIZE) and n.srcs[0].op not in (Op.CONST, Op.DIMSIZE):
                self.bind(bound, n, bound[id(n.srcs[0])])    # the source's value (repeated, or stored)
                continue
            ctype = COMPUTE_TYPE[n.dtype]
            if n.op in (Op.BROADCAST, Op.MATERIALIZE):
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

    def fold(self, n: Node, bound: dict[int, str], lets: list) -> None:
        """An inline reduction (see ir.partition.is_inline) as a loop of this invocation's own."""
        var = f"j{self.counter[0]}"
        self.counter[0] += 1
        child, scope = self.moved(n.arg, Var(var), bound)
        inner = tuple(child.emit([n.srcs[0]], scope))
        name = self.fresh()
        lets.append(Fold(name, n.op, var, extent(n.arg, self.sizes), inner, child.ref(n.srcs[0], "f32", scope)))
        self.bind(bound, n, name)

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
        if n.op == Op.FLIP:
            axis = n.arg
            last = Bin("-", extent(axis, self.sizes), Const(1))
            child, scope = self.moved(axis, Bin("-", last, self.index_of[axis]), bound)
            lets.extend(child.emit([n.srcs[0]], scope))
            return child.ref(n.srcs[0], ctype, scope)
        if n.op == Op.WINDOW:
            axis, by, sign = n.arg
            here, step = self.index_of[axis], self.index_of[by]
            valid, moved = _moved(here, step, sign, extent(axis, self.sizes))
            child, scope = self.moved(axis, moved, bound)
            lets.extend(child.emit([n.srcs[0]], scope))
            return Guard(valid, child.ref(n.srcs[0], ctype, scope), ctype)
        if n.op == Op.SHIFT:
            axis, off = n.arg
            valid, moved = _moved(self.index_of[axis], Const(abs(off)), -1 if off < 0 else 1, extent(axis, self.sizes))
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
