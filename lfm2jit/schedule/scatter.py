"""Scatter schedule: deterministic scatter-adds of rows, one workgroup per destination row.

Two callers, one template (embedding_grad):

``embedding_grad`` (the embedding's gradient): the host sorts the ids once (it has them, see
ops/embedding.py): ``order`` lists positions grouped by token (stable, so by position within a
token), slot u covers order[bounds[u, 0] : bounds[u, 1]] and belongs to table row ``rows[u]``;
unused slots are empty (start == end). The sum is added to the row, which the caller zeroed.

``segment_sum`` (gather's adjoint, from bucket_sort's order and offsets on the GPU): slot v is
table row v, covering order[offsets[v] : offsets[v + 1]]; every row is stored (zero for an empty
one), or added to when the output is accumulated.

Each workgroup sums its positions' rows in that fixed order, so results do not depend on
scheduling and no atomics are needed (each row belongs to one slot).
"""
from __future__ import annotations

import math
from dataclasses import dataclass

from .code import Const, Index
from .layout import extent, strides
from .spec import EntryPoint, IntrinsicCall, Plan

WORKGROUP = 64


@dataclass(frozen=True)
class ScatterParams:
    workgroup_size: int
    slots: Index            # slot u < slots may hold positions
    cols: int
    g: str
    g_dtype: str
    order: str
    bounds: str             # embedding_grad: i32[T, 2] (start, end) per slot; segment_sum: offsets i32[V + 1]
    rows: str | None        # embedding_grad: the table row of each slot; segment_sum: None (slot v is row v)
    out: str
    out_dtype: str
    out_row: int            # the table's row stride
    accumulate: bool = True  # add the sum to the row (embedding_grad always does)
    store_empty: bool = False  # write rows no position reaches (segment_sum stores their zero)


def plan(call: IntrinsicCall, target=None) -> Plan:
    g, order, bounds, rows = call.operands
    (out,) = call.outputs
    t_axis, d_axis = g.shape
    params = ScatterParams(WORKGROUP, extent(t_axis, call.sizes), call.sizes[d_axis], g.name, g.dtype, order.name,
                           bounds.name, rows.name, out.name, out.dtype, strides(out.shape, call.sizes)[out.shape[0]])
    return Plan("embedding_grad", params, (EntryPoint("main", call.sizes[t_axis]),))


def plan_segments(call: IntrinsicCall, target=None) -> Plan:
    g, order, offsets = call.operands
    (out,) = call.outputs
    keys = call.sizes[out.shape[0]]
    cols = math.prod(call.sizes[a] for a in g.shape[len(order.shape):])
    params = ScatterParams(WORKGROUP, Const(keys), cols, g.name, g.dtype, order.name, offsets.name, None, out.name,
                           out.dtype, cols, accumulate=out.name in call.accumulate, store_empty=True)
    return Plan("embedding_grad", params, (EntryPoint("main", keys),))
