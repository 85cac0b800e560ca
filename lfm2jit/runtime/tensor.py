"""Tensor: a GPU storage buffer with a logical shape and dtype.

The buffer may hold more elements than the shape needs (``capacity``): a sequence padded up to its
length bucket keeps its real length in ``shape`` and its padded rows past the end of the buffer's
used prefix, so ``numpy()`` reads exactly the real elements.

A tensor larger than the device's largest buffer (``max-buffer-size``: 256 MiB by default; LFM2-1.2B's
f32 embedding is 512 MiB) lives in several buffers, ``parts``, each one binding long (the pieces a
kernel binds it in, schedule/pieces.py), one after another in the tensor's bytes. It is written,
read, viewed and bound piece by piece; a view within one part (``rows``, ``bytes_view``) is an
ordinary single-buffer tensor.
"""
from __future__ import annotations

import math
import weakref

import numpy as np
import wgpu

DTYPES = {"f32": np.float32, "f16": np.float16, "i32": np.int32, "u32": np.uint32}
NUMPY_TO_DTYPE = {np.dtype(v): k for k, v in DTYPES.items()}
ITEMSIZE = {k: np.dtype(v).itemsize for k, v in DTYPES.items()}
USAGE = wgpu.BufferUsage.STORAGE | wgpu.BufferUsage.COPY_SRC | wgpu.BufferUsage.COPY_DST


def infer_dtype(arr: np.ndarray) -> str:
    """The tensor dtype for a numpy array: float64 becomes f32 and int64 becomes i32."""
    dtype = {np.dtype(np.float64): "f32", np.dtype(np.int64): "i32"}.get(arr.dtype) or NUMPY_TO_DTYPE.get(arr.dtype)
    if dtype is None:
        raise ValueError(f"cannot store numpy dtype {arr.dtype} on the GPU; use one of {', '.join(DTYPES)}")
    return dtype


def part_bytes(limits) -> int:
    """The bytes of each part of a tensor larger than one buffer: one binding, rounded down to the
    binding offset alignment (the same size schedule/pieces.py cuts bindings at)."""
    align = max(4, int(limits.get("min-storage-buffer-offset-alignment", 256)))
    most = min(limits.get("max-storage-buffer-binding-size", 128 << 20), limits.get("max-buffer-size", 256 << 20))
    return int(most) // align * align


