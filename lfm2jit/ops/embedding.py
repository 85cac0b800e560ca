"""The host side of the embedding gradient (schedule/scatter.py): slots from sorted token ids."""
from __future__ import annotations

import numpy as np


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
