"""Intrinsic schedule: a kernel whose outputs are the results of one intrinsic call."""
from __future__ import annotations

from .. import intrinsics
from ..ir.nodes import KernelIR, TensorArg
from ..ir.ops import Op
from .spec import schedule_error


def check_tiles_kind(ir: KernelIR, tiles, kind: type | None, schedule: str) -> None:
    """A tiles override must be of the class the schedule reads; another would be misread or ignored."""
    if tiles is not None and (kind is None or not isinstance(tiles, kind)):
        expected = f"{kind.__name__} or None" if kind else "None (its layout is fixed)"
        raise ValueError(f"{ir.name}: tiles={tiles!r} do not apply to a {schedule} kernel; expected {expected}")


def plan(ir: KernelIR, sizes: dict[str, int], accumulate: frozenset[str], tiles=None):
    calls = {id(ir.results[o.name].srcs[0]): ir.results[o.name].srcs[0]
             for o in ir.outputs if ir.results[o.name].op == Op.PROJ}
    if len(calls) != 1 or any(ir.results[o.name].op != Op.PROJ for o in ir.outputs):
        raise schedule_error(ir, "a kernel that calls an intrinsic must output only that call's results",
                             "outputs assigned directly from one intrinsic call")
    (call,) = calls.values()
    intr = intrinsics.get(call.arg)
    check_tiles_kind(ir, tiles, intr.tiles, intr.name)
    operands = []
    for i, src in enumerate(call.srcs):
        if src.op != Op.INPUT:
            raise schedule_error(ir, f"operand {intr.params[i]!r} of {intr.name} is computed in the kernel",
                                 "intrinsic operands that are kernel inputs")
        operands.append(TensorArg(src.arg, src.dtype, src.shape))
    by_index = {ir.results[o.name].arg: o for o in ir.outputs}
    outputs = tuple(by_index.get(i) for i in range(len(intr.outputs)))
    call_spec = intrinsics.IntrinsicCall(intr.name, tuple(operands), outputs, sizes, accumulate, tiles)
    return intr.plan(call_spec)
