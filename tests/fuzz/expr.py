"""The fuzzer's own model of the kernel language: expression tree, type rules, printer, parser and a
float64 reference evaluator over named axes.

Nothing here imports the compiler: the reference must stay independent of its IR. The rules are
restated from the language's documentation (docs/kernel-language.md, grammar.lark) and its checker's behaviour:

- a value has a dtype (f32 f16 i32 u32, or ``float`` for a literal-only value) and a shape, a tuple
  of axis names (an integer size is the axis named by its digits, e.g. "3");
- operands broadcast by name (``merge``): shared axes keep their order, an axis only the right
  operand has goes before the next shared axis (or at the end);
- comparisons give 0/1 in their operands' dtype; ``where(c, a, b)`` selects a where c != 0;
- ``stack(v1, .., vn, n)`` puts the new axis "n" before the last axis of the values' broadcast shape;
- a subscript has one item per axis: ``:`` (or the axis' own name), an integer (takes that entry,
  dropping the axis) or ``A - k`` / ``A + k`` (reads k earlier / later, zero outside 0..size-1; for T
  the size is the real length);
- a subscript item ``A - L`` / ``A + L`` with L an axis name the value does not have (and no
  variable's name) is a window: the value gains L as its LAST axis, x[.., a - l, ..] (resp. a + l),
  zero outside 0..size(A)-1 (T: the real length); windows append their axes in item order, takes
  drop theirs afterwards;
- ``flip(x, A)`` reverses axis A: x[.., |A| - 1 - a, ..] (T: over the real length);
- ``mean`` divides by the axis' size (T: the real length); reductions need a float value;
- an input may have a default (``b: f32[D] = 0.5``, ``s: f32 = -2``; whole numbers for integer
  dtypes; none on outputs or in-place parameters): a caller may leave it out, and it then holds that
  value over all its axes;
- ``gather(table, ids)`` reads rows of an input tensor table [V, ...] at integer ids (each in [0, |V|)):
  the result is ids' axes followed by the table's other axes, which must not share an axis with ids;
- ``v, i = topk(x, K)`` (a statement of its own, targets written "v, i") takes a value x [R, E] of
  floats and gives the K largest of each row (K a new axis, or an integer, at most |E|) in descending
  order, equal values by lower index, and their indices (i32);
- ``grouped_matmul(x, w, ends)`` (x float [S, K], w float [E, N, K], ends i32[E], the running sum of
  the experts' row counts) is [S, N]: row s of expert e (ends[e-1] <= s < ends[e], ends[-1] = 0)
  is x[s] w[e]^T; rows past ends[E-1] are unspecified (the evaluator gives NaN there, so a value
  read from them shows). ``grouped_matmul_scaled(x, w, ends, scale)`` (scale float [S]) times
  scale[s]. f32 when x or w is f32, else f16;
- a tensor may mark leading axes optional (``x: f32[B?, T, D]``): optional axes come first, T is never
  optional and, when present, is the first axis after them. A caller may pass the tensor without a
  prefix of its optional axes (they are then size 1); an output is returned without the prefix of its
  declared optional axes that some input left out (see ``returned_shape``).
"""
from __future__ import annotations

import math
import re
from dataclasses import dataclass, field

import numpy as np

SEQ = "T"
DTYPES = ("f32", "f16", "i32", "u32")
FLOATS = ("f32", "f16")
INTS = ("i32", "u32")
ABSTRACT = "float"
UNARY_FUNCS = ("exp", "log", "sqrt", "rsqrt", "abs", "sigmoid", "silu", "tanh", "recip", "cos", "sin")
FLOAT_ONLY_FUNCS = tuple(f for f in UNARY_FUNCS if f != "abs")
BINARY_FUNCS = ("max", "min", "eq")
REDUCE_FUNCS = ("sum", "mean", "max")
BINOPS = ("+", "-", "*", "/", "**", "<", ">", "%", "&", "|", "<<", ">>")
INT_BINOPS = ("%", "&", "|", "<<", ">>")     # integer operands only
INT_RANGE = {"i32": (-2**31, 2**31 - 1), "u32": (0, 2**32 - 1)}
GROUPED = ("grouped_matmul", "grouped_matmul_scaled")


class ModelError(Exception):
    """The fuzzer's model says a kernel is ill-typed (or a source does not parse)."""


# ---------------------------------------------------------------- tree
@dataclass(frozen=True)
class Expr:
    pass


@dataclass(frozen=True)
class Num(Expr):
    value: float
    text: str


@dataclass(frozen=True)
class Ref(Expr):
    name: str


@dataclass(frozen=True)
class Neg(Expr):
    x: Expr


@dataclass(frozen=True)
class Bin(Expr):
    op: str
    a: Expr
    b: Expr


@dataclass(frozen=True)
class Fn(Expr):
    """A call: unary functions, max/min/eq (binary), where (3 args), casts f32/f16/i32/u32."""
    name: str
    args: tuple


@dataclass(frozen=True)
class Red(Expr):
    fn: str
    x: Expr
    axis: str


@dataclass(frozen=True)
class Idx(Expr):
    axis: str


@dataclass(frozen=True)
class Flip(Expr):
    x: Expr
    axis: str


@dataclass(frozen=True)
class Stk(Expr):
    values: tuple
    n: int


@dataclass(frozen=True)
class Sub(Expr):
    """items, one per axis of x: ("full",) for ':', ("name", A) for the axis' own name, ("take", i)
    for an integer, ("shift", A, k) for ``A + k`` (k > 0) or ``A - |k|`` (k < 0), ("window", A, L, s)
    for ``A + L`` (s = 1) or ``A - L`` (s = -1) over a new axis L."""
    x: Expr
    items: tuple


@dataclass(frozen=True)
class TopK(Expr):
    """``topk(x, K)``: only as the whole value of a two-target statement ("v, i")."""
    x: Expr
    k: str


def targets(target: str) -> list[str]:
    """The names a statement assigns: one, or "v, i" for topk's two."""
    return target.split(", ")


def children(e: Expr) -> tuple:
    if isinstance(e, TopK):
        return (e.x,)
    if isinstance(e, Neg):
        return (e.x,)
    if isinstance(e, Bin):
        return (e.a, e.b)
    if isinstance(e, Fn):
        return e.args
    if isinstance(e, (Red, Flip)):
        return (e.x,)
    if isinstance(e, Stk):
        return e.values
    if isinstance(e, Sub):
        return (e.x,)
    return ()


