"""Arenas: many tensors carved side by side out of a few buffers, so a pass over all of them is
a few dispatches instead of one per tensor.

A model's gradients are ~150 tensors; the gradient norm's first pass and the window's zeroing
walk every one each step, and on a fast GPU most of those dispatches are too small to cover
their own launch. Carved into an arena, tensors that follow each other form ``runs``: one span of
one buffer, which a single dispatch (or clear) covers.

Layout: each tensor starts at a multiple of the adapter's storage binding alignment, right after
the previous one's slot; the bytes between a tensor's end and the next slot (its padding) are
bound by no tensor (a view's capacity is exactly its size), so no kernel can write them. They are
zero from the moment the arena is made (``carve`` records the clear), so a sum over a run equals
the sum over its tensors. An arena buffer holds at most the adapter's storage binding size, so a
run of several tensors can always be bound whole; tensors that do not fit start another buffer.
"""
from __future__ import annotations

import math
import weakref
from typing import NamedTuple, Sequence

from .tensor import ITEMSIZE, Tensor


# arena buffer's owning tensor -> {byte offset: bytes} of the tensors carved from it: only whole
# carved tensors join a run (a user's rows of one, or of any other buffer, never take in bytes
# that are not padding)
_SLOTS: "weakref.WeakKeyDictionary[Tensor, dict[int, int]]" = weakref.WeakKeyDictionary()


class Run(NamedTuple):
    """Consecutive tensors of one arena buffer: ``span`` covers them and their padding."""
    span: Tensor                 # a flat view of the bytes from the first tensor's start to the last's end
    tensors: tuple[Tensor, ...]


def _align(ctx) -> int:
    return max(ITEMSIZE["f32"], int(ctx.limits.get("min-storage-buffer-offset-alignment", 256)))


def _up(n: int, step: int) -> int:
    return -(-n // step) * step


def buffer_limit(ctx) -> int:
    """The most bytes one arena buffer holds: what one binding (and one buffer) may cover. A
    tensor larger than that is carved alone (kernels bind it in pieces, as they would anyway)."""
    limits = ctx.limits
    return int(min(limits.get("max-storage-buffer-binding-size", 1 << 27), limits.get("max-buffer-size", 1 << 28)))


def carve(recorder, shapes: Sequence[tuple[int, ...]], dtype: str = "f32") -> list[Tensor]:
    """Zeroed tensors of these shapes, laid out in order over as few pooled buffers as the binding
    limit allows. Each view keeps its buffer alive; the buffer returns to the pool when the last
    view is gone."""
    align, limit, item = _align(recorder.ctx), buffer_limit(recorder.ctx), ITEMSIZE[dtype]
    slots = [_up(math.prod(s) * item, align) for s in shapes]      # an empty tensor takes no room
    groups: list[list[int]] = [[]]
    used = 0
    for i, slot in enumerate(slots):
        if used + slot > limit and groups[-1]:       # one larger than a binding gets a buffer of its own
            groups.append([])
            used = 0
        groups[-1].append(i)
        used += slot
    out: list[Tensor | None] = [None] * len(shapes)
    for group in groups:
        if not group:
            continue
        nbytes = max(sum(slots[i] for i in group), align)
        arena = recorder.empty((nbytes // item,), dtype)
        recorder.zero_(arena)
        at, carved = 0, {}
        for i in group:
            n = math.prod(shapes[i])
            out[i] = Tensor(recorder.ctx, arena.buffer, shapes[i], dtype, capacity=n, offset=at, base=arena)
            if n:
                carved[at] = n * item
            at += slots[i]
        _SLOTS[arena] = carved
    return out


def _carved(t: Tensor) -> bool:
    """Whether t is a whole tensor carve made (or a view of one under another shape)."""
    slots = _SLOTS.get(t._base) if t._base is not None else None
    return slots is not None and slots.get(t.offset) == t.nbytes


def runs(tensors: Sequence[Tensor]) -> list[Run]:
    """The tensors (empty ones left out) grouped, in order, into maximal runs: each next tensor
    starts in the same arena where the previous one's slot ends. A tensor that is not a whole
    carved one is a run of its own."""
    groups: list[list[Tensor]] = []
    align = None
    for t in tensors:
        if t.size == 0:
            continue
        if groups:
            last = groups[-1][-1]
            align = align or _align(t.ctx)
            if (t._base is last._base and t.dtype == last.dtype and _carved(t) and _carved(last)
                    and t.offset == last.offset + _up(last.nbytes, align)):
                groups[-1].append(t)
                continue
        groups.append([t])
    return [Run(_span(tuple(g)), tuple(g)) for g in groups]


def _span(tensors: tuple[Tensor, ...]) -> Tensor:
    first, last = tensors[0], tensors[-1]
    if len(tensors) == 1:
        return first.view((first.size,))
    n = (last.offset + last.nbytes - first.offset) // ITEMSIZE[first.dtype]
    return Tensor(first.ctx, first.buffer, (n,), first.dtype, capacity=n, offset=first.offset,
                  base=first._base or first)
