"""Arenas: many tensors carved side by side out of a few buffers, so a pass over all of them is
a few dispatches instead of one per tensor.

A model has ~150 parameters, and as many gradients and moments; the gradient norm's first pass,
the window's zeroing and the optimizer walk every one each step, and on a fast GPU most of those
dispatches are too small to cover their own launch. Carved into an arena, tensors that follow each
other form ``runs``: one span of one buffer, which a single dispatch (or clear) covers; lists that
go together element by element (parameters, gradients, moments, carved in one order) are walked
by ``runs_together``.

Layout: each tensor starts at a multiple of the adapter's storage binding alignment, right after
the previous one's slot; the bytes between a tensor's end and the next slot (its padding) are
bound by no tensor (a view's capacity is exactly its size). They are zero from the moment the
arena is made (``carve`` records the clear; ``upload``'s buffers are new), so a sum over a run
equals the sum over its tensors; a pass that writes a span must leave zeros zero there (an
optimizer step does, for a parameter, gradient and moments all zero). An arena buffer holds at
most the adapter's storage binding size, so a run of several tensors can always be bound whole;
tensors that do not fit start another buffer.
"""
from __future__ import annotations

import math
import weakref
from typing import NamedTuple, Sequence

import numpy as np

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


def _layout(ctx, shapes: Sequence[tuple[int, ...]], item: int) -> list[tuple[int, list[tuple[int, int]]]]:
    """Arena buffers for these shapes, in order: (bytes, [(index, byte offset)]) each. A slot is
    the tensor's bytes rounded up to the binding alignment (an empty tensor takes none); a buffer
    holds at most ``buffer_limit`` bytes, except one tensor larger than that, alone in its own."""
    align, limit = _align(ctx), buffer_limit(ctx)
    slots = [_up(math.prod(s) * item, align) for s in shapes]
    groups: list[list[int]] = [[]]
    used = 0
    for i, slot in enumerate(slots):
        if used + slot > limit and groups[-1]:
            groups.append([])
            used = 0
        groups[-1].append(i)
        used += slot
    out = []
    for group in filter(None, groups):
        at, placed = 0, []
        for i in group:
            placed.append((i, at))
            at += slots[i]
        out.append((max(at, align), placed))
    return out


def _views(arena: Tensor, placed, shapes, dtype: str, out: list) -> None:
    """The tensors of one arena buffer, at their slots; their slots are recorded for ``runs``."""
    carved = {}
    for i, at in placed:
        n = math.prod(shapes[i])
        out[i] = Tensor(arena.ctx, arena.buffer, shapes[i], dtype, capacity=n, offset=at, base=arena,
                        parts=arena.parts)
        if n:
            carved[at] = n * ITEMSIZE[dtype]
    _SLOTS[arena] = carved


