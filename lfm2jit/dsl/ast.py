"""Typed, frozen AST nodes for the kernel language; every node carries its source line and column."""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Loc:
    """1-based line and column of the token a node is reported at (a BinOp: its operator)."""
    line: int
    column: int


@dataclass(frozen=True)
class TypeSpec:
    """``f32[T, D]``; ``dims`` is empty for a scalar. A dim is an axis name or an integer size.

    ``loc`` is the dtype's location; ``dim_locs`` (one per dim, when parsed) locate the dims;
    ``optional`` names the axes written ``B?`` (a caller may leave them out: size 1).
    """
    dtype: str
    dims: tuple[str | int, ...]
    loc: Loc
    dim_locs: tuple[Loc, ...] = ()
    optional: tuple[str, ...] = ()

    def dim_loc(self, i: int) -> Loc:
        return self.dim_locs[i] if i < len(self.dim_locs) else self.loc


@dataclass(frozen=True)
class Param:
    name: str
    type: TypeSpec
    loc: Loc
    default: float | None = None     # ``b: f32[D] = 0``: the value of an input the caller leaves out


@dataclass(frozen=True)
class Number:
    value: float
    text: str
    loc: Loc


@dataclass(frozen=True)
class Var:
    name: str
    loc: Loc


@dataclass(frozen=True)
class BinOp:
    op: str          # add sub mul div pow lt gt
    lhs: "Expr"
    rhs: "Expr"
    loc: Loc


@dataclass(frozen=True)
class Neg:
    operand: "Expr"
    loc: Loc


@dataclass(frozen=True)
class Call:
    func: str
    args: tuple["Expr", ...]
    loc: Loc


@dataclass(frozen=True)
class Full:
    """``:`` in a subscript: keep this axis whole."""
    loc: Loc


@dataclass(frozen=True)
class Subscript:
    """``x[:, 0]`` or ``x[T - 2]``: one item per axis of the value, positionally."""
    value: "Expr"
    items: tuple["Expr | Full", ...]
    loc: Loc


Expr = Number | Var | BinOp | Neg | Call | Subscript


@dataclass(frozen=True)
class Assign:
    targets: tuple[str, ...]     # several only for an intrinsic that returns several values
    value: Expr
    loc: Loc

    @property
    def target(self) -> str:
        return self.targets[0]


@dataclass(frozen=True)
class KernelDef:
    name: str
    inputs: tuple[Param, ...]
    outputs: tuple[Param, ...]
    body: tuple[Assign, ...]
    loc: Loc


@dataclass(frozen=True)
class SourceFile:
    filename: str
    text: str
    kernels: tuple[KernelDef, ...]


def unparse_expr(e: Expr) -> str:
    """Source text for an expression, fully parenthesised: parse(unparse(x)) == x up to locations."""
    if isinstance(e, Number):
        return e.text
    if isinstance(e, Var):
        return e.name
    if isinstance(e, Neg):
        return f"(-{unparse_expr(e.operand)})"
    if isinstance(e, BinOp):
        sym = {"add": "+", "sub": "-", "mul": "*", "div": "/", "pow": "**", "lt": "<", "gt": ">", "mod": "%",
               "bitand": "&", "bitor": "|", "shl": "<<", "shr": ">>"}[e.op]
        return f"({unparse_expr(e.lhs)} {sym} {unparse_expr(e.rhs)})"
    if isinstance(e, Subscript):
        items = ", ".join(":" if isinstance(i, Full) else unparse_expr(i) for i in e.items)
        return f"{unparse_expr(e.value)}[{items}]"
    return f"{e.func}({', '.join(unparse_expr(a) for a in e.args)})"


def unparse(src: SourceFile) -> str:
    """Source text for a whole file, used by the round-trip tests and by ``dump --ast``."""
    def typ(t: TypeSpec) -> str:
        dims = ", ".join(f"{d}?" if d in t.optional else str(d) for d in t.dims)
        return t.dtype + (f"[{dims}]" if t.dims else "")

    def default(p: Param) -> str:
        return "" if p.default is None else f" = {p.default!r}"

    out = []
    for k in src.kernels:
        ins = ", ".join(f"{p.name}: {typ(p.type)}{default(p)}" for p in k.inputs)
        outs = ", ".join(f"{p.name}: {typ(p.type)}" for p in k.outputs)
        out.append(f"kernel {k.name}({ins}) -> ({outs}) {{")
        out.extend(f"    {', '.join(s.targets)} = {unparse_expr(s.value)}" for s in k.body)
        out.append("}")
    return "\n".join(out) + "\n"