def buffer_bytes(elements: int, dtype: str) -> int:
    """Bytes for a buffer of that many elements: at least 16, a multiple of 16 (copy alignment)."""
    return max(16, -(-elements * ITEMSIZE[dtype] // 16) * 16)


class Tensor:
    def __init__(self, ctx, buffer, shape, dtype: str, capacity: int | None = None, on_free=None,
                 offset: int = 0, base: "Tensor | None" = None, parts: tuple | None = None):
        if dtype not in DTYPES:
            raise ValueError(f"dtype must be one of {', '.join(DTYPES)}, got {dtype!r}")
        self.ctx = ctx
        self.buffer = buffer
        self.shape = tuple(int(s) for s in shape)
        self.dtype = dtype
        self.capacity = capacity if capacity is not None else self.size
        self.offset = offset          # bytes into the buffer where element 0 lives
        self._base = base             # a view keeps the tensor that owns its buffer alive
        self.parts = parts            # a tensor larger than one buffer: its buffers, in order (buffer: the first)
        self.grad: Tensor | None = None
        if on_free is not None:
            # A finalizer (not __del__) holds the buffer strongly, so a tensor collected as part of
            # a reference cycle hands back a live buffer, never one the cycle collector released.
            weakref.finalize(self, on_free, buffer)

    @property
    def size(self) -> int:
        return math.prod(self.shape)

    @property
    def nbytes(self) -> int:
        return self.size * ITEMSIZE[self.dtype]

    def __repr__(self) -> str:
        return f"Tensor({self.dtype}{list(self.shape)})"

    @property
    def binding_size(self) -> int:
        """Bytes a kernel may see through this tensor: its capacity, rounded up to 4."""
        return -(-self.capacity * ITEMSIZE[self.dtype] // 4) * 4

    def view(self, *shape: int) -> "Tensor":
        """The same elements under another shape of the same size (no copy)."""
        shape = tuple(shape[0]) if len(shape) == 1 and isinstance(shape[0], (tuple, list)) else shape
        if math.prod(shape) != self.size:
            raise ValueError(f"cannot view {self!r} ({self.size} elements) as {list(shape)}")
        return Tensor(self.ctx, self.buffer, shape, self.dtype, capacity=self.capacity, offset=self.offset,
                      base=self._base or self, parts=self.parts)

    def bytes_view(self, offset: int, nbytes: int) -> "Tensor":
        """A flat view of ``nbytes`` bytes of this tensor's buffer from byte ``offset`` (how a tensor
        larger than one binding is bound, piece by piece)."""
        n = nbytes // ITEMSIZE[self.dtype]
        buffer, offset = self._locate(offset, nbytes)
        return Tensor(self.ctx, buffer, (n,), self.dtype, capacity=n, offset=offset, base=self._base or self)

    def _locate(self, offset: int, nbytes: int) -> tuple:
        """(buffer, offset in it) of ``nbytes`` bytes from byte ``offset`` of the tensor's bytes,
        which must lie in one part."""
        if self.parts is None:
            return self.buffer, offset
        step = part_bytes(self.ctx.limits)
        i = offset // step
        if i >= len(self.parts) or offset + nbytes > (i + 1) * step:
            raise ValueError(f"bytes {offset}:{offset + nbytes} of {self!r} cross one of its {step}-byte buffers "
                             f"(it is larger than the device's largest buffer): take a range within one")
        return self.parts[i], offset - i * step

    def whole_buffer(self, what: str) -> None:
        """Refuse ``what`` (an operation on one buffer range) on a tensor held in several buffers."""
        if self.parts is not None:
            raise ValueError(f"{what}: {self!r} is held in {len(self.parts)} buffers (larger than the device's "
                             "largest buffer); this operation takes a tensor in one")

    def rows(self, start: int, stop: int) -> "Tensor":
        """Rows start:stop of the leading axis, as a view (the offset must meet the adapter's alignment)."""
        if not 0 <= start < stop <= self.shape[0]:
            raise ValueError(f"rows {start}:{stop} out of range for {self!r}")
        row = math.prod(self.shape[1:]) if len(self.shape) > 1 else 1
        offset = self.offset + start * row * ITEMSIZE[self.dtype]
        align = self.ctx.limits.get("min-storage-buffer-offset-alignment", 256)
        if offset % align:
            raise ValueError(f"rows {start}:{stop} of {self!r} start at byte {offset}, "
                             f"not a multiple of the adapter's {align}-byte binding alignment")
        n = (stop - start) * row
        buffer, offset = self._locate(offset, n * ITEMSIZE[self.dtype])
        return Tensor(self.ctx, buffer, (stop - start,) + self.shape[1:], self.dtype, capacity=n,
                      offset=offset, base=self._base or self)

    @classmethod
    def from_numpy(cls, ctx, array, dtype: str | None = None) -> "Tensor":
        """Upload an array; dtype defaults to the array's (float64 becomes f32, int64 becomes i32)."""
        arr = np.asarray(array)
        t = cls.empty(ctx, arr.shape, dtype or infer_dtype(arr))
        t.write(arr)
        return t

    @classmethod
    def empty(cls, ctx, shape, dtype: str = "f32") -> "Tensor":
        nbytes = buffer_bytes(math.prod(shape), dtype)
        largest = ctx.limits.get("max-buffer-size")
        if largest is None or nbytes <= largest:
            return cls(ctx, ctx.device.create_buffer(size=nbytes, usage=USAGE), shape, dtype)
        step = part_bytes(ctx.limits)
        parts = tuple(ctx.device.create_buffer(size=min(step, nbytes - at), usage=USAGE) for at in range(0, nbytes, step))
        return cls(ctx, parts[0], shape, dtype, parts=parts)

    def write(self, array) -> None:
        """Overwrite the contents from a numpy array of the same number of elements."""
        arr = np.ascontiguousarray(np.asarray(array), dtype=DTYPES[self.dtype])
        if arr.size != self.size:
            raise ValueError(f"cannot write {arr.size} elements {list(arr.shape)} into {self!r}")
        self.ctx.flush()   # recorded work that reads the old contents must run first
        data = memoryview(arr.reshape(-1)).cast("B")       # the array's own bytes: no copy of a large one
        if len(data) % 4:                                   # an odd count of f16s: padded to whole words
            data = memoryview(data.tobytes() + b"\0" * (4 - len(data) % 4))
        for at, size in self._spans(len(data)):
            buffer, offset = self._locate(self.offset + at, size)
            self.ctx.queue.write_buffer(buffer, offset, data[at:at + size])

    def numpy(self) -> np.ndarray:
        """A copy of the contents (the real elements only), after all recorded work has run."""
        self.ctx.flush()
        nbytes = self.nbytes
        if nbytes == 0:
            return np.zeros(self.shape, DTYPES[self.dtype])
        raw = b"".join(self.ctx.queue.read_buffer(*self._locate(self.offset + at, size), size)
                       for at, size in self._spans(-(-nbytes // 4) * 4))
        return np.frombuffer(raw, dtype=DTYPES[self.dtype], count=self.size).reshape(self.shape).copy()

    def _spans(self, nbytes: int) -> list[tuple[int, int]]:
        """(byte offset, bytes) of ``nbytes`` from the tensor's start, cut where its parts end."""
        if self.parts is None:
            return [(0, nbytes)] if nbytes else []
        step = part_bytes(self.ctx.limits)
        out, at = [], 0
        while at < nbytes:
            size = min(nbytes - at, step - (self.offset + at) % step)
            out.append((at, size))
            at += size
        return out
