"""Bucket-sort schedule: integer keys ids [N] in [0, V) -> order [N] grouped by key (stable) and
offsets [V + 1], the exclusive prefix sums of the per-key counts. Deterministic by construction:
every count is a count (no atomics), every sum runs in a fixed order.

Keys outside [0, V) go to an extra bucket V after the others, so order stays a permutation of the
positions and offsets[V] is the number of keys in range. The N positions are cut into chunks of
one workgroup; ``counts`` (scratch) holds one row of V + 1 counters per chunk and a row of totals.

    count       workgroup c: each position's rank among the earlier positions of its chunk with its
                key; the last of each key writes the chunk's count of it (every other counter is 0)
    chunk_scan  one invocation per bucket: the chunks' counts -> each chunk's start within the
                bucket (in chunk order), and the bucket's total
    key_scan    one workgroup: the totals -> offsets (each invocation sums a run of buckets, then a
                scan of the runs in workgroup memory)
    place       workgroup c: position i of key k goes to offsets[k] + (chunk c's start in k) + its rank

Positions past the real length (a T axis shorter than its bucket) are not sorted, and order's
entries for them are not written.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

from ..ir.nodes import SEQ_AXIS
from .code import Const, Index, SeqLen, mul
from .spec import EntryPoint, IntrinsicCall, Plan, Scratch

WORKGROUP = 256      # positions per chunk; WebGPU's default limit of invocations per workgroup


@dataclass(frozen=True)
class SortParams:
    workgroup_size: int
    n: Index                # positions to sort: the real length times the other axes
    keys: int               # V
    chunks: int
    ids: str
    ids_dtype: str
    order: str | None       # None: not kept (no placement pass)
    offsets: str            # the output, or a scratch buffer when it is not kept
    counts: str             # the scratch buffer


def valid_count(shape: tuple[str, ...], sizes: dict[str, int]) -> Index:
    """How many leading flat positions of a row-major tensor of ``shape`` are real: all of them, or
    (T among the axes, leading after batch axes that only exist when T fills its bucket) T's real
    length times the other sizes."""
    rest = math.prod(sizes[a] for a in shape if a != SEQ_AXIS)
    return mul(SeqLen(), rest) if SEQ_AXIS in shape else Const(rest)


def plan(call: IntrinsicCall, target=None) -> Plan:
    (ids,) = call.operands
    order, offsets = call.outputs
    (v_axis,) = call.axes
    keys = call.sizes[v_axis]
    buckets = keys + 1
    padded = math.prod(call.sizes[a] for a in ids.shape)
    chunks = -(-padded // WORKGROUP)
    scratch = (Scratch("sort_counts", "u32", (chunks + 1) * buckets),)
    if offsets is None:                       # placement still needs the offsets: kept in scratch
        scratch += (Scratch("sort_offsets", "i32", buckets),)
    params = SortParams(WORKGROUP, valid_count(ids.shape, call.sizes), keys, chunks, ids.name, ids.dtype,
                        order.name if order else None, offsets.name if offsets else "sort_offsets", "sort_counts")
    entries = (EntryPoint("count", chunks), EntryPoint("chunk_scan", -(-buckets // WORKGROUP)),
               EntryPoint("key_scan", 1)) + ((EntryPoint("place", chunks),) if order else ())
    return Plan("bucket_sort", params, entries, scratch)
