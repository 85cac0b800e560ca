"""Reverse-mode differentiation of kernel IR: the table of local gradient rules and grad_ir.

``RULES`` is the table of local gradients: for an op, given the node and the adjoint flowing into
it, the adjoint of each source (None where none flows). Adjoints that arrive broadcast over extra
axes are summed back to the source's shape. The result is a backward KernelIR whose inputs are the
forward inputs, the forward outputs it can reuse (saved values), and one cotangent ``d_<output>``
per differentiated output; its outputs are ``d_<input>`` for each input asked for.
"""
from __future__ import annotations

from typing import Callable

from ..dsl.errors import DslError
from . import intrinsics
from .graph import GraphBuilder
from .nodes import ABSTRACT, KernelIR, Node, TensorArg, substitute, toposort
from .ops import FLOAT_DTYPES, REDUCE, Op
from .shapes import plus_one


Rule = Callable[[GraphBuilder, Node, Node], list]


def _sigmoid(b: GraphBuilder, x: Node) -> Node:
    return b.unary(Op.SIGMOID, x)


RULES: dict[Op, Rule] = {
    Op.ADD: lambda b, n, g: [g, g],
    Op.SUB: lambda b, n, g: [g, b.neg(g)],
    Op.MUL: lambda b, n, g: [b.mul(g, n.srcs[1]), b.mul(g, n.srcs[0])],
    Op.DIV: lambda b, n, g: [b.div(g, n.srcs[1]), b.neg(b.div(b.mul(g, n), n.srcs[1]))],
    Op.POW: lambda b, n, g: [b.mul(g, b.mul(n.srcs[1], b.binary(Op.POW, n.srcs[0], b.sub(n.srcs[1], b.const(1))))),
                             b.mul(g, b.mul(n, b.unary(Op.LOG, n.srcs[0])))],
    Op.MAX: lambda b, n, g: [b.mul(g, b.sub(b.const(1), b.binary(Op.LT, n.srcs[0], n.srcs[1]))),
                             b.mul(g, b.binary(Op.LT, n.srcs[0], n.srcs[1]))],
    Op.MIN: lambda b, n, g: [b.mul(g, b.sub(b.const(1), b.binary(Op.GT, n.srcs[0], n.srcs[1]))),
                             b.mul(g, b.binary(Op.GT, n.srcs[0], n.srcs[1]))],
    Op.LT: lambda b, n, g: [None, None],
    Op.GT: lambda b, n, g: [None, None],
    Op.NEG: lambda b, n, g: [b.neg(g)],
    Op.EXP: lambda b, n, g: [b.mul(g, n)],
    Op.LOG: lambda b, n, g: [b.div(g, n.srcs[0])],
    Op.SQRT: lambda b, n, g: [b.div(b.mul(g, b.const(0.5)), n)],
    Op.RSQRT: lambda b, n, g: [b.mul(g, b.mul(b.const(-0.5), b.mul(n, b.mul(n, n))))],
    Op.RECIP: lambda b, n, g: [b.neg(b.mul(g, b.mul(n, n)))],
    Op.ABS: lambda b, n, g: [b.mul(g, b.sub(b.const(1), b.mul(b.const(2), b.binary(Op.LT, n.srcs[0], b.const(0)))))],
    Op.SIGMOID: lambda b, n, g: [b.mul(g, b.mul(n, b.sub(b.const(1), n)))],
    # silu(x) = x*s(x); silu'(x) = s + x*s*(1-s)
    Op.SILU: lambda b, n, g: [b.mul(g, b.add(_sigmoid(b, n.srcs[0]),
                                             b.mul(n.srcs[0], b.mul(_sigmoid(b, n.srcs[0]),
                                                                    b.sub(b.const(1), _sigmoid(b, n.srcs[0]))))))],
    Op.TANH: lambda b, n, g: [b.mul(g, b.sub(b.const(1), b.mul(n, n)))],
    Op.CAST: lambda b, n, g: [b.node(Op.CAST, (g,), g.shape, n.srcs[0].dtype, n.srcs[0].dtype)
                              if n.srcs[0].dtype in FLOAT_DTYPES else None],
    Op.WHERE: lambda b, n, g: [None, b.where(n.srcs[0], g, b.const(0)), b.where(n.srcs[0], b.const(0), g)],
    Op.COS: lambda b, n, g: [b.neg(b.mul(g, b.unary(Op.SIN, n.srcs[0])))],
    Op.SIN: lambda b, n, g: [b.mul(g, b.unary(Op.COS, n.srcs[0]))],
    Op.EQ: lambda b, n, g: [None, None],
    # integer ops: nothing is differentiable through them (no float adjoint reaches them: a cast
    # from an integer passes none on)
    Op.MOD: lambda b, n, g: [None, None],
    Op.BITAND: lambda b, n, g: [None, None],
    Op.BITOR: lambda b, n, g: [None, None],
    Op.SHL: lambda b, n, g: [None, None],
    Op.SHR: lambda b, n, g: [None, None],
    Op.INDEX: lambda b, n, g: [],
    # ids are integers; the table's adjoint is a deterministic scatter-add of g's rows by id
    Op.GATHER: lambda b, n, g: [_gather_back(b, n, g), None],
    # reading at t + k sends the adjoint back to t - k (zero past either end); an adjoint that does
    # not vary along the axis is first repeated over it, so the shift sees where the axis ends
    Op.SHIFT: lambda b, n, g: [_shift(b, g, n.srcs[0].shape, n.arg[0], -n.arg[1])],
    Op.BROADCAST: lambda b, n, g: [g],
    # x[T - L][t, l] = x[t - l]: x[t] collects g[t + l, l] over l (a window back, summed over L)
    Op.WINDOW: lambda b, n, g: [_window_back(b, g, n)],
    Op.FLIP: lambda b, n, g: [_flip(b, _with(b, g, n.shape, n.arg), n.arg)],
    # taking entry i of an axis puts the adjoint back at entry i, zero elsewhere, and vice versa
    Op.TAKE: lambda b, n, g: [b.node(Op.EMBED, (g,), _with_axis(n.srcs[0].shape, g.shape, n.arg[0]), g.dtype, n.arg)],
    Op.EMBED: lambda b, n, g: [b.node(Op.TAKE, (g,), tuple(a for a in g.shape if a != n.arg[0]), g.dtype, n.arg)],
    # a sum repeats its adjoint over the reduced axis (explicitly: an operand of the sum that lacks
    # the axis must collect the adjoint once per entry, sum(z + x, M) gives z |M| times)
    Op.SUM: lambda b, n, g: [b.broadcast(g, b.layout(g.shape, n.srcs[0].shape))],
    # max: the adjoint goes to the entries equal to the maximum
    Op.RMAX: lambda b, n, g: [_max_back(b, n, g)],
    Op.MATERIALIZE: lambda b, n, g: [g],
}


