"""Which lets of a vec4 fetch's lane 0 every lane shares (schedule/matmul.py ``computed_operand``).

Lane j of a fetched vec4 computes its element at index ``| j`` along one axis, whose lane-0 index
is a multiple of 4. A value such as an NF4 weight's word index ``i >> 3`` or its block's absmax
is then the same in all four lanes, and is computed once, by lane 0. For each integer value the
analysis tracks a power of two its lane-0 value is a multiple of (``align``) and what each lane
adds to it (``step``: value_j = value_0 + j * step); a value with step 0 is shared.
"""
from __future__ import annotations

from dataclasses import dataclass

from ..ir.ops import Op
from .code import Apply, Bin, Const, Index, IndexValue, Let, Lit, Load, Ref, ScalarArg, SeqLen, Var

LANES = 4
_INTEGER = ("u32", "i32")
_UNKNOWN_ALIGN = 1
_ZERO_ALIGN = 1 << 31          # 0 is a multiple of every power of two an index can hold


@dataclass(frozen=True)
class Lane:
    align: int                 # lane 0's value is a multiple of this power of two
    step: int                  # lane j's value is lane 0's + j * step (0: the same in every lane)
    const: int | None = None   # the value, where it is an integer literal


SHARED = Lane(_UNKNOWN_ALIGN, 0)


def _pow2(c: int) -> int:
    """The largest power of two dividing c (``_ZERO_ALIGN`` for 0)."""
    return c & -c if c else _ZERO_ALIGN


def shared_lets(lets: list[Let], along: str) -> set[str]:
    """Names of lane 0's lets whose value every lane shares; ``along`` is the index variable lane j
    reads at ``| j`` (a multiple of 4 in lane 0)."""
    known: dict[str, Lane | None] = {}

    def index(x: Index) -> Lane | None:
        if isinstance(x, Var):
            if x.name == along:
                return Lane(LANES, 1)
            return known[x.name] if x.name in known else SHARED
        if isinstance(x, Const):
            return Lane(_pow2(x.value), 0, x.value)
        if isinstance(x, SeqLen):
            return SHARED
        if isinstance(x, Bin):
            a, b = index(x.a), index(x.b)
            return _combine({"+": Op.ADD, "-": Op.SUB, "*": Op.MUL}.get(x.op), a, b)
        return None

    def value(v) -> Lane | None:
        if isinstance(v, Ref):
            return known.get(v.name)
        if isinstance(v, Lit):
            whole = float(v.value).is_integer() and v.value >= 0 and v.ctype in _INTEGER
            return Lane(_pow2(int(v.value)), 0, int(v.value)) if whole else SHARED
        if isinstance(v, ScalarArg):
            return SHARED
        if isinstance(v, IndexValue):
            return index(v.index)
        if isinstance(v, Load):
            at = index(v.offset)
            return SHARED if at is not None and at.step == 0 else None
        if isinstance(v, Apply):
            args = [value(a) for a in v.args]
            if v.op == Op.CAST and v.ctype in _INTEGER and v.arg_types[0] in _INTEGER:
                return args[0]
            if v.ctype in _INTEGER and len(args) == 2:
                return _combine(v.op, *args)
            return SHARED if all(a is not None and a.step == 0 for a in args) else None
        return None             # a guarded or looped value: left to each lane

    for let in lets:
        known[let.name] = value(let.value)
    return {name for name, lane in known.items() if lane is not None and lane.step == 0}


def _combine(op: Op | None, a: Lane | None, b: Lane | None) -> Lane | None:
    """An integer op's lanes from its operands'; None where lanes may differ in another way."""
    if a is None or b is None:
        return None
    if op == Op.ADD:
        return Lane(min(a.align, b.align), a.step + b.step)
    if op == Op.SUB and a.step >= b.step:
        return Lane(min(a.align, b.align), a.step - b.step)
    if op == Op.MUL:
        if a.const is None:
            a, b = b, a
        if a.const is not None:
            return Lane(min(_ZERO_ALIGN, a.align * b.align), a.const * b.step)
        return Lane(min(_ZERO_ALIGN, a.align * b.align), 0) if a.step == b.step == 0 else None
    if op == Op.SHL and b.const is not None and b.const < 32:
        return Lane(min(_ZERO_ALIGN, a.align << b.const), a.step << b.const)
    if op == Op.SHR and b.const is not None and b.const < 32:
        # value_0 % 2^s is a multiple of min(align, 2^s), so adding j * step below that leaves >> s alone
        if b.step == 0 and LANES * a.step - a.step < min(a.align, 1 << b.const):
            return Lane(max(_UNKNOWN_ALIGN, a.align >> b.const), 0)
        return None
    return SHARED if a.step == b.step == 0 else None
