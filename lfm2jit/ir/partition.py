"""Partition: split a kernel into parts that each run as one dispatch of one template.

A kernel states math, not loops, so its outputs rarely share one loop structure: rmsnorm's
backward reduces each row for dx and over T for dw, and ``y = sum(a, T) * b`` needs the sum before
any element of y. Forward and backward kernels go through the same pass:

1. Each output is planned on its own: the reductions it needs are matched against the iteration
   structures the schedules implement (``Structure``: pointwise, a row reduction over the last
   axis, a column reduction over some axes, a contraction, an intrinsic call). A value that does
   not fit the output's structure (a reduction over another axis, a reduction read at a shifted
   position, the operand of a GEMM that is not a tensor, an intrinsic's result used in an
   expression) is cut: it becomes a temporary tensor, planned the same way as an output.
2. Outputs and temporaries of the same structure that do not depend on each other share a part;
   parts are ordered so that every temporary is written before it is read. Outputs that are each
   an epilogue of the same contraction share its GEMM (``d_a`` and ``d_b`` of SwiGLU's gradient
   from ``dy W2``); a contraction that roots of other parts read is cut, so it is computed once.

Every part is a KernelIR of its own (temporaries appear as its inputs or outputs) carrying its
Structure, so the scheduler only maps a structure to a template.
"""
from __future__ import annotations

import itertools
from dataclasses import dataclass, replace

from . import intrinsics
from .nodes import ABSTRACT, SEQ_AXIS, KernelIR, Node, Structure, TensorArg, substitute, toposort
from .ops import BINARY, LEAF, MOVING, REDUCE, UNARY, Op


@dataclass(frozen=True)
class Partition:
    parts: tuple[KernelIR, ...]      # in dispatch order, each with its .structure
    temps: tuple[TensorArg, ...]     # tensors one part writes and a later one reads


def is_contraction(n: Node) -> bool:
    """SUM over K of a product of two operands that each have an axis the other lacks."""
    if n.op != Op.SUM or n.srcs[0].op != Op.MUL:
        return False
    a, b = n.srcs[0].srcs
    k = n.arg
    return k in a.shape and k in b.shape and bool(set(a.shape) - set(b.shape)) and bool(set(b.shape) - set(a.shape))


def gemm_axes(n: Node, out_shape: tuple[str, ...]) -> dict | None:
    """The axes of a contraction the GEMM template runs (m, n, k, batch), or None when it does not
    fit: exactly one free axis per operand, at most one batch axis (never T: the template would
    run padded rows), and an output that is the contraction itself (no further broadcast)."""
    if not is_contraction(n) or set(out_shape) != set(n.shape) or len(out_shape) != len(n.shape):
        return None
    a, b = n.srcs[0].srcs
    batch = [x for x in a.shape if x in b.shape and x != n.arg]
    free_a, free_b = set(a.shape) - set(b.shape), set(b.shape) - set(a.shape)
    if len(batch) > 1 or SEQ_AXIS in batch or len(free_a) != 1 or len(free_b) != 1:
        return None
    out_free = [x for x in out_shape if x not in batch]
    return {"m": out_free[0], "n": out_free[-1], "k": n.arg, "batch": batch[0] if batch else None}


# What a GEMM's epilogue may compute from its sum: elementwise ops, and reads of other tensors at a
# moved index (a fixed entry, a shift, a flip) where the sum is not beneath them.
EPILOGUE_OPS = LEAF | UNARY | BINARY | {Op.WHERE, Op.BROADCAST}
EPILOGUE_READS = frozenset({Op.TAKE, Op.SHIFT, Op.FLIP})


@dataclass(frozen=True)
class Contraction:
    """A part's GEMM: the accumulator (one contraction, or a sum of contractions over the same
    output, each a phase of one K loop) and the terms it adds up; the part's root is computed from
    the accumulator at each output element (the epilogue; the root is the accumulator when there
    is none)."""
    acc: Node
    terms: tuple[Node, ...]

    def epilogue_of(self, root: Node) -> Node | None:
        """What ``root`` computes from the sum, or None when it stores the sum itself (a cast to the
        output's type included: the store converts)."""
        if root is self.acc or (root.op == Op.CAST and root.srcs[0] is self.acc):
            return None
        return root


def _terms(n: Node, shape: tuple[str, ...], cut) -> list[Node] | None:
    """The contractions ``n`` adds up (``n`` itself, or both sides of an ADD), or None; a cut node
    is a tensor the part reads, not a contraction."""
    if id(n) in cut:
        return None
    if gemm_axes(n, shape) is not None:
        return [n]
    if n.op == Op.ADD and n.shape == n.srcs[0].shape == n.srcs[1].shape:
        a, b = _terms(n.srcs[0], shape, cut), _terms(n.srcs[1], shape, cut)
        return a + b if a is not None and b is not None else None
    return None


