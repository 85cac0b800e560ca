"""Token ids: checked on the host, uploaded with the embedding gradient's slots."""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ..ops.embedding import slots
from ..runtime import Tensor


def check_ids(ids, vocab_size: int, what: str = "input_ids") -> np.ndarray:
    """The ids as int32 [B, T] (a 1-D sequence is B = 1)."""
    arr = np.asarray(ids)
    if arr.ndim == 1:
        arr = arr[None]
    if arr.ndim != 2 or arr.size == 0:
        raise ValueError(f"{what} must be a non-empty [T] sequence or [B, T] batch of token ids, "
                         f"got shape {list(np.shape(ids))}")
    if not np.issubdtype(arr.dtype, np.integer):
        raise ValueError(f"{what} must be integers, got {arr.dtype}")
    bad = np.argwhere((arr < 0) | (arr >= vocab_size))
    if bad.size:
        at = tuple(bad[0]) if np.ndim(ids) == 2 else (bad[0][1],)
        raise ValueError(f"{what}[{', '.join(map(str, at))}] = {arr[tuple(bad[0])]} is outside the vocabulary "
                         f"0..{vocab_size - 1}")
    return arr.astype(np.int32)


def check_segments(segments, length: int) -> tuple[int, ...]:
    """Sequence lengths of a concatenated row of ``length`` positions: positive integers summing to it."""
    try:
        lengths = tuple(int(n) for n in segments)
        ok = all(int(n) == n and not isinstance(n, bool) for n in segments)
    except (TypeError, ValueError):
        ok, lengths = False, ()
    if not ok or not lengths or min(lengths) < 1 or sum(lengths) != length:
        raise ValueError(f"segments must be the lengths (integers >= 1) of the sequences concatenated in the row, "
                         f"summing to its {length} positions; got {segments!r}")
    return lengths


def segment_layout(lengths) -> tuple[np.ndarray, np.ndarray]:
    """int32 [T] each row's sequence start and int32 [T] its position within that sequence."""
    starts = np.repeat(np.cumsum((0,) + tuple(lengths))[:-1], lengths).astype(np.int32)
    return starts, (np.arange(sum(lengths)) - starts).astype(np.int32)


@dataclass
class Segments:
    """Sequences concatenated in one row (Lfm2Model.forward's ``segments``): on the device, what the
    layers that mix positions read. Attention sees keys from starts[t] on, the short conv's taps stop
    at the sequence start (pos), and RoPE turns by each row's own position (cos, sin)."""
    lengths: tuple[int, ...]
    starts: Tensor                                # (T,) i32 where row t's sequence starts
    pos: Tensor                                   # (T,) i32 row t's position within its sequence
    cos: Tensor                                   # (T, R) RoPE tables of those positions
    sin: Tensor                                   # (T, R)

    @classmethod
    def upload(cls, engine, lengths, rope) -> "Segments":
        starts, pos = segment_layout(lengths)
        cos, sin = rope.angles(pos)
        return cls(tuple(lengths), engine.tensor(starts, "i32"), engine.tensor(pos, "i32"), engine.tensor(cos),
                   engine.tensor(sin))

    def write(self, lengths, rope) -> None:
        """A new layout of the same row length (checked by the caller)."""
        starts, pos = segment_layout(lengths)
        cos, sin = rope.angles(pos)
        self.lengths = tuple(lengths)
        for t, arr in ((self.starts, starts), (self.pos, pos), (self.cos, cos), (self.sin, sin)):
            t.write(arr)


@dataclass
class DeviceIds:
    """A [B, S] batch of token ids on the device, with the embedding gradient's slots (see
    intrinsics/embedding.slots), all uploaded before the forward records anything. A recorded
    train step (runtime/program.py) reads these tensors, so it replays with new ids written in."""
    host: np.ndarray                              # (B, S) int32
    ids: Tensor                                   # (T,) i32
    order: Tensor                                 # (T,) i32
    bounds: Tensor                                # (T, 2) i32
    rows: Tensor                                  # (T,) i32
    skip: int | None                              # the padding token, whose row gets no gradient
    segments: Segments | None = None              # sequences concatenated in the one row, when they are

    @classmethod
    def upload(cls, engine, ids: np.ndarray, skip: int | None) -> "DeviceIds":
        """Checked int32 ids [B, S] (check_ids) and their slots, uploaded."""
        flat = ids.reshape(-1)
        order, bounds, rows = slots(flat, skip=skip)
        return cls(ids, engine.tensor(flat), engine.tensor(order), engine.tensor(bounds), engine.tensor(rows), skip)

    def write(self, ids: np.ndarray) -> None:
        """New ids of the same shape (checked by the caller, as Lfm2Model.check_ids does)."""
        if ids.shape != self.host.shape:
            raise ValueError(f"ids of shape {list(ids.shape)} do not fit uploaded ids of shape {list(self.host.shape)}")
        self.host = ids.astype(np.int32)
        flat = self.host.reshape(-1)
        self.ids.write(flat)
        for t, arr in zip((self.order, self.bounds, self.rows), slots(flat, skip=self.skip)):
            t.write(arr)