def with_children(e: Expr, kids: tuple) -> Expr:
    if isinstance(e, TopK):
        return TopK(kids[0], e.k)
    if isinstance(e, Neg):
        return Neg(kids[0])
    if isinstance(e, Bin):
        return Bin(e.op, kids[0], kids[1])
    if isinstance(e, Fn):
        return Fn(e.name, tuple(kids))
    if isinstance(e, Red):
        return Red(e.fn, kids[0], e.axis)
    if isinstance(e, Flip):
        return Flip(kids[0], e.axis)
    if isinstance(e, Stk):
        return Stk(tuple(kids), e.n)
    if isinstance(e, Sub):
        return Sub(kids[0], e.items)
    return e


def walk(e: Expr):
    yield e
    for c in children(e):
        yield from walk(c)


@dataclass(frozen=True)
class Param:
    name: str
    dtype: str
    shape: tuple          # () for a runtime scalar
    optional: tuple = ()  # the leading axes marked ``?`` (a caller may leave out a prefix of them)
    default: float | None = None   # an input's default (a caller may leave the input out)


@dataclass
class KernelDef:
    name: str
    inputs: list
    outputs: list
    body: list            # [(target, Expr)]

    @property
    def inplace(self) -> list[str]:
        ins = {p.name for p in self.inputs}
        return [o.name for o in self.outputs if o.name in ins]

    def axes(self) -> list[str]:
        seen: dict[str, None] = {}
        for p in self.inputs + self.outputs:
            for a in p.shape:
                seen.setdefault(a, None)
        for _, e in self.body:
            for n in walk(e):
                if isinstance(n, (Red, Idx)):
                    seen.setdefault(n.axis, None)
                elif isinstance(n, TopK):
                    seen.setdefault(n.k, None)
                elif isinstance(n, Stk):
                    seen.setdefault(str(n.n), None)
                elif isinstance(n, Sub):
                    for it in n.items:
                        if it[0] == "window":
                            seen.setdefault(it[2], None)
        return list(seen)

    def window_axes(self) -> list[str]:
        """Axes some window introduces (x[T - L]): their sizes may come from dims= only."""
        out: dict[str, None] = {}
        for _, e in self.body:
            for n in walk(e):
                if isinstance(n, Sub):
                    for it in n.items:
                        if it[0] == "window":
                            out.setdefault(it[2], None)
        return list(out)

    def uses_f16(self) -> bool:
        if any(p.dtype == "f16" for p in self.inputs + self.outputs):
            return True
        return any(isinstance(n, Fn) and n.name == "f16" for _, e in self.body for n in walk(e))


def is_fixed(axis: str) -> bool:
    return axis.isdigit()


# ---------------------------------------------------------------- shapes
def merge(a: tuple, b: tuple):
    """Broadcast shape of a and b by axis name, or None when their shared axes are ordered differently."""
    shared_a = [x for x in a if x in b]
    shared_b = [x for x in b if x in a]
    if shared_a != shared_b:
        return None
    before: dict[str, list] = {}
    pending: list = []
    for x in b:
        if x in a:
            before[x] = pending
            pending = []
        else:
            pending.append(x)
    out: list = []
    for x in a:
        out.extend(before.get(x, []))
        out.append(x)
    out.extend(pending)
    return tuple(out)


def is_subseq(small, big) -> bool:
    it = iter(big)
    return all(a in it for a in small)


@dataclass(frozen=True)
class Ty:
    shape: tuple
    dtype: str


def _unify(a: str, b: str) -> str:
    if a == ABSTRACT:
        return b
    if b == ABSTRACT or a == b:
        return a
    raise ModelError(f"dtype mismatch {a} and {b}")


def _literal_value(e: Expr):
    if isinstance(e, Num):
        return e.value
    if isinstance(e, Neg) and isinstance(e.x, Num):
        return -e.x.value
    return None