def carve(recorder, shapes: Sequence[tuple[int, ...]], dtype: str = "f32") -> list[Tensor]:
    """Zeroed tensors of these shapes, laid out in order over as few pooled buffers as the binding
    limit allows. Each view keeps its buffer alive; the buffer returns to the pool when the last
    view is gone."""
    item = ITEMSIZE[dtype]
    out: list[Tensor | None] = [None] * len(shapes)
    for nbytes, placed in _layout(recorder.ctx, shapes, item):
        arena = recorder.empty((nbytes // item,), dtype, exact=True)
        recorder.zero_(arena)
        _views(arena, placed, shapes, dtype, out)
    return out


def carve_like(recorder, tensors: Sequence[Tensor]) -> list[Tensor]:
    """Zeroed tensors shaped and typed like ``tensors`` (a gradient or a moment per parameter),
    carved in their order, one arena set per dtype."""
    out: list[Tensor | None] = [None] * len(tensors)
    for dtype in dict.fromkeys(t.dtype for t in tensors):
        where = [i for i, t in enumerate(tensors) if t.dtype == dtype]
        for i, t in zip(where, carve(recorder, [tensors[i].shape for i in where], dtype)):
            out[i] = t
    return out


def allocate(ctx, shapes: Sequence[tuple[int, ...]], dtype: str = "f32") -> list[Tensor]:
    """Long-lived zero tensors of these shapes (a model's parameters), carved as ``carve`` does
    but out of buffers of their own, outside the pool (whose peak counts what a step uses). A
    new WebGPU buffer is zeros, so the padding is too."""
    shapes = [tuple(s) for s in shapes]
    item = ITEMSIZE[dtype]
    out: list[Tensor | None] = [None] * len(shapes)
    for nbytes, placed in _layout(ctx, shapes, item):
        _views(Tensor.empty(ctx, (nbytes // item,), dtype), placed, shapes, dtype, out)
    return out


def upload(ctx, arrays: Sequence[np.ndarray], dtype: str = "f32") -> list[Tensor]:
    """``allocate``d tensors holding these arrays."""
    out = allocate(ctx, [np.shape(a) for a in arrays], dtype)
    for t, a in zip(out, arrays):
        if t.size:
            t.write(a)
    return out


def _carved(t: Tensor) -> bool:
    """Whether t is a whole tensor carve made (or a view of one under another shape)."""
    slots = _SLOTS.get(t._base) if t._base is not None else None
    return slots is not None and slots.get(t.offset) == t.nbytes


def _groups(tensors: Sequence[Tensor]) -> list[list[int]]:
    """Indices of the non-empty tensors, grouped in order into maximal runs: each next tensor
    starts in the same arena where the previous one's slot ends."""
    groups: list[list[int]] = []
    align = None
    for i, t in enumerate(tensors):
        if t.size == 0:
            continue
        if groups:
            last = tensors[groups[-1][-1]]
            align = align or _align(t.ctx)
            if (t._base is last._base and t.dtype == last.dtype and _carved(t) and _carved(last)
                    and t.offset == last.offset + _up(last.nbytes, align)):
                groups[-1].append(i)
                continue
        groups.append([i])
    return groups


def runs(tensors: Sequence[Tensor]) -> list[Run]:
    """The tensors (empty ones left out) grouped, in order, into maximal runs. A tensor that is
    not a whole carved one is a run of its own; a run longer than one binding is cut into spans
    that each fit one (``cut``)."""
    out = []
    for g in _groups(tensors):
        members = tuple(tensors[i] for i in g)
        out += [Run(span, members) for (span,) in cut(_span(members))]
    return out


def cut(*spans: Tensor) -> list[tuple[Tensor, ...]]:
    """Flat views of one size that go together element by element, cut at the same elements into
    consecutive views of at most one binding each (each starting at the binding alignment), so a
    pass over them never binds more than the device allows."""
    first = spans[0]
    item = ITEMSIZE[first.dtype]
    align = _align(first.ctx)
    step = buffer_limit(first.ctx) // align * align // item
    if first.size <= step:
        return [spans]
    return [tuple(x.bytes_view(x.offset + start * item, min(step, first.size - start) * item) for x in spans)
            for start in range(0, first.size, step)]


def runs_together(lists: Sequence[Sequence[Tensor]]) -> list[tuple[Tensor, ...]]:
    """For lists of tensors that go together element by element (a parameter, its gradient, its
    moments: the same shapes and dtype at each index), one span per list over each maximal range
    of indices that is a run in every list. Carved in the same order, the lists' slots line up,
    so element e of one span belongs with element e of the others."""
    n = len(lists[0])
    for xs in lists:
        if len(xs) != n:
            raise ValueError(f"runs_together takes lists of one length, got {[len(xs) for xs in lists]}")
        for a, b in zip(lists[0], xs):
            if a.shape != b.shape or a.dtype != b.dtype:
                raise ValueError(f"runs_together: {a!r} goes with {b!r}; the shapes and dtypes must match")
    starts = {g[0] for xs in lists for g in _groups(xs)}
    joint: list[list[int]] = []
    for i in range(n):
        if lists[0][i].size == 0:
            continue
        if i in starts or not joint:
            joint.append([])
        joint[-1].append(i)
    return [piece for g in joint for piece in cut(*(_span(tuple(xs[i] for i in g)) for xs in lists))]


def _span(tensors: tuple[Tensor, ...]) -> Tensor:
    first, last = tensors[0], tensors[-1]
    if len(tensors) == 1:
        return first.view((first.size,))
    n = (last.offset + last.nbytes - first.offset) // ITEMSIZE[first.dtype]
    return Tensor(first.ctx, first.buffer, (n,), first.dtype, capacity=n, offset=first.offset,
                  base=first._base or first, parts=first.parts)
