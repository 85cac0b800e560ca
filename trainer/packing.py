"""Packing consecutive sequences into one pass, as training and held-out evaluation both run them.

``pad`` (the default on a CPU adapter): padded at their ends to one length (a multiple of ``unit``)
and stacked. The model mixes positions causally and within each sequence, so a sequence's real
positions come out as they do alone; padded positions carry no loss.

``concat`` (the default on a GPU; ``Trainer.with_packing(..., mode="concat")``: training, token
log-probs and token objectives, as DPO and GRPO run them; ``held_out_loss(..., packing="concat")``):
concatenated into one row, padded only at its end to a multiple of the length bucket, with each
sequence's length (Lfm2Model.forward's ``segments``): attention, the short conv and RoPE restart at
every sequence, so again each comes out as it does alone, and a window of mixed lengths computes no
padding rows."""
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


PACKING_MODES = ("pad", "concat")
PACKING_CHOICES = PACKING_MODES + ("auto",)     # "auto": the adapter's default_mode


def default_mode(ctx) -> str:
    """The packing a run on ``ctx`` gets unless it asks: "concat" on a GPU, where it was faster at
    every length measured, "pad" on a CPU adapter, where a row of many sequences costs more than a
    batch of them at the shipped data's short lengths (docs/data.md, Packing)."""
    return "pad" if str(ctx.info.get("adapter_type", "")).lower() == "cpu" else "concat"


def resolve_mode(mode: str, ctx) -> str:
    """``mode`` checked ("pad", "concat" or "auto"), "auto" replaced by ``default_mode(ctx)``."""
    if mode not in PACKING_CHOICES:
        raise ValueError(f"packing mode must be one of {', '.join(PACKING_CHOICES)}, got {mode!r}")
    return default_mode(ctx) if mode == "auto" else mode


def concatenable(lengths, max_rows: int) -> int:
    """How many of the leading sequences to concatenate into one row: as many as fit ``max_rows``
    positions; 1 at least."""
    total = n = 0
    for length in lengths:
        total += length
        if n and total > max_rows:
            break
        n += 1
    return max(n, 1)


def concatenating_saves_rows(lengths, unit: int, bucket: int) -> bool:
    """Whether sequences of these lengths take fewer rows concatenated (their total, rounded up to
    ``bucket``) than stacked (each padded to the longest, rounded up to ``unit``): concat mode
    stacks a group that stacks without padding (equal lengths, a multiple of the unit), keeping
    the batched layout, as the results are the same either way."""
    stacked = len(lengths) * -(-max(lengths) // unit) * unit
    return -(-sum(lengths) // bucket) * bucket < stacked


def concat(ids, targets, masks, unit: int, pad: int):
    """Sequences concatenated into one row: ids [L] (L their total rounded up to ``unit``, the rest
    ``pad``), targets [L], each list of per-sequence masks in ``masks`` as [L] (0 past the end), and
    the row's segments: each sequence's length, then the padding's when there is any."""
    lengths = [len(row) for row in ids]
    total = sum(lengths)
    length = -(-total // unit) * unit
    segments = lengths + ([length - total] if length > total else [])

    def row(parts, fill, dtype):
        out = np.full(length, fill, dtype)
        out[:total] = np.concatenate([np.asarray(p) for p in parts])
        return out
    return (row(ids, pad, np.int32), row(targets, 0, np.int32),
            tuple(row(rows, 0, np.float32) for rows in masks), segments)


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