class AutodiffError(DslError):
    """A kernel that cannot be differentiated as asked; located at the kernel's definition."""

    def __init__(self, ir: KernelIR, message: str, expected: str | None = None):
        super().__init__(message, filename=ir.filename, line=ir.line, column=1 if ir.line else 0,
                         source=ir.source or None, expected=expected)


def _with(b: GraphBuilder, g: Node, shape: tuple[str, ...], axis: str) -> Node:
    """``g`` repeated over ``axis`` (placed as in ``shape``) if it lacks it: an op that moves along
    an axis must see where the axis ends."""
    return g if axis in g.shape else b.broadcast(g, _with_axis(shape, g.shape, axis))


def _shift(b: GraphBuilder, g: Node, src_shape: tuple[str, ...], axis: str, offset: int) -> Node:
    g = _with(b, g, src_shape, axis)
    return b.node(Op.SHIFT, (g,), g.shape, g.dtype, (axis, offset))


def _max_back(b: GraphBuilder, n: Node, g: Node) -> Node:
    """g where the entry equals the maximum. An entry computed by an expression is compared with a
    maximum of the same stored values: recomputed separately, the two could differ in the last bit
    (WGSL does not promise one result for sin or exp in two shaders) and drop the gradient."""
    src = n.srcs[0]
    if src.op != Op.INPUT:
        src = b.node(Op.MATERIALIZE, (src,), src.shape, src.dtype)
        n = b.node(Op.RMAX, (src,), n.shape, n.dtype, n.arg)
    return b.mul(g, b.sub(b.const(1), b.binary(Op.LT, src, n)))


