"""Tensor: a GPU storage buffer with a logical shape and dtype.

The buffer may hold more elements than the shape needs (``capacity``): a sequence padded up to its
length bucket keeps its real length in ``shape`` and its padded rows past the end of the buffer's
used prefix, so ``numpy()`` reads exactly the real elements.
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


def buffer_bytes(elements: int, dtype: str) -> int:
    """Bytes for a buffer of that many elements: at least 16, a multiple of 16 (copy alignment)."""
    return max(16, -(-elements * ITEMSIZE[dtype] // 16) * 16)


class Tensor:
    def __init__(self, ctx, buffer, shape, dtype: str, capacity: int | None = None, on_free=None,
                 offset: int = 0, base: "Tensor | None" = None):
        if dtype not in DTYPES:
            raise ValueError(f"dtype must be one of {', '.join(DTYPES)}, got {dtype!r}")
        self.ctx = ctx
        self.buffer = buffer
        self.shape = tuple(int(s) for s in shape)
        self.dtype = dtype
        self.capacity = capacity if capacity is not None else self.size
        self.offset = offset          # bytes into the buffer where element 0 lives
        self._base = base             # a view keeps the tensor that owns its buffer alive
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
                      base=self._base or self)

    def bytes_view(self, offset: int, nbytes: int) -> "Tensor":
        """A flat view of ``nbytes`` bytes of this tensor's buffer from byte ``offset`` (how a tensor
        larger than one binding is bound, piece by piece)."""
        n = nbytes // ITEMSIZE[self.dtype]
        return Tensor(self.ctx, self.buffer, (n,), self.dtype, capacity=n, offset=offset, base=self._base or self)

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
        return Tensor(self.ctx, self.buffer, (stop - start,) + self.shape[1:], self.dtype, capacity=n,
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
        n = math.prod(shape)
        buf = ctx.device.create_buffer(size=buffer_bytes(n, dtype), usage=USAGE)
        return cls(ctx, buf, shape, dtype)

    def write(self, array) -> None:
        """Overwrite the contents from a numpy array of the same number of elements."""
        arr = np.ascontiguousarray(np.asarray(array), dtype=DTYPES[self.dtype])
        if arr.size != self.size:
            raise ValueError(f"cannot write {arr.size} elements {list(arr.shape)} into {self!r}")
        self.ctx.flush()   # recorded work that reads the old contents must run first
        data = arr.tobytes()
        if len(data) % 4:
            data += b"\0" * (4 - len(data) % 4)
        if data:
            self.ctx.queue.write_buffer(self.buffer, self.offset, data)

    def numpy(self) -> np.ndarray:
        """A copy of the contents (the real elements only), after all recorded work has run."""
        self.ctx.flush()
        nbytes = self.nbytes
        if nbytes == 0:
            return np.zeros(self.shape, DTYPES[self.dtype])
        raw = self.ctx.queue.read_buffer(self.buffer, self.offset, -(-nbytes // 4) * 4)
        return np.frombuffer(raw, dtype=DTYPES[self.dtype], count=self.size).reshape(self.shape).copy()