class Checker:
    """Types every node of a kernel (keyed by structure: the same subtree has one type)."""

    def __init__(self, k: KernelDef):
        self.k = k
        self.env: dict[str, Ty] = {}
        self.types: dict[Expr, Ty] = {}
        self.fixed = {a: int(a) for p in k.inputs + k.outputs for a in p.shape if is_fixed(a)}

    def check(self) -> dict[str, Ty]:
        k = self.k
        names = [p.name for p in k.inputs]
        if len(set(names)) != len(names) or len({o.name for o in k.outputs}) != len(k.outputs):
            raise ModelError("duplicate parameter")
        for p in k.inputs + k.outputs:
            if p.dtype not in DTYPES:
                raise ModelError(f"dtype {p.dtype}")
            if len(set(p.shape)) != len(p.shape):
                raise ModelError("axis twice")
            lead = len(p.optional)
            if tuple(p.shape[:lead]) != tuple(p.optional):
                raise ModelError("optional axes lead")
            if SEQ in p.optional or any(is_fixed(a) for a in p.optional):
                raise ModelError("T (or a fixed axis) optional")
            if SEQ in p.shape and p.shape.index(SEQ) != lead:
                raise ModelError("T not leading (after optional axes)")
            if any(is_fixed(a) and int(a) < 1 for a in p.shape):
                raise ModelError("axis size < 1")
        ins = {p.name: p for p in k.inputs}
        for o in k.outputs:
            if not o.shape:
                raise ModelError("scalar output")
            if o.default is not None:
                raise ModelError("output with a default")
            if o.name in ins and (ins[o.name].dtype, ins[o.name].shape, ins[o.name].optional) != \
                    (o.dtype, o.shape, o.optional):
                raise ModelError("in-place type differs")
            if o.name in ins and ins[o.name].default is not None:
                raise ModelError("in-place parameter with a default")
        for p in k.inputs:
            if not p.shape and p.dtype != "f32":
                raise ModelError("scalar must be f32")
            if p.default is not None:
                if not math.isfinite(p.default) or abs(p.default) >= 2.0**127:
                    raise ModelError("default out of range")
                if p.dtype in INTS:
                    lo, hi = INT_RANGE[p.dtype]
                    if p.default != int(p.default) or not lo <= p.default <= hi:
                        raise ModelError(f"default {p.default} not {p.dtype}")
            self.env[p.name] = Ty(p.shape, p.dtype)
        decl = {o.name: o for o in k.outputs}
        assigned: set = set()
        for names, e in k.body:
            many = targets(names)
            if len(many) > 1 or isinstance(e, TopK):
                self.topk(many, e, decl, assigned)
                continue
            target = names
            if (target in self.env and not (target in decl and target in ins and target not in assigned)):
                raise ModelError(f"{target} assigned twice")
            t = self.ty(e)
            if target in decl:
                o = decl[target]
                if t.dtype not in (o.dtype, ABSTRACT):
                    raise ModelError(f"output {target} dtype {t.dtype} vs {o.dtype}")
                if not is_subseq(t.shape, o.shape):
                    raise ModelError(f"output {target} shape {t.shape} vs {o.shape}")
                if o.dtype in INTS:
                    self._adopt(e, o.dtype)
            self.env[target] = t
            assigned.add(target)
        for o in k.outputs:
            if o.name not in assigned:
                raise ModelError(f"output {o.name} never assigned")
        return self.env

    def topk(self, names: list, e: Expr, decl: dict, assigned: set):
        """``v, i = topk(x, K)``: x a float value [R, E], K a new axis (or an integer <= |E|)."""
        if len(names) != 2 or not isinstance(e, TopK):
            raise ModelError("topk() assigns two names, and two names need topk()")
        t = self.ty(e.x)
        if t.dtype not in FLOATS or len(t.shape) != 2:
            raise ModelError("topk() of a float [R, E]")
        if e.k in t.shape or e.k in self.env or (is_fixed(e.k) and (int(e.k) < 1 or (
                is_fixed(t.shape[1]) and int(e.k) > int(t.shape[1])))):
            raise ModelError("topk() K: a new axis, at most E")
        shape = (t.shape[0], e.k)
        self.types[e] = Ty(shape, t.dtype)
        for name, ty in zip(names, (Ty(shape, t.dtype), Ty(shape, "i32"))):
            if name in self.env or names.count(name) > 1:
                raise ModelError(f"{name} assigned twice")
            if name in decl and ((decl[name].dtype, decl[name].shape) != (ty.dtype, ty.shape)):
                raise ModelError(f"output {name} declared otherwise")
            self.env[name] = ty
            assigned.add(name)

    def _adopt(self, e: Expr, dtype: str):
        if dtype not in INTS:
            return
        v = _literal_value(e)
        if v is None:
            return
        lo, hi = INT_RANGE[dtype]
        if v != int(v) or not lo <= v <= hi:
            raise ModelError(f"literal {v} not {dtype}")

    def _binary(self, a: Expr, b: Expr, float_only=False) -> Ty:
        ta, tb = self.ty(a), self.ty(b)
        dt = _unify(ta.dtype, tb.dtype)
        if float_only and dt in INTS:
            raise ModelError("float-only op on ints")
        shape = merge(ta.shape, tb.shape)
        if shape is None:
            raise ModelError(f"cannot broadcast {ta.shape} {tb.shape}")
        if ta.dtype == ABSTRACT:
            self._adopt(a, dt)
        if tb.dtype == ABSTRACT:
            self._adopt(b, dt)
        return Ty(shape, dt)

    def ty(self, e: Expr) -> Ty:
        t = self.types.get(e)
        if t is None:
            t = self.types[e] = self._ty(e)
        return t

    def _ty(self, e: Expr) -> Ty:
        if isinstance(e, Num):
            if not math.isfinite(e.value) or e.value < 0:
                raise ModelError("bad literal")
            return Ty((), ABSTRACT)
        if isinstance(e, Ref):
            if e.name not in self.env:
                raise ModelError(f"unknown name {e.name}")
            return self.env[e.name]
        if isinstance(e, Neg):
            t = self.ty(e.x)
            if t.dtype == "u32":
                raise ModelError("negating u32")
            return t
        if isinstance(e, Bin):
            t = self._binary(e.a, e.b, float_only=e.op == "**")
            if e.op in INT_BINOPS and t.dtype not in INTS:
                raise ModelError(f"{e.op} of non-integers")
            return t
        if isinstance(e, Fn):
            f, args = e.name, e.args
            if f in UNARY_FUNCS:
                if len(args) != 1:
                    raise ModelError("arity")
                t = self.ty(args[0])
                if f in FLOAT_ONLY_FUNCS and t.dtype in INTS:
                    raise ModelError(f"{f} of ints")
                return t
            if f in BINARY_FUNCS:
                if len(args) != 2:
                    raise ModelError("arity")
                return self._binary(args[0], args[1])
            if f == "where":
                if len(args) != 3:
                    raise ModelError("arity")
                tc, ta, tb = (self.ty(x) for x in args)
                dt = _unify(ta.dtype, tb.dtype)
                shape = ()
                for t in (tc, ta, tb):
                    shape = merge(shape, t.shape)
                    if shape is None:
                        raise ModelError("where broadcast")
                if ta.dtype == ABSTRACT:
                    self._adopt(args[1], dt)
                if tb.dtype == ABSTRACT:
                    self._adopt(args[2], dt)
                return Ty(shape, dt)
            if f in DTYPES:
                if len(args) != 1:
                    raise ModelError("arity")
                return Ty(self.ty(args[0]).shape, f)
            if f == "gather":
                if len(args) != 2 or not isinstance(args[0], Ref) or args[0].name not in \
                        {p.name for p in self.k.inputs if p.shape}:
                    raise ModelError("gather() reads a tensor input")
                table, ids = self.ty(args[0]), self.ty(args[1])
                if ids.dtype not in INTS:
                    raise ModelError("gather() ids are integers")
                if set(ids.shape) & set(table.shape[1:]) or merge(ids.shape, table.shape[1:]) is None:
                    raise ModelError("gather() ids share an axis with the table's rows")
                return Ty(ids.shape + table.shape[1:], table.dtype)
            if f in GROUPED:
                if len(args) != (4 if f == "grouped_matmul_scaled" else 3):
                    raise ModelError("arity")
                x, w, ends = (self.ty(a) for a in args[:3])
                if x.dtype not in FLOATS or w.dtype not in FLOATS or len(x.shape) != 2 or len(w.shape) != 3:
                    raise ModelError(f"{f}: x float [S, K], w float [E, N, K]")
                if w.shape[2] != x.shape[1] or ends.dtype != "i32" or ends.shape != w.shape[:1]:
                    raise ModelError(f"{f}: x [S, K], w [E, N, K], ends i32[E]")
                if len(set(x.shape + w.shape)) != 4:
                    raise ModelError(f"{f}: S, E, N and K are four axes")
                if len(args) == 4:
                    sc = self.ty(args[3])
                    if sc.dtype not in FLOATS or sc.shape != x.shape[:1]:
                        raise ModelError(f"{f}: scale float [S]")
                return Ty((x.shape[0], w.shape[1]), "f32" if "f32" in (x.dtype, w.dtype) else "f16")
            raise ModelError(f"unknown function {f}")
        if isinstance(e, Red):
            t = self.ty(e.x)
            if e.axis not in t.shape or is_fixed(e.axis):
                raise ModelError("reduce over a missing or fixed-size axis (a reduction names its axis)")
            if t.dtype not in FLOATS:
                raise ModelError("reduce of non-float")
            return Ty(tuple(a for a in t.shape if a != e.axis), t.dtype)
        if isinstance(e, Flip):
            t = self.ty(e.x)
            if e.axis not in t.shape or is_fixed(e.axis) or e.axis in self.env:
                raise ModelError("flip() along a missing or fixed-size axis")
            return t
        if isinstance(e, Idx):
            if is_fixed(e.axis):
                raise ModelError("index() names its axis: not a fixed-size one")
            return Ty((e.axis,), "i32")
        if isinstance(e, Stk):
            if len(e.values) < 2 or len(e.values) != e.n:
                raise ModelError("stack count")
            ts = [self.ty(v) for v in e.values]
            dt = ABSTRACT
            for t in ts:
                dt = _unify(dt, t.dtype)
            base = ()
            for t in ts:
                base = merge(base, t.shape)
                if base is None:
                    raise ModelError("stack broadcast")
            axis = str(e.n)
            if axis in base:
                raise ModelError("stack axis exists")
            if axis in self.fixed and self.fixed[axis] != e.n:
                raise ModelError("stack size")
            shape = base[:-1] + (axis,) + base[-1:] if base else (axis,)
            return Ty(shape, dt)
        if isinstance(e, Sub):
            t = self.ty(e.x)
            if len(e.items) != len(t.shape):
                raise ModelError("subscript arity")
            shape = list(t.shape)
            for axis, it in zip(t.shape, e.items):
                if it[0] == "window":
                    if is_fixed(axis) or it[1] != axis:
                        raise ModelError("window along a fixed axis or by another axis' name")
                    L = it[2]
                    if L in shape or is_fixed(L) or L == SEQ or L in self.env:
                        raise ModelError("window axis not new (or T, or a variable's name)")
                    shape.append(L)
                elif it[0] == "take":
                    if is_fixed(axis) and it[1] >= int(axis):
                        raise ModelError("index out of range")
                    shape.remove(axis)
                elif it[0] == "shift" and (is_fixed(axis) or it[1] != axis):
                    raise ModelError("shift along a fixed axis or by another axis' name")
                elif it[0] == "name" and it[1] != axis:
                    raise ModelError("subscript by another axis' name")
            return Ty(tuple(shape), t.dtype)
        if isinstance(e, TopK):
            raise ModelError("topk() returns two values: v, i = topk(x, K)")
        raise ModelError(f"unknown node {e!r}")


