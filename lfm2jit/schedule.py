"""IR + concrete sizes -> a KernelSpec: which template, with which parameters, launched how.

Binding table (the same for every schedule; sizes derive from it):

    group 0, binding 0        uniform Info { t_valid: u32, <each scalar>: f32 }   runtime values, no recompile
    group 0, binding 1..n     the tensor inputs in signature order,  var<storage, read>
    group 0, binding n+1..    the outputs in signature order,        var<storage, read_write>

Specialization: every axis gets a concrete size baked into the WGSL as a `const`; the sequence
axis T is rounded up to a multiple of the length bucket, and the real length is `info.t_valid`, so
one pipeline serves every length in a bucket and padded rows are skipped.
"""
from __future__ import annotations

import hashlib
import json
import math
from dataclasses import dataclass, field

from .codegen.wgsl import COMPUTE_TYPE, REDUCE_COMBINE, REDUCE_INIT, ExprEmitter, store
from .dsl.errors import DslError
from .ir.nodes import SEQ_AXIS, KernelIR, Node, toposort
from .ir.ops import REDUCE, Op

MAX_WORKGROUP = 256


@dataclass(frozen=True)
class KernelSpec:
    """Everything that determines one kernel's WGSL. ``key`` is derived from all of it."""
    kernel: str
    template: str
    context: dict
    workgroups: int                      # total workgroups, folded into 2-D at dispatch
    inputs: tuple[str, ...]
    outputs: tuple[tuple[str, str, tuple[int, ...]], ...]   # (name, dtype, padded shape)
    scalars: tuple[str, ...]
    dims: dict = field(default_factory=dict)

    @property
    def key(self) -> str:
        blob = json.dumps({"template": self.template, "context": self.context}, sort_keys=True)
        return hashlib.sha256(blob.encode()).hexdigest()[:24]