def find_contraction(root: Node, shape: tuple[str, ...], cut=frozenset(), users=None, siblings=()) -> Contraction | None:
    """The GEMM a root computes, if it is one: an accumulator (see Contraction) under an epilogue of
    elementwise ops (a scale, a residual add, a cast) that may read other tensors at a moved index,
    never the sum itself. The accumulator's nodes must have no reader outside this root and those of
    ``siblings`` (other outputs of the same shape) that are epilogues of the same sum (``users``:
    the kernel's use counts; those siblings then store their values from the same GEMM), so that
    fusing never computes a GEMM twice; None otherwise."""
    group = toposort([root], stop=cut)
    for acc in reversed(group):                    # the accumulator nearest the root
        terms = _terms(acc, shape, cut)
        if terms is None:
            continue
        inside = toposort([acc], stop=set(cut) | {id(t) for t in terms})
        if not _is_epilogue(root, acc, cut):
            return None
        if users is not None and acc is not root:
            sharing = [r for r in siblings if r is not root and _reads(r, acc, cut) and _is_epilogue(r, acc, cut)]
            here = use_counts([root, *sharing])
            if any(users.get(id(n), 0) != here.get(id(n), 0) for n in inside + terms):
                return None
        return Contraction(acc, tuple(terms))
    return None


def _is_epilogue(root: Node, acc: Node, cut) -> bool:
    """Whether ``root`` is computed from ``acc`` by elementwise ops and reads of other tensors at a
    moved index (where ``acc`` is not beneath them)."""
    below = {id(n) for n in toposort([acc], stop=cut)}
    for n in toposort([root], stop=set(cut) | {id(acc)}):
        if n.op in EPILOGUE_READS:
            if any(id(m) in below for m in toposort([n], stop=cut)):
                return False
        elif n.op not in EPILOGUE_OPS:
            return False
    return True


def _reads(root: Node, n: Node, cut) -> bool:
    """Whether ``root``'s own part computes from ``n`` (or is it): ``n`` reached without passing a cut node."""
    return any(m is n for m in toposort([root], stop=cut))


INLINE_FIXED = 64     # reductions over a fixed axis at most this long run inside each invocation


def is_inline(r: Node, stop=frozenset()) -> bool:
    """A reduction every invocation computes itself, in a loop: over a window axis (a conv's taps,
    x[T - L]) or a short fixed-size axis. It needs no schedule of its own. What is read from memory
    (``stop``: cut nodes, and stored values) is not looked into, so a part sees what its kernel does."""
    if r.arg.isdigit():
        return int(r.arg) <= INLINE_FIXED
    stored = {id(n) for n in toposort([r.srcs[0]], stop=stop) if n.op == Op.MATERIALIZE}
    return any(n.op == Op.WINDOW and n.arg[1] == r.arg for n in toposort([r.srcs[0]], stop=set(stop) | stored))


def use_counts(roots) -> dict[int, int]:
    users: dict[int, int] = {}
    for n in toposort(roots):
        for s in n.srcs:
            users[id(s)] = users.get(id(s), 0) + 1
    return users


def reduction_chain(r: Node, users: dict[int, int], stop=frozenset()) -> tuple[tuple[str, ...], Node, list[Node]]:
    """(axes, source, links) of a reduction: SUM(SUM(x, a), b), whose inner sum has no other use,
    is one reduction of x over (a, b) (undoing a broadcast produces such chains)."""
    axes, src, links = [r.arg], r.srcs[0], []
    while r.op == Op.SUM and src.op == Op.SUM and users.get(id(src), 0) == 1 and id(src) not in stop \
            and not is_inline(src, stop):
        links.append(src)
        axes.insert(0, src.arg)
        src = src.srcs[0]
    return tuple(axes), src, links


# What a GEMM operand's fetch may compute (a prologue): elementwise ops over tensors, indices,
# sizes and table lookups.
PROLOGUE_OPS = LEAF | UNARY | BINARY | {Op.WHERE, Op.BROADCAST, Op.GATHER}


