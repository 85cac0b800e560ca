"""Tensors larger than one storage binding, bound in pieces.

WebGPU binds at most ``maxStorageBufferBindingSize`` bytes of a buffer (128 MiB by default, which
LFM2-350M's f32 embedding table already exceeds). A larger tensor is bound as several consecutive
bindings over consecutive ranges of its bytes, each as long as the binding limit allows (rounded
down to the offset alignment, so every piece starts where a binding may); the kernel reaches an
element through accessor functions that pick its piece (codegen/wgsl.py). Which tensors are pieced
is decided here, from the device's limits and the specialization's sizes, never by per-op code.

Templates that index their tensors only through the spec's loads and stores (or the accessor
filters) can take pieces; the others bind every tensor whole, and a kernel of theirs with a tensor
past the limit is an error that says so before any GPU work. Passes over flat spans (arena runs:
optimizer, gradient norm) are cut into spans of at most one binding instead (runtime/arena.py).
"""
from __future__ import annotations

import math
from dataclasses import replace

from .spec import Binding, Target

# the templates that reach tensors through the load/store accessors, and the accesses they do so for
# (the matrix GEMM loads its accumulator with subgroupMatrixLoad, which takes the array itself);
# scratch buffers are always bound whole
PIECEABLE = {"pointwise": {"read", "read_write"}, "rowreduce": {"read", "read_write"},
             "embedding_grad": {"read", "read_write"}, "matmul": {"read", "read_write"}, "matmul_matrix": {"read"},
             "topk": {"read", "read_write"}, "bucket_sort": {"read", "read_write"}}
ITEMSIZE = {"f32": 4, "f16": 2, "i32": 4, "u32": 4}


class BindingLimitError(ValueError):
    """A kernel cannot be bound on this device: a tensor too large for its template, or too many bindings."""


def piece_bytes(target: Target) -> int:
    """The bytes of every piece but the last: the binding limit, rounded down to the offset alignment."""
    return target.binding_bytes // target.binding_align * target.binding_align


def binding_bytes(elements: int, dtype: str) -> int:
    """Bytes a tensor of that many elements is bound with (as the runtime binds it: rounded up to 4)."""
    return -(-elements * ITEMSIZE[dtype] // 4) * 4


def assign(kernel: str, template: str, bindings: tuple[Binding, ...], elements: dict[str, int],
           target: Target, scratch: frozenset[str] = frozenset()) -> tuple[Binding, ...]:
    """``bindings`` numbered again from 1, each tensor larger than one binding split into pieces.
    ``elements`` gives each binding's element count at this specialization (``scratch``: the
    template's own buffers). Raises
    BindingLimitError when a tensor too large is bound by a template that cannot take pieces, or
    when the kernel needs more storage bindings than the device has."""
    step = piece_bytes(target)
    out, slot = [], 1
    for b in bindings:
        nbytes = binding_bytes(elements[b.tensor], b.dtype)
        pieces = max(1, math.ceil(nbytes / step))
        if pieces > 1 and (b.tensor in scratch or b.access not in PIECEABLE.get(template, ())):
            raise BindingLimitError(
                f"{kernel}: {b.tensor} binds {nbytes} bytes ({b.dtype}[{elements[b.tensor]}]); the device binds at "
                f"most {target.binding_bytes} (max-storage-buffer-binding-size) and the {template} template "
                "binds this tensor whole: use a shorter length bucket or smaller operands")
        out.append(replace(b, binding=slot, pieces=pieces, piece_bytes=step if pieces > 1 else 0))
        slot += pieces
    names = {b.tensor for b in out}
    for b in out:
        clash = next((f"{b.tensor}_{i}" for i in range(b.pieces) if b.pieces > 1 and f"{b.tensor}_{i}" in names), None)
        if clash:
            raise BindingLimitError(f"{kernel}: {b.tensor} is bound in pieces, whose names would clash with "
                                    f"tensor {clash!r}: rename it")
    used = slot - 1
    if used > target.storage_buffers:
        pieced = [f"{b.tensor} in {b.pieces}" for b in out if b.pieces > 1]
        raise BindingLimitError(
            f"{kernel}: the {template} kernel needs {used} storage bindings"
            + (f" ({', '.join(pieced)} pieces)" if pieced else "")
            + f"; the device allows {target.storage_buffers} (max-storage-buffers-per-shader-stage)")
    return tuple(out)


def ranges(binding: Binding, offset: int, nbytes: int, most: int) -> list[tuple[int, int] | None]:
    """(byte offset, bytes) of each piece of a tensor bound from ``offset`` for ``nbytes`` bytes,
    or None for a piece that lies wholly past the tensor's end. ``most``: the bytes of one piece
    (piece_bytes), the longest binding a kernel planned with one piece needs.

    A kernel of a length bucket is planned for the bucket's rows, but the tensor may hold fewer (a
    caller's real rows) or more (a buffer reserved for a longer bucket): each planned piece binds what
    of the tensor it covers, cut to the planned piece length, and a piece past the tensor's end binds
    a stand-in (engine.py): only rows past the real length lie there, which no template reads or
    writes (schedule/layout.py), but the kernel's layout has a binding for it all the same."""
    if binding.pieces == 1:
        return [(offset, min(nbytes, most))]
    out = []
    for i in range(binding.pieces):
        start = i * binding.piece_bytes
        size = min(binding.piece_bytes, nbytes - start)
        out.append((offset + start, size) if size > 0 else None)
    return out
