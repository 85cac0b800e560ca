"""The WGSL backend table: how each IR op, index expression and value of schedule/code.py is spelled,
and the templates' offsets (codegen/offsets.py); an int is a u32 constant, a str a WGSL name.

This module and the templates are the only places that know WGSL. Values are always named by a
`let` or are literals, so operator precedence never arises between them; index expressions are
parenthesised where they nest.
"""
from __future__ import annotations

import contextlib
from contextvars import ContextVar
from functools import singledispatch

from ..ir.ops import Op
from ..schedule.code import (COMPUTE_TYPE, Apply, Bin, Compare, Const, Fold, Guard, IndexLet, IndexValue, Let, Lit,
                             Load, Ref, ScalarArg, SeqLen, Store, Var)
from ..schedule.layout import ident
from ..schedule.spec import Binding
from .offsets import Product, Sum, index

SPELLING: dict[Op, str] = {
    Op.NEG: "-{0}", Op.EXP: "exp({0})", Op.LOG: "log({0})", Op.SQRT: "sqrt({0})",
    Op.RSQRT: "inverseSqrt({0})", Op.ABS: "abs({0})", Op.SIGMOID: "1.0 / (1.0 + exp(-{0}))",
    Op.SILU: "{0} / (1.0 + exp(-{0}))", Op.TANH: "tanh({0})", Op.RECIP: "1.0 / {0}",
    Op.CAST: "{t}({0})",
    Op.ADD: "{0} + {1}", Op.SUB: "{0} - {1}", Op.MUL: "{0} * {1}", Op.DIV: "{0} / {1}",
    Op.POW: "pow({0}, {1})", Op.MAX: "max({0}, {1})", Op.MIN: "min({0}, {1})",
    Op.LT: "{t}({0} < {1})", Op.GT: "{t}({0} > {1})", Op.EQ: "{t}({0} == {1})",
    Op.COS: "cos({0})", Op.SIN: "sin({0})",
    Op.MOD: "{0} % {1}", Op.BITAND: "{0} & {1}", Op.BITOR: "{0} | {1}",
    Op.SHL: "{0} << (u32({1}) & 31u)", Op.SHR: "{0} >> (u32({1}) & 31u)",
    Op.WHERE: "select({2}, {1}, {0} != {c0}(0))",
}

# identity element and combine spelling for each reduction
REDUCE_INIT = {Op.SUM: "0.0", Op.RMAX: "-3.4028234e38"}
REDUCE_COMBINE = {Op.SUM: "{0} + {1}", Op.RMAX: "max({0}, {1})"}


def buffer(name: str) -> str:
    """The WGSL name of a tensor binding or of a runtime scalar's Info field: suffixed, so a user's
    name can never collide with a WGSL keyword or builtin, or with a template's own variables (none
    of which ends in '_')."""
    return f"{name}_"


# The tensors of the kernel being rendered that are bound in pieces (schedule/pieces.py): their
# elements are reached through accessor functions, which _common.wgsl.j2 declares.
_PIECED: ContextVar[frozenset[str]] = ContextVar("pieced", default=frozenset())


@contextlib.contextmanager
def pieced(names) -> None:
    """Spell loads and stores of these tensors through their piece accessors while inside."""
    token = _PIECED.set(frozenset(names))
    try:
        yield
    finally:
        _PIECED.reset(token)


def load(name: str, index_text: str) -> str:
    """Element ``index_text`` of tensor ``name``."""
    return f"{name}_load({index_text})" if name in _PIECED.get() else f"{buffer(name)}[{index_text}]"


def store(name: str, index_text: str, value_text: str, accumulate: bool = False) -> str:
    """A statement writing (or, ``accumulate``, adding) ``value_text`` to element ``index_text`` of ``name``."""
    if accumulate:
        value_text = f"{load(name, index_text)} + {value_text}"
    if name in _PIECED.get():
        return f"{name}_store({index_text}, {value_text});"
    return f"{buffer(name)}[{index_text}] = {value_text};"


def element(b: Binding) -> str:
    return f"vec{b.vector}<{b.dtype}>" if b.vector > 1 else b.dtype


def element_bytes(b: Binding) -> int:
    return b.vector * {"f16": 2}.get(b.dtype, 4)