def passed_shape(p: Param, dropped) -> tuple:
    """The axes of input p as a caller passes it when it leaves out the optional axes ``dropped``
    (only a prefix of p's optional axes can be left out)."""
    k = 0
    while k < len(p.optional) and p.optional[k] in dropped:
        k += 1
    return p.shape[k:]


def left_out_axes(k: KernelDef, dropped, passed=None) -> set:
    """The optional axes the engine sees left out: those some (passed) input leaves out."""
    out: set = set()
    for p in k.inputs:
        if passed is not None and p.name not in passed:
            continue
        n = len(p.shape) - len(passed_shape(p, dropped))
        out.update(p.optional[:n])
    return out


def returned_shape(o: Param, left_out) -> tuple:
    """An output's axes as the engine returns it: without the prefix of its declared optional axes
    that the call's inputs left out."""
    return passed_shape(o, left_out)


def check(k: KernelDef) -> Checker:
    c = Checker(k)
    c.check()
    return c


# ---------------------------------------------------------------- printing
def fmt_type(p: Param) -> str:
    axes = [a + "?" if a in p.optional else a for a in p.shape]
    text = p.dtype + (f"[{', '.join(axes)}]" if p.shape else "")
    if p.default is not None:
        text += " = " + fmt_default(p.default)
    return text


def fmt_default(v: float) -> str:
    v = float(v)
    mag = abs(v)
    body = str(int(mag)) if mag == int(mag) and mag < 1e15 else repr(mag)
    return ("-" if v < 0 or (v == 0 and math.copysign(1.0, v) < 0) else "") + body


def _p(e: Expr, level: int) -> str:
    """Source text of e where the context needs at least ``level`` (0 compare, 1 sum, 2 product,
    3 unary, 4 power, 5 atom)."""
    own, text = _text(e)
    return text if own >= level else f"({text})"


def _text(e: Expr) -> tuple[int, str]:
    if isinstance(e, Num):
        return 5, e.text
    if isinstance(e, Ref):
        return 5, e.name
    if isinstance(e, Neg):
        return 3, "-" + _p(e.x, 3)
    if isinstance(e, Bin):
        if e.op in ("<", ">"):
            return 0, f"{_p(e.a, 1)} {e.op} {_p(e.b, 1)}"
        if e.op in ("+", "-"):
            return 1, f"{_p(e.a, 1)} {e.op} {_p(e.b, 2)}"
        if e.op in ("*", "/", "%"):
            return 2, f"{_p(e.a, 2)} {e.op} {_p(e.b, 3)}"
        if e.op in ("&", "|", "<<", ">>"):   # below + and - (as in Python): written in parentheses
            return 5, f"({_p(e.a, 2)} {e.op} {_p(e.b, 2)})"
        return 4, f"{_p(e.a, 5)} ** {_p(e.b, 3)}"
    if isinstance(e, Fn):
        return 5, f"{e.name}({', '.join(_p(a, 0) for a in e.args)})"
    if isinstance(e, Red):
        return 5, f"{e.fn}({_p(e.x, 0)}, {e.axis})"
    if isinstance(e, Flip):
        return 5, f"flip({_p(e.x, 0)}, {e.axis})"
    if isinstance(e, Idx):
        return 5, f"index({e.axis})"
    if isinstance(e, TopK):
        return 5, f"topk({_p(e.x, 0)}, {e.k})"
    if isinstance(e, Stk):
        return 5, f"stack({', '.join(_p(v, 0) for v in e.values)}, {e.n})"
    if isinstance(e, Sub):
        return 5, f"{_p(e.x, 5)}[{', '.join(_item_text(it, None) for it in e.items)}]"
    raise TypeError(e)


def _item_text(it, axis) -> str:
    if it[0] == "full":
        return ":"
    if it[0] == "name":
        return it[1]
    if it[0] == "take":
        return str(it[1])
    if it[0] == "window":
        return f"{it[1]} {'+' if it[3] > 0 else '-'} {it[2]}"
    axis, k = it[1], it[2]
    return f"{axis} - {-k}" if k < 0 else f"{axis} + {k}"


