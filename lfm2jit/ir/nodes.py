"""Typed IR: a DAG of nodes with named symbolic axes (T is the sequence axis) and a dtype."""
from __future__ import annotations

import functools

from dataclasses import dataclass, field

from .ops import Op

SEQ_AXIS = "T"
ABSTRACT = "float"   # the dtype of a literal until it meets a typed operand


@dataclass(frozen=True, eq=False)
class Node:
    """One value of the kernel. ``shape`` is a tuple of axis names (an integer size is spelled "3")."""
    op: Op
    srcs: tuple["Node", ...]
    shape: tuple[str, ...]
    dtype: str
    arg: object = None

    def __repr__(self) -> str:
        return f"{self.op.name}{list(self.shape)}:{self.dtype}" + (f"({self.arg})" if self.arg is not None else "")


@dataclass(frozen=True)
class TensorArg:
    name: str
    dtype: str
    shape: tuple[str, ...]
    optional: tuple[str, ...] = ()   # leading axes a caller may leave out (size 1)


@dataclass(frozen=True)
class Structure:
    """How one part of a partitioned kernel iterates; the scheduler picks its template by ``kind``.

    pointwise:   one invocation per element of ``space``
    rowreduce:   ``space`` = rows + (c,); reductions over c, the last axis (``reduced`` = (c,))
    colreduce:   ``space`` = the outputs' axes; reductions over every axis in ``reduced`` together
    contraction: a sum of a product of two tensors (a GEMM); ``space`` = the output's axes
    intrinsic:   the outputs of one intrinsic call (a hand-written template)
    """
    kind: str
    space: tuple[str, ...]
    reduced: tuple[str, ...] = ()


@dataclass
class KernelIR:
    """A checked kernel: its signature and, for each output, the node that computes it."""
    name: str
    inputs: tuple[TensorArg, ...]
    scalars: tuple[str, ...]
    outputs: tuple[TensorArg, ...]
    results: dict[str, Node]
    source: str = ""
    filename: str = "<source>"
    line: int = 0
    fixed_dims: dict[str, int] = field(default_factory=dict)   # integer axes written in the source
    inouts: tuple[str, ...] = ()     # parameters that are both input and output: updated in place
    defaults: dict[str, float] = field(default_factory=dict)   # inputs a caller may leave out: their value
    structure: "Structure | None" = None   # set on the parts partition() makes: how the part iterates

    @functools.cached_property
    def axes(self) -> tuple[str, ...]:
        """Every axis the kernel needs a size for, in first-seen order: the signature's, then any
        other its values use (a temporary's reduced axis, the axis of index() or of a mean).
        Computed once: every kernel call asks for it, and a checked kernel never changes."""
        seen: dict[str, None] = {}
        for t in self.inputs + self.outputs:
            for a in t.shape:
                seen.setdefault(a, None)
        for n in toposort(self.results.values()):
            for a in n.shape + ((n.arg,) if n.op in (Op.DIMSIZE, Op.INDEX) else ()):
                seen.setdefault(a, None)
        return tuple(seen)


def toposort(roots, stop=frozenset(), children=None) -> list[Node]:
    """All nodes reachable from roots, each after its sources, in a deterministic order.

    Nodes whose id is in ``stop`` are neither returned nor walked into (already computed values);
    ``children(node)`` overrides which sources are walked (default: all of them).
    """
    order: list[Node] = []
    seen: set[int] = set()
    stack = [(r, False) for r in reversed(list(roots))]
    while stack:
        node, expanded = stack.pop()
        if id(node) in seen or id(node) in stop:
            continue
        if expanded:
            seen.add(id(node))
            order.append(node)
            continue
        stack.append((node, True))
        srcs = node.srcs if children is None else children(node)
        stack.extend((s, False) for s in reversed(srcs) if id(s) not in seen)
    return order


def substitute(results: dict[str, Node], mapping: dict[int, Node]) -> dict[str, Node]:
    """Rebuild the graph under ``results`` with the nodes whose ids are in ``mapping`` replaced."""
    memo: dict[int, Node] = dict(mapping)
    for n in toposort(results.values(), stop=mapping.keys()):
        srcs = tuple(memo.get(id(s), s) for s in n.srcs)
        memo[id(n)] = n if all(a is b for a, b in zip(srcs, n.srcs)) else Node(n.op, srcs, n.shape, n.dtype, n.arg)
    return {k: memo.get(id(v), v) for k, v in results.items()}


def format_ir(kernel: KernelIR) -> str:
    """A readable listing of the IR, one node per line (``dump --ir``)."""
    order = toposort(kernel.results.values())
    names = {id(n): f"%{i}" for i, n in enumerate(order)}
    lines = [f"kernel {kernel.name}"]
    for n in order:
        srcs = ", ".join(names[id(s)] for s in n.srcs)
        arg = f" {n.arg!r}" if n.arg is not None else ""
        lines.append(f"  {names[id(n)]} = {n.op.name.lower()}({srcs}){arg} : {n.dtype}[{', '.join(n.shape)}]")
    for name, n in kernel.results.items():
        lines.append(f"  out {name} = {names[id(n)]}")
    return "\n".join(lines)
