"""Top-k schedule: the k largest entries of each row of x [T, E], one invocation per row.

Each invocation runs K passes over its row, every pass picking the entry that ranks first among
those ranking after the previous pick, so nothing but the previous pick is kept (no row copy, no
workgroup memory, no subgroups); it reads the row K times, which suits routers (E of a few to a
few hundred). Entries rank by a key of their bits, descending, then by index, ascending:

    key(v) = 0xffffffff                      v is NaN (any sign or payload): above +inf
             0x80000000                      v is -0 or +0 (equal, as torch compares them)
             bits(v) | 0x80000000            v > 0
             ~bits(v)                        v < 0

f16 values are keyed as the f32 they widen to (exactly, NaN staying NaN). Padded rows
(past the real length) are neither read nor written.
"""
from __future__ import annotations

from dataclasses import dataclass

from ..ir.intrinsics import IntrinsicError
from .code import Index
from .layout import extent
from .spec import EntryPoint, IntrinsicCall, Plan

WORKGROUP = 64       # rows per workgroup: one invocation each


@dataclass(frozen=True)
class TopkParams:
    workgroup_size: int
    rows: Index             # the real length
    cols: int               # E
    k: int
    x: str
    x_dtype: str
    values: str | None
    values_dtype: str
    indices: str | None
    accumulate: tuple[str, ...]   # outputs added into instead of stored


def plan(call: IntrinsicCall, target=None) -> Plan:
    (x,) = call.operands
    values, indices = call.outputs
    t_axis, e_axis = x.shape
    k_axis = next(o.shape[1] for o in call.outputs if o is not None)
    k, e = call.sizes[k_axis], call.sizes[e_axis]
    if k > e:
        raise IntrinsicError(f"topk: K = {k_axis} = {k} is larger than x's last axis {e_axis} = {e}; expected K <= E")
    params = TopkParams(WORKGROUP, extent(t_axis, call.sizes), e, k, x.name, x.dtype,
                        values.name if values else None, values.dtype if values else x.dtype,
                        indices.name if indices else None,
                        tuple(o.name for o in call.outputs if o is not None and o.name in call.accumulate))
    return Plan("topk", params, (EntryPoint("main", -(-call.sizes[t_axis] // WORKGROUP)),))