def expr_text(e: Expr) -> str:
    return _p(e, 0)


def kernel_text(k: KernelDef) -> str:
    ins = ", ".join(f"{p.name}: {fmt_type(p)}" for p in k.inputs)
    outs = ", ".join(f"{p.name}: {fmt_type(p)}" for p in k.outputs)
    body = "".join(f"    {t} = {expr_text(e)}\n" for t, e in k.body)
    return f"kernel {k.name}({ins}) -> ({outs}) {{\n{body}}}\n"


# ---------------------------------------------------------------- parsing (a small recursive descent parser)
_TOKEN = re.compile(r"\s+|#[^\n]*|(?P<num>([0-9]+\.[0-9]*|\.[0-9]+|[0-9]+)([eE][-+]?[0-9]+)?)"
                    r"|(?P<name>[A-Za-z_][A-Za-z0-9_]*)|(?P<op>\*\*|->|<<|>>|[-+*/%&|<>()\[\]{},:=?])")


def _tokens(text: str) -> list[tuple[str, str]]:
    out, pos = [], 0
    while pos < len(text):
        m = _TOKEN.match(text, pos)
        if not m:
            raise ModelError(f"unexpected character {text[pos]!r}")
        pos = m.end()
        for kind in ("num", "name", "op"):
            if m.group(kind) is not None:
                out.append((kind, m.group(kind)))
    out.append(("end", ""))
    return out


class _Parser:
    def __init__(self, text: str):
        self.toks = _tokens(text)
        self.i = 0

    def peek(self, k=0):
        return self.toks[self.i + k]

    def take(self, want=None):
        tok = self.toks[self.i]
        if want is not None and tok[1] != want:
            raise ModelError(f"expected {want!r}, got {tok[1]!r}")
        self.i += 1
        return tok

    def name(self) -> str:
        kind, v = self.take()
        if kind != "name":
            raise ModelError(f"expected a name, got {v!r}")
        return v

    def kernels(self) -> list[KernelDef]:
        out = []
        while self.peek()[0] != "end":
            out.append(self.kernel())
        return out

    def kernel(self) -> KernelDef:
        self.take("kernel")
        name = self.name()
        self.take("(")
        ins = self.params(")")
        self.take(")")
        self.take("->")
        self.take("(")
        outs = self.params(")")
        self.take(")")
        self.take("{")
        body = []
        while self.peek()[1] != "}":
            names = [self.name()]
            while self.peek()[1] == ",":
                self.take(",")
                names.append(self.name())
            self.take("=")
            body.append((", ".join(names), self.expr()))
        self.take("}")
        return KernelDef(name, ins, outs, body)

    def params(self, close) -> list[Param]:
        out = []
        while self.peek()[1] != close:
            name = self.name()
            self.take(":")
            dtype = self.name()
            shape, optional = [], []
            if self.peek()[1] == "[":
                self.take("[")
                while True:
                    shape.append(self.take()[1])
                    if self.peek()[1] == "?":
                        self.take("?")
                        optional.append(shape[-1])
                    if self.peek()[1] == ",":
                        self.take(",")
                        continue
                    break
                self.take("]")
            default = None
            if self.peek()[1] == "=":
                self.take("=")
                sign = 1.0
                if self.peek()[1] == "-":
                    self.take("-")
                    sign = -1.0
                kind, v = self.take()
                if kind != "num":
                    raise ModelError(f"a default is a number, got {v!r}")
                default = sign * float(v)
            if tuple(shape[:len(optional)]) != tuple(optional):
                raise ModelError("optional axes lead")
            out.append(Param(name, dtype, tuple(shape), tuple(optional), default))
            if self.peek()[1] == ",":
                self.take(",")
        return out

    def expr(self) -> Expr:
        a = self.bits()
        if self.peek()[1] in ("<", ">"):
            op = self.take()[1]
            return Bin(op, a, self.bits())
        return a

    def bits(self, ops=("|", "&", ("<<", ">>"))) -> Expr:
        """| below &, & below the shifts, the shifts below + and -."""
        if not ops:
            return self.sum()
        here = ops[0] if isinstance(ops[0], tuple) else (ops[0],)
        a = self.bits(ops[1:])
        while self.peek()[1] in here:
            op = self.take()[1]
            a = Bin(op, a, self.bits(ops[1:]))
        return a

    def sum(self) -> Expr:
        a = self.product()
        while self.peek()[1] in ("+", "-"):
            op = self.take()[1]
            a = Bin(op, a, self.product())
        return a

    def product(self) -> Expr:
        a = self.unary()
        while self.peek()[1] in ("*", "/", "%"):
            op = self.take()[1]
            a = Bin(op, a, self.unary())
        return a

    def unary(self) -> Expr:
        if self.peek()[1] == "-":
            self.take()
            return Neg(self.unary())
        a = self.atom()
        if self.peek()[1] == "**":
            self.take()
            return Bin("**", a, self.unary())
        return a

    def atom(self) -> Expr:
        kind, v = self.take()
        if kind == "num":
            e = Num(float(v), v)
        elif kind == "name":
            if self.peek()[1] == "(":
                self.take("(")
                args = []
                while self.peek()[1] != ")":
                    args.append(self.expr())
                    if self.peek()[1] == ",":
                        self.take(",")
                self.take(")")
                e = Fn(v, tuple(args))          # resolved (reductions, index, stack) later
            else:
                e = Ref(v)
        elif v == "(":
            e = self.expr()
            self.take(")")
        else:
            raise ModelError(f"unexpected {v!r}")
        while self.peek()[1] == "[":
            self.take("[")
            items = []
            while True:
                if self.peek()[1] == ":":
                    self.take()
                    items.append(("full",))
                else:
                    items.append(("expr", self.expr()))
                if self.peek()[1] == ",":
                    self.take(",")
                    continue
                break
            self.take("]")
            e = Sub(e, tuple(items))
        return e


