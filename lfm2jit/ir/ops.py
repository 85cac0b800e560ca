"""The IR's one op enum and its groups, so passes ask "is this a reduce?" once."""
from __future__ import annotations

from enum import Enum, auto


class Op(Enum):
    INPUT = auto()      # a tensor argument; arg = name
    SCALAR = auto()     # a runtime scalar argument (uniform buffer); arg = name
    CONST = auto()      # a literal; arg = float
    DIMSIZE = auto()    # the concrete size of an axis, known at specialization; arg = axis name
    # unary
    NEG = auto(); EXP = auto(); LOG = auto(); SQRT = auto(); RSQRT = auto(); ABS = auto()  # noqa: E702
    SIGMOID = auto(); SILU = auto(); TANH = auto(); RECIP = auto(); COS = auto(); SIN = auto()  # noqa: E702
    CAST = auto()       # arg = target dtype
    # binary
    ADD = auto(); SUB = auto(); MUL = auto(); DIV = auto(); POW = auto()  # noqa: E702
    MAX = auto(); MIN = auto(); LT = auto(); GT = auto(); EQ = auto()  # noqa: E702
    # integer only: remainder (truncated, as WGSL's %), bitwise and / or, shifts (the amount taken
    # modulo 32; >> of an i32 is arithmetic)
    MOD = auto(); BITAND = auto(); BITOR = auto(); SHL = auto(); SHR = auto()  # noqa: E702
    # ternary
    WHERE = auto()
    # reductions over one axis; arg = axis name
    SUM = auto(); RMAX = auto()  # noqa: E702
    # indexing: SHIFT reads at index + offset along an axis, zero outside (arg = (axis, offset));
    # TAKE fixes an axis to one entry, dropping it (arg = (axis, index)); EMBED is its inverse, zero
    # at the other entries (arg = (axis, index)); INDEX is the index along an axis (arg = axis);
    # GATHER reads rows of a table (srcs: table, ids) by integer ids
    SHIFT = auto(); TAKE = auto(); EMBED = auto(); INDEX = auto(); GATHER = auto()  # noqa: E702
    # WINDOW reads at index + sign * (the index along another axis), zero outside: x[T - L] is
    # x[t - l] for every l (arg = (axis, by, sign)); the by axis is new (appended last), or one the
    # source has, read at the same index (a diagonal, which the window's gradient needs).
    # FLIP reverses an axis (arg = axis): flip(w, L)[l] = w[|L| - 1 - l].
    WINDOW = auto(); FLIP = auto()  # noqa: E702
    # BROADCAST repeats its source over the axes of its shape it lacks (named broadcasting does
    # this implicitly; autodiff makes it explicit where an op must see the axis, e.g. a SHIFT)
    BROADCAST = auto()
    # MATERIALIZE is its source, stored to memory before use: every reader then sees the same bits
    # (a maximum's gradient compares entries with the maximum; recomputing them in two kernels may
    # round differently)
    MATERIALIZE = auto()
    # a hand-tuned template (attention, ...): arg = intrinsic name; PROJ picks output arg of it
    INTRINSIC = auto(); PROJ = auto()  # noqa: E702


LEAF = frozenset({Op.INPUT, Op.SCALAR, Op.CONST, Op.DIMSIZE, Op.INDEX})
UNARY = frozenset({Op.NEG, Op.EXP, Op.LOG, Op.SQRT, Op.RSQRT, Op.ABS, Op.SIGMOID, Op.SILU, Op.TANH,
                   Op.RECIP, Op.COS, Op.SIN, Op.CAST})
BINARY = frozenset({Op.ADD, Op.SUB, Op.MUL, Op.DIV, Op.POW, Op.MAX, Op.MIN, Op.LT, Op.GT, Op.EQ,
                    Op.MOD, Op.BITAND, Op.BITOR, Op.SHL, Op.SHR})
INT_ONLY = frozenset({Op.MOD, Op.BITAND, Op.BITOR, Op.SHL, Op.SHR})
COMPARE = frozenset({Op.LT, Op.GT, Op.EQ})
REDUCE = frozenset({Op.SUM, Op.RMAX})
FLOAT_ONLY = frozenset({Op.EXP, Op.LOG, Op.SQRT, Op.RSQRT, Op.SIGMOID, Op.SILU, Op.TANH, Op.RECIP, Op.POW,
                        Op.COS, Op.SIN})

# DSL function names -> ops. Reductions are named here too; a call is a reduction when its second
# argument names an axis of the first.
UNARY_FUNCS = {"exp": Op.EXP, "log": Op.LOG, "sqrt": Op.SQRT, "rsqrt": Op.RSQRT, "abs": Op.ABS,
               "sigmoid": Op.SIGMOID, "silu": Op.SILU, "tanh": Op.TANH, "recip": Op.RECIP,
               "cos": Op.COS, "sin": Op.SIN}
BINARY_FUNCS = {"max": Op.MAX, "min": Op.MIN, "eq": Op.EQ}
REDUCE_FUNCS = {"sum": Op.SUM, "max": Op.RMAX, "mean": Op.SUM}
BINOP_NAMES = {"add": Op.ADD, "sub": Op.SUB, "mul": Op.MUL, "div": Op.DIV, "pow": Op.POW,
               "lt": Op.LT, "gt": Op.GT, "mod": Op.MOD, "bitand": Op.BITAND, "bitor": Op.BITOR,
               "shl": Op.SHL, "shr": Op.SHR}
BINOP_SYMBOLS = {"mod": "%", "bitand": "&", "bitor": "|", "shl": "<<", "shr": ">>"}

# Ops that read their source at another index than their own (or a table by ids).
MOVING = frozenset({Op.SHIFT, Op.TAKE, Op.GATHER, Op.WINDOW, Op.FLIP})

DTYPES = ("f32", "f16", "i32", "u32")
FLOAT_DTYPES = ("f32", "f16")