def bucketed(t: int, bucket: int) -> int:
    """Round a sequence length up to a multiple of the bucket."""
    return max(bucket, -(-t // bucket) * bucket)


def bind_dims(ir: KernelIR, dims: dict[str, int], bucket: int) -> dict[str, int]:
    """Concrete sizes for every axis; T is bucketed. Raises DslError naming a missing or bad size."""
    if not isinstance(bucket, int) or bucket < 1:
        raise ValueError(f"length bucket must be a positive integer, got {bucket!r}")
    sizes = dict(ir.fixed_dims)
    for name, value in dims.items():
        if not isinstance(value, int) or value < 1:
            raise ValueError(f"size of axis {name} for kernel {ir.name!r} must be a positive integer, got {value!r}")
        if name in ir.fixed_dims and ir.fixed_dims[name] != value:
            raise ValueError(f"axis {name} of kernel {ir.name!r} is fixed to {ir.fixed_dims[name]}, got {value}")
        sizes[name] = value
    missing = [a for a in ir.axes if a not in sizes]
    if missing:
        raise ValueError(f"kernel {ir.name!r} needs sizes for axes {', '.join(missing)} "
                         f"(e.g. --dim {missing[0]}=64)")
    if SEQ_AXIS in sizes:
        sizes[SEQ_AXIS] = bucketed(sizes[SEQ_AXIS], bucket)
    return {a: sizes[a] for a in ir.axes}


def _iteration_space(ir: KernelIR, order: list[Node]) -> tuple[str, ...]:
    space: tuple[str, ...] = ()
    for shape in [o.shape for o in ir.outputs] + [n.srcs[0].shape for n in order if n.op in REDUCE]:
        if len(shape) > len(space):
            space = shape
    return space


def _error(ir: KernelIR, message: str, expected: str) -> DslError:
    return DslError(message, filename=ir.filename, line=ir.line, column=1, source=ir.source, expected=expected)


def _strides(shape: tuple[str, ...], dims: dict[str, int]) -> dict[str, int]:
    out, acc = {}, 1
    for a in reversed(shape):
        out[a] = acc
        acc *= dims[a]
    return out


def _offset(shape: tuple[str, ...], dims: dict[str, int], index_of: dict[str, str]) -> str:
    strides = _strides(shape, dims)
    terms = [index_of[a] if strides[a] == 1 else f"{index_of[a]} * {strides[a]}u" for a in shape]
    return " + ".join(terms) if terms else "0u"


def specialize(ir: KernelIR, dims: dict[str, int], bucket: int = 1) -> KernelSpec:
    """Choose the schedule for a kernel and fill in its template parameters."""
    sizes = bind_dims(ir, dims, bucket)
    order = toposort(ir.results.values())
    space = _iteration_space(ir, order)
    reductions = [n for n in order if n.op in REDUCE]
    for n in order:
        if n.shape and not all(a in space for a in n.shape):
            raise _error(ir, f"value {n} does not fit the iteration space [{', '.join(space)}]",
                         "every value's axes within the largest output's")
    if reductions:
        ctx, workgroups = _rowreduce(ir, sizes, space, order, reductions)
        template = "rowreduce"
    else:
        ctx, workgroups = _pointwise(ir, sizes, space)
        template = "pointwise"
    ctx.update(_common(ir, sizes))
    ctx["template"] = template
    outputs = tuple((o.name, o.dtype, tuple(sizes[a] for a in o.shape)) for o in ir.outputs)
    return KernelSpec(ir.name, template, ctx, workgroups, tuple(t.name for t in ir.inputs), outputs,
                      ir.scalars, sizes)


def _common(ir: KernelIR, sizes: dict[str, int]) -> dict:
    tensors = [(t, "read") for t in ir.inputs] + [(t, "read_write") for t in ir.outputs]
    return {
        "kernel": ir.name,
        "dims": [{"name": ident(a), "size": s} for a, s in sizes.items()],
        "has_seq": SEQ_AXIS in sizes,
        "scalars": list(ir.scalars),
        "uses_f16": any(t.dtype == "f16" for t, _ in tensors),
        "bindings": [{"name": t.name, "binding": i + 1, "access": acc, "elem": t.dtype}
                     for i, (t, acc) in enumerate(tensors)],
    }


def ident(axis: str) -> str:
    """A WGSL identifier for an axis; integer axes ("3") become "AX3"."""
    return axis if axis[0].isalpha() or axis[0] == "_" else f"AX{axis}"


def _index_names(space: tuple[str, ...]) -> dict[str, str]:
    return {a: f"i_{ident(a)}" for a in space}


def _unravel(axes: tuple[str, ...], sizes: dict[str, int], flat: str) -> list[dict]:
    """Index variables for ``axes`` from a flat row-major index, innermost first in the division."""
    out, strides = [], _strides(axes, sizes)
    for a in axes:
        out.append({"var": f"i_{ident(a)}", "expr": f"({flat} / {strides[a]}u) % {sizes[a]}u"})
    return out


def _pointwise(ir: KernelIR, sizes, space):
    for o in ir.outputs:
        if o.shape != space:
            raise _error(ir, f"output {o.name!r} has shape [{', '.join(o.shape)}] but the kernel iterates "
                         f"over [{', '.join(space)}]", "all outputs of an elementwise kernel share one shape")
    index_of = _index_names(space)
    emitter = ExprEmitter(lambda n: _load(n, sizes, index_of), sizes)
    bound: dict[int, str] = {}
    lets = emitter.emit(ir.results.values(), bound)
    total = math.prod(sizes[a] for a in space)
    wg = MAX_WORKGROUP
    ctx = {
        "workgroup_size": wg,
        "total": total,
        "indices": _unravel(space, sizes, "gid"),
        "lets": [vars(x) for x in lets],
        "stores": [{"name": o.name, "offset": "gid",
                    "value": store(bound[id(ir.results[o.name])], ir.results[o.name].dtype, o.dtype)}
                   for o in ir.outputs],
    }
    return ctx, -(-total // wg)


def _load(n: Node, sizes, index_of) -> str:
    value = f"{n.arg}[{_offset(n.shape, sizes, index_of)}]"
    return value if COMPUTE_TYPE[n.dtype] == n.dtype else f"{COMPUTE_TYPE[n.dtype]}({value})"


def _rowreduce(ir: KernelIR, sizes, space, order, reductions):
    col_axis = space[-1]
    for r in reductions:
        if r.arg != col_axis:
            raise _error(ir, f"reduction over axis {r.arg}, but the row-reduction schedule reduces the last "
                         f"axis {col_axis} of [{', '.join(space)}]", f"reductions over {col_axis} only")
    row_axes = space[:-1]
    for o in ir.outputs:
        if o.shape not in (space, row_axes):
            raise _error(ir, f"output {o.name!r} has shape [{', '.join(o.shape)}]",
                         f"[{', '.join(space)}] or one value per row [{', '.join(row_axes)}]")
    index_of = _index_names(space)
    index_of[col_axis] = "c"
    emitter = ExprEmitter(lambda n: _load(n, sizes, index_of), sizes)
    bound: dict[int, str] = {}

    def row_level(n: Node) -> bool:
        return col_axis not in n.shape

    def ready(n: Node) -> bool:     # row-level and every reduction under it already bound
        return row_level(n) and all(id(s) in bound or s.op in (Op.CONST, Op.DIMSIZE) or ready(s) for s in n.srcs) \
            and n.op not in REDUCE

    def row_lets():
        todo = [n for n in order if id(n) not in bound and n.op not in (Op.CONST, Op.DIMSIZE) and ready(n)]
        return [vars(x) for x in emitter.emit(todo, bound)]

    phases = []
    pre = row_lets()
    for r in reductions:
        scoped = dict(bound)    # element-level lets live inside this phase's loop only
        elem_lets = [vars(x) for x in emitter.emit([r.srcs[0]], scoped)]
        arg_name = scoped[id(r.srcs[0])]
        name = f"r{len(phases)}"
        bound[id(r)] = name
        phases.append({"result": name, "init": REDUCE_INIT[r.op], "lets": elem_lets, "arg": arg_name,
                       "combine": REDUCE_COMBINE[r.op].format(f"acc_{name}", arg_name),
                       "combine_tree": REDUCE_COMBINE[r.op].format("red[lid]", "red[lid + s]"),
                       "after": row_lets()})
    final_scope = dict(bound)
    elem_outputs = [o for o in ir.outputs if o.shape == space]
    row_outputs = [o for o in ir.outputs if o.shape != space]
    final_lets = [vars(x) for x in emitter.emit([ir.results[o.name] for o in elem_outputs], final_scope)]
    wg = min(MAX_WORKGROUP, max(32, 1 << (sizes[col_axis] - 1).bit_length()))
    rows = math.prod(sizes[a] for a in row_axes)
    row_index = _index_names(row_axes)
    ctx = {
        "workgroup_size": wg,
        "rows": rows,
        "cols": sizes[col_axis],
        "indices": _unravel(row_axes, sizes, "row"),
        "seq_in_rows": SEQ_AXIS in row_axes,
        "pre": pre,
        "phases": phases,
        "final_lets": final_lets,
        "elem_stores": [{"name": o.name, "offset": _offset(o.shape, sizes, index_of),
                         "value": store(final_scope[id(ir.results[o.name])], ir.results[o.name].dtype, o.dtype)}
                        for o in elem_outputs],
        "row_stores": [{"name": o.name, "offset": _offset(o.shape, sizes, row_index),
                        "value": store(bound[id(ir.results[o.name])], ir.results[o.name].dtype, o.dtype)}
                       for o in row_outputs],
    }
    return ctx, rows
