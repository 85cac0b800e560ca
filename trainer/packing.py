"""Packing consecutive sequences into one pass, as training and held-out evaluation both run them:
padded at their ends to one length (a multiple of ``unit``) and stacked. The model mixes
positions causally and within each sequence, so a sequence's real positions come out as they do
alone; padded positions carry no loss."""
from __future__ import annotations

import numpy as np

PACK_WASTE = 1.25               # packed rows per row of the sequences' own (unit-rounded) lengths, at most


def packable(lengths, unit: int, max_rows: int) -> int:
    """How many of the leading sequences (of these lengths) to pack into one pass: as many as fit
    ``max_rows`` rows while padding to the longest adds at most PACK_WASTE of their own rows
    (packing pays for many similar lengths, not for a short sequence beside a long one); 1 at
    least."""
    longest = own = n = 0
    for length in lengths:
        rows = -(-length // unit) * unit
        longest, own = max(longest, rows), own + rows
        if n and ((n + 1) * longest > max_rows or (n + 1) * longest > PACK_WASTE * own):
            break
        n += 1
    return max(n, 1)


def pad_token(cfg) -> int:
    """The id padded positions take: the model's pad token, else 0 (unscored either way)."""
    return cfg.pad_token_id if cfg.pad_token_id is not None else 0


def pack(ids, targets, masks, unit: int, pad: int):
    """Sequences stacked into one packed pass: ids [B, L] (L the longest rounded up to ``unit``,
    pads ``pad``), targets and each list of per-sequence masks in ``masks`` flattened to [B * L]
    (pads 0: unscored)."""
    length = -(-max(len(row) for row in ids) // unit) * unit
    return (_stack(ids, length, pad, np.int32), _stack(targets, length, 0, np.int32).reshape(-1),
            tuple(_stack(rows, length, 0, np.float32).reshape(-1) for rows in masks))


def _stack(rows, length: int, fill, dtype) -> np.ndarray:
    """[len(rows), length] of ``fill``, each row's values at its start."""
    out = np.full((len(rows), length), fill, dtype)
    for i, row in enumerate(rows):
        out[i, :len(row)] = row
    return out
