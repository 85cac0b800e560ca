"""Many float32 tensors to and from the host in a few large transfers (the gradient exchange of
data parallelism reads every gradient back and writes its mean once per step).

``queue.read_buffer`` makes a new mappable buffer per call and hands back a copy that numpy copies
again; ``Tensor.write`` copies its array to bytes, which ``queue.write_buffer`` copies once more,
one tensor (and one flush) at a time. Here each slot (a bucket of tensors) has a persistent
mappable staging buffer, made once and reused while large enough, and the tensors are packed into
or unpacked from it by recorded buffer copies (the transfer itself: on a discrete GPU a mappable
buffer lives in host memory), one submit per slot:

* ``StagedReadback``: slot i is mapped and converted while the GPU still copies slot i + 1 (or,
  when a recorded backward makes the copies as it finishes each group's gradients, while it still
  computes the next group), and the mapped bytes go straight into the caller's array in one pass
  (float64 for an exact sum, say), cut into ranges that several threads copy
  (lfm2jit/runtime/host_threads.py);
* ``StagedWrite``: a slot's values go into its mapped buffer in one copy, and its unpacking copies
  are recorded in order with the recorded work, so nothing is flushed per tensor.
"""
from __future__ import annotations

import numpy as np
import wgpu

from .host_threads import copy_out
from .tensor import Tensor

READ_USAGE = wgpu.BufferUsage.MAP_READ | wgpu.BufferUsage.COPY_DST
WRITE_USAGE = wgpu.BufferUsage.MAP_WRITE | wgpu.BufferUsage.COPY_SRC


def _check_f32(what: str, tensors) -> None:
    for t in tensors:
        if t.dtype != "f32":
            raise ValueError(f"{what} moves f32 tensors; got {t!r}")


def _outside_capture(engine, what: str, why: str) -> None:
    """Host transfers cannot be part of a recorded program: a replay would not repeat the host's side."""
    if engine.capturing is not None:
        raise RuntimeError(f"{what} inside engine.capture(): {why}, which a replayed program cannot repeat")


def _packed(tensors):
    """(tensor, byte offset) of each non-empty f32 tensor packed one after another in a staging buffer."""
    at = 0
    for t in tensors:
        if t.size:
            yield t, at
        at += 4 * t.size


class _Slots:
    """Persistent staging buffers of one usage, one per slot, grown (never shrunk) as needed."""

    def __init__(self, engine, usage):
        self.engine, self.usage = engine, usage
        self._buffers: list = []           # slot -> staging buffer

    def __getitem__(self, slot: int):
        return self._buffers[slot]

    def get(self, slot: int, nbytes: int):
        """Slot ``slot``'s buffer, made (or remade larger) to hold ``nbytes``."""
        while len(self._buffers) <= slot:
            self._buffers.append(None)
        buf = self._buffers[slot]
        if buf is None or buf.size < nbytes:
            if buf is not None:
                buf.destroy()
            buf = self._buffers[slot] = self.engine.device.create_buffer(size=nbytes, usage=self.usage)
        return buf

    def release(self) -> None:
        """Free the staging buffers (they are made again when next needed)."""
        for buf in self._buffers:
            if buf is not None:
                buf.destroy()
        self._buffers = []


