"""A float64 numpy interpreter of KernelIR: an independent reference for IR-level tests.

Written from the op semantics in lfm2jit/ir/ops.py, not from the WGSL code generator. Every value
is held as an array whose axes are exactly its node's ``shape`` (a tuple of axis names), in that
order; operands are aligned to a node's shape by axis name (transposed, then given size-1 axes
where they lack one, then broadcast). So a node's ``shape`` is authoritative for the order of its
result, whatever order its operands use.

Precision is not modelled: f32/f16 values are computed in float64 and float casts are exact;
casts to i32/u32 truncate toward zero. LT/GT give 1.0 or 0.0, WHERE selects where its condition is
nonzero, and integer DIV truncates toward zero, as WGSL does; the integer ops (% & | << >>) run
on int64 and wrap to 32 bits.
"""
from __future__ import annotations

import numpy as np

from lfm2jit.ir.nodes import KernelIR, Node, toposort
from lfm2jit.ir.ops import Op

INT_DTYPES = ("i32", "u32")


def _sigmoid(x: np.ndarray) -> np.ndarray:
    # exp of a non-positive argument only, so no overflow warnings at large |x|
    e = np.exp(-np.abs(x))
    return np.where(x >= 0, 1.0 / (1.0 + e), e / (1.0 + e))


UNARY = {
    Op.NEG: np.negative,
    Op.EXP: np.exp,
    Op.LOG: np.log,
    Op.SQRT: np.sqrt,
    Op.RSQRT: lambda x: 1.0 / np.sqrt(x),
    Op.ABS: np.abs,
    Op.SIGMOID: _sigmoid,
    Op.SILU: lambda x: x * _sigmoid(x),
    Op.TANH: np.tanh,
    Op.RECIP: lambda x: 1.0 / x,
    Op.COS: np.cos,
    Op.SIN: np.sin,
}

BINARY = {
    Op.ADD: np.add,
    Op.SUB: np.subtract,
    Op.MUL: np.multiply,
    Op.DIV: np.divide,
    Op.POW: np.power,
    Op.MAX: np.maximum,
    Op.MIN: np.minimum,
    Op.LT: lambda a, b: (a < b).astype(np.float64),
    Op.GT: lambda a, b: (a > b).astype(np.float64),
    Op.EQ: lambda a, b: (a == b).astype(np.float64),
}


INTEGER = {       # on exact integers; % truncates, shifts take the amount modulo 32, << wraps
    Op.MOD: lambda a, b: np.fmod(a, np.where(b == 0, 1, b)) * (b != 0),
    Op.BITAND: np.bitwise_and,
    Op.BITOR: np.bitwise_or,
    Op.SHL: lambda a, b: np.left_shift(a, b & 31),
    Op.SHR: lambda a, b: np.right_shift(a, b & 31),
}


def _wrap(v: np.ndarray, dtype: str) -> np.ndarray:
    """int64 values into the dtype's range, as 32-bit arithmetic wraps them."""
    v = v & 0xFFFFFFFF
    return v if dtype == "u32" else np.where(v >= 2**31, v - 2**32, v)


class EvalError(ValueError):
    pass


def axis_size(axis: str, sizes: dict[str, int]) -> int:
    if axis in sizes:
        return int(sizes[axis])
    if axis.isdigit():          # an integer axis is spelled by its size
        return int(axis)
    if axis.endswith("+1"):     # one past an axis: a bucket sort's offsets [V + 1]
        return axis_size(axis[:-2], sizes) + 1
    raise EvalError(f"no size for axis {axis}")


def align(value: np.ndarray, axes: tuple[str, ...], target: tuple[str, ...], sizes: dict[str, int]) -> np.ndarray:
    """``value`` (with axes ``axes``) laid out over ``target``: transposed into target's order,
    size-1 axes inserted for the axes it lacks, broadcast to the full target sizes."""
    missing = [a for a in axes if a not in target]
    if missing:
        raise EvalError(f"value over [{', '.join(axes)}] has axes {missing} that [{', '.join(target)}] lacks")
    present = [a for a in target if a in axes]
    value = np.transpose(value, [axes.index(a) for a in present])
    shape = [value.shape[present.index(a)] if a in axes else 1 for a in target]
    value = value.reshape(shape)
    return np.broadcast_to(value, tuple(axis_size(a, sizes) for a in target))


def _sizes(ir: KernelIR, inputs: dict[str, np.ndarray], sizes: dict[str, int]) -> dict[str, int]:
    out = {a: int(n) for a, n in ir.fixed_dims.items()}
    for t in ir.inputs:
        if t.name not in inputs:
            raise EvalError(f"{ir.name}: missing input {t.name!r}")
        arr = np.asarray(inputs[t.name])
        if arr.ndim != len(t.shape):
            raise EvalError(f"{ir.name}: input {t.name!r} has {arr.ndim} axes, expected [{', '.join(t.shape)}]")
        for a, n in zip(t.shape, arr.shape):
            if a in out and out[a] != n:
                raise EvalError(f"{ir.name}: input {t.name!r} has {a}={n}, but {a}={out[a]} elsewhere")
            out[a] = n
    for a, n in sizes.items():
        if a in out and out[a] != n:
            raise EvalError(f"{ir.name}: sizes say {a}={n}, but the inputs have {a}={out[a]}")
        out[a] = int(n)
    return out


