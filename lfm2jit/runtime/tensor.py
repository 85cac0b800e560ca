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
    def __init__(self, ctx, buffer, shape, dtype: str, capacity: int | None = None, on_free=None):
        if dtype not in DTYPES:
            raise ValueError(f"dtype must be one of {', '.join(DTYPES)}, got {dtype!r}")
        self.ctx = ctx
        self.buffer = buffer
        self.shape = tuple(int(s) for s in shape)
        self.dtype = dtype
        self.capacity = capacity if capacity is not None else self.size
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
            self.ctx.queue.write_buffer(self.buffer, 0, data)

    def numpy(self) -> np.ndarray:
        """A copy of the contents (the real elements only), after all recorded work has run."""
        self.ctx.flush()
        nbytes = self.nbytes
        if nbytes == 0:
            return np.zeros(self.shape, DTYPES[self.dtype])
        raw = self.ctx.queue.read_buffer(self.buffer, 0, -(-nbytes // 4) * 4)
        return np.frombuffer(raw, dtype=DTYPES[self.dtype], count=self.size).reshape(self.shape).copy()
