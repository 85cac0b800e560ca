"""Storage-precision variants: the same kernel with its f32 tensors stored as f16.

Arithmetic still runs in f32 (loads widen, stores narrow), so an f16 variant differs from the
f32 kernel only in memory traffic and rounding at the buffers.
"""
from __future__ import annotations

from .nodes import KernelIR, Node, TensorArg, toposort


def retype(ir: KernelIR, storage: str) -> KernelIR:
    """``ir`` with every f32 tensor (inputs, outputs and values) stored as ``storage``."""
    if storage == "f32":
        return ir
    swap = {"f32": storage}
    memo: dict[int, Node] = {}
    for n in toposort(ir.results.values()):
        srcs = tuple(memo[id(s)] for s in n.srcs)
        arg = swap.get(n.arg, n.arg) if isinstance(n.arg, str) and n.op.name == "CAST" else n.arg
        memo[id(n)] = Node(n.op, srcs, n.shape, swap.get(n.dtype, n.dtype) if n.op.name != "SCALAR" else n.dtype, arg)

    def arg_of(t: TensorArg) -> TensorArg:
        return TensorArg(t.name, swap.get(t.dtype, t.dtype), t.shape)

    return KernelIR(f"{ir.name}_{storage}", tuple(arg_of(t) for t in ir.inputs), ir.scalars,
                    tuple(arg_of(t) for t in ir.outputs), {k: memo[id(v)] for k, v in ir.results.items()},
                    ir.source, ir.filename, ir.line, dict(ir.fixed_dims))
