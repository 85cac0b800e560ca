"""Intrinsics: operations whose best kernel is a hand-tuned, parameterised template (attention).

An intrinsic is called from the DSL like a function and returns one or more tensors
(``o, lse = attention(q, k, v)``). Its entry here says how output shapes follow from operand
shapes, how to fill its template, and its gradient rule, which is itself a call of another
intrinsic, so backward kernels still come from differentiating the IR.
"""
from __future__ import annotations

import threading
from dataclasses import dataclass, field
from typing import Callable

from ..ir.nodes import KernelIR, Node, TensorArg
from ..ir.ops import Op


class IntrinsicError(ValueError):
    """Operands that an intrinsic cannot take; the message says which and what was expected."""


@dataclass(frozen=True)
class IntrinsicCall:
    """One call as the scheduler sees it: operands and outputs with names, concrete sizes."""
    name: str
    operands: tuple[TensorArg, ...]          # kernel inputs, in the intrinsic's parameter order
    outputs: tuple[TensorArg | None, ...]    # kernel outputs per intrinsic output (None: not kept)
    sizes: dict[str, int]
    accumulate: frozenset[str] = frozenset()
    tiles: object = None                     # the caller's tiles override (of the Intrinsic's `tiles` class)


@dataclass(frozen=True)
class Intrinsic:
    name: str
    params: tuple[str, ...]
    outputs: tuple[str, ...]
    # operand (dtype, shape)s -> output (dtype, shape)s; raises IntrinsicError
    infer: Callable[[list[tuple[str, tuple[str, ...]]]], list[tuple[str, tuple[str, ...]]]]
    # -> (template name, template context, workgroups: int or (x, y, z))
    plan: Callable[[IntrinsicCall], tuple[str, dict, object]]
    # (GraphBuilder, INTRINSIC node, its PROJ nodes by output index, adjoint per output or None)
    # -> adjoint per operand or None, built from other intrinsic calls; None when not differentiable
    grad: Callable | None = None
    differentiable_outputs: tuple[str, ...] = field(default=())
    # outputs the template only adds into (a scatter): callers must pass them and accumulate
    adds_only: bool = False
    # the class of tiles a caller may pass to override the plan's choice (engine.run(tiles=...), the
    # autotuner); None: the plan takes no override
    tiles: type | None = None


REGISTRY: dict[str, Intrinsic] = {}


def register(intrinsic: Intrinsic) -> Intrinsic:
    if intrinsic.name in REGISTRY:
        raise RuntimeError(f"intrinsic {intrinsic.name!r} registered twice")
    REGISTRY[intrinsic.name] = intrinsic
    return intrinsic


def get(name: str) -> Intrinsic | None:
    _load_all()
    return REGISTRY.get(name)


def names() -> list[str]:
    _load_all()
    return sorted(REGISTRY)


def call_nodes(intrinsic: Intrinsic, operands: list[Node]) -> list[Node]:
    """The IR of one call: an INTRINSIC node over the operands and one PROJ node per output."""
    results = intrinsic.infer([(n.dtype, n.shape) for n in operands])
    call = Node(Op.INTRINSIC, tuple(operands), (), "tuple", intrinsic.name)
    return [Node(Op.PROJ, (call,), shape, dtype, i) for i, (dtype, shape) in enumerate(results)]


def kernel_ir(name: str, intrinsic: str, inputs: list[TensorArg], outputs: list[str]) -> KernelIR:
    """A kernel whose body is ``outputs... = intrinsic(inputs...)``, built without DSL source."""
    intr = get(intrinsic)
    if intr is None:
        raise IntrinsicError(f"no intrinsic named {intrinsic!r}; known: {', '.join(names())}")
    operands = [Node(Op.INPUT, (), t.shape, t.dtype, t.name) for t in inputs]
    projs = call_nodes(intr, operands)
    if len(outputs) != len(projs):
        raise IntrinsicError(f"{intrinsic} returns {len(projs)} values ({', '.join(intr.outputs)}), "
                             f"got {len(outputs)} names")
    results = dict(zip(outputs, projs))
    return KernelIR(name, tuple(inputs), (), tuple(TensorArg(n, p.dtype, p.shape) for n, p in results.items()),
                    results)


_loaded = False
_load_lock = threading.Lock()


def _load_all() -> None:
    """Import the modules that register intrinsics (lazily: they import the scheduler). Locked,
    and marked done only after the imports, so another thread never sees a half-filled registry."""
    global _loaded
    if _loaded:
        return
    with _load_lock:
        if not _loaded:
            from . import attention, embedding  # noqa: F401
            _loaded = True
