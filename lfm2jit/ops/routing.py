"""Routing kernels for mixture-of-experts layers (ops/kernels/routing.lk), called by name.

    values, indices = topk(engine, scores, k)          scores [T, E] -> [T, k] each (f32, i32)
    order, offsets = sort_slots(engine, ids, experts)  ids i32[T, k] -> order i32[T, k], offsets i32[experts + 1]
    rows = sum_slots(engine, g, order, offsets)        g [T, k, D] -> rows [experts, D], in slot order

The backward of topk is ``grad(library.get("route_topk"), ["scores"], cotangents=["values"])``,
which reads the saved indices.
"""
from __future__ import annotations

from ..runtime.tensor import Tensor


def topk(engine, scores: Tensor, k: int, bucket: int = 1) -> tuple[Tensor, Tensor]:
    """The k largest scores of each row in descending order (equal scores: lower index first), and their indices."""
    out = engine.run("route_topk", scores=scores, dims={"K": k}, bucket=bucket)
    return out["values"], out["indices"]


def sort_slots(engine, ids: Tensor, experts: int, bucket: int = 1) -> tuple[Tensor, Tensor]:
    """The slots t * k + j grouped by expert (stable), and offsets [experts + 1] into them."""
    out = engine.run("sort_slots", ids=ids, dims={"E": experts}, bucket=bucket)
    return out["order"], out["offsets"]


def sum_slots(engine, g: Tensor, order: Tensor, offsets: Tensor, bucket: int = 1) -> Tensor:
    """Row e: the sum of g's slots of expert e, in slot order (bit-identical from run to run)."""
    return engine.run("sum_slots", g=g, order=order, offsets=offsets, bucket=bucket)["rows"]