def _gather_back(b: GraphBuilder, n: Node, g: Node) -> Node:
    """gather(table, ids)[i..., d...] = table[ids[i...], d...]: row v of the table's adjoint sums g's
    rows at the positions holding id v. bucket_sort groups the positions by id (stable) and
    segment_sum adds each group in that order, so the sum's order is fixed: bit-identical runs."""
    table, ids = n.srcs
    rows = table.shape[0]
    g = b.broadcast(g, n.shape)              # every row of g, also where the adjoint is the same along an axis
    sort = b.node(Op.INTRINSIC, (ids,), (rows,), "tuple", intrinsics.BUCKET_SORT)
    order = b.node(Op.PROJ, (sort,), ids.shape, "i32", 0)
    offsets = b.node(Op.PROJ, (sort,), (plus_one(rows),), "i32", 1)
    segments = b.node(Op.INTRINSIC, (g, order, offsets), (), "tuple", intrinsics.SEGMENT_SUM)
    return b.node(Op.PROJ, (segments,), table.shape, g.dtype, 0)


def _flip(b: GraphBuilder, g: Node, axis: str) -> Node:
    """flip(g) along ``axis``; through a sum over another axis, flip(sum(x, T)) = sum(flip(x), T), so
    the flip is read inside the sum's loop rather than needing the sum materialised first."""
    if g.op == Op.SUM and g.arg != axis:
        return b.sum(_flip(b, g.srcs[0], axis), g.arg)
    return b.node(Op.FLIP, (g,), g.shape, g.dtype, axis)


def _window_back(b: GraphBuilder, g: Node, n: Node) -> Node:
    axis, by, sign = n.arg
    g = _with(b, g, n.shape, axis)
    shape = g.shape if by in g.shape else g.shape + (by,)
    back = b.node(Op.WINDOW, (g,), shape, g.dtype, (axis, by, -sign))
    return back if by in n.srcs[0].shape else b.sum(back, by)


def _with_axis(src_shape: tuple[str, ...], adj_shape: tuple[str, ...], axis: str) -> tuple[str, ...]:
    """The adjoint's shape with ``axis`` put back where the source had it (before its successor)."""
    after = src_shape[src_shape.index(axis) + 1:]
    for i, a in enumerate(adj_shape):
        if a in after:
            return adj_shape[:i] + (axis,) + adj_shape[i:]
    return adj_shape + (axis,)


