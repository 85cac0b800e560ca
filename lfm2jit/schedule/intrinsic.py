"""Intrinsic schedule: a part whose outputs are the results of one intrinsic call.

The IR only declares an intrinsic (ir/intrinsics.py); how each one runs (its planner, template and
the tiles a caller may choose) is this table.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from ..ir import intrinsics
from ..ir.nodes import KernelIR, TensorArg
from ..ir.ops import Op
from ..tune.tiles import AttentionTiles, MatrixAttentionTiles, MatrixTiles, TileConfig
from . import attention, dropout, grouped, scatter, sort, topk
from .spec import IntrinsicCall, Plan


@dataclass(frozen=True)
class IntrinsicPlanner:
    plan: Callable[..., Plan]                # (call, target) -> Plan
    tiles: type | tuple[type, ...] | None = None   # the class(es) of tiles a caller may pass; None: no override


ATTENTION_TILES = (AttentionTiles, MatrixAttentionTiles)
GEMM_TILES = (TileConfig, MatrixTiles)
PLANNERS: dict[str, IntrinsicPlanner] = {
    intrinsics.ATTENTION: IntrinsicPlanner(attention.plan_forward, ATTENTION_TILES),
    intrinsics.ATTENTION_DQ: IntrinsicPlanner(attention.plan_dq, ATTENTION_TILES),
    intrinsics.ATTENTION_DKDV: IntrinsicPlanner(attention.plan_dkdv, ATTENTION_TILES),
    intrinsics.EMBEDDING_GRAD: IntrinsicPlanner(scatter.plan),
    intrinsics.DROPOUT: IntrinsicPlanner(dropout.plan),
    intrinsics.TOPK: IntrinsicPlanner(topk.plan),
    intrinsics.BUCKET_SORT: IntrinsicPlanner(sort.plan),
    intrinsics.SEGMENT_SUM: IntrinsicPlanner(scatter.plan_segments),
    intrinsics.GROUPED_MATMUL: IntrinsicPlanner(grouped.plan, GEMM_TILES),
    intrinsics.GROUPED_MATMUL_SCALED: IntrinsicPlanner(grouped.plan, GEMM_TILES),
    intrinsics.GROUPED_MATMUL_DX: IntrinsicPlanner(grouped.plan, GEMM_TILES),
    intrinsics.GROUPED_MATMUL_DW: IntrinsicPlanner(grouped.plan, GEMM_TILES),
}


def call_of(ir: KernelIR):
    """The INTRINSIC node whose results this part outputs."""
    return ir.results[ir.outputs[0].name].srcs[0]


def plan(ir: KernelIR, sizes: dict[str, int], accumulate: frozenset[str], tiles=None, target=None) -> Plan:
    call = call_of(ir)
    intr = intrinsics.get(call.arg)
    # an operand that is not a tensor is a prologue (partition.py): named for the planner, which computes it
    operands = tuple(TensorArg(src.arg if src.op == Op.INPUT else f"computed {param}", src.dtype, src.shape)
                     for param, src in zip(intr.params, call.srcs))
    computed = tuple((t.name, src) for t, src in zip(operands, call.srcs) if src.op != Op.INPUT)
    by_index = {ir.results[o.name].arg: o for o in ir.outputs}
    outputs = tuple(by_index.get(i) for i in range(len(intr.outputs)))
    return PLANNERS[call.arg].plan(IntrinsicCall(call.arg, operands, outputs, sizes, accumulate, tiles, call.shape,
                                                 computed), target)