def evaluate(ir: KernelIR, inputs: dict[str, np.ndarray], scalars: dict[str, float] | None = None,
             sizes: dict[str, int] | None = None) -> dict[str, np.ndarray]:
    """Every output of ``ir`` in float64, each laid out over its declared shape.

    ``inputs`` maps tensor argument names to arrays (in their declared axis order); ``scalars``
    the runtime scalars; ``sizes`` axis sizes the inputs do not determine (checked where they do).
    """
    scalars = dict(scalars or {})
    sizes = _sizes(ir, inputs, dict(sizes or {}))
    values: dict[int, np.ndarray] = {}

    def get(n: Node, target: tuple[str, ...]) -> np.ndarray:
        return align(values[id(n)], n.shape, target, sizes)

    for node in toposort(ir.results.values()):
        op, shape = node.op, node.shape
        if op == Op.INPUT:
            if node.arg not in inputs:
                raise EvalError(f"{ir.name}: missing input {node.arg!r}")
            arr = np.asarray(inputs[node.arg], dtype=np.float64)
            want = tuple(axis_size(a, sizes) for a in shape)
            if arr.shape != want:
                raise EvalError(f"{ir.name}: input {node.arg!r} has shape {arr.shape}, expected {want}")
            v = arr
        elif op == Op.SCALAR:
            if node.arg not in scalars:
                raise EvalError(f"{ir.name}: missing scalar {node.arg!r}")
            v = np.float64(scalars[node.arg])
        elif op == Op.CONST:
            v = np.float64(node.arg)
        elif op == Op.DIMSIZE:
            v = np.float64(axis_size(node.arg, sizes))
        elif op == Op.CAST:
            v = get(node.srcs[0], shape)
            if node.dtype in INT_DTYPES:
                v = np.trunc(v)
        elif op in UNARY:
            v = UNARY[op](get(node.srcs[0], shape))
        elif op in INTEGER:
            a, b = (get(s, shape).astype(np.int64) for s in node.srcs)
            v = _wrap(INTEGER[op](a, b), node.dtype).astype(np.float64)
        elif op in BINARY:
            a, b = (get(s, shape) for s in node.srcs)
            if op == Op.DIV and node.dtype in INT_DTYPES:
                v = np.trunc(a / b)
            else:
                v = BINARY[op](a, b)
        elif op == Op.WHERE:
            c, a, b = (get(s, shape) for s in node.srcs)
            v = np.where(c != 0, a, b)
        elif op in (Op.SUM, Op.RMAX):
            src = node.srcs[0]
            if node.arg not in src.shape:
                raise EvalError(f"{ir.name}: {op.name} over {node.arg}, which {src} lacks")
            order = tuple(a for a in src.shape if a != node.arg) + (node.arg,)
            x = align(values[id(src)], src.shape, order, sizes)
            v = (np.sum if op == Op.SUM else np.max)(x, axis=-1)
            v = align(v, order[:-1], shape, sizes)
        elif op == Op.MATERIALIZE:      # the source, stored
            v = get(node.srcs[0], shape)
        elif op == Op.BROADCAST:        # the source repeated over the axes it lacks
            v = get(node.srcs[0], shape)
        elif op == Op.INDEX:
            v = np.arange(axis_size(node.arg, sizes), dtype=np.float64)
        elif op == Op.SHIFT:            # v[.., i, ..] = src[.., i + offset, ..], zero outside the axis
            axis, off = node.arg
            src = get(node.srcs[0], shape)
            ax = shape.index(axis)
            v = np.zeros_like(src)
            n = src.shape[ax]
            dst = [slice(None)] * src.ndim
            srcsl = [slice(None)] * src.ndim
            dst[ax] = slice(max(0, -off), min(n, n - off))
            srcsl[ax] = slice(max(0, off), min(n, n + off))
            v[tuple(dst)] = src[tuple(srcsl)]
        elif op == Op.WINDOW:           # v[.., i, .., j] = src[.., i + sign * j, ..], zero outside the axis
            axis, by, sign = node.arg
            src = node.srcs[0]
            x = align(values[id(src)], src.shape, tuple(a for a in shape if a in src.shape), sizes)
            n, m = axis_size(axis, sizes), axis_size(by, sizes)
            v = np.zeros(tuple(axis_size(a, sizes) for a in shape))
            for idx in np.ndindex(v.shape):
                at = dict(zip(shape, idx))
                i = at[axis] + sign * at[by]
                if 0 <= i < n:
                    v[idx] = x[tuple(i if a == axis else at[a] for a in shape if a in src.shape)]
            assert m == v.shape[shape.index(by)]
        elif op == Op.FLIP:             # reverse one axis
            v = np.flip(get(node.srcs[0], shape), axis=shape.index(node.arg))
        elif op == Op.TAKE:             # fix one entry of an axis, dropping it
            axis, at = node.arg
            src = node.srcs[0]
            v = align(np.take(values[id(src)], at, axis=src.shape.index(axis)),
                      tuple(a for a in src.shape if a != axis), shape, sizes)
        elif op == Op.EMBED:            # put the value at one entry of a new axis, zero elsewhere
            axis, at = node.arg
            v = np.zeros(tuple(axis_size(a, sizes) for a in shape))
            sl = [slice(None)] * len(shape)
            sl[shape.index(axis)] = at
            v[tuple(sl)] = get(node.srcs[0], tuple(a for a in shape if a != axis))
        elif op == Op.GATHER:           # rows of the table picked by integer ids
            table, ids = node.srcs
            rows = values[id(table)][values[id(ids)].astype(np.int64)]
            v = align(rows, ids.shape + table.shape[1:], shape, sizes)
        elif op == Op.INTRINSIC:
            values[id(node)] = intrinsic(node, [values[id(s)] for s in node.srcs], sizes)
            continue
        elif op == Op.PROJ:
            v = values[id(node.srcs[0])][node.arg]
        else:
            raise EvalError(f"{ir.name}: no semantics for op {op.name}")
        v = np.asarray(v, dtype=np.float64)
        want = tuple(axis_size(a, sizes) for a in shape)
        if v.shape != want:
            v = np.broadcast_to(v, want)
        values[id(node)] = v

    return {o.name: np.array(align(values[id(ir.results[o.name])], ir.results[o.name].shape, o.shape, sizes))
            for o in ir.outputs}