def grad_ir(ir: KernelIR, wrt: list[str] | None = None, cotangents: list[str] | None = None) -> KernelIR:
    """The backward kernel of ``ir``: d_<input> for each name in ``wrt`` (default: every float input),
    given cotangents d_<output> for each name in ``cotangents`` (default: every output)."""
    if ir.inouts:
        raise AutodiffError(ir, f"{ir.name}: kernels that update {list(ir.inouts)} in place have no backward",
                            "a kernel without in-place outputs")
    inputs = {t.name: t for t in ir.inputs}
    outputs = {t.name: t for t in ir.outputs}
    wrt = list(wrt) if wrt is not None else [t.name for t in ir.inputs if t.dtype in FLOAT_DTYPES]
    cotangents = list(cotangents) if cotangents is not None else list(outputs)
    for name in wrt:
        if name not in inputs:
            raise AutodiffError(ir, f"{ir.name}: cannot differentiate with respect to {name!r}",
                                f"one of the tensor inputs: {', '.join(inputs)}")
        if inputs[name].dtype not in FLOAT_DTYPES:
            raise AutodiffError(ir, f"{ir.name}: input {name!r} is {inputs[name].dtype}; only float inputs have gradients",
                                "a float (f32 or f16) input")
    for name in cotangents:
        if name not in outputs:
            raise AutodiffError(ir, f"{ir.name}: no output {name!r} to take a cotangent for",
                                f"one of the outputs: {', '.join(outputs)}")

    b = GraphBuilder()
    adjoints: dict[int, list[Node]] = {}
    seeds = []
    for name in cotangents:
        out = outputs[name]
        seed = b.node(Op.INPUT, (), out.shape, out.dtype, f"d_{name}")
        seeds.append(TensorArg(f"d_{name}", out.dtype, out.shape, out.optional))
        adjoints.setdefault(id(ir.results[name]), []).append(seed)

    order = toposort(ir.results.values())
    projections: dict[int, dict[int, Node]] = {}     # intrinsic call -> its PROJ nodes by index
    for n in order:
        if n.op == Op.PROJ:
            projections.setdefault(id(n.srcs[0]), {})[n.arg] = n
    for node in reversed(order):
        if node.op == Op.INTRINSIC:
            src_adjoints = _intrinsic_rule(ir, b, node, projections.get(id(node), {}), adjoints)
        else:
            pending = adjoints.pop(id(node), None)
            if not pending or node.op in (Op.INPUT, Op.SCALAR, Op.CONST, Op.DIMSIZE):
                if pending:
                    adjoints[id(node)] = pending   # keep input adjoints for the end
                continue
            g = _total(b, pending, node.shape)
            if node.op == Op.PROJ:             # handed to the call when it is reached
                adjoints.setdefault(("proj", id(node)), []).append(g)
                continue
            rule = RULES.get(node.op)
            if rule is None:
                raise AutodiffError(ir, f"{ir.name}: no gradient rule for {node.op.name}", "a differentiable op")
            b.order = node.srcs[0].shape if node.op in REDUCE else node.shape
            src_adjoints = rule(b, node, g)
            b.order = None
        for src, adj in zip(node.srcs, src_adjoints):
            if adj is not None and src.op not in (Op.CONST, Op.DIMSIZE, Op.SCALAR):
                adjoints.setdefault(id(src), []).append(adj)

    input_nodes = {n.arg: n for n in order if n.op == Op.INPUT}
    results: dict[str, Node] = {}
    grad_outputs = []
    for name in wrt:
        t = inputs[name]
        node = input_nodes.get(name)
        pending = adjoints.get(id(node)) if node is not None else None
        value = _total(b, pending, t.shape) if pending else b.const(0)
        value = b.node(Op.CAST, (value,), value.shape, t.dtype, t.dtype) if value.dtype != t.dtype else value
        results[f"d_{name}"] = value
        grad_outputs.append(TensorArg(f"d_{name}", t.dtype, t.shape, t.optional))

    # Reuse forward outputs the backward needs instead of recomputing them (saved values). An output
    # declared wider than its value (z = exp(w) stored as [T, D]) cannot stand in for the narrower node.
    saved = {id(ir.results[o]): b.node(Op.INPUT, (), outputs[o].shape, outputs[o].dtype, o)
             for o in outputs if ir.results[o].op not in (Op.INPUT, Op.CAST)
             and ir.results[o].shape == outputs[o].shape}
    results = substitute(results, saved)
    used = {n.arg for n in toposort(results.values()) if n.op == Op.INPUT}
    scalars_used = {n.arg for n in toposort(results.values()) if n.op == Op.SCALAR}
    new_inputs = tuple(t for t in ir.inputs if t.name in used) \
        + tuple(outputs[o] for o in outputs if o in used) \
        + tuple(s for s in seeds if s.name in used)
    kept = {t.name for t in new_inputs} | scalars_used
    # integer axes a gradient rule introduced (attention's stats [T, 2, H]) are fixed as the source's are
    fixed = {**{a: int(a) for n in toposort(results.values()) for a in n.shape if a.isdigit()}, **ir.fixed_dims}
    return KernelIR(f"{ir.name}_bwd", new_inputs, tuple(s for s in ir.scalars if s in scalars_used),
                    tuple(grad_outputs), results, ir.source, ir.filename, ir.line, fixed,
                    defaults={n: v for n, v in ir.defaults.items() if n in kept})


def _intrinsic_rule(ir: KernelIR, b: GraphBuilder, call: Node, projs: dict[int, Node], adjoints) -> list:
    """Adjoints of an intrinsic call's operands, from its declared gradient rule."""
    intr = intrinsics.get(call.arg)
    outs = [adjoints.pop(("proj", id(projs[i])), [None])[0] if i in projs else None
            for i in range(len(intr.outputs))]
    if all(g is None for g in outs):
        return [None] * len(call.srcs)
    if intr.grad is None:
        raise AutodiffError(ir, f"{ir.name}: intrinsic {call.arg} has no gradient rule", "a differentiable intrinsic")
    try:
        return intr.grad(b, call, projs, outs)
    except intrinsics.IntrinsicError as e:
        raise AutodiffError(ir, str(e)) from None


def _total(b: GraphBuilder, pending: list[Node], shape: tuple[str, ...]) -> Node:
    """The sum of a node's adjoints, each summed back to (a subset of) its ``shape``. Adjoints may
    order their axes differently ([N, K] from a contraction, [K, N] from an elementwise use), so
    the sum is laid out in ``shape``'s order rather than by merging the operands' orders."""
    total = None
    for adj in pending:
        adj = b.sum_to(adj, shape)
        if total is None:
            total = adj
        else:
            axes = set(total.shape) | set(adj.shape)
            dtype = adj.dtype if total.dtype == ABSTRACT else total.dtype
            total = b.node(Op.ADD, (total, adj), tuple(a for a in shape if a in axes), dtype)
    return total
