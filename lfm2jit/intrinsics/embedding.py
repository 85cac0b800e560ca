"""The embedding table's gradient: a deterministic scatter-add of row gradients into the table.

    dE = embedding_grad(g, order, bounds, rows)      g: [T, D]   order, rows: i32 [T]   bounds: i32 [T, 2]

The host sorts the ids once (it has them): ``order`` lists positions grouped by token (stable, so
by position within a token), slot u covers order[bounds[u, 0] : bounds[u, 1]] and belongs to table
row ``rows[u]``; unused slots are empty (start == end). One workgroup per slot sums its positions'
gradient rows in that fixed order and adds the sum to its table row, so results do not depend on
scheduling and no atomics are needed (each row belongs to one slot). dE is only added to: the
kernel runs with accumulate on dE, after the caller zeroes it (or to accumulate a tied LM head's
gradient).
"""
from __future__ import annotations

import numpy as np

from ..codegen.wgsl import COMPUTE_TYPE
from ..schedule.spec import buffer_var, extent, strides
from . import Intrinsic, IntrinsicCall, IntrinsicError, register

NAME = "embedding_grad"
WORKGROUP = 64


def _infer(operands):
    if len(operands) != 4:
        raise IntrinsicError(f"{NAME} takes 4 operands (g, order, bounds, rows), got {len(operands)}")
    (gd, g), (od, order), (bd, bounds), (rd, rows) = operands
    if len(g) != 2 or gd not in ("f32", "f16"):
        raise IntrinsicError(f"{NAME}: g must be a float [T, D], got {gd}[{', '.join(g)}]")
    if (od, order) != ("i32", g[:1]) or (rd, rows) != ("i32", g[:1]):
        raise IntrinsicError(f"{NAME}: order and rows must be i32[{g[0]}]")
    if bd != "i32" or len(bounds) != 2 or bounds[0] != g[0]:
        raise IntrinsicError(f"{NAME}: bounds must be i32[{g[0]}, 2], got {bd}[{', '.join(bounds)}]")
    return [(gd, ("V", g[1]))]


def _plan(call: IntrinsicCall):
    g, order, bounds, rows = call.operands
    (out,) = call.outputs
    t_axis, d_axis = g.shape
    ctx = {
        "workgroup_size": WORKGROUP,
        "slots": extent(t_axis, call.sizes),
        "cols": call.sizes[d_axis],
        "g": buffer_var(g.name), "g_convert": COMPUTE_TYPE[g.dtype] != g.dtype,
        "order": buffer_var(order.name), "bounds": buffer_var(bounds.name), "rows": buffer_var(rows.name),
        "out": buffer_var(out.name), "out_elem": out.dtype, "out_row": strides(out.shape, call.sizes)[out.shape[0]],
    }
    return "embedding_grad", ctx, call.sizes[t_axis]


register(Intrinsic(NAME, ("g", "order", "bounds", "rows"), ("dE",), _infer, _plan, adds_only=True))


def slots(ids: np.ndarray, skip: int | None = None) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Host side of embedding_grad: (order [T], bounds [T, 2], rows [T]) for these token ids.

    Positions holding ``skip`` (torch's padding_idx) get no slot, so that row's gradient stays zero.
    """
    ids = np.asarray(ids).reshape(-1)
    t = ids.shape[0]
    order = np.argsort(ids, kind="stable").astype(np.int32)
    rows, starts = np.unique(ids[order], return_index=True)
    ends = np.append(starts[1:], t)
    if skip is not None:
        keep = rows != skip
        rows, starts, ends = rows[keep], starts[keep], ends[keep]
    bounds = np.zeros((t, 2), np.int32)
    bounds[:len(rows), 0] = starts
    bounds[:len(rows), 1] = ends
    padded_rows = np.zeros(t, np.int32)
    padded_rows[:len(rows)] = rows
    return order, bounds, padded_rows