def is_prologue(x: Node, cut=frozenset()) -> bool:
    """Whether a GEMM operand that is not a tensor is computed in the GEMM's operand fetch instead
    of a temporary of its own: an elementwise expression that decodes tables by gather() (a packed
    weight: its codes, their codebook, the blocks' scales), so the decoded operand never exists
    in memory. Other expressions (silu(a) * b) are stored first: a temporary read by every tile
    costs less than recomputing each element once per tile of the other operand."""
    nodes = toposort([x], stop=cut)
    return (x.op not in LEAF and all(n.op in PROLOGUE_OPS for n in nodes)
            and any(n.op == Op.GATHER for n in nodes))


def _is_leaf(n: Node, cut: set[int]) -> bool:
    return n.op == Op.INPUT or id(n) in cut


class _Planner:
    """Plans each root (an output or a temporary) until nothing more needs cutting."""

    def __init__(self, ir: KernelIR):
        self.ir = ir
        self.users = use_counts(ir.results.values())
        self.accumulators: dict[int, Node] = {}       # root id -> the sum its contraction part stores from

    def plan(self, root: Node, shape: tuple[str, ...], seed=()) -> tuple[Structure, dict[int, Node]]:
        """The root's structure and the nodes cut from its graph (by id), starting from ``seed``."""
        cut: dict[int, Node] = {id(n): n for n in seed if n is not root}
        while True:
            structure, more = self.classify(root, shape, set(cut))
            if not more:
                return structure, cut
            cut.update((id(n), n) for n in more)

    def classify(self, root: Node, shape: tuple[str, ...], cut: set[int]) -> tuple[Structure | None, list[Node]]:
        group = toposort([root], stop=cut)
        if root.op == Op.PROJ:                       # an intrinsic call: operands are tensors or prologues
            call, intr = root.srcs[0], intrinsics.get(root.srcs[0].arg)
            return Structure("intrinsic", shape), [s for p, s in zip(intr.params, call.srcs) if not _is_leaf(s, cut)
                                                   and not (p in intr.prologue and is_prologue(s, cut))]
        projs = [n for n in group if n.op == Op.PROJ]
        if projs:                                    # an intrinsic's result used in an expression
            return None, projs
        stored = [n for n in group if n.op == Op.MATERIALIZE and n is not root]
        if stored:                                   # values every reader must see with the same bits
            return None, stored
        siblings = [r for name, r in self.ir.results.items() if r.shape == root.shape]
        gemm = find_contraction(root, shape, cut, self.users, siblings)
        if gemm is not None:
            self.accumulators[id(root)] = gemm.acc
            bad = [x for t in gemm.terms for x in t.srcs[0].srcs if not _is_leaf(x, cut) and not is_prologue(x, cut)]
            return Structure("contraction", shape, tuple(t.arg for t in gemm.terms)), bad
        inner = [n for n in group if n.op == Op.SUM and gemm_axes(n, n.shape) is not None]
        if inner:                                    # a GEMM inside an expression runs as a GEMM
            return None, inner
        return self.reduction_structure(root, shape, group, cut)

    def reduction_structure(self, root: Node, shape, group: list[Node], cut: set[int]):
        links: set[int] = set()
        reds = [n for n in group if n.op in REDUCE and not is_inline(n, cut)]
        for r in reds:
            links.update(id(x) for x in reduction_chain(r, self.users, cut)[2])
        heads = [r for r in reds if id(r) not in links]
        if not heads:
            return Structure("pointwise", shape), []
        head_ids = {id(h) for h in heads}
        chains = {id(h): reduction_chain(h, self.users, cut) for h in heads}
        # a reduction read at a moved position along an axis of its result cannot be computed there
        moved = []
        for m in group:
            if m.op in MOVING and m.op != Op.GATHER:
                axis = m.arg[0]
                moved += [h for h in toposort([m.srcs[0]], stop=cut) if id(h) in head_ids and axis in h.shape]
        if moved:
            return None, moved
        # a reduction whose result has an axis the output lacks (one an inline loop or a fixed index
        # removes later) would be needed once per entry of that axis: compute it beforehand
        wide = [h for h in heads if not set(h.shape) <= set(shape)]
        if wide:
            return None, wide
        top = _reachable(root, head_ids, cut)
        sets = [frozenset(chains[id(h)][0]) for h in top]
        fitting = next((s for s in sets if _fits(s, shape)), None)
        off = [h for h, s in zip(top, sets) if s != fitting]
        if off:
            return None, off
        nested = [h for h in heads if id(h) not in {id(t) for t in top}]
        off = [h for h in nested if frozenset(chains[id(h)][0]) != fitting]
        if off:
            return None, off
        if len(fitting) == 1:
            (c,) = fitting
            if c in shape:                           # reduced and broadcast back over the row
                return Structure("rowreduce", shape, (c,)), []
            sources = [chains[id(h)][1] for h in heads]
            if all(s.shape and s.shape[-1] == c for s in sources):
                return Structure("rowreduce", shape + (c,), (c,)), []
        source_axes = [a for h in heads for a in chains[id(h)][1].shape]
        reduced = tuple(dict.fromkeys(a for a in source_axes if a in fitting))
        return Structure("colreduce", shape, reduced), []