class StagedReadback:
    """Reusable staging for reading groups of f32 tensors: ``submit(groups)``, then ``read(i, out)``
    for each group in order. Or, for copies that a recorded program makes itself (a train step
    staging its gradients as the backward finishes them, then replayed): ``reserve(sizes)`` once,
    ``record(slot, group, replayed=True)`` inside the capture, and ``read`` after each replay."""

    def __init__(self, engine):
        self.engine = engine
        self._slots = _Slots(engine, READ_USAGE)
        self._sizes: list[int] = []        # slot -> elements its last copies hold

    def submit(self, groups: list[list[Tensor]]) -> list[int]:
        """Record the copies of each group's tensors, packed in order, into the group's staging
        buffer, after everything recorded so far; submit them group by group. Returns each group's
        number of elements."""
        _check_f32("StagedReadback", (t for group in groups for t in group))
        _outside_capture(self.engine, "StagedReadback.submit", "its copies are read on the host")
        self.engine.flush()                      # the work that computes the tensors goes first
        sizes = self.reserve([sum(t.size for t in group) for group in groups])
        for slot, group in enumerate(groups):
            self.record(slot, group)
            self.engine.flush()
        return sizes

    def reserve(self, sizes: list[int]) -> list[int]:
        """Make (or keep) a staging buffer per slot for ``sizes[slot]`` elements; a buffer that a
        recorded program copies into stays the same as long as no slot needs to grow."""
        for slot, n in enumerate(sizes):
            self._slots.get(slot, max(4, 4 * n))
        self._sizes = list(sizes)
        return list(sizes)

    def record(self, slot: int, group: list[Tensor], replayed: bool = False) -> None:
        """Record the copies of ``group``'s tensors, packed in order, into slot ``slot`` (reserved
        for exactly their elements), after everything recorded so far. ``replayed``: inside a
        capture, whose replays repeat the copies (the caller reads the slot after each)."""
        _check_f32("StagedReadback", group)
        n = sum(t.size for t in group)
        if slot >= len(self._sizes) or self._sizes[slot] != n:
            raise ValueError(f"StagedReadback.record: slot {slot} is reserved for "
                             f"{self._sizes[slot] if slot < len(self._sizes) else 'no'} elements; the group has {n}")
        buf = self._slots[slot]
        for t, at in _packed(group):
            self.engine.copy_into_buffer(t, buf, at, replayed=replayed)

    def read(self, slot: int, out: np.ndarray) -> np.ndarray:
        """Wait for slot ``slot``'s copies, then convert its elements into ``out`` (1-D, as many
        elements as the group has, any float dtype) in one pass (``copy_out``'s threads)."""
        n = self._sizes[slot]
        if out.shape != (n,):
            raise ValueError(f"StagedReadback.read: slot {slot} holds {n} elements; out has shape {out.shape}")
        if n == 0:
            return out
        buf = self._slots[slot]
        buf.map_sync(wgpu.MapMode.READ, 0, 4 * n)
        try:
            copy_out(out, np.frombuffer(buf.read_mapped(0, 4 * n, copy=False), dtype=np.float32, count=n))
        finally:
            buf.unmap()
        return out

    def release(self) -> None:
        """Free the staging buffers (they are made again when next needed)."""
        self._slots.release()
        self._sizes = []


class StagedWrite:
    """Reusable staging for overwriting groups of f32 tensors from host arrays: ``write(slot,
    tensors, values)`` per group (a slot's buffer is reused by the next write to that slot, which
    waits for the GPU to have unpacked it)."""

    def __init__(self, engine):
        self.engine = engine
        self._slots = _Slots(engine, WRITE_USAGE)

    def write(self, slot: int, tensors: list[Tensor], values: np.ndarray) -> None:
        """Overwrite ``tensors`` with ``values`` (1-D, as many elements as the tensors hold together,
        packed in order; converted to float32), after all work recorded so far; the copies are
        submitted before this returns. Bad input is refused before anything is written."""
        _check_f32("StagedWrite", tensors)
        n = sum(t.size for t in tensors)
        if np.shape(values) != (n,):
            raise ValueError(f"StagedWrite.write: the tensors hold {n} elements; values have shape {np.shape(values)}")
        _outside_capture(self.engine, "StagedWrite.write", "its values come from the host")
        if n == 0:
            return
        buf = self._slots.get(slot, 4 * n)
        buf.map_sync(wgpu.MapMode.WRITE, 0, 4 * n)
        try:
            buf.write_mapped(np.ascontiguousarray(values, np.float32), 0)
        finally:
            buf.unmap()
        for t, at in _packed(tensors):
            self.engine.copy_from_buffer(buf, at, t)
        self.engine.flush()

    def release(self) -> None:
        """Free the staging buffers (they are made again when next needed)."""
        self._slots.release()