def _resolve(e: Expr, env: set) -> Expr:
    """Parsed calls and subscripts -> Red / Idx / Stk / subscript items, given the names in scope."""
    if isinstance(e, Fn):
        args = e.args
        if e.name in REDUCE_FUNCS and len(args) == 2 and isinstance(args[1], Ref) and args[1].name not in env:
            return Red(e.name, _resolve(args[0], env), args[1].name)
        if e.name == "index" and len(args) == 1 and isinstance(args[0], Ref):
            return Idx(args[0].name)
        if e.name == "flip" and len(args) == 2 and isinstance(args[1], Ref) and args[1].name not in env:
            return Flip(_resolve(args[0], env), args[1].name)
        if e.name == "topk" and len(args) == 2 and isinstance(args[1], Ref) and args[1].name not in env:
            return TopK(_resolve(args[0], env), args[1].name)
        if e.name == "topk" and len(args) == 2 and isinstance(args[1], Num):
            return TopK(_resolve(args[0], env), str(int(args[1].value)))
        if e.name == "stack" and len(args) >= 3 and isinstance(args[-1], Num):
            return Stk(tuple(_resolve(a, env) for a in args[:-1]), int(args[-1].value))
        return Fn(e.name, tuple(_resolve(a, env) for a in args))
    if isinstance(e, Sub):
        items = []
        for it in e.items:
            if it[0] == "full":
                items.append(it)
                continue
            x = it[1]
            if isinstance(x, Num):
                items.append(("take", int(x.value)))
            elif isinstance(x, Ref):
                items.append(("name", x.name))
            elif isinstance(x, Bin) and x.op in "+-" and isinstance(x.a, Ref) and isinstance(x.b, Num):
                k = int(x.b.value)
                items.append(("shift", x.a.name, k if x.op == "+" else -k))
            elif isinstance(x, Bin) and x.op in "+-" and isinstance(x.a, Ref) and isinstance(x.b, Ref) \
                    and x.b.name not in env:
                items.append(("window", x.a.name, x.b.name, 1 if x.op == "+" else -1))
            else:
                raise ModelError(f"unsupported subscript item {expr_text(x)}")
        return Sub(_resolve(e.x, env), tuple(items))
    kids = children(e)
    return with_children(e, tuple(_resolve(c, env) for c in kids)) if kids else e


def parse(text: str) -> list[KernelDef]:
    ks = _Parser(text).kernels()
    for k in ks:
        env = {p.name for p in k.inputs}
        body = []
        for t, e in k.body:
            body.append((t, _resolve(e, env)))
            env.update(targets(t))
        k.body = body
    return ks


# ---------------------------------------------------------------- reference evaluation
@dataclass
class Val:
    arr: np.ndarray     # float64 for float dtypes, int64 for integer ones
    axes: tuple
    dtype: str


# per-op relative rounding modelled by the noise (see run.py for the precision model)
EPS = {"f32": 2.0**-23, "f16": 2.0**-11, ABSTRACT: 2.0**-23}
TRANSCENDENTAL = {"exp", "log", "sqrt", "rsqrt", "sigmoid", "silu", "tanh", "recip", "cos", "sin", "**"}
# functions whose error is absolute near a zero of the result, not relative: WGSL's tanh inherits
# sinh/cosh's accuracy (lavapipe: |error| ~ 1.2 * 2^-23 at any x, so tanh(1e-5) is off by 1%), log
# has an absolute error bound around 1 (lavapipe: ~ 2^-23); 2 ulps of 1, absolute, are modelled
ABSOLUTE_ERROR = {"tanh": 2.0, "log": 2.0}


NEAR = 64 * 2.0 ** -23     # comparison operands closer than this (relative) are a decision f32 may flip


@dataclass
class Noise:
    """Relative perturbations of every rounding op, keyed by the node's structure (so a subtree
    written twice gets the same perturbation, as the compiler computes it once)."""
    rng: np.random.Generator
    scale: float
    cache: dict = field(default_factory=dict)

    def rel(self, node, shape, dtype, op=None) -> np.ndarray | float:
        key = (node, "rel")
        u = self.cache.get(key)
        if u is None:
            u = self.cache[key] = self.rng.uniform(-1.0, 1.0, size=shape)
        eps = EPS.get(dtype, EPS["f32"]) * (4.0 if op in TRANSCENDENTAL and dtype != "f16" else 1.0)
        return 1.0 + self.scale * eps * u

    def absolute(self, node, shape, dtype) -> np.ndarray:
        key = (node, "abs")
        u = self.cache.get(key)
        if u is None:
            u = self.cache[key] = self.rng.uniform(-1.0, 1.0, size=shape)
        return self.scale * EPS.get(dtype, EPS["f32"]) * u


def _sigmoid(x):
    return 0.5 * (1.0 + np.tanh(0.5 * x))


_UNARY = {
    "exp": np.exp, "log": np.log, "sqrt": np.sqrt, "rsqrt": lambda x: 1.0 / np.sqrt(x), "abs": np.abs,
    "sigmoid": _sigmoid, "silu": lambda x: x * _sigmoid(x), "tanh": np.tanh, "recip": lambda x: 1.0 / x,
    "cos": np.cos, "sin": np.sin,
}