def _reachable(root: Node, heads: set[int], cut: set[int]) -> list[Node]:
    """The reductions reachable from ``root`` without passing through another one, in order."""
    found: list[Node] = []
    seen: set[int] = set()
    stack = [root]
    while stack:
        n = stack.pop()
        if id(n) in seen or id(n) in cut:
            continue
        seen.add(id(n))
        if id(n) in heads:
            found.append(n)
            continue
        stack.extend(reversed(n.srcs))
    return found


def _fits(axes: frozenset[str], shape: tuple[str, ...]) -> bool:
    """Whether reductions over ``axes`` fit an output of ``shape``: the axes are not the output's,
    or (one axis) it is the output's last one, reduced per row and broadcast back."""
    if len(axes) == 1 and next(iter(axes)) in shape:
        return shape[-1] in axes
    return not axes & set(shape)


@dataclass
class _Root:
    name: str
    node: Node
    shape: tuple[str, ...]
    dtype: str
    structure: Structure
    cut: dict[int, Node]
    level: int = 0


def _merge_key(r: _Root, accumulators: dict[int, Node]):
    """Roots of one key and level share a part: an intrinsic call's results, the outputs stored
    from one GEMM's sum, or roots of the same loop structure."""
    s = r.structure
    if s.kind == "intrinsic":
        return ("intrinsic", id(r.node.srcs[0]))
    if s.kind == "contraction":
        return ("contraction", id(accumulators[id(r.node)]))
    return (s.kind, s.space, s.reduced)


def partition(ir: KernelIR) -> Partition:
    """The parts ``ir`` runs as, in dispatch order (one part, ``ir`` itself, when it needs one).

    A kernel that updates a tensor in place is one elementwise pass when it reads that tensor only
    at the element it writes; otherwise (another element, or several parts) the old values are
    copied to a temporary first, which every part reads instead."""
    ir = _copied_results(ir)
    split = _partition(ir)
    if ir.inouts and (len(split.parts) > 1 or split.parts[0].structure.kind != "pointwise"
                      or any(_read_elsewhere(ir, name) for name in ir.inouts)):
        return _partition(ir, [n for n in toposort(ir.results.values()) if n.op == Op.INPUT and n.arg in ir.inouts])
    return split


def _copied_results(ir: KernelIR) -> KernelIR:
    """An intrinsic call stores each result once, into a tensor of the result's shape: an output
    declared wider than the result (``y = v`` broadcast over more axes), or a second output of the
    same result, is an elementwise copy of it (a BROADCAST root, planned pointwise)."""
    stored: set[int] = set()
    results = dict(ir.results)
    for o in ir.outputs:
        n = ir.results[o.name]
        if n.op != Op.PROJ:
            continue
        if n.shape == o.shape and id(n) not in stored:
            stored.add(id(n))
            continue
        results[o.name] = Node(Op.BROADCAST, (n,), o.shape, n.dtype)
    return ir if results == ir.results else replace(ir, results=results)


def _read_elsewhere(ir: KernelIR, name: str) -> bool:
    """Whether an element of input ``name`` is read by an invocation that writes another one:
    under a shift, a window, a flip or a fixed index along one of its axes, or inside a reduction
    over one of them."""
    seen: set[tuple[int, frozenset]] = set()
    stack = [(n, frozenset()) for n in ir.results.values()]
    while stack:
        n, moved = stack.pop()
        if (id(n), moved) in seen:
            continue
        seen.add((id(n), moved))
        if n.op == Op.INPUT and n.arg == name and moved & set(n.shape):
            return True
        if n.op in (Op.SHIFT, Op.TAKE, Op.WINDOW):
            moved = moved | {n.arg[0]}
        elif n.op in REDUCE or n.op == Op.FLIP:
            moved = moved | {n.arg}
        elif n.op == Op.GATHER:
            moved = moved | {n.srcs[0].shape[0]}
        stack.extend((s, moved) for s in n.srcs)
    return False