def literal(value: float, ctype: str) -> str:
    """A literal of the consumer's compute type; negative ones parenthesised so `-{0}` stays valid."""
    if ctype in ("i32", "u32"):
        if value != int(value):
            raise ValueError(f"literal {value} is not an integer but is used as {ctype}")
        text = f"{ctype}({int(value)})"
    else:
        text = f"f32({float(value)!r})"
    return f"({text})" if value < 0 else text


@singledispatch
def spell(x) -> str:
    raise TypeError(f"no WGSL spelling for {x!r}")


@spell.register
def _(x: Var) -> str:
    return x.name


@spell.register
def _(x: Const) -> str:
    return f"{x.value}u"


@spell.register
def _(x: SeqLen) -> str:
    return "info.t_valid"


@spell.register
def _(x: Bin) -> str:
    if x.op in ("max", "min"):
        return f"{x.op}({spell(x.a)}, {spell(x.b)})"

    def part(y):
        return f"({spell(y)})" if isinstance(y, Bin) and y.op not in ("max", "min") else spell(y)
    return f"{part(x.a)} {x.op} {part(x.b)}"


@spell.register
def _(x: int) -> str:
    if isinstance(x, bool):
        raise TypeError(f"no WGSL spelling for {x!r}")
    return f"{x}u"


@spell.register
def _(x: str) -> str:
    return spell(index(x))


@spell.register
def _(x: Sum) -> str:
    def term(y):
        return f"({spell(y)})" if isinstance(y, Sum) else spell(y)
    return " + ".join(map(term, x.terms)) + "".join(f" - {term(y)}" for y in x.minus)


@spell.register
def _(x: Product) -> str:
    def factor(y):
        nested = isinstance(y, Sum) or (isinstance(y, Bin) and y.op not in ("max", "min"))
        return f"({spell(y)})" if nested else spell(y)
    return " * ".join(map(factor, x.factors))


@spell.register
def _(x: Compare) -> str:
    return f"{spell(x.a)} {x.op} {spell(x.b)}"


@spell.register
def _(x: Lit) -> str:
    return literal(x.value, x.ctype)


@spell.register
def _(x: Ref) -> str:
    return x.name


@spell.register
def _(x: Load) -> str:
    text = load(x.tensor, spell(x.offset))
    ctype = COMPUTE_TYPE[x.dtype]
    return text if ctype == x.dtype else f"{ctype}({text})"


@spell.register
def _(x: ScalarArg) -> str:
    return f"info.{buffer(x.name)}"


@spell.register
def _(x: IndexValue) -> str:
    return f"{x.ctype}({spell(x.index)})"


@spell.register
def _(x: Apply) -> str:
    return SPELLING[x.op].format(*(spell(a) for a in x.args), t=x.ctype, c0=x.arg_types[0] if x.arg_types else x.ctype)


@spell.register
def _(x: Guard) -> str:
    return f"select({x.ctype}(0), {spell(x.value)}, {spell(x.cond)})"


@spell.register
def _(x: Let) -> str:
    return f"let {x.name}: {x.ctype} = {spell(x.value)};"


@spell.register
def _(x: Fold) -> str:
    body = "".join("\n    " + spell(item).replace("\n", "\n    ") for item in x.lets)
    combine = REDUCE_COMBINE[x.op].format(x.name, spell(x.value))
    return (f"var {x.name}: f32 = {REDUCE_INIT[x.op]};\n"
            f"for (var {x.var} = 0u; {x.var} < {spell(x.extent)}; {x.var} += 1u) {{{body}\n"
            f"    {x.name} = {combine};\n}}")


@spell.register
def _(x: IndexLet) -> str:
    return f"let {x.var} = {spell(x.index)};"


@spell.register
def _(x: Store) -> str:
    value = spell(x.value)
    if x.value_type != x.dtype:
        value = f"{x.dtype}({value})"
    return store(x.tensor, spell(x.offset), value, x.accumulate)


def reduce_init(op: Op) -> str:
    return REDUCE_INIT[op]


def reduce_combine(op: Op, acc: str, value: str) -> str:
    return REDUCE_COMBINE[op].format(acc, value)


def const_name(axis: str) -> str:
    """The WGSL constant holding an axis' baked size."""
    return ident(axis)