class Evaluator:
    """Evaluates a checked kernel in float64 at given sizes (T = the real length) and inputs.

    ``decisions`` collects, per discontinuous or kinked node, what it decided: 'disc' entries
    (comparisons, where on a float condition, float->int casts) change the value when they flip;
    'kink' entries (abs, max/min, reduction max) change only the derivative. ``ties`` counts reduction
    maxima with a tie for the largest entry (where the derivative is a convention).
    """

    def __init__(self, k: KernelDef, checker: Checker, sizes: dict[str, int], noise: Noise | None = None):
        self.k = k
        self.types = checker.types
        self.sizes = dict(sizes)
        for a in k.axes():
            if is_fixed(a):
                self.sizes[a] = int(a)
        self.noise = noise
        self.decisions: dict = {}
        self.ties = 0
        self.near = 0            # float comparisons whose operands sit within rounding of each other
        self.memo: dict = {}

    # -- helpers
    def expand(self, v: Val, axes: tuple) -> np.ndarray:
        assert is_subseq(v.axes, axes), (v.axes, axes)
        shape = [self.sizes[a] if a in v.axes else 1 for a in axes]
        return np.asarray(v.arr).reshape(shape)

    def full(self, v: Val, axes: tuple) -> np.ndarray:
        return np.broadcast_to(self.expand(v, axes), tuple(self.sizes[a] for a in axes))

    def record(self, kind: str, node, arr):
        self.decisions[(kind, node)] = np.asarray(arr).copy()

    def rounded(self, node, arr, dtype, op=None):
        if self.noise is None or dtype in INTS:
            return arr
        return arr * self.noise.rel(node, np.shape(arr), dtype, op)

    # -- evaluation
    def run(self, inputs: dict) -> dict[str, np.ndarray]:
        env: dict[str, Val] = {}
        for p in self.k.inputs:
            if p.name in inputs:
                x = inputs[p.name]
            elif p.default is not None:      # left out: the default over all its axes
                x = np.full(tuple(self.sizes[a] for a in p.shape), p.default)
            else:
                raise KeyError(f"input {p.name} not given and without a default")
            arr = np.asarray(x, dtype=np.int64 if p.dtype in INTS else np.float64)
            arr = arr.reshape(tuple(self.sizes[a] for a in p.shape))    # left-out optional axes: size 1
            env[p.name] = Val(arr, p.shape, p.dtype)
        decl = {o.name: o for o in self.k.outputs}
        outs = {}
        for names, e in self.k.body:
            if isinstance(e, TopK):
                pairs = zip(targets(names), self.topk(e, env))
            else:
                pairs = [(names, self.ev(e, env))]
            for target, v in pairs:
                self.assign(target, v, env, decl, outs)
        return outs

    def topk(self, e: TopK, env) -> tuple[Val, Val]:
        """The K largest of each row, in descending order, equal values by lower index (a stable
        sort of the negated row). Which entries are picked is a decision: it changes the indices and
        where the gradient goes; a tie inside the picked ones (or at the boundary) is counted."""
        x = self.ev(e.x, env)
        k = self.sizes[e.k]
        if k > x.arr.shape[1]:
            raise ModelError("topk() K larger than E")
        idx = np.argsort(-x.arr, axis=1, kind="stable")[:, :k]
        vals = np.take_along_axis(x.arr, idx, axis=1)
        self.record("disc", e, idx)
        ordered = -np.sort(-x.arr, axis=1)[:, :min(k + 1, x.arr.shape[1])]
        self.ties += int(np.count_nonzero(np.diff(ordered, axis=1) == 0))
        shape = (x.axes[0], e.k)
        return Val(vals, shape, x.dtype), Val(idx.astype(np.int64), shape, "i32")

    def grouped(self, e: Fn, t: Ty, args: list) -> Val:
        """y[s] = x[s] w[e]^T (times scale[s]) over expert e's rows ends[e-1] <= s < ends[e]; NaN on
        rows past ends[E-1] (left as they were: unspecified). Rounding: a sum's, then the scale's,
        then an f16 result's store."""
        x, w, ends = args[:3]
        xs, ws = self.types[e.args[0]].shape, self.types[e.args[1]].shape
        X, W = self.full(x, xs), self.full(w, ws)
        bounds = np.asarray(ends.arr, dtype=np.int64).reshape(-1)
        S = X.shape[0]
        y = np.full((S, W.shape[1]), np.nan)
        mag = np.zeros_like(y)
        lo = 0
        for i, end in enumerate(bounds):
            a, b = min(max(int(lo), 0), S), min(max(int(end), 0), S)
            if b > a:
                y[a:b] = X[a:b] @ W[i].T
                mag[a:b] = np.abs(X[a:b]) @ np.abs(W[i]).T
            lo = end
        if self.noise is not None:
            y = y + 2.0 * mag * self.noise.absolute(e, y.shape, "f32")
        if len(args) == 4:
            y = self.rounded(("scale", e), y * self.full(args[3], xs[:1])[:, None], "f32")
        if t.dtype == "f16":
            y = self.rounded(("store", e), y, "f16")
        return Val(y, t.shape, t.dtype)

    def assign(self, target: str, v: Val, env, decl, outs) -> None:
        env[target] = v
        if target in decl:
            o = decl[target]
            arr = np.array(self.full(v, o.shape), dtype=np.int64 if o.dtype in INTS else np.float64)
            if o.dtype == "f16" and self.noise is not None:
                arr = arr * self.noise.rel(("store", target), arr.shape, "f16")
            if o.dtype == "u32":
                arr = np.mod(arr, 2**32)
            outs[target] = arr

    def ev(self, e: Expr, env) -> Val:
        key = e
        if isinstance(e, Ref):
            return env[e.name]
        hit = self.memo.get(key)
        if hit is not None:
            return hit
        v = self._ev(e, env)
        self.memo[key] = v
        return v

    def _binop(self, e, op, a: Val, b: Val, dtype: str, shape: tuple) -> np.ndarray:
        x, y = self.expand(a, shape), self.expand(b, shape)
        is_int = dtype in INTS
        if is_int:
            x, y = x.astype(np.int64), y.astype(np.int64)
        if op == "+":
            r = x + y
        elif op == "-":
            r = x - y
        elif op == "*":
            r = x * y
        elif op == "/":
            if is_int:
                if np.any(y == 0):
                    raise FloatingPointError("integer division by zero")
                r = np.trunc(x / y).astype(np.int64)
            else:
                r = x / y
        elif op in INT_BINOPS:    # WGSL's: % truncates, shifts take the amount modulo 32, 32 bits wrap
            if op == "%":
                if np.any(y == 0):
                    raise FloatingPointError("integer remainder by zero")
                r = np.fmod(x, y)
            elif op == "&":
                r = x & y
            elif op == "|":
                r = x | y
            else:
                r = (x << (y & 31)) if op == "<<" else (x >> (y & 31))
            r = r & 0xFFFFFFFF
            return r if dtype == "u32" else np.where(r >= 2**31, r - 2**32, r)
        elif op == "**":      # WGSL's pow is exp2(y * log2(x)): undefined (here NaN) for x < 0, and x = 0, y <= 0
            xb, yb = np.broadcast_arrays(x, y)
            r = np.where((xb > 0) | ((xb == 0) & (yb > 0)), np.power(np.abs(xb), yb), np.nan)
        elif op in ("<", ">", "eq"):
            r = (x < y) if op == "<" else (x > y) if op == ">" else (x == y)
            if not is_int:
                self.record("disc", e, np.broadcast_to(r, tuple(self.sizes[a] for a in shape)))
                # a random perturbation may miss a decision this close; an f32 computation may not
                gap = np.abs(x - y) <= NEAR * np.maximum(np.abs(x), np.abs(y))
                self.near += int(np.count_nonzero(gap & (x != y)))
            return r.astype(np.int64 if is_int else np.float64)
        elif op in ("max", "min"):
            if not is_int:
                self.record("kink", e, np.sign(np.broadcast_to(x - y, tuple(self.sizes[a] for a in shape))))
            return np.maximum(x, y) if op == "max" else np.minimum(x, y)
        else:
            raise ValueError(op)
        if is_int:
            return r
        return self.rounded(e, r, dtype, op)

    def _ev(self, e: Expr, env) -> Val:
        t = self.types[e]
        if isinstance(e, Num):
            r = np.float64(e.value)
            if self.noise is not None and float(np.float32(e.value)) != e.value:
                r = r * self.noise.rel(e, (), ABSTRACT)
            return Val(np.asarray(r), (), t.dtype)
        if isinstance(e, Neg):
            x = self.ev(e.x, env)
            return Val(-x.arr, x.axes, t.dtype)
        if isinstance(e, Bin):
            a, b = self.ev(e.a, env), self.ev(e.b, env)
            return Val(self._binop(e, e.op, a, b, t.dtype, t.shape), t.shape, t.dtype)
        if isinstance(e, Fn):
            f = e.name
            if f in UNARY_FUNCS:
                x = self.ev(e.args[0], env)
                if f == "abs":
                    if t.dtype not in INTS:
                        self.record("kink", e, np.sign(x.arr))
                    return Val(np.abs(x.arr), x.axes, t.dtype)
                r = self.rounded(e, _UNARY[f](x.arr.astype(np.float64)), t.dtype, f)
                if f in ABSOLUTE_ERROR and self.noise is not None:
                    r = r + ABSOLUTE_ERROR[f] * self.noise.absolute(e, np.shape(r), t.dtype)
                return Val(r, x.axes, t.dtype)
            if f in BINARY_FUNCS:
                a, b = self.ev(e.args[0], env), self.ev(e.args[1], env)
                return Val(self._binop(e, f, a, b, t.dtype, t.shape), t.shape, t.dtype)
            if f == "where":
                c, a, b = (self.ev(x, env) for x in e.args)
                cond = self.expand(c, t.shape) != 0
                if c.dtype not in INTS:
                    self.record("disc", e, np.broadcast_to(cond, tuple(self.sizes[x] for x in t.shape)))
                x, y = self.expand(a, t.shape), self.expand(b, t.shape)
                if t.dtype in INTS:       # a literal-only branch is computed in f32 and cast, as in _binop
                    x, y = x.astype(np.int64), y.astype(np.int64)
                return Val(np.where(cond, x, y), t.shape, t.dtype)
            if f in DTYPES:
                x = self.ev(e.args[0], env)
                if f in INTS:
                    if x.dtype in INTS:
                        r = x.arr.astype(np.int64)
                    else:
                        r = np.trunc(x.arr)
                        self.record("disc", e, r)
                        # a value within rounding of a (non-zero) whole number may truncate either way
                        # in f32; exact whole numbers (exact arithmetic) are deterministic
                        frac = np.abs(x.arr - np.round(x.arr))
                        close = (frac > 0) & (frac <= NEAR * np.maximum(np.abs(x.arr), 1.0)) & (np.abs(x.arr) >= 0.5)
                        self.near += int(np.count_nonzero(close))
                        lo, hi = INT_RANGE[f]
                        r = np.clip(r, lo, hi).astype(np.int64)
                    if f == "u32":
                        r = np.mod(r, 2**32)
                    elif x.dtype == "u32":
                        r = np.where(r >= 2**31, r - 2**32, r)
                    return Val(r, x.axes, f)
                r = x.arr.astype(np.float64)
                if f == "f16" and x.dtype != "f16" and self.noise is not None:
                    r = r * self.noise.rel(e, np.shape(r), "f16")
                return Val(r, x.axes, f)
            if f == "gather":
                table, ids = self.ev(e.args[0], env), self.ev(e.args[1], env)
                rows = ids.arr.astype(np.int64)
                if np.any(rows < 0) or np.any(rows >= table.arr.shape[0]):
                    raise ModelError("gather() id out of range")
                return Val(table.arr[rows], t.shape, t.dtype)
            if f in GROUPED:
                return self.grouped(e, t, [self.ev(a, env) for a in e.args])
            raise ValueError(f)
        if isinstance(e, Red):
            x = self.ev(e.x, env)
            ax = x.axes.index(e.axis)
            arr = x.arr
            if e.fn == "max":
                r = arr.max(axis=ax)
                self.record("kink", e, arr.argmax(axis=ax))
                if arr.shape[ax] > 1:
                    top2 = np.sort(arr, axis=ax)
                    gap = np.take(top2, -1, axis=ax) - np.take(top2, -2, axis=ax)
                    if np.any(gap <= 1e-12 * np.maximum(1.0, np.abs(r))):
                        self.ties += 1
                return Val(r, t.shape, t.dtype)
            r = arr.sum(axis=ax)
            if self.noise is not None:
                mag = 2.0 * np.abs(arr).sum(axis=ax)
                r = r + mag * self.noise.absolute(e, np.shape(r), t.dtype)
            if e.fn == "mean":
                r = self.rounded(("mean", e), r / self.sizes[e.axis], t.dtype)
            return Val(r, t.shape, t.dtype)
        if isinstance(e, Flip):
            x = self.ev(e.x, env)
            return Val(np.flip(x.arr, axis=x.axes.index(e.axis)).copy(), x.axes, t.dtype)
        if isinstance(e, Idx):
            return Val(np.arange(self.sizes[e.axis], dtype=np.int64), (e.axis,), "i32")
        if isinstance(e, Stk):
            vals = [self.ev(v, env) for v in e.values]
            base = tuple(a for a in t.shape if a != str(e.n))
            parts = [np.array(self.full(v, base), dtype=np.int64 if t.dtype in INTS else np.float64)
                     for v in vals]
            return Val(np.stack(parts, axis=max(len(base) - 1, 0)), t.shape, t.dtype)
        if isinstance(e, Sub):
            x = self.ev(e.x, env)
            arr = x.arr
            for ax, (axis, it) in enumerate(zip(x.axes, e.items)):
                if it[0] == "shift":
                    arr = _shift(arr, ax, it[2])
                elif it[0] == "window":        # a new last axis: entry l reads a + sign * l
                    n = self.sizes[it[2]]
                    arr = np.stack([_shift(arr, ax, it[3] * l) for l in range(n)], axis=-1)
            for ax in reversed(range(len(x.axes))):
                it = e.items[ax]
                if it[0] == "take":
                    arr = np.take(arr, it[1], axis=ax)
            return Val(arr, t.shape, t.dtype)
        raise TypeError(e)


def _shift(arr: np.ndarray, ax: int, k: int) -> np.ndarray:
    """out[i] = arr[i + k], zero where i + k is outside 0..n-1."""
    n = arr.shape[ax]
    out = np.zeros_like(arr)
    src = slice(max(k, 0), n + min(k, 0))
    dst = slice(max(-k, 0), n - max(k, 0))
    if src.start < src.stop and dst.start < dst.stop:
        idx_src = [slice(None)] * arr.ndim
        idx_dst = [slice(None)] * arr.ndim
        idx_src[ax], idx_dst[ax] = src, dst
        out[tuple(idx_dst)] = arr[tuple(idx_src)]
    return out
