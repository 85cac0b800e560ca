"""Buffer pool: buffers freed by tensors are kept by size class and reused by later allocations.

A freed buffer is reusable at once, even while recorded work still reads it: later recorded
commands run after earlier ones (WebGPU orders dispatches and clears in a stream), and every host
write (Tensor.write) flushes the recorded work first. An allocation takes the oldest free buffer of
its size class (the lowest serial number), not the last one freed: tensors are freed when Python
drops them, in an order that varies from step to step (reference cycles wait for the collector),
but a training step that allocates the same sizes each time then gets the same buffers back, and
its bind groups are reused.

A recorded Program (program.py) reserves the buffers it binds: while it lives, a reserved buffer
is never handed out again, even after the tensor that held it is freed, so replaying the program
cannot overwrite someone else's data. Reserved buffers count as in use.
"""
from __future__ import annotations

import heapq
import itertools
from collections import defaultdict

from .tensor import USAGE


def size_class(nbytes: int) -> int:
    """Round up to 1/8 steps of a power of two: at most 12.5% waste, many shapes share a class."""
    if nbytes <= 256:
        return 256
    top = 1 << (nbytes - 1).bit_length()
    step = top // 16
    return -(-nbytes // step) * step


class BufferPool:
    def __init__(self, device):
        self.device = device
        self.free: dict[int, list] = defaultdict(list)     # size -> heap of (serial, buffer)
        self.serial: dict[int, int] = {}                     # id(buffer) -> creation order
        self._counter = itertools.count()
        self.allocated_bytes = 0
        self.peak_bytes = 0
        self.in_use_bytes = 0
        self.reused = 0
        self.reserved: dict[int, list] = {}                  # id(buffer) -> [programs holding it, tensor freed?]

    def acquire(self, nbytes: int, exact: bool = False):
        """A buffer of ``nbytes`` rounded up to its size class, or (``exact``) of ``nbytes``
        itself: what long-lived arenas take, whose sizes no other request shares, and where a
        class would waste up to 1/16 (58 MB of each of LFM2-350M's moment arenas)."""
        size = nbytes if exact else size_class(nbytes)
        if self.free[size]:
            self.reused += 1
            _, buf = heapq.heappop(self.free[size])
        else:
            buf = self.device.create_buffer(size=size, usage=USAGE)
            self.serial[id(buf)] = next(self._counter)
            self.allocated_bytes += size
        self.in_use_bytes += size
        self.peak_bytes = max(self.peak_bytes, self.in_use_bytes)
        return buf

    def release(self, buffer) -> None:
        held = self.reserved.get(id(buffer))
        if held is not None:
            held[1] = True          # the program still owns it: it stays in use, out of the free lists
            return
        self.in_use_bytes -= buffer.size
        heapq.heappush(self.free[buffer.size], (self.serial[id(buffer)], buffer))

    def reserve(self, buffers) -> None:
        """Keep these buffers (those the pool made) out of the free lists until ``unreserve``."""
        taken: dict[int, set] = {}
        for buf in buffers:
            if id(buf) not in self.serial:
                continue            # not the pool's: its owner keeps it
            held = self.reserved.get(id(buf))
            if held is not None:
                held[0] += 1
                continue
            free = any(b is buf for _, b in self.free[buf.size])
            self.reserved[id(buf)] = [1, free]
            if free:
                taken.setdefault(buf.size, set()).add(id(buf))
                self.in_use_bytes += buf.size
        for size, ids in taken.items():
            self.free[size] = [entry for entry in self.free[size] if id(entry[1]) not in ids]
            heapq.heapify(self.free[size])
        self.peak_bytes = max(self.peak_bytes, self.in_use_bytes)

    def unreserve(self, buffers) -> None:
        """Undo one ``reserve``: a buffer no program holds and no tensor uses goes back to the free lists."""
        for buf in buffers:
            held = self.reserved.get(id(buf))
            if held is None:
                continue
            held[0] -= 1
            if held[0] == 0:
                del self.reserved[id(buf)]
                if held[1]:
                    self.release(buf)
