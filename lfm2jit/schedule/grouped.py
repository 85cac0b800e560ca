"""Grouped GEMM schedule: the experts of a mixture of experts, each over its own rows, as the matmul
template with a ``Grouping`` (schedule/matmul.py) instead of a fixed batch.

The rows (token slots) are sorted by expert; ``ends`` i32[E], on the device, says where each
expert's rows end (the running sum of the experts' row counts): expert e owns rows
ends[e-1] .. ends[e] - 1 (ends[-1] = 0). Nothing about the split is known when the kernel is planned:

* ``grouped_matmul`` / ``_scaled`` / ``_dx`` (``over="m"``): y[s] = x[s] w[e]^T (dx: dy[s] w[e]).
  The experts' tile rows are laid end to end (expert e takes ceil(count_e / BM) of them); the grid
  has ceil(S / BM) + E tile rows, enough for any split, and each workgroup finds its expert by
  walking ``ends`` (E loads, against a K loop of K / BK steps). Workgroups past the last expert's
  tiles return at once: no dense all-experts compute. The scale is an epilogue: y[s] *= scale[s].
* ``grouped_matmul_dw`` (``over="k"``): dw[e] = sum over e's rows of dy[s]^T x[s], one batch of
  the grid per expert, the sum running over that expert's rows only, in order (deterministic); an
  empty expert's dw is zero (or, accumulated, unchanged).

Rows outside ends[-1] .. ends[E-1] (a bucket's padding) are never read and outputs there are left
as they were. Ends are clamped to 0 .. the row count, and an end below the one before gives an empty
expert, so bad data cannot reach outside the tensors. The weights may be bound in pieces (an 8B
model's experts exceed a binding) as any SIMT GEMM operand.
"""
from __future__ import annotations

import math
from dataclasses import replace

from ..ir import intrinsics
from ..ir.ops import Op
from ..tune import heuristics
from ..tune.tiles import MatrixTiles
from .code import Apply, Const, Let, Load, Ref, Var
from .layout import extent, strides
from .matmul import (REDUCE_THREADS, Grouping, MatmulParams, MatrixParams, Operand, Output, computed_operand,
                     contiguity, epilogue_frags, vector_reads)
from .pieces import binding_bytes
from .spec import EntryPoint, IntrinsicCall, Plan

MAX_WORKGROUPS = 65535    # WebGPU's maxComputeWorkgroupsPerDimension (its default limit)


def _tiles(call: IntrinsicCall, m: int, n: int, k: int, k_contiguous: int, frag, target):
    """The caller's tiles or the GEMM heuristics', without split-K (each output is one sum): SIMT
    tiles, or the experts' matrix tiles where ``frag`` (the device's f16 subgroup matrices) is given."""
    if call.tiles is not None:
        if call.tiles.split != 1:
            raise ValueError(f"{call.name}: tiles {call.tiles} split K; the grouped GEMM sums each output whole")
        if isinstance(call.tiles, MatrixTiles) and frag is None:
            raise ValueError(f"{call.name}: tiles={call.tiles!r} need a device with f16 subgroup matrices (the matrix units)")
        tiles = call.tiles
    elif frag is None:
        return replace(heuristics.matmul_tiles(m, n, k), split=1)
    else:
        def whole(t: MatrixTiles) -> MatrixTiles:
            return replace(t, split=1, tail=0)
        tiles = whole(heuristics.grouped_matrix_tiles(m, n, k, k_contiguous, lambda t: whole(t).problem(
            frag, target.subgroup_size, target.workgroup_bytes, n) is None))
    if isinstance(tiles, MatrixTiles):
        problem = tiles.problem(frag, target.subgroup_size, target.workgroup_bytes, n)
        if problem:
            raise ValueError(f"{call.name}: tiles {tiles} do not fit the matrix template: {problem}")
    return tiles