def _partition(ir: KernelIR, protected=()) -> Partition:
    planner = _Planner(ir)
    taken = {t.name for t in ir.inputs + ir.outputs} | set(ir.scalars)
    fresh = (f"tmp{i}" for i in itertools.count() if f"tmp{i}" not in taken)
    roots: list[_Root] = []
    temp_names: dict[int, str] = {}                  # cut node id -> its temporary's name
    todo = [(o.name, ir.results[o.name], o.shape, o.dtype) for o in ir.outputs]
    # an intrinsic's result that is an output and read elsewhere is read from that output (as stored,
    # f16 included): one call of the template stores each result once, so no temporary beside it
    for o in ir.outputs:
        n = ir.results[o.name]
        if n.op == Op.PROJ and n.shape == o.shape and o.name not in ir.inouts:
            temp_names.setdefault(id(n), o.name)
    while todo:
        name, node, shape, dtype = todo.pop(0)
        graph = {id(n) for n in toposort([node])}
        structure, cut = planner.plan(node, shape, [n for n in protected if id(n) in graph])
        roots.append(_Root(name, node, shape, dtype, structure, cut))
        for n in cut.values():
            if id(n) not in temp_names:
                temp_names[id(n)] = next(fresh)
                todo.append((temp_names[id(n)], n, n.shape, _temp_dtype(n)))
    keys = {r.name: _merge_key(r, planner.accumulators) for r in roots}
    if len(roots) == len(ir.outputs) and not any(r.cut for r in roots) and len(set(keys.values())) == 1:
        return Partition((replace(ir, structure=roots[0].structure),), ())
    by_name = {r.name: r for r in roots}
    writer = {i: by_name[name] for i, name in temp_names.items()}
    _levels(roots, writer)
    groups: dict[tuple, list[_Root]] = {}
    for r in roots:
        groups.setdefault((r.level, keys[r.name]), []).append(r)
    # a sum that roots of other parts compute too (not through a temporary): it goes first, once, into one
    done = {id(n) for n in protected}
    split = {id(a): a for a in (planner.accumulators[id(r.node)] for r in roots if r.structure.kind == "contraction")
             if id(a) not in done and len({(q.level, keys[q.name]) for q in roots
                                           if id(a) not in q.cut and _reads(q.node, a, q.cut)}) > 1}
    if split:
        return _partition(ir, tuple(protected) + tuple(split.values()))
    position = {r.name: i for i, r in enumerate(roots)}      # outputs first, in declared order
    ordered = sorted(groups.items(), key=lambda kv: (kv[0][0], min(position[m.name] for m in kv[1])))
    parts = [_part(ir, members, writer) for _, members in ordered]
    temps = tuple(TensorArg(r.name, r.dtype, r.shape) for r in roots[len(ir.outputs):])
    if len(parts) == 1:                  # one part after all (outputs merged): it keeps the kernel's name
        parts = [replace(parts[0], name=ir.name)]
    return Partition(tuple(parts), temps)


def _temp_dtype(n: Node) -> str:
    """Temporaries are stored as f32 (integers as themselves): they are small next to the
    activations, and keeping them exact keeps a split kernel's numbers those of a fused one."""
    return n.dtype if n.dtype in ("i32", "u32") else "f32"


def _levels(roots: list[_Root], writer: dict[int, _Root]) -> None:
    """level = 1 + the highest level among the roots whose temporaries it reads (0 if none)."""
    memo: dict[str, int] = {}

    def level(r: _Root) -> int:
        if r.name not in memo:
            memo[r.name] = 1 + max((level(writer[i]) for i in r.cut), default=-1)
        return memo[r.name]
    for r in roots:
        r.level = level(r)


def _part(ir: KernelIR, members: list[_Root], writer: dict[int, _Root]) -> KernelIR:
    """One part: its members' values, with the temporaries they read as inputs."""
    results: dict[str, Node] = {}
    read: dict[str, TensorArg] = {}
    for r in members:
        leaves = {}
        for i in r.cut:
            w = writer[i]
            read[w.name] = TensorArg(w.name, w.dtype, w.shape)
            leaves[i] = Node(Op.INPUT, (), w.shape, w.dtype, w.name)
        results.update(substitute({r.name: r.node}, leaves))
    used = {n.arg for n in toposort(results.values()) if n.op in (Op.INPUT, Op.SCALAR)}
    inputs = tuple(t for t in ir.inputs if t.name in used) + tuple(t for n, t in read.items() if n in used)
    outputs = tuple(TensorArg(r.name, r.dtype, r.shape) for r in members)
    name = ir.name + "_" + "_".join(r.name for r in members)
    return replace(ir, name=name, inputs=inputs, scalars=tuple(s for s in ir.scalars if s in used),
                   outputs=outputs, results=results, structure=members[0].structure,
                   inouts=tuple(n for n in ir.inouts if n in results and n in used))