def intrinsic(node: Node, operands: list[np.ndarray], sizes: dict[str, int]) -> tuple[np.ndarray, ...]:
    """The results of an intrinsic call, from the meanings ir/intrinsics.py states (operands laid
    out over their nodes' shapes; the call's shape holds its axis arguments)."""
    name = node.arg
    if name == "topk":           # the K largest of each row, descending, equal values by lower index
        (x,), (k,) = operands, node.shape
        idx = np.argsort(-x, axis=-1, kind="stable")[:, :axis_size(k, sizes)]
        return np.take_along_axis(x, idx, axis=-1), idx.astype(np.float64)
    if name == "bucket_sort":    # positions grouped by key, stably; keys outside [0, V) after the rest
        (ids,), (v,) = operands, node.shape
        keys = axis_size(v, sizes)
        flat = ids.reshape(-1).astype(np.int64)
        bucket = np.where((flat >= 0) & (flat < keys), flat, keys)
        order = np.argsort(bucket, kind="stable").reshape(ids.shape)
        offsets = np.concatenate([[0], np.cumsum(np.bincount(bucket, minlength=keys + 1))])[:keys + 1]
        return order.astype(np.float64), offsets.astype(np.float64)
    if name == "segment_sum":    # row v sums g's rows at order[offsets[v] : offsets[v + 1]]
        g, order, offsets = operands
        rows = g.reshape((order.size,) + g.shape[order.ndim:])
        flat = order.reshape(-1).astype(np.int64)
        bounds = offsets.astype(np.int64)
        out = np.stack([rows[flat[bounds[i]:bounds[i + 1]]].sum(axis=0) for i in range(len(bounds) - 1)])
        return (out,)
    if name in ("grouped_matmul", "grouped_matmul_scaled", "grouped_matmul_dx"):
        # y[s] = x[s] w[e]^T (dx: dy[s] w[e]) times scale[s], for expert e's rows ends[e-1] <= s < ends[e]
        # (ends clamped to the rows); rows past ends[E-1] are left as they were: unspecified, NaN here
        x, w, ends = operands[:3]
        mats = w if name == "grouped_matmul_dx" else np.swapaxes(w, 1, 2)
        y = np.full((x.shape[0], mats.shape[2]), np.nan)
        lo = 0
        for e, end in enumerate(ends.astype(np.int64)):
            a, b = min(max(lo, 0), x.shape[0]), min(max(int(end), 0), x.shape[0])
            if b > a:
                y[a:b] = x[a:b] @ mats[e]
            lo = int(end)
        if name == "grouped_matmul_scaled":
            y = y * operands[3][:, None]
        return (y,)
    if name == "grouped_matmul_dw":     # dw[e] = sum over e's rows of dy[s]^T x[s]; an empty expert's is zero
        dy, x, ends = operands
        dw = np.zeros((len(ends), dy.shape[1], x.shape[1]))
        lo = 0
        for e, end in enumerate(ends.astype(np.int64)):
            a, b = min(max(lo, 0), x.shape[0]), min(max(int(end), 0), x.shape[0])
            if b > a:
                dw[e] = dy[a:b].T @ x[a:b]
            lo = int(end)
        return (dw,)
    raise EvalError(f"no semantics for intrinsic {name}")
