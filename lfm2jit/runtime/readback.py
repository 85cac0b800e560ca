"""Many float32 tensors back to the host in a few large transfers (the gradient exchange of data
parallelism reads every gradient once per step).

``queue.read_buffer`` makes a new mappable buffer per call and hands back a copy that numpy copies
again. Here each slot (a bucket of tensors) has a persistent ``MAP_READ | COPY_DST`` staging buffer,
made once and reused while large enough; the tensors are packed into it by recorded buffer copies
(the device-to-host transfer itself: on a discrete GPU a mappable buffer lives in host memory), one
submit per slot, so that slot i is mapped and converted while the GPU still copies slot i + 1; and
the mapped bytes go straight into the caller's array in one pass (float64 for an exact sum, say).
"""
from __future__ import annotations

import numpy as np
import wgpu

from .tensor import Tensor

STAGING_USAGE = wgpu.BufferUsage.MAP_READ | wgpu.BufferUsage.COPY_DST


class StagedReadback:
    """Reusable staging for reading groups of f32 tensors: ``submit(groups)``, then ``read(i, out)``
    for each group in order."""

    def __init__(self, engine):
        self.engine = engine
        self._buffers: list = []           # slot -> staging buffer (grown, never shrunk)
        self._sizes: list[int] = []        # slot -> elements submitted by the last submit()

    def _staging(self, slot: int, nbytes: int):
        while len(self._buffers) <= slot:
            self._buffers.append(None)
        buf = self._buffers[slot]
        if buf is None or buf.size < nbytes:
            if buf is not None:
                buf.destroy()
            buf = self._buffers[slot] = self.engine.device.create_buffer(size=nbytes, usage=STAGING_USAGE)
        return buf

    def submit(self, groups: list[list[Tensor]]) -> list[int]:
        """Record the copies of each group's tensors, packed in order, into the group's staging
        buffer, after everything recorded so far; submit them group by group. Returns each group's
        number of elements."""
        for group in groups:
            for t in group:
                if t.dtype != "f32":
                    raise ValueError(f"StagedReadback reads f32 tensors; got {t!r}")
        if self.engine.capturing is not None:
            raise RuntimeError("StagedReadback.submit inside engine.capture(): its copies are read on the host, "
                               "which a replayed program cannot repeat")
        self.engine.flush()                      # the work that computes the tensors goes first
        sizes = [sum(t.size for t in group) for group in groups]
        for slot, (group, n) in enumerate(zip(groups, sizes)):
            buf = self._staging(slot, max(4, 4 * n))
            at = 0
            for t in group:
                if t.size:
                    self.engine.copy_into_buffer(t, buf, at)
                at += 4 * t.size
            self.engine.flush()
        self._sizes = sizes
        return list(sizes)

    def read(self, slot: int, out: np.ndarray) -> np.ndarray:
        """Wait for slot ``slot``'s copies, then convert its elements into ``out`` (1-D, as many
        elements as the group has, any float dtype) in one pass."""
        n = self._sizes[slot]
        if out.shape != (n,):
            raise ValueError(f"StagedReadback.read: slot {slot} holds {n} elements; out has shape {out.shape}")
        if n == 0:
            return out
        buf = self._buffers[slot]
        buf.map_sync(wgpu.MapMode.READ, 0, 4 * n)
        try:
            np.copyto(out, np.frombuffer(buf.read_mapped(0, 4 * n, copy=False), dtype=np.float32, count=n))
        finally:
            buf.unmap()
        return out

    def release(self) -> None:
        """Free the staging buffers (they are made again when next needed)."""
        for buf in self._buffers:
            if buf is not None:
                buf.destroy()
        self._buffers, self._sizes = [], []
