"""Storage-precision variants: the same kernel with its f32 tensors stored as f16.

Arithmetic still runs in f32 (loads widen, stores narrow), so an f16 variant differs from the
f32 kernel only in memory traffic and rounding at the buffers. ``keep`` names tensors (inputs or
outputs) that stay f32: mixed precision stores activations as f16 but parameters, their gradients
and per-row statistics as f32, all in the same kernel.
"""
from __future__ import annotations

import dataclasses

from .nodes import KernelIR, Node, TensorArg, toposort


def retype(ir: KernelIR, storage: str, keep: frozenset[str] = frozenset()) -> KernelIR:
    """``ir`` with every f32 tensor (inputs, outputs and values) but those named in ``keep``
    stored as ``storage``."""
    if storage == "f32":
        return ir
    swap = {"f32": storage}
    unknown = sorted(set(keep) - {t.name for t in ir.inputs + ir.outputs})
    if unknown:
        raise ValueError(f"{ir.name}: cannot keep {unknown} in f32: the kernel has no such tensors")
    memo: dict[int, Node] = {}
    for n in toposort(ir.results.values()):
        srcs = tuple(memo[id(s)] for s in n.srcs)
        arg = swap.get(n.arg, n.arg) if isinstance(n.arg, str) and n.op.name == "CAST" else n.arg
        kept = n.op.name == "SCALAR" or (n.op.name == "INPUT" and n.arg in keep)
        memo[id(n)] = Node(n.op, srcs, n.shape, n.dtype if kept else swap.get(n.dtype, n.dtype), arg)

    def arg_of(t: TensorArg) -> TensorArg:
        return t if t.name in keep else dataclasses.replace(t, dtype=swap.get(t.dtype, t.dtype))

    suffix = f"_{storage}" + "".join(f"_{n}32" for n in sorted(keep))
    return dataclasses.replace(ir, name=f"{ir.name}{suffix}", inputs=tuple(arg_of(t) for t in ir.inputs),
                               outputs=tuple(arg_of(t) for t in ir.outputs),
                               results={k: memo[id(v)] for k, v in ir.results.items()})
