"""AST -> typed IR: resolves names, checks dtypes and shapes, broadcasts by axis name."""
from __future__ import annotations

import math

from ..dsl import ast
from ..dsl.errors import DslError
from . import intrinsics
from .graph import GraphBuilder
from .nodes import ABSTRACT, SEQ_AXIS, KernelIR, Node, TensorArg
from .shapes import is_subsequence, merge
from .ops import (BINOP_SYMBOLS, INT_ONLY, BINARY_FUNCS, BINOP_NAMES, DTYPES, FLOAT_DTYPES, FLOAT_ONLY, REDUCE_FUNCS,
                  UNARY_FUNCS, Op)
F32_OVERFLOW = 2.0**128 - 2.0**103   # the smallest magnitude that rounds to infinity in f32
INT_RANGE = {"i32": (-2**31, 2**31 - 1), "u32": (0, 2**32 - 1)}


def _fmt(dtype: str, shape: tuple[str, ...]) -> str:
    return dtype + (f"[{', '.join(shape)}]" if shape else " scalar")


class _Builder:
    def __init__(self, kdef: ast.KernelDef, src: ast.SourceFile):
        self.kdef = kdef
        self.src = src
        self.env: dict[str, Node] = {}
        self.graph = GraphBuilder()
        self.fixed_dims: dict[str, int] = {}
        self.inouts: set[str] = set()
        self.defaults: dict[str, float] = {}

    def error(self, loc: ast.Loc, message: str, expected: str | None = None) -> DslError:
        return DslError(message, filename=self.src.filename, line=loc.line, column=loc.column,
                        source=self.src.text, expected=expected)

    def node(self, op: Op, srcs: tuple[Node, ...], shape, dtype: str, arg=None) -> Node:
        return self.graph.node(op, srcs, shape, dtype, arg)

    # ---- signature ----
    def shape_of(self, p: ast.Param) -> tuple[str, ...]:
        t = p.type
        if t.dtype not in DTYPES:
            raise self.error(t.loc, f"unknown dtype {t.dtype!r}", expected=", ".join(DTYPES))
        shape: list[str] = []
        for i, d in enumerate(t.dims):
            name = str(d)
            if isinstance(d, int):
                if d < 1:
                    raise self.error(t.dim_loc(i), f"axis size {d} of {p.name!r} is not positive", "a size >= 1")
                self.fixed_dims[name] = d
            if name in shape:
                raise self.error(t.dim_loc(i), f"axis {name} appears twice in the type of {p.name!r}",
                                 "each axis name once per tensor")
            shape.append(name)
        lead = len(t.optional)
        if tuple(shape[:lead]) != t.optional:
            at = next(i for i, d in enumerate(shape) if d in t.optional and i >= lead)
            raise self.error(t.dim_loc(at), f"optional axis {shape[at]} of {p.name!r} follows a required one",
                             "optional axes (B?) first: a caller leaves out leading axes")
        if SEQ_AXIS in t.optional:
            raise self.error(t.dim_loc(shape.index(SEQ_AXIS)), f"axis {SEQ_AXIS} of {p.name!r} is optional",
                             f"{SEQ_AXIS} as a required axis")
        if SEQ_AXIS in shape and shape.index(SEQ_AXIS) != lead:
            raise self.error(t.dim_loc(shape.index(SEQ_AXIS)), f"axis {SEQ_AXIS} of {p.name!r} is not the leading axis",
                             f"{SEQ_AXIS} first (after optional batch axes), so that padding a sequence pads a suffix")
        return tuple(shape)

    def signature(self):
        inputs, scalars, outputs = [], [], []
        in_types = {p.name: p.type for p in self.kdef.inputs}
        for group in (self.kdef.inputs, self.kdef.outputs):
            names = set()
            for p in group:
                if p.name in names:
                    raise self.error(p.loc, f"parameter {p.name!r} is declared twice", "unique parameter names")
                names.add(p.name)
        for p in self.kdef.outputs:   # an output named like an input is updated in place
            if p.name in in_types:
                t = in_types[p.name]
                if (t.dtype, t.dims) != (p.type.dtype, p.type.dims):
                    raise self.error(p.loc, f"in-place output {p.name!r} is declared with another type than input "
                                     f"{p.name!r}", "the same dtype and shape for an updated parameter")
                if not t.dims:
                    raise self.error(p.loc, f"output {p.name!r} is a scalar", "outputs are tensors, e.g. f32[T]")
                self.inouts.add(p.name)
        for p in self.kdef.inputs:
            shape = self.shape_of(p)
            if p.default is not None:
                self.check_default(p)
            if shape:
                inputs.append(TensorArg(p.name, p.type.dtype, shape, p.type.optional))
                self.env[p.name] = self.node(Op.INPUT, (), shape, p.type.dtype, p.name)
            else:
                if p.type.dtype != "f32":
                    raise self.error(p.type.loc, f"scalar parameter {p.name!r} has dtype {p.type.dtype}",
                                     "f32 (runtime scalars live in one f32 uniform block)")
                scalars.append(p.name)
                self.env[p.name] = self.node(Op.SCALAR, (), (), "f32", p.name)
        for p in self.kdef.outputs:
            shape = self.shape_of(p)
            if not shape:
                raise self.error(p.type.loc, f"output {p.name!r} is a scalar", "outputs are tensors, e.g. f32[T]")
            if p.default is not None:
                raise self.error(p.loc, f"output {p.name!r} has a default", "defaults on inputs only")
            outputs.append(TensorArg(p.name, p.type.dtype, shape, p.type.optional))
        return tuple(inputs), tuple(scalars), tuple(outputs)

    def check_default(self, p: ast.Param) -> None:
        if p.name in self.inouts:
            raise self.error(p.loc, f"in-place parameter {p.name!r} has a default", "a parameter the caller passes")
        if not math.isfinite(p.default) or abs(p.default) >= F32_OVERFLOW:
            raise self.error(p.loc, f"default {p.default} of {p.name!r} is out of range", "a finite f32 value")
        if p.type.dtype in INT_RANGE:
            lo, hi = INT_RANGE[p.type.dtype]
            if p.default != int(p.default) or not lo <= p.default <= hi:
                raise self.error(p.loc, f"default {p.default} of {p.name!r} is not representable as {p.type.dtype}",
                                 f"a whole number in [{lo}, {hi}]")
        self.defaults[p.name] = float(p.default)

    # ---- expressions ----
    def unify_dtype(self, loc, what: str, a: Node, b: Node) -> str:
        if a.dtype == ABSTRACT:
            return b.dtype
        if b.dtype == ABSTRACT or a.dtype == b.dtype:
            return a.dtype
        raise self.error(loc, f"dtype mismatch in {what}: {a.dtype} and {b.dtype}",
                         "operands of one dtype (cast with f32(...) or f16(...))")

    def broadcast(self, loc, what: str, *xs: Node) -> tuple[str, ...]:
        out: tuple[str, ...] = ()
        for x in xs:
            merged = merge(out, x.shape)
            if merged is None:
                raise self.error(loc, f"cannot broadcast {what}: shapes [{', '.join(out)}] and "
                                 f"[{', '.join(x.shape)}] order their shared axes differently",
                                 "shared axes in the same order in both operands")
            out = merged
        return out

    def expr(self, e: ast.Expr) -> Node:
        if isinstance(e, ast.Number):
            if not math.isfinite(e.value) or abs(e.value) >= F32_OVERFLOW:
                raise self.error(e.loc, f"number {e.text} is out of range", "a finite f32 value")
            return self.node(Op.CONST, (), (), ABSTRACT, e.value)
        if isinstance(e, ast.Var):
            if e.name not in self.env:
                raise self.error(e.loc, f"unknown name {e.name!r}", self._known())
            return self.env[e.name]
        if isinstance(e, ast.Neg):
            x = self.expr(e.operand)
            if x.dtype == "u32":
                raise self.error(e.loc, "cannot negate a u32 value", "a signed or float operand")
            return self.node(Op.NEG, (x,), x.shape, x.dtype)
        if isinstance(e, ast.BinOp):
            return self.binary(e.loc, BINOP_NAMES[e.op], BINOP_SYMBOLS.get(e.op, e.op), self.expr(e.lhs),
                               self.expr(e.rhs), (e.lhs.loc, e.rhs.loc))
        if isinstance(e, ast.Subscript):
            return self.subscript(e)
        return self.call(e)

    def subscript(self, e: ast.Subscript) -> Node:
        x = self.expr(e.value)
        if len(e.items) != len(x.shape):
            raise self.error(e.loc, f"subscript has {len(e.items)} item{'s' * (len(e.items) != 1)} but the value is "
                             f"{_fmt(x.dtype, x.shape)}", "one item per axis: ':', an index, or AXIS - k")
        takes = []
        for axis, item in zip(x.shape, e.items):
            if isinstance(item, ast.Full) or (isinstance(item, ast.Var) and item.name == axis):
                continue
            if _is_int(item):
                index = int(item.value)
                if axis in self.fixed_dims and index >= self.fixed_dims[axis]:
                    raise self.error(item.loc, f"index {index} is out of range for axis {axis} of size "
                                     f"{self.fixed_dims[axis]}", f"an index below {self.fixed_dims[axis]}")
                takes.append((axis, index))
            elif isinstance(item, ast.BinOp) and item.op in ("add", "sub") and isinstance(item.lhs, ast.Var) \
                    and item.lhs.name == axis and _is_int(item.rhs):
                k = int(item.rhs.value)
                x = self.node(Op.SHIFT, (x,), x.shape, x.dtype, (axis, k if item.op == "add" else -k))
            elif isinstance(item, ast.BinOp) and item.op in ("add", "sub") and isinstance(item.lhs, ast.Var) \
                    and item.lhs.name == axis and isinstance(item.rhs, ast.Var) and item.rhs.name not in self.env:
                by = item.rhs.name
                if by in x.shape:
                    raise self.error(item.rhs.loc, f"window axis {by} is already an axis of the value",
                                     f"a new axis name (the window x[{axis} - {by}] adds it)")
                x = self.node(Op.WINDOW, (x,), x.shape + (by,), x.dtype, (axis, by, 1 if item.op == "add" else -1))
            else:
                raise self.error(item.loc, f"cannot subscript axis {axis} with this expression",
                                 f"':', an integer index, {axis} - k / {axis} + k with an integer k, or a window "
                                 f"{axis} - L / {axis} + L over a new axis L")
        for axis, index in takes:
            x = self.node(Op.TAKE, (x,), tuple(a for a in x.shape if a != axis), x.dtype, (axis, index))
        return x

    def binary(self, loc, op: Op, what: str, a: Node, b: Node, locs=None) -> Node:
        dtype = self.unify_dtype(loc, what, a, b)
        if op in FLOAT_ONLY and dtype not in FLOAT_DTYPES + (ABSTRACT,):
            raise self.error(loc, f"{what} needs float operands, got {dtype}", "f32 or f16 operands")
        if op in INT_ONLY and dtype not in INT_RANGE:
            raise self.error(loc, f"{what} needs integer operands, got {dtype if dtype != ABSTRACT else 'literals only'}",
                             "i32 or u32 operands (cast with u32(...) or i32(...))")
        la, lb = locs or (loc, loc)
        shape = self.broadcast(loc, what, a, b)
        a, b = self.adopt(la, a, dtype), self.adopt(lb, b, dtype)
        # comparisons give 0 or 1 in the operands' dtype, so they compose with arithmetic
        return self.node(op, (a, b), shape, dtype)

    def adopt(self, loc, x: Node, dtype: str) -> Node:
        """A literal operand takes the dtype of the value it meets; for an integer dtype it must be one.

        Float contexts need nothing (literals are spelled in the consumer's compute type). In an
        integer context a literal (or a negated one) must be a whole number in the dtype's range, and
        a compound literal-only expression, which is computed in f32, is cast to the integer dtype.
        """
        if x.dtype != ABSTRACT or dtype not in INT_RANGE:
            return x
        value = None
        if x.op == Op.CONST:
            value = float(x.arg)
        elif x.op == Op.NEG and x.srcs[0].op == Op.CONST:
            value = -float(x.srcs[0].arg)
        if x.op == Op.DIMSIZE:          # an axis' size: spelled in the consumer's type
            return x
        if value is None:
            return self.node(Op.CAST, (x,), x.shape, dtype, dtype)
        lo, hi = INT_RANGE[dtype]
        if value != int(value) or not lo <= value <= hi:
            shown = int(value) if value.is_integer() else value
            raise self.error(loc, f"literal {shown} is not representable as {dtype}",
                             f"a whole number in [{lo}, {hi}] (or cast with {dtype}(...))")
        return self.node(Op.CONST, (), (), ABSTRACT, value)

    def call(self, e: ast.Call) -> Node:
        f, args = e.func, e.args
        if f in REDUCE_FUNCS and len(args) == 2 and isinstance(args[1], ast.Var) and args[1].name not in self.env:
            return self.reduce(e)
        if f in UNARY_FUNCS:
            self.arity(e, 1)
            x = self.expr(args[0])
            if x.dtype not in FLOAT_DTYPES + (ABSTRACT,) and UNARY_FUNCS[f] in FLOAT_ONLY:
                raise self.error(e.loc, f"{f} needs a float operand, got {x.dtype}", "an f32 or f16 operand")
            return self.node(UNARY_FUNCS[f], (x,), x.shape, x.dtype)
        if f in BINARY_FUNCS:
            self.arity(e, 2)
            return self.binary(e.loc, BINARY_FUNCS[f], f, self.expr(args[0]), self.expr(args[1]),
                               (args[0].loc, args[1].loc))
        if f == "where":
            self.arity(e, 3)
            c, a, b = (self.expr(a) for a in args)
            dtype = self.unify_dtype(e.loc, "where", a, b)
            shape = self.broadcast(e.loc, "where", c, a, b)
            a, b = self.adopt(args[1].loc, a, dtype), self.adopt(args[2].loc, b, dtype)
            return self.node(Op.WHERE, (c, a, b), shape, dtype)
        if f in DTYPES:
            self.arity(e, 1)
            x = self.expr(args[0])
            return x if x.dtype == f else self.node(Op.CAST, (x,), x.shape, f, f)
        if f == "flip":
            self.arity(e, 2)
            x = self.expr(args[0])
            axis = self.axis_name(args[1])
            if axis not in x.shape:
                raise self.error(args[1].loc, f"flip() along axis {axis}, which {_fmt(x.dtype, x.shape)} does not have",
                                 "an axis of the value: " + (", ".join(x.shape) or "none (it is a scalar)"))
            return self.node(Op.FLIP, (x,), x.shape, x.dtype, axis)
        if f == "index":
            self.arity(e, 1)
            axis = self.axis_name(args[0])
            return self.node(Op.INDEX, (), (axis,), "i32", axis)
        if f == "size":
            self.arity(e, 1)
            return self.node(Op.DIMSIZE, (), (), ABSTRACT, self.axis_name(args[0]))
        if f == "gather":
            self.arity(e, 2)
            table, ids = self.expr(args[0]), self.expr(args[1])
            if table.op != Op.INPUT or not table.shape:
                raise self.error(args[0].loc, "gather() reads from a tensor parameter", "a kernel input, e.g. E: f32[V, D]")
            if ids.dtype not in ("i32", "u32"):
                raise self.error(args[1].loc, f"gather() ids must be integers, got {ids.dtype}", "an i32 or u32 value")
            shape = merge(ids.shape, table.shape[1:])
            if shape is None or set(ids.shape) & set(table.shape[1:]):
                raise self.error(e.loc, "gather() ids share an axis with the table's rows", "disjoint axes")
            return self.node(Op.GATHER, (table, ids), ids.shape + table.shape[1:], table.dtype)
        if f == "stack":
            if len(args) < 3:
                raise self.error(e.loc, "stack() needs at least two values and an axis", "stack(a, b, AXIS)")
            values = [self.expr(a) for a in args[:-1]]
            axis = self.axis_name(args[-1], count=len(values))
            dtype = values[0].dtype
            for v, a in zip(values[1:], args[1:-1]):     # unify with the dtype of the values so far
                dtype = self.unify_dtype(a.loc, "stack", self.node(Op.CONST, (), (), dtype, 0.0), v)
            values = [self.adopt(a.loc, v, dtype) for v, a in zip(values, args)]
            base = self.broadcast(e.loc, "stack", *values)
            if axis in base:
                raise self.error(args[-1].loc, f"stack() axis {axis} is already an axis of the values", "a new axis")
            shape = base[:-1] + (axis,) + base[-1:] if base else (axis,)
            parts = [self.node(Op.EMBED, (v,), shape, dtype, (axis, i)) for i, v in enumerate(values)]
            out = parts[0]
            for p in parts[1:]:
                out = self.node(Op.ADD, (out, p), shape, dtype)
            return out
        intr = intrinsics.get(f)
        if intr is not None:
            outs = self.intrinsic(e, intr)
            if len(outs) != 1:
                raise self.error(e.loc, f"{f}() returns {len(outs)} values ({', '.join(intr.outputs)})",
                                 f"an assignment of all of them: {', '.join(intr.outputs)} = {f}(...)")
            return outs[0]
        if f in REDUCE_FUNCS:
            raise self.error(e.loc, f"{f}() needs a value and an axis name", f"{f}(value, AXIS), e.g. {f}(x, D)")
        known = sorted(set(UNARY_FUNCS) | set(BINARY_FUNCS) | set(REDUCE_FUNCS) | set(DTYPES)
                       | {"where", "index", "size", "gather", "stack", "flip"} | set(intrinsics.names()))
        raise self.error(e.loc, f"unknown function {f!r}", "one of " + ", ".join(known))

    def axis_name(self, arg: ast.Expr, count: int | None = None) -> str:
        """An axis written as a name (not a value) or, for stack(), an integer size."""
        if isinstance(arg, ast.Var) and arg.name not in self.env:
            return arg.name
        if count is not None and _is_int(arg):
            if int(arg.value) != count:
                raise self.error(arg.loc, f"stack() of {count} values along an axis of size {int(arg.value)}",
                                 f"an axis of size {count}")
            self.fixed_dims[str(int(arg.value))] = count
            return str(int(arg.value))
        raise self.error(arg.loc, "expected an axis name here", "an axis name such as T or D")

    def intrinsic(self, e: ast.Call, intr) -> list[Node]:
        wanted = intr.params + intr.axes
        given = len(intr.params) - max(0, len(wanted) - len(e.args)) if intr.optional else len(intr.params)
        if not len(wanted) - intr.optional <= len(e.args) <= len(wanted):
            n = f"{len(intr.params) - intr.optional} to {len(intr.params)}" if intr.optional else f"{len(intr.params)}"
            what = f"{n} operands" + (f" and {len(intr.axes)} axis" if intr.axes else "")
            raise self.error(e.loc, f"{intr.name}() takes {what} ({', '.join(wanted)}), got {len(e.args)} arguments",
                             ", ".join(wanted))
        operands = []
        for a in e.args[:given]:
            x = self.expr(a)
            if x.op != Op.INPUT and not intr.computed_operands:
                raise self.error(a.loc, f"{intr.name}() takes kernel inputs as operands",
                                 "a tensor parameter (compute other values in another kernel)")
            operands.append(x)
        axes = tuple(self.intrinsic_axis(intr, name, a) for name, a in zip(intr.axes, e.args[given:]))
        try:
            outs = intrinsics.call_nodes(intr, operands, axes)
            self.fixed_dims.update((a, int(a)) for p in outs for a in p.shape if a.isdigit())
            return outs
        except intrinsics.IntrinsicError as err:
            raise self.error(e.loc, f"{intr.name}(): {err}", ", ".join(intr.params + intr.axes)) from None

    def intrinsic_axis(self, intr, name: str, arg: ast.Expr) -> str:
        """An intrinsic's axis argument: a name that is not a value (its size comes from the call), or
        a positive integer (a fixed-size axis)."""
        if isinstance(arg, ast.Var) and arg.name not in self.env:
            return arg.name
        if _is_int(arg) and int(arg.value) >= 1:
            size = int(arg.value)
            self.fixed_dims[str(size)] = size
            return str(size)
        raise self.error(arg.loc, f"{intr.name}() takes its {name} as an axis name or a positive integer",
                         f"an axis name such as {name}, or an integer such as 2")

    def reduce(self, e: ast.Call) -> Node:
        x = self.expr(e.args[0])
        axis = e.args[1].name
        if axis not in x.shape:
            raise self.error(e.args[1].loc, f"{e.func}() over axis {axis}, which {_fmt(x.dtype, x.shape)} does not have",
                             "an axis of the value: " + (", ".join(x.shape) or "none (it is a scalar)"))
        if x.dtype == ABSTRACT:        # literals only (where(c, 1.0, 0.0)): summed in f32, the compute type
            x = self.node(Op.CAST, (x,), x.shape, "f32", "f32")
        if x.dtype not in FLOAT_DTYPES:
            raise self.error(e.loc, f"{e.func}() needs a float value, got {x.dtype}", "an f32 or f16 value")
        shape = tuple(a for a in x.shape if a != axis)
        out = self.node(REDUCE_FUNCS[e.func], (x,), shape, x.dtype, axis)
        if e.func == "mean":
            out = self.node(Op.DIV, (out, self.node(Op.DIMSIZE, (), (), ABSTRACT, axis)), shape, x.dtype)
        return out

    def arity(self, e: ast.Call, n: int):
        if len(e.args) != n:
            raise self.error(e.loc, f"{e.func}() takes {n} argument{'s' * (n != 1)}, got {len(e.args)}",
                             f"{n} argument{'s' * (n != 1)}")

    def _known(self) -> str:
        return "a parameter or an earlier assignment: " + ", ".join(sorted(self.env)) if self.env else "a parameter"

    # ---- body ----
    def build(self) -> KernelIR:
        inputs, scalars, outputs = self.signature()
        declared = {o.name: o for o in outputs}
        results: dict[str, Node] = {}
        assigned: set[str] = set()
        for st in self.kdef.body:
            for target in st.targets:
                updatable = target in self.inouts and target not in assigned
                if (target in self.env and not updatable) or st.targets.count(target) > 1:
                    kind = "a parameter" if target in {p.name for p in self.kdef.inputs} else "already assigned"
                    raise self.error(st.loc, f"{target!r} is {kind}", "a new name (values are assigned once)")
            values = self.assigned_values(st)
            for target, value in zip(st.targets, values):
                if target in declared:
                    value = self.check_output(st, value, declared[target])
                    results[target] = value
                self.env[target] = value
                assigned.add(target)
        for o in outputs:
            if o.name not in results:
                p = next(p for p in self.kdef.outputs if p.name == o.name)
                raise self.error(p.loc, f"output {o.name!r} is never assigned", f"an assignment '{o.name} = ...'")
        return KernelIR(self.kdef.name, inputs, scalars, outputs, results, self.src.text, self.src.filename,
                        self.kdef.loc.line, dict(self.fixed_dims), tuple(sorted(self.inouts)), dict(self.defaults))

    def assigned_values(self, st: ast.Assign) -> list[Node]:
        if len(st.targets) == 1:
            return [self.expr(st.value)]
        intr = intrinsics.get(st.value.func) if isinstance(st.value, ast.Call) else None
        if intr is None:
            raise self.error(st.loc, f"{len(st.targets)} names assigned from one value",
                             "one name, or an intrinsic call that returns several values")
        outs = self.intrinsic(st.value, intr)
        if len(outs) != len(st.targets):
            raise self.error(st.loc, f"{intr.name}() returns {len(outs)} values ({', '.join(intr.outputs)}), "
                             f"assigned to {len(st.targets)} names", ", ".join(intr.outputs))
        return outs

    def check_output(self, st: ast.Assign, value: Node, decl: TensorArg) -> Node:
        if value.dtype not in (decl.dtype, ABSTRACT):
            raise self.error(st.loc, f"output {decl.name!r} is declared {decl.dtype} but its value is {value.dtype}",
                             f"a {decl.dtype} value (cast with {decl.dtype}(...))")
        if value.shape != decl.shape and not is_subsequence(value.shape, decl.shape):
            raise self.error(st.loc, f"output {decl.name!r} is declared {_fmt(decl.dtype, decl.shape)} "
                             f"but its value is {_fmt(value.dtype, value.shape)}", _fmt(decl.dtype, decl.shape))
        value = self.adopt(st.value.loc, value, decl.dtype)
        if value.dtype == ABSTRACT:
            value = self.node(Op.CAST, (value,), value.shape, decl.dtype, decl.dtype)
        return value


def _is_int(e) -> bool:
    return isinstance(e, ast.Number) and e.value == int(e.value) and "." not in e.text and "e" not in e.text.lower()


def build_kernel(kdef: ast.KernelDef, src: ast.SourceFile) -> KernelIR:
    """Check one parsed kernel and lower it to IR; raises DslError with the source location."""
    return _Builder(kdef, src).build()