def _operand(x, row_axis: str, k_axis: str, batch_axis: str | None, sizes, tiles, rows: int,
             split: str | None, computed: dict | None = None) -> Operand:
    """A GEMM operand; ``split`` names the axis the experts split ("m": its rows, "k": the sum's),
    which starts where the device data says: no vec4 reads along it (they would not be aligned).
    An operand in ``computed`` (name -> IR node) is computed in the fetch (a decoded weight)."""
    if computed and x.name in computed:
        return computed_operand(computed[x.name], x.name, row_axis, k_axis, batch_axis, sizes, tiles, rows,
                                split=split)
    st = strides(x.shape, sizes)
    op = Operand(x.name, x.dtype, st[row_axis], st[k_axis], st[batch_axis] if batch_axis else 0)
    if isinstance(tiles, MatrixTiles):
        vec = contiguity(op, row_axis, k_axis, sizes)
        return replace(op, vec=None if vec == split else vec)
    vec = vector_reads(tiles, op, row_axis, k_axis, sizes, rows)
    vec = None if vec == split else vec
    return replace(op, vec=vec, loads=rows * tiles.bk // (4 if vec else 1) // tiles.threads)


def _matrix(target, out, sizes, *dtypes: str):
    """The f16 fragments of the matrix units where the device has them and an operand or the result
    is f16 (as the dense GEMM decides: f32 products keep f32), else None; also None where the output
    is larger than a binding, which the matrix template cannot store in pieces (an 8B model's dW
    under WebGPU's default limits) and the SIMT one can."""
    if target is None or not target.subgroup_size or "f16" not in dtypes:
        return None
    if binding_bytes(math.prod(sizes[a] for a in out.shape), out.dtype) > target.binding_bytes:
        return None
    return target.matrix("f16", "f32")


def _params(tiles, frag, target, **common):
    if isinstance(tiles, MatrixTiles):
        params = MatrixParams(tiles=tiles, frag=frag, subgroup_size=target.subgroup_size, emulated=target.emulated,
                              **common)
        return "matmul_matrix", replace(params, epilogue_frags=epilogue_frags(params, target.workgroup_bytes))
    return "matmul", MatmulParams(tiles=tiles, **common)


def _rows(tiles) -> tuple[int, int]:
    """The workgroup tile's rows along M and N."""
    return (tiles.wm, tiles.wn) if isinstance(tiles, MatrixTiles) else (tiles.bm, tiles.bn)


def plan(call: IntrinsicCall, target=None) -> Plan:
    if call.name == intrinsics.GROUPED_MATMUL_DW:
        return _plan_dw(call, target)
    transposed = call.name == intrinsics.GROUPED_MATMUL_DX
    x, w, ends = call.operands[:3]
    scale = call.operands[3] if call.name == intrinsics.GROUPED_MATMUL_SCALED else None
    (y,) = call.outputs
    s_axis = x.shape[0]
    e_axis, w_rows, w_k = w.shape
    n_axis, k_axis = (w_k, w_rows) if transposed else (w_rows, w_k)
    sizes = call.sizes
    experts = sizes[e_axis]
    frag = _matrix(target, y, sizes, x.dtype, w.dtype, y.dtype)
    k_contiguous = 1 + (not transposed)
    # the grid the tiles fill is every expert's rows together
    tiles = _tiles(call, sizes[s_axis], sizes[n_axis], sizes[k_axis], k_contiguous, frag, target)
    tile_m, tile_n = _rows(tiles)
    a = _operand(x, s_axis, k_axis, None, sizes, tiles, tile_m, split="m")
    b = _operand(w, n_axis, k_axis, e_axis, sizes, tiles, tile_n, split=None, computed=dict(call.computed))
    yst = strides(y.shape, sizes)
    c = Output(y.name, y.dtype, yst[s_axis], yst[n_axis], 0, y.name in call.accumulate)
    epilogue, result = (), None
    if scale is not None:
        epilogue = (Let("ep_scale", "f32", Load(scale.name, Var("gm"), scale.dtype)),)
        result = Apply(Op.MUL, (Ref("dot"), Ref("ep_scale")), "f32", ("f32", "f32"))
    tile_rows = -(-sizes[s_axis] // tile_m) + experts
    if tile_rows > MAX_WORKGROUPS:
        raise ValueError(f"{call.name}: {tile_rows} tile rows of {tile_m} exceed WebGPU's {MAX_WORKGROUPS} "
                         "workgroups a grid dimension: take taller tiles")
    template, params = _params(tiles, frag, target, m_ext=extent(s_axis, sizes), n_ext=Const(sizes[n_axis]),
                               k_ext=Const(sizes[k_axis]), a=a, b=b, c=c, axes=(s_axis, n_axis, k_axis, e_axis),
                               m_pad=sizes[s_axis], n_size=sizes[n_axis], batches=1, reduce_threads=REDUCE_THREADS,
                               epilogue=epilogue, result=result, group=Grouping(ends.name, experts, "m"))
    grid = (-(-sizes[n_axis] // tile_n), tile_rows, 1)
    return Plan(template, params, (EntryPoint("main", grid),), vectors=_vectors(a, b))


def _plan_dw(call: IntrinsicCall, target) -> Plan:
    """dw[e, n, k] = sum over e's rows s of dy[s, n] x[s, k]: M = N, N = K, the sum over S."""
    dy, x, ends = call.operands
    (dw,) = call.outputs
    s_axis, n_axis = dy.shape
    k_axis = x.shape[1]
    e_axis = dw.shape[0]
    sizes = call.sizes
    experts = sizes[e_axis]
    if experts > MAX_WORKGROUPS:
        raise ValueError(f"{call.name}: {experts} experts exceed WebGPU's {MAX_WORKGROUPS} workgroups a grid dimension")
    frag = _matrix(target, dw, sizes, dy.dtype, x.dtype, dw.dtype)
    # the grid is E output matrices (as one tall one to the dense rules, unless thin: those have their
    # own tiles); each sums an average expert's rows
    m = sizes[n_axis] * (experts if min(sizes[n_axis], sizes[k_axis]) > heuristics.NARROW else 1)
    tiles = _tiles(call, m, sizes[k_axis], max(1, sizes[s_axis] // experts), 0, frag, target)
    if call.tiles is None and isinstance(tiles, MatrixTiles):
        tiles = replace(tiles, group=1)   # no bands over the E matrices: 2.4x (results/h100_grouped_autotune.json)
    tile_m, tile_n = _rows(tiles)
    a = _operand(dy, n_axis, s_axis, None, sizes, tiles, tile_m, split="k")
    b = _operand(x, k_axis, s_axis, None, sizes, tiles, tile_n, split="k")
    wst = strides((e_axis, n_axis, k_axis), sizes)
    c = Output(dw.name, dw.dtype, wst[n_axis], wst[k_axis], wst[e_axis], dw.name in call.accumulate)
    template, params = _params(tiles, frag, target, m_ext=Const(sizes[n_axis]), n_ext=Const(sizes[k_axis]),
                               k_ext=extent(s_axis, sizes), a=a, b=b, c=c, axes=(n_axis, k_axis, s_axis, e_axis),
                               m_pad=sizes[n_axis], n_size=sizes[k_axis], batches=experts,
                               reduce_threads=REDUCE_THREADS, group=Grouping(ends.name, experts, "k"))
    grid = (-(-sizes[k_axis] // tile_n), -(-sizes[n_axis] // tile_m), experts)
    return Plan(template, params, (EntryPoint("main", grid),), vectors=_vectors(a, b))


def _vectors(a: Operand, b: Operand) -> tuple[tuple[str, int], ...]:
    return tuple(dict.fromkeys((op.tensor, 4) for op in (a, b) if op.vec and op.value is None))
