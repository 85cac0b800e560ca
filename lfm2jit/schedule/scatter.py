"""Scatter schedule: the embedding table's gradient as a deterministic scatter-add.

The host sorts the ids once (it has them, see ops/embedding.py): ``order`` lists positions grouped
by token (stable, so by position within a token), slot u covers order[bounds[u, 0] : bounds[u, 1]]
and belongs to table row ``rows[u]``; unused slots are empty (start == end). One workgroup per
slot sums its positions' gradient rows in that fixed order and adds the sum to its table row, so
results do not depend on scheduling and no atomics are needed (each row belongs to one slot).
"""
from __future__ import annotations

from dataclasses import dataclass

from .code import Index
from .layout import extent, strides
from .spec import EntryPoint, IntrinsicCall, Plan

WORKGROUP = 64


@dataclass(frozen=True)
class ScatterParams:
    workgroup_size: int
    slots: Index            # the real length: slot u < slots may hold positions
    cols: int
    g: str
    g_dtype: str
    order: str
    bounds: str
    rows: str
    out: str
    out_dtype: str
    out_row: int            # the table's row stride


def plan(call: IntrinsicCall, target=None) -> Plan:
    g, order, bounds, rows = call.operands
    (out,) = call.outputs
    t_axis, d_axis = g.shape
    params = ScatterParams(WORKGROUP, extent(t_axis, call.sizes), call.sizes[d_axis], g.name, g.dtype, order.name,
                           bounds.name, rows.name, out.name, out.dtype, strides(out.shape, call.sizes)[out.shape[0]])
    return Plan("embedding_grad", params, (EntryPoint("main", call.sizes[t_axis]),))
