"""Dropout schedule: y = x * m with a mask m drawn on the GPU from a key, one invocation per element.

    key = (k0, k1, threshold, scale bits)     i32[4], the words read as u32
    h = pcg(pcg(i ^ k0) ^ k1)                 i: the element's offset t * D + d in x [T, D]
    m = scale if h >= threshold else 0        scale: the f32 whose bits are key[3] (1 / (1 - p))

pcg is the 32-bit PCG output permutation (RXS-M-XS) of one LCG step: v * 747796405 + 2891336453.
A drop probability p takes threshold = round(p * 2^32) (host side: model/adapters.py, dropout_key). The
mask depends only on the key and the element's place, so the backward redraws the forward's mask
instead of keeping it, and a replayed program draws a new one when the host writes a new key.
"""
from __future__ import annotations

from dataclasses import dataclass

from .code import Index
from .layout import extent
from .spec import EntryPoint, IntrinsicCall, Plan

WORKGROUP = 256


@dataclass(frozen=True)
class DropoutParams:
    workgroup_size: int
    rows: Index             # the real length
    cols: int
    x: str
    x_dtype: str
    key: str
    y: str
    y_dtype: str
    accumulate: bool        # y += x * m instead of y = x * m


def plan(call: IntrinsicCall, target=None) -> Plan:
    x, key = call.operands
    (y,) = call.outputs
    t_axis, d_axis = x.shape
    params = DropoutParams(WORKGROUP, extent(t_axis, call.sizes), call.sizes[d_axis], x.name, x.dtype, key.name,
                           y.name, y.dtype, y.name in call.accumulate)
    elements = call.sizes[t_axis] * call.sizes[d_axis]
    return Plan("dropout", params, (EntryPoint("main", -(-elements // WORKGROUP)),))
