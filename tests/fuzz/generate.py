"""Random well-typed kernels, each with its own float64 meaning (expr.Evaluator over the same tree).

A kernel draws a global axis order (batch axes B C first when it has any, then T when present,
then symbolic axes D N K M H and fixed-size axes "2".."4" shuffled, then window axes L W last);
every tensor's shape is a subsequence of it, so shared axes keep one order.

Features, each drawn per kernel (RATES): window axes (25% of the kernels have some; about 15% end up
using a window: values x[T - L], x[D + L], convolutions sum(flip(w, L) * x[T - L, :], L), means and
maxima over windows), flip() (about 12%), gather(table, ids) of an input table [V, ...] at ids clamped into [0, |V|)
(15% of the kernels may use it), a statement ``v, i = topk(x, K)`` whose values and indices later
statements (and outputs) read (12%), a grouped GEMM ``g0 = grouped_matmul(x, w, ends)`` or
``grouped_matmul_scaled(x, w, ends, scale)`` (20% of the kernels may have one, about 12% do; from a stream of its own: see
Generator.grouped_statement) whose result later statements read (else it is an output): x [S, K] an
input or computed, w [E, N, K] an input, a prologue the GEMM computes in its operand fetch (a
decode gather(table, codes) * scale, ...) or another expression partition stores first, E new
(1..4 experts; a quarter of the calls over 33..79 rows, a fifth over a K of 17..40), ends a new i32[E] input that run.py draws as a running sum of row counts (empty
experts included) ending at |S|; half of the calls are masked to their owned rows,
where(sum(f32(index(S) < ends), E) > 0.5, call, 0.0), and only for those may the last end fall below
|S| (the product, and its gradient in x and scale, are unspecified past it: such a call's backward
is skipped), inputs with defaults (12%: tensors and scalars, each
defaulted input left out at run time with probability 1/2), optional leading batch axes (12%:
x: f32[B?, T, D]; B, or B and C, left out at run time, passed as size 1, or of size 2..3, when T fills
whole buckets), and padding poison (half of the kernels: T-leading tensors live in buffers of
bucketed(T) rows whose padded rows hold NaN, see run.py). Expressions are generated top-down for a target shape S: the result's shape is a
subsequence of S (broadcasting fills the rest) and is checked with the fuzzer's own type rules
(expr.Checker) before it is accepted. Static value intervals (inputs in [-2, 2], sizes known) keep
every domain safe: log/sqrt/rsqrt/recip/division get a positive, bounded-away-from-zero argument,
exp/sin/cos/tanh a bounded one, and values are scaled back when their bound exceeds 1e3.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np

from .expr import (ABSTRACT, FLOATS, GROUPED, INTS, SEQ, UNARY_FUNCS, Bin, Checker, Expr, Flip, Fn, Idx, KernelDef,
                   ModelError, Neg, Num, Param, Red, Ref, Stk, Sub, TopK, Ty, is_fixed, is_subseq, kernel_text, walk)

SYMBOLIC = ("D", "N", "K", "M", "H")
BATCH = ("B", "C")          # optional leading axes
WINDOW = ("L", "W")         # window axes (new names, last in the global order)
FLOAT_DEFAULTS = (0.0, 0.5, -2.0, 1.0, 0.25, 1.5, -0.75, 2.0, -1.0)
INT_DEFAULTS = {"i32": (0, 1, 2, -1, 3, -3), "u32": (0, 1, 2, 5)}
RATES = {"window": 0.25, "flip": 0.06, "defaults": 0.12, "batch": 0.12, "poison": 0.5}
# routing features, drawn from a stream of their own so the kernels of seeds without them stay as they were
ROUTING_RATES = {"gather": 0.15, "topk": 0.12, "grouped": 0.2}
ROWS = "V"                  # a gathered table's row axis
EXPERTS = "E"               # a grouped GEMM's experts (w [E, N, K], ends i32[E])
INPUT_RANGE = {"f32": (-2.0, 2.0), "f16": (-2.0, 2.0), "i32": (-3, 3), "u32": (0, 5)}
SCALAR_RANGE = (-2.0, 2.0)
CAP = 1e3


@dataclass
class Case:
    """One generated (or replayed) kernel with the sizes and bucket it runs at."""
    kernel: KernelDef
    sizes: dict            # symbolic axis -> size (T: the real length)
    bucket: int
    seed: int | None = None
    data_seed: int = 0
    note: str = ""
    meta: dict = field(default_factory=dict)
    left_out: tuple = ()       # defaulted inputs the call leaves out
    dropped: tuple = ()        # optional leading axes the call leaves out (their size is 1)
    poison: bool = False       # T-leading tensors in bucket-sized buffers with NaN padded rows

    @property
    def source(self) -> str:
        return kernel_text(self.kernel)


# ---------------------------------------------------------------- intervals
def _hull(*ivs):
    return (min(i[0] for i in ivs), max(i[1] for i in ivs))


def _mul(a, b):
    c = (a[0] * b[0], a[0] * b[1], a[1] * b[0], a[1] * b[1])
    return (min(c), max(c))


def _sig(x):
    return 1.0 / (1.0 + math.exp(-max(min(x, 700), -700)))


def _mono(f, iv):
    a, b = f(iv[0]), f(iv[1])
    return (min(a, b), max(a, b))


class Intervals:
    """Sound value bounds of expressions, given bounds of the names in scope and the axis sizes."""

    def __init__(self, sizes: dict):
        self.sizes = sizes
        self.env: dict[str, tuple] = {}
        self.memo: dict = {}

    def size(self, axis):
        return int(axis) if is_fixed(axis) else self.sizes[axis]

    def of(self, e: Expr):
        if isinstance(e, Ref):
            return self.env[e.name]
        hit = self.memo.get(e)
        if hit is None:
            hit = self.memo[e] = self._of(e)
        return hit

    def _of(self, e: Expr):
        if isinstance(e, Num):
            return (e.value, e.value)
        if isinstance(e, Neg):
            lo, hi = self.of(e.x)
            return (-hi, -lo)
        if isinstance(e, Bin):
            a, b = self.of(e.a), self.of(e.b)
            if e.op == "+":
                return (a[0] + b[0], a[1] + b[1])
            if e.op == "-":
                return (a[0] - b[1], a[1] - b[0])
            if e.op == "*":
                return _mul(a, b)
            if e.op == "/":
                if b[0] <= 0 <= b[1]:
                    return (-math.inf, math.inf)
                return _mul(a, (1.0 / b[1], 1.0 / b[0]))
            if e.op == "%":          # by a positive literal m: truncated, so |r| < m with a's sign
                m = b[1]
                return (-(m - 1) if a[0] < 0 else 0, (m - 1) if a[1] > 0 else 0)
            if e.op == "&":          # with a non-negative literal mask c: in [0, c]
                return (0, b[1])
            if e.op == "|":          # with a non-negative literal c: a | c >= a, and at most a + c
                return (a[0], max(a[1], 0) + b[1])
            if e.op == ">>":         # arithmetic: floor(a / 2^s)
                return (math.floor(a[0] / 2 ** b[1]), math.floor(a[1] / 2 ** b[1]))
            if e.op == "<<":
                return (a[0] * 2 ** b[1], a[1] * 2 ** b[1])
            if e.op == "**":
                if a[0] <= 0:
                    return (-math.inf, math.inf)
                c = [x ** y for x in a for y in b]
                return (min(c), max(c))
            return (0.0, 1.0)
        if isinstance(e, Fn):
            f, args = e.name, e.args
            if f in GROUPED:         # bounded where it is generated (Generator.grouped_statement)
                return (-math.inf, math.inf)
            if f in ("max", "min"):
                a, b = self.of(args[0]), self.of(args[1])
                return (max(a[0], b[0]), max(a[1], b[1])) if f == "max" else (min(a[0], b[0]), min(a[1], b[1]))
            if f == "eq":
                return (0.0, 1.0)
            if f == "where":
                return _hull(self.of(args[1]), self.of(args[2]))
            if f in ("f32", "f16", "gather"):
                return self.of(args[0])
            if f in INTS:
                lo, hi = self.of(args[0])
                return (math.trunc(lo), math.trunc(hi)) if f == "i32" else (max(0, math.trunc(lo)), max(0, math.trunc(hi)))
            iv = self.of(args[0])
            if f == "abs":
                lo = 0.0 if iv[0] <= 0 <= iv[1] else min(abs(iv[0]), abs(iv[1]))
                return (lo, max(abs(iv[0]), abs(iv[1])))
            if f in ("cos", "sin"):
                return (-1.0, 1.0)
            if f == "sigmoid":
                return _mono(_sig, iv)
            if f == "tanh":
                return _mono(math.tanh, iv)
            if f == "silu":
                lo = min(iv[0] * _sig(iv[0]), iv[1] * _sig(iv[1]), 0.0 if iv[0] <= 0 <= iv[1] else math.inf)
                return (min(lo, -0.2785) if iv[0] < -1.0 else lo, max(iv[0] * _sig(iv[0]), iv[1] * _sig(iv[1])))
            if iv[1] > 700 and f == "exp":
                return (0.0, math.inf)
            if f == "exp":
                return (math.exp(iv[0]), math.exp(iv[1]))
            if iv[0] <= 0:
                return (-math.inf, math.inf)
            if f == "log":
                return (math.log(iv[0]), math.log(iv[1]))
            if f == "sqrt":
                return (math.sqrt(iv[0]), math.sqrt(iv[1]))
            if f == "rsqrt":
                return (1.0 / math.sqrt(iv[1]), 1.0 / math.sqrt(iv[0]))
            if f == "recip":
                return (1.0 / iv[1], 1.0 / iv[0])
            raise ValueError(f)
        if isinstance(e, Red):
            lo, hi = self.of(e.x)
            if e.fn in ("mean", "max"):
                return (lo, hi)
            n = self.size(e.axis)
            return (min(lo, n * lo), max(hi, n * hi))
        if isinstance(e, Idx):
            return (0, self.size(e.axis) - 1)
        if isinstance(e, Stk):
            return _hull(*(self.of(v) for v in e.values))
        if isinstance(e, Flip):
            return self.of(e.x)
        if isinstance(e, Sub):
            lo, hi = self.of(e.x)
            if any(it[0] in ("shift", "window") for it in e.items):
                return (min(lo, 0.0), max(hi, 0.0))
            return (lo, hi)
        raise TypeError(e)


def nice(x: float) -> Num:
    """A short positive literal close below x."""
    for v in (4.0, 3.0, 2.0, 1.5, 1.0, 0.75, 0.5, 0.3, 0.25, 0.2, 0.1, 0.05, 0.03, 0.02, 0.01, 0.005,
              0.003, 0.002, 0.001, 0.0005, 0.0002, 0.0001, 1e-5, 1e-6):
        if v <= x:
            return num(v)
    return num(1e-7)


def num(v: float, style: int = 0) -> Num:
    v = float(v)
    if v == int(v) and abs(v) < 1e6:
        text = f"{int(v)}.0" if style == 0 else str(int(v))
    else:
        text = repr(v)
    return Num(v, text)


# ---------------------------------------------------------------- the generator
class Generator:
    def __init__(self, seed: int, has_f16: bool = True, max_inputs: int = 6):
        self.seed = seed
        self.rng = np.random.default_rng(seed)
        self.has_f16 = has_f16
        self.max_inputs = max_inputs
        r = self.rng
        self.bucket = int(r.choice([4, 8]))
        # features of this kernel (drawn first, so each is a fixed share of the seeds)
        f = {k: r.random() < v for k, v in RATES.items()}
        self.batch = tuple(BATCH[:int(r.choice([1, 1, 1, 1, 2]))]) if f["batch"] else ()
        self.windows = tuple(WINDOW[:int(r.choice([1, 1, 1, 2]))]) if f["window"] else ()
        self.flips = f["flip"] or (bool(self.windows) and r.random() < 0.6)
        self.defaults = f["defaults"]
        self.poison = f["poison"]
        self.batch_mode = str(r.choice(["drop", "drop", "one", "many", "many"])) if self.batch else ""
        axes = []
        if r.random() < 0.85:
            axes.append(SEQ)
        nsym = int(r.choice([1, 1, 2, 2, 2, 3, 3]))
        syms = list(r.choice(SYMBOLIC, size=nsym, replace=False))
        nfix = int(r.choice([0, 0, 1, 1, 2]))
        fixed = [str(v) for v in r.choice([2, 3, 4], size=nfix, replace=False)]
        rest = syms + fixed
        r.shuffle(rest)
        self.axes = tuple(str(a) for a in list(self.batch) + axes + rest + list(self.windows))
        self.sizes = {}
        self.dropped: tuple = ()
        for a in self.batch:
            if self.batch_mode == "many":
                self.sizes[a] = int(r.integers(2, 4)) if a == "B" else int(r.integers(1, 3))
            else:
                self.sizes[a] = 1
        if self.batch_mode == "drop":
            self.dropped = self.batch[:int(r.integers(1, len(self.batch) + 1))]
        packed = math.prod(self.sizes[a] for a in self.batch) > 1
        for a in self.axes:
            if a == SEQ:
                if packed:      # several sequences in one tensor fill whole buckets
                    self.sizes[a] = int(r.choice([self.bucket, 2 * self.bucket] if self.bucket == 4 else [8]))
                else:
                    self.sizes[a] = int(r.choice([t for t in range(1, 14) if t % self.bucket]))
            elif a in self.windows:
                self.sizes[a] = int(r.choice([1, 2, 3, 3, 4, 5]))
            elif not is_fixed(a) and a not in self.batch:
                self.sizes[str(a)] = int(r.integers(1, 7))
        routing = np.random.default_rng([seed, 47])
        self.routing_rng = routing
        self.gathers = routing.random() < ROUTING_RATES["gather"]
        self.topk = routing.random() < ROUTING_RATES["topk"]
        if self.gathers:
            self.sizes[ROWS] = int(routing.integers(1, 7))
        # grouped GEMMs: a stream of their own (the gather and topk draws above stay as they were)
        self.grouped_rng = np.random.default_rng([seed, 53])
        self.grouped = self.grouped_rng.random() < ROUTING_RATES["grouped"]
        self.inputs: list[Param] = []
        self.reserved: set[str] = set()          # names leaves may not read (an in-place input)
        self.temps: list[tuple[str, object]] = []  # (name, Ty) readable by later statements
        self.kernel = KernelDef("k", self.inputs, [], [])
        self.checker = Checker(self.kernel)
        self.iv = Intervals(self.sizes)

    # -- small helpers
    def p(self, x: float) -> bool:
        return self.rng.random() < x

    def pick(self, seq):
        return seq[int(self.rng.integers(len(seq)))]

    def order(self, axes) -> tuple:
        return tuple(a for a in self.axes if a in set(axes))

    def subseq(self, S, keep=0.6, nonempty=False) -> tuple:
        out = tuple(a for a in S if self.p(keep))
        if nonempty and not out and S:
            out = (self.pick(S),)
        return out

    def ty(self, e: Expr):
        return self.checker.ty(e)

    def fits(self, e: Expr, S, dt, need=()) -> bool:
        try:
            t = self.ty(e)
        except (ModelError, KeyError):
            return False
        if not is_subseq(t.shape, S) or any(a not in t.shape for a in need):
            return False
        if SEQ in t.shape and any(a not in self.batch for a in t.shape[:t.shape.index(SEQ)]):
            return False
        return t.dtype == dt or (t.dtype == ABSTRACT and not need)

    def bound(self, e: Expr) -> float:
        lo, hi = self.iv.of(e)
        return max(abs(lo), abs(hi))

    # -- leaves
    def optional_of(self, shape) -> tuple:
        """Leading batch axes are marked optional: always before T (the language's rule), mostly else."""
        lead = []
        for a in shape:
            if a not in self.batch:
                break
            lead.append(a)
        if not lead:
            return ()
        if SEQ in shape or self.p(0.75):
            return tuple(lead)
        return ()

    def default_for(self, dtype):
        if not self.defaults or not self.p(0.5):
            return None
        return float(self.pick(INT_DEFAULTS[dtype] if dtype in INTS else FLOAT_DEFAULTS))

    def new_input(self, shape, dtype) -> Ref:
        name = f"x{len([p for p in self.inputs if p.name.startswith('x')])}"
        p = Param(name, dtype, tuple(shape), self.optional_of(shape), self.default_for(dtype))
        self.inputs.append(p)
        self.checker.env[name] = Ty(p.shape, dtype)
        self.iv.env[name] = INPUT_RANGE[dtype]
        return Ref(name)

    def scalar(self) -> Ref:
        scalars = [p for p in self.inputs if not p.shape]
        if scalars and (self.p(0.6) or len(scalars) >= 3):
            return Ref(self.pick(scalars).name)
        name = f"s{len(scalars)}"
        self.inputs.append(Param(name, "f32", (), (), self.default_for("f32")))
        self.checker.env[name] = Ty((), "f32")
        self.iv.env[name] = SCALAR_RANGE
        return Ref(name)

    def tensor_leaf(self, S, dt, exact=False) -> Expr:
        if not S:
            return self.exact(S, dt)
        cands = [p for p in self.inputs if p.shape and p.dtype == dt and p.name not in self.reserved
                 and (p.shape == tuple(S) if exact else is_subseq(p.shape, S))]
        n_tensors = len([p for p in self.inputs if p.shape])
        if cands and (self.p(0.6) or n_tensors >= self.max_inputs):
            return Ref(self.pick(cands).name)
        if exact or not S:
            shape = tuple(S)
        else:
            shape = tuple(S) if self.p(0.5) else self.subseq(S, 0.6, nonempty=True)
        if not shape:
            shape = tuple(S)
        return self.new_input(shape, dt)

    def literal(self, dt) -> Num:
        if dt in INTS:
            return num(int(self.rng.integers(0, 4)), style=1)
        v = self.pick([0.5, 1.0, 2.0, 0.1, 0.25, 3.0, 1.5, 0.75, 0.3, 1e-3, 0.0])
        return num(v, style=int(self.rng.integers(2)))

    def temp_leaf(self, S, dt):
        cands = [n for n, t in self.temps if t.dtype == dt and is_subseq(t.shape, S)]
        return Ref(self.pick(cands)) if cands else None

    def leaf(self, S, dt) -> Expr:
        r = self.rng.random()
        if r < 0.18:
            t = self.temp_leaf(S, dt)
            if t is not None:
                return t
        if dt in FLOATS:
            if r < 0.30:
                lit = self.literal(dt)
                return lit if dt == "f32" or self.p(0.7) else Fn("f16", (lit,))
            if r < 0.40:
                s = self.scalar()
                return s if dt == "f32" else Fn("f16", (s,))
            sym = [a for a in S if not is_fixed(a)]
            if r < 0.46 and sym and dt == "f32":
                return Fn("f32", (Idx(self.pick(sym)),))
            return self.tensor_leaf(S, dt)
        sym = [a for a in S if not is_fixed(a)]
        if r < 0.35 and sym:
            idx = Idx(self.pick(sym))
            return idx if dt == "i32" else Fn("u32", (idx,))
        if r < 0.5:
            return self.literal(dt)
        return self.tensor_leaf(S, dt)

    def exact(self, S, dt) -> Expr:
        """A value of exactly shape S and dtype dt."""
        if not S:
            if dt == "f32":
                return self.scalar() if self.p(0.5) else self.literal(dt)
            if dt == "f16":
                return Fn("f16", (self.scalar(),))
            return Fn(dt, (self.scalar(),)) if dt == "i32" and self.p(0.3) else Fn(dt, (self.literal(dt),))
        if dt == "i32" and len(S) == 1 and not is_fixed(S[0]) and self.p(0.4):
            return Idx(S[0])
        return self.tensor_leaf(S, dt, exact=True)

    # -- safety rewrites (by static bounds)
    def positive(self, e: Expr, margin: float) -> Expr:
        lo, hi = self.iv.of(e)
        if lo > margin:
            return e
        if lo >= 0:
            return Bin("+", e, num(margin * 5 if margin < 0.1 else 0.5))
        if self.p(0.7):
            return Bin("+", Fn("abs", (e,)), num(0.5 if margin >= 0.1 else 0.1))
        return Bin("+", Bin("*", e, e), num(0.5))

    def nonzero(self, e: Expr) -> Expr:
        lo, hi = self.iv.of(e)
        if lo > 0.2 or hi < -0.2:
            return e
        p = self.positive(e, 0.2)
        return Neg(p) if self.p(0.3) else p

    def within(self, e: Expr, limit: float) -> Expr:
        m = self.bound(e)
        if m <= limit:
            return e
        if not math.isfinite(m):
            return Fn("tanh", (e,))
        if self.p(0.3):
            return Bin("*", num(limit), Fn("tanh", (Bin("*", e, nice(1.0 / m)),)))
        return Bin("*", e, nice(limit / m))

    def capped(self, e: Expr) -> Expr:
        try:
            t = self.ty(e)
        except ModelError:
            return e
        if t.dtype in INTS:
            m = self.bound(e)
            if m > 1e4:
                return Fn("max", (Fn("min", (e, num(100, 1))), Neg(num(100, 1)))) if t.dtype == "i32" \
                    else Fn("min", (e, num(100, 1)))
            return e
        return self.within(e, CAP)

    # -- expressions
    def gen(self, S, dt, depth, need=()) -> Expr:
        S = tuple(S)
        for _ in range(5):
            try:
                e = self._gen(S, dt, depth, need)
            except ModelError:
                e = None
            if e is not None and self.fits(e, S, dt, need):
                e = self.capped(e)
                if self.fits(e, S, dt, need):
                    return e
        return self.exact(S, dt)

    def _gen(self, S, dt, depth, need) -> Expr | None:
        if depth <= 0 or (not need and self.p(0.12)):
            return self.leaf(S, dt)
        if dt in FLOATS:
            return self.gen_float(S, dt, depth, need)
        return self.gen_int(S, dt, depth, need)

    def gen_float(self, S, dt, depth, need):
        free = [a for a in self.axes if a not in S]
        free_sym = [a for a in free if not is_fixed(a)]     # reductions name their axis: never a fixed one
        choices = ["unary"] * 6 + ["binary"] * 9 + ["neg"] + ["where"] * 2 + ["cast"] * 2 + ["shift"] * 2
        if free_sym:
            choices += ["reduce"] * 5 + ["contract"] * 2
        if free_sym and len(S) == 2 and not any(is_fixed(a) for a in S):
            choices += ["gemm"] * 5
        if free:
            choices += ["take"] * 2
        if any(is_fixed(a) and 2 <= int(a) <= 4 for a in S):
            choices += ["stack"] * 5
        if any(a in self.windows for a in S):
            choices += ["window"] * 8
        if any(a in self.windows for a in free):
            choices += ["conv"] * 10
        if self.flips and any(not is_fixed(a) for a in S):
            choices += ["flip"] * 3
        if self.gathers and S and self.routing_rng.random() < 0.2:
            return self.gathered(S, dt, depth - 1, need)
        kind = self.pick(choices)
        d = depth - 1
        if kind == "window":
            return self.windowed(S, self.pick([a for a in S if a in self.windows]), dt, d, need)
        if kind == "conv":
            return self.conv(S, self.pick([a for a in free if a in self.windows]), dt, d, need)
        if kind == "flip":
            return self.flipped(S, dt, d, need)
        if kind == "unary":
            f = self.pick(UNARY_FUNCS)
            x = self.gen(S, dt, d, need)
            if f == "exp":
                x = self.within(x, 5.0)
            elif f == "log":
                x = self.positive(x, 0.05)
            elif f in ("sqrt", "rsqrt"):
                x = self.positive(x, 0.05)
            elif f == "recip":
                x = self.nonzero(x)
            elif f in ("sin", "cos"):
                x = self.within(x, 3.0)
            elif f in ("tanh", "sigmoid", "silu"):
                x = self.within(x, 15.0)
            return Fn(f, (x,))
        if kind == "neg":
            return Neg(self.gen(S, dt, d, need))
        if kind == "binary":
            op = self.pick(["+", "+", "-", "-", "*", "*", "*", "/", "**", "max", "min", "eq", "<", ">"])
            na, nb = self.split_need(need)
            a = self.gen(S, dt, d, na)
            if op == "**":
                a = self.positive(a, 0.1)
                if self.p(0.6):
                    b = num(self.pick([2, 3, 0.5, 1.5, -1, -0.5, 2.5]))
                    if b.value < 0:
                        b = Neg(Num(-b.value, repr(-b.value)))
                else:
                    b = self.within(self.gen(S, dt, d, nb), 2.0)
                e = Bin("**", a, b)
                return e if self.bound(e) <= CAP else Bin("**", Fn("min", (a, num(4.0))), b)
            b = self.gen(S, dt, d, nb)
            if op == "eq" and self.p(0.5):      # make equality happen: compare with a copy or a rounded value
                b = a if self.p(0.5) else b
            if op == "/":
                b = self.nonzero(b)
            if self.p(0.5) and op in ("+", "*", "max", "min", "eq"):
                a, b = b, a
            if op in ("max", "min", "eq"):
                return Fn(op, (a, b))
            return Bin(op, a, b)
        if kind == "where":
            c = self.cond(S, d)
            na, nb = self.split_need(need)
            return Fn("where", (c, self.gen(S, dt, d, na), self.gen(S, dt, d, nb)))
        if kind == "cast":
            if dt == "f32":
                src = self.pick(["i32", "i32", "u32"] + (["f16"] if self.has_f16 else []))
                return Fn("f32", (self.gen(S, src, d, need),))
            return Fn("f16", (self.gen(S, "f32", d, need),))
        if kind == "shift":
            x = self.gen(S, dt, d, need)
            return self.shifted(x)
        if kind == "reduce":
            A = self.pick(free_sym)
            S2 = self.order(S + (A,))
            fn = self.pick(["sum", "sum", "mean", "max"])
            inner = self.gen(S2, dt, d, tuple(need) + (A,))
            return Red(fn, inner, A)
        if kind == "contract":
            K = self.pick(free_sym)
            sa = self.subseq(S, 0.5)
            sb = tuple(a for a in S if a not in sa or self.p(0.2))
            a = self.gen(self.order(sa + (K,)), dt, max(d - 1, 0), (K,))
            b = self.gen(self.order(sb + (K,)), dt, max(d - 1, 0), (K,))
            return Red("sum", Bin("*", a, b), K)
        if kind == "gemm":          # a product the GEMM template runs, of tensors, maybe plus a second one
            terms = []
            for K in self.rng.permutation(free_sym)[:1 + int(self.p(0.3) and len(free_sym) > 1)]:
                a = self.tensor_leaf(self.order((S[0], K)), dt, exact=True)
                b = self.tensor_leaf(self.order((S[1], K)), dt, exact=True)
                terms.append(Red("sum", Bin("*", a, b), str(K)))
            return terms[0] if len(terms) == 1 else Bin("+", *terms)
        if kind == "take":
            fixed = [a for a in free if is_fixed(a)]
            A = self.pick(fixed) if fixed and self.p(0.8) else self.pick(free)
            x = self.gen(self.order(S + (A,)), dt, d, tuple(need) + (A,))
            t = self.ty(x)
            items = []
            for axis in t.shape:
                if axis == A:
                    items.append(("take", int(self.rng.integers(int(A))) if is_fixed(A) else 0))
                elif not is_fixed(axis) and self.p(0.2):
                    items.append(self.shift_item(axis))
                else:
                    items.append(("full",))
            return Sub(x, tuple(items))
        if kind == "stack":
            F = self.pick([a for a in S if is_fixed(a) and 2 <= int(a) <= 4])
            base = tuple(a for a in S if a != F)
            vals = tuple(self.gen(base, dt, d) for _ in range(int(F)))
            return Stk(vals, int(F))
        raise ValueError(kind)

    def gathered(self, S, dt, d, need) -> Expr:
        """gather(table, ids): ids over a leading part of S, clamped into the table's rows; the
        table an input [V] + the rest of S (a table that is itself gathered never has a default)."""
        k = int(self.rng.integers(1, len(S) + 1))
        ids_shape, rest = S[:k], S[k:]
        shape = (ROWS,) + tuple(rest)
        tables = [p for p in self.inputs if p.shape == shape and p.dtype == dt and p.default is None
                  and p.name not in self.reserved]
        if tables and self.p(0.5):
            table = Ref(self.pick(tables).name)
        else:
            name = f"x{len([p for p in self.inputs if p.name.startswith('x')])}"
            self.inputs.append(Param(name, dt, shape))
            self.checker.env[name] = Ty(shape, dt)
            self.iv.env[name] = INPUT_RANGE[dt]
            table = Ref(name)
        ids = self.gen(ids_shape, "i32", d, tuple(a for a in need if a in ids_shape))
        top = self.sizes[ROWS] - 1
        ids = Fn("max", (Fn("min", (ids, num(top, 1))), num(0, 1)))
        return Fn("gather", (table, ids))

    def topk_statement(self) -> tuple[str, Expr] | None:
        """``v, i = topk(x, K)`` over a new input x [R, E] (or a value computed from it and others): R
        the sequence axis (or the first symbolic one), E an axis after it, K an axis after R with |K| <= |E| (a fixed one, or a
        symbolic one); v and i become temporaries later statements may read."""
        r = self.routing_rng
        found = self.row_axes()
        if found is None:
            return None
        rows, after = found
        size = {a: int(a) if is_fixed(a) else self.sizes[a] for a in after}
        pairs = [(e, k) for e in after for k in after if k != e and size[k] <= size[e]]
        if not pairs:
            return None
        e_axis, k_axis = pairs[int(r.integers(len(pairs)))]
        dt = "f16" if self.has_f16 and r.random() < 0.3 else "f32"     # f16: exact ties, by index
        x_shape = self.order((rows, e_axis))
        x = self.plain_input(x_shape, dt)
        if r.random() < 0.4:                     # a computed value (scores + bias) instead of the input itself
            e = self.gen(x_shape, dt, 2, x_shape)
            if self.ty(e).shape == x_shape:
                x = e
        shape = (rows, k_axis)
        for name, ty, iv in (("v0", Ty(shape, dt), INPUT_RANGE[dt]), ("i0", Ty(shape, "i32"), (0, size[e_axis] - 1))):
            self.checker.env[name] = ty
            self.iv.env[name] = iv
            self.temps.append((name, ty))
        return "v0, i0", TopK(x, k_axis)

    def row_axes(self) -> tuple[str, list[str]] | None:
        """The rows of a routing statement (the sequence axis, or the first symbolic one; not a batch
        or window axis) and the plain axes after them, or None without such an axis."""
        plain = [a for a in self.axes if a not in self.batch and a not in self.windows]
        rows = SEQ if SEQ in plain else next((a for a in plain if not is_fixed(a)), None)
        return None if rows is None else (rows, plain[plain.index(rows) + 1:])

    def plain_input(self, shape, dt) -> Ref:
        """A new input of exactly this shape: no default, no optional axes."""
        x = self.new_input(shape, dt)
        self.inputs[-1] = Param(x.name, dt, tuple(shape))
        return x

    def grouped_statement(self) -> tuple[str, Expr] | None:
        """``g0 = grouped_matmul(x, w, ends)`` (or ``grouped_matmul_scaled(x, w, ends, scale)``): rows
        S the sequence axis (or the first symbolic one), N and K two axes after it (N first), E a new
        axis of 1..4 experts, ends a new input i32[E] (run.py draws a running sum of row counts, some
        experts empty). x an input [S, K] or a value computed from others; w an input [E, N, K], or
        a prologue computed in the GEMM's operand fetch (elementwise, reading tables by gather(): a
        decode gather(table, codes) * scale, ...), or another expression (stored first). Half of
        the calls are masked to the owned rows, where(sum(f32(index(S) < ends), E) > 0.5, .., 0.0):
        only those may meet ends[E-1] < |S| at run time (rows past it are unspecified); g0 becomes a
        temporary later statements (and maybe the outputs) read."""
        r = self.grouped_rng
        found = self.row_axes()
        if found is None:
            return None
        rows, after = found
        if len(after) < 2:
            return None
        i, j = sorted(int(v) for v in r.choice(len(after), 2, replace=False))
        n_axis, k_axis = after[i], after[j]
        self.sizes[EXPERTS] = int(r.integers(1, 5))
        packed = math.prod(self.sizes[a] for a in self.batch) > 1
        if r.random() < 0.25 and not (rows == SEQ and packed):   # rows over several tiles (experts split inside them)
            self.sizes[rows] = int(r.choice([t for t in range(33, 80) if rows != SEQ or t % self.bucket]))
        if r.random() < 0.2 and not is_fixed(k_axis) and not self.topk:    # a K loop of several steps (topk: sized already)
            self.sizes[k_axis] = int(r.integers(17, 41))
        xdt, wdt = (("f16" if self.has_f16 and r.random() < 0.3 else "f32") for _ in range(2))
        x_shape, w_shape = (rows, k_axis), (EXPERTS, n_axis, k_axis)
        x = self.plain_input(x_shape, xdt)
        if r.random() < 0.35:                    # a computed x
            e = self.gen(x_shape, xdt, 2, x_shape)
            if self.ty(e).shape == x_shape:
                x = e
        w, wb = self.grouped_weight(w_shape, wdt, n_axis, k_axis)
        ends = Ref(f"e{len([p for p in self.inputs if p.name.startswith('e')])}")
        self.inputs.append(Param(ends.name, "i32", (EXPERTS,)))
        self.checker.env[ends.name] = Ty((EXPERTS,), "i32")
        self.iv.env[ends.name] = (0, self.sizes[rows])
        bound = self.bound(x) * wb * (int(k_axis) if is_fixed(k_axis) else self.sizes[k_axis])
        if r.random() < 0.4:
            sdt = "f16" if self.has_f16 and r.random() < 0.2 else "f32"
            scale = self.plain_input((rows,), sdt)
            if r.random() < 0.35:
                e = self.gen((rows,), sdt, 2, (rows,))
                if self.ty(e).shape == (rows,):
                    scale = e
            bound *= self.bound(scale)
            call = Fn("grouped_matmul_scaled", (x, w, ends, scale))
        else:
            call = Fn("grouped_matmul", (x, w, ends))
        if r.random() < 0.5:                     # masked to the owned rows
            owned = Bin(">", Red("sum", Fn("f32", (Bin("<", Idx(rows), ends),)), EXPERTS), num(0.5))
            call = Fn("where", (owned, call, num(0.0)))
        t = self.ty(call)
        self.checker.env["g0"] = t
        self.iv.env["g0"] = (-bound, bound)
        self.temps.append(("g0", t))
        return "g0", call

    def grouped_weight(self, shape, dt, n_axis, k_axis) -> tuple[Expr, float]:
        """w [E, N, K] and a bound of its values: an input (45%), a prologue (35%), another value (20%)."""
        r = self.grouped_rng
        u = r.random()
        if u < 0.45:
            return self.plain_input(shape, dt), 2.0
        if u < 0.8:                              # a prologue: elementwise, reading tables by gather()
            if ROWS not in self.sizes:
                self.sizes[ROWS] = int(r.integers(1, 7))
            top = self.sizes[ROWS] - 1
            table = self.plain_input((ROWS,) + (shape[2:] if r.random() < 0.3 else ()), dt)
            ids_shape = shape[:3 - len(self.checker.env[table.name].shape) + 1]
            if r.random() < 0.5:
                codes = self.plain_input(ids_shape, "u32")      # packed codes: 0..5, masked or clamped
                ids = Bin("&", codes, num(3, 1)) if top >= 3 and r.random() < 0.5 else Fn("min", (codes, num(top, 1)))
            else:
                codes = self.plain_input(ids_shape, "i32")
                ids = Fn("max", (Fn("min", (codes, num(top, 1))), num(0, 1)))
            dec = Fn("gather", (table, ids))
            kind = r.integers(4)
            if kind == 0:
                return dec, 2.0
            if kind == 1:                        # blocks' scales [E, N]
                return Bin("*", dec, self.plain_input(shape[:2], dt)), 4.0
            if kind == 2:                        # a scale and an offset
                s = self.plain_input(shape[:2], dt)
                return Bin("-", Bin("*", dec, s), Fn("gather", (table, Fn("min", (Fn("abs", (codes,)), num(top, 1)))))), 6.0
            return Bin("+", self.plain_input(shape, dt), Bin("*", dec, num(0.5))), 3.0     # a base plus a decoded delta
        kind = r.integers(3)                     # not a prologue: stored before the GEMM
        w = self.plain_input(shape, dt)
        if kind == 0:
            return Fn("tanh", (w,)), 1.0
        if kind == 1 and not is_fixed(k_axis):
            return Bin("-", w, Red("mean", w, k_axis)), 4.0
        return Bin("*", w, Fn("sigmoid", (self.plain_input(shape[:2], dt),))), 2.0

    def split_need(self, need):
        na = tuple(a for a in need if self.p(0.5))
        return na, tuple(a for a in need if a not in na)

    def shift_item(self, axis):
        k = int(self.rng.integers(1, 4))
        if axis != SEQ or self.p(0.3):
            k = k if self.p(0.5) else -k
        else:
            k = -k
        if self.p(0.05):
            k = self.sizes.get(axis, 1) + 1 if self.p(0.5) else 0
        return ("shift", axis, k)

    def shifted(self, x: Expr) -> Expr:
        try:
            t = self.ty(x)
        except ModelError:
            return x
        if not t.shape:
            return x
        items = []
        for axis in t.shape:
            if not is_fixed(axis) and self.p(0.5):
                items.append(self.shift_item(axis))
            elif self.p(0.1):
                items.append(("name", axis) if not is_fixed(axis) else ("full",))
            else:
                items.append(("full",))
        if all(it[0] != "shift" for it in items):
            sym = [i for i, a in enumerate(t.shape) if not is_fixed(a)]
            if not sym:
                return x
            i = self.pick(sym)
            items[i] = self.shift_item(t.shape[i])
        return Sub(x, tuple(items))

    def before(self, S, L) -> tuple:
        """The axes of S that come before window axis L in the global order (a window appends L last)."""
        return tuple(a for a in S if self.axes.index(a) < self.axes.index(L))

    def windowed(self, S, L, dt, d, need) -> Expr | None:
        """x[.., A - L, ..] (or A + L): a value of S's axes before L, with L appended."""
        Sx = self.before(S, L)
        if any(a not in Sx and a != L for a in need):
            return None
        syms = [a for a in Sx if not is_fixed(a)]
        if not syms:
            return None
        A = SEQ if SEQ in syms and self.p(0.6) else self.pick(syms)
        x = self.gen(Sx, dt, d, tuple(dict.fromkeys([a for a in need if a in Sx] + [A])))
        try:
            t = self.ty(x)
        except ModelError:
            return None
        if A not in t.shape:
            return None
        sign = -1 if (A == SEQ and self.p(0.7)) or self.p(0.5) else 1
        items = []
        for axis in t.shape:
            if axis == A:
                items.append(("window", A, L, sign))
            elif not is_fixed(axis) and self.p(0.1):
                items.append(self.shift_item(axis))
            else:
                items.append(("full",))
        return Sub(x, tuple(items))

    def conv(self, S, L, dt, d, need) -> Expr | None:
        """A reduction over a window axis: sum(flip(w, L) * x[T - L, :], L), mean, max(x[T + L], L)."""
        Sx = self.before(S, L)
        if any(a not in Sx for a in need):
            return None
        win = self.windowed(self.order(Sx + (L,)), L, dt, max(d, 1), tuple(need))
        if win is None:
            return None
        fn = self.pick(["sum", "sum", "sum", "mean", "max"])
        if fn == "max" and self.p(0.5):
            return Red("max", win, L)
        w = self.gen(self.order(self.subseq(Sx, 0.4) + (L,)), dt, max(d - 1, 0), (L,))
        if self.p(0.5):
            w = Flip(w, L)
        return Red(fn, Bin("*", w, win) if self.p(0.7) else Bin("*", win, w), L)

    def flipped(self, S, dt, d, need) -> Expr | None:
        syms = [a for a in S if not is_fixed(a)]
        A = self.pick([a for a in syms if a == SEQ or a in self.windows] or syms) if self.p(0.5) else self.pick(syms)
        return Flip(self.gen(S, dt, d, tuple(dict.fromkeys(tuple(need) + (A,)))), A)

    def cond(self, S, d) -> Expr:
        """A where() condition: mostly a comparison, sometimes a raw float or int value."""
        r = self.rng.random()
        if r < 0.55:
            dt = "f32" if self.p(0.7) else "i32"
            a = self.gen(S, dt, max(d - 1, 0))
            b = self.gen(S, dt, max(d - 1, 0)) if self.p(0.5) else self.literal(dt)
            return Bin(self.pick(["<", ">"]), a, b)
        if r < 0.7:
            return self.gen(S, "i32", d)
        return self.gen(S, "f32", d)

    def gen_int(self, S, dt, depth, need):
        d = depth - 1
        choices = ["binary"] * 6 + ["abs", "where", "cast", "cast", "shift", "bits", "bits"]
        if dt == "i32":
            choices += ["neg", "div"]
        if any(a in self.windows for a in S):
            choices += ["window"]
        if self.flips and any(not is_fixed(a) for a in S):
            choices += ["flip"]
        kind = self.pick(choices)
        if kind == "window":
            return self.windowed(S, self.pick([a for a in S if a in self.windows]), dt, d, need)
        if kind == "flip":
            return self.flipped(S, dt, d, need)
        if kind == "binary":
            op = self.pick(["+", "+", "*", "max", "min", "eq", "<", ">"] + (["-"] if dt == "i32" else []))
            na, nb = self.split_need(need)
            a, b = self.gen(S, dt, d, na), self.gen(S, dt, d, nb)
            if op in ("max", "min", "eq"):
                return Fn(op, (a, b))
            return Bin(op, a, b)
        if kind == "div":
            return Bin("/", self.gen(S, dt, d, need), num(self.pick([2, 3]), 1))
        if kind == "bits":       # integer bit operations, each with a literal right operand
            op = self.pick(["%", "&", "|", ">>", "<<"])
            c = {"%": [2, 3, 5], "&": [1, 3, 7], "|": [1, 2, 4], ">>": [1, 2], "<<": [1, 2]}[op]
            return Bin(op, self.gen(S, dt, d, need), num(self.pick(c), 1))
        if kind == "neg":
            return Neg(self.gen(S, dt, d, need))
        if kind == "abs":
            return Fn("abs", (self.gen(S, dt, d, need),))
        if kind == "where":
            na, nb = self.split_need(need)
            return Fn("where", (self.cond(S, d), self.gen(S, dt, d, na), self.gen(S, dt, d, nb)))
        if kind == "cast":
            if dt == "u32":
                if self.p(0.5):
                    return Fn("u32", (Fn("abs", (self.gen(S, "i32", d, need),)),))
                x = self.gen(S, "f32", d, need)
                return Fn("u32", (Fn("abs", (Bin("*", x, num(2.0)),)),))
            if self.p(0.3):
                return Fn("i32", (self.gen(S, "u32", d, need),))
            x = self.gen(S, "f32", d, need)
            return Fn("i32", (Bin("*", x, num(self.pick([1.0, 2.0, 3.0]))),))
        if kind == "shift":
            return self.shifted(self.gen(S, dt, d, need))
        raise ValueError(kind)

    # -- statements
    def statement(self, target: str, S, dt, depth) -> Expr:
        e = self.gen(S, dt, depth)
        t = self.ty(e)
        lo, hi = self.iv.of(e)
        self.iv.env[target] = (lo, hi)
        self.checker.env[target] = t
        return e

    def out_dtype(self):
        r = self.rng.random()
        if r < 0.10 and self.has_f16:
            return "f16"
        if r < 0.17:
            return "i32"
        if r < 0.20:
            return "u32"
        return "f32"

    def out_shape(self):
        S = self.subseq(self.axes, 0.6, nonempty=True)
        if SEQ in self.axes and SEQ not in S and self.p(0.6):
            S = self.order(S + (SEQ,))
        return S

    def build(self) -> Case:
        r = self.rng
        n_out = int(r.choice([1, 1, 1, 2, 2, 3]))
        n_tmp = int(r.choice([0, 0, 1, 1, 2, 3]))
        inplace = self.p(0.04)
        O0 = self.out_shape()
        outs = []
        for i in range(n_out):
            S = O0 if i == 0 or inplace or self.p(0.65) else self.out_shape()
            outs.append(Param(f"y{i}", self.out_dtype(), S, self.optional_of(S)))
        slots = ["t"] * n_tmp + ["y"] * (n_out - 1)
        r.shuffle(slots)
        slots.append("y")
        order_out = list(outs)
        r.shuffle(order_out)
        body = []
        if self.topk:
            stmt = self.topk_statement()
            if stmt is not None:
                body.append(stmt)
                v, i = stmt[0].split(", ")
                if self.routing_rng.random() < 0.5:      # the values (and maybe the indices) as outputs too
                    outs.append(Param(v, self.checker.env[v].dtype, self.checker.env[v].shape))
                    if self.routing_rng.random() < 0.4:
                        outs.append(Param(i, "i32", self.checker.env[i].shape))
        if self.grouped:
            stmt = self.grouped_statement()
            if stmt is not None:
                body.append(stmt)
                if self.grouped_rng.random() < 0.4:      # the product itself as an output too
                    t = self.checker.env["g0"]
                    outs.append(Param("g0", t.dtype, t.shape))
        ti = 0
        for slot in slots:
            if slot == "t":
                S = self.subseq(self.axes, 0.55)
                dt = "f32" if self.p(0.8) else self.pick(["i32"] + (["f16"] if self.has_f16 else []))
                name = f"t{ti}"
                ti += 1
                e = self.statement(name, S, dt, int(r.integers(1, 4)))
                self.temps.append((name, self.ty(e)))
            else:
                o = order_out.pop(0)
                S = o.shape if self.p(0.85) else self.subseq(o.shape, 0.6)
                e = self.statement(o.name, S, o.dtype, int(r.integers(1, 5)))
                self.temps.append((o.name, self.ty(e)))
                name = o.name
            body.append((name, e))
        if inplace:
            p = Param("p", "f32", O0, self.optional_of(O0))
            self.reserved.add("p")
            e = self.gen(O0, "f32", 2)
            op = self.pick(["+", "*", "-"])
            val = Bin(op, Ref("p"), e) if self.p(0.7) else Bin(op, e, Ref("p"))
            self.checker.env["p"] = Ty(O0, "f32")
            self.iv.env["p"] = INPUT_RANGE["f32"]
            self.inputs.append(p)
            val = self.capped(val)
            body.append(("p", val))
            outs.append(p)
        if body and body[0][0] == "g0" or len(body) > 1 and body[1][0] == "g0":
            read = any(isinstance(n, Ref) and n.name == "g0" for t, e in body if t != "g0" for n in walk(e))
            if not read and "g0" not in {o.name for o in outs}:      # a product nothing reads: an output
                t = self.checker.env["g0"]
                outs.append(Param("g0", t.dtype, t.shape))
        self.kernel.outputs = outs
        self.kernel.body = body
        self.kernel.inputs = self.inputs
        # sizes of every symbolic axis the kernel names (an output-only axis comes from dims=)
        axes = self.kernel.axes()
        sizes = {a: self.sizes[a] for a in list(self.axes) + [ROWS, EXPERTS] if a in axes and a in self.sizes and not is_fixed(a)}
        left_out = tuple(p.name for p in self.inputs if p.default is not None and self.p(0.5))
        return Case(self.kernel, sizes, self.bucket, seed=self.seed,
                    data_seed=int(r.integers(2**31)), left_out=left_out,
                    dropped=tuple(a for a in self.dropped if a in axes),
                    poison=self.poison and SEQ in axes)


FEATURES = ("window", "flip", "default", "left out", "optional", "dropped", "packed", "poison", "gemm epilogue",
            "sum of gemms", "shared gemm", "gather", "topk", "grouped", "grouped computed w")


def features(case: Case) -> set[str]:
    """Which of the language's newer features (and call variants) a case uses."""
    k = case.kernel
    nodes = [n for _, e in k.body for n in walk(e)]
    out = set()
    if any(isinstance(n, Sub) and any(it[0] == "window" for it in n.items) for n in nodes):
        out.add("window")
    if any(isinstance(n, Flip) for n in nodes):
        out.add("flip")
    if any(isinstance(n, Fn) and n.name == "gather" for n in nodes):
        out.add("gather")
    if any(isinstance(n, TopK) for n in nodes):
        out.add("topk")
    grouped = [n for n in nodes if isinstance(n, Fn) and n.name in GROUPED]
    if grouped:
        out.add("grouped")
    if any(not isinstance(n.args[1], Ref) for n in grouped):
        out.add("grouped computed w")
    if any(p.default is not None for p in k.inputs):
        out.add("default")
    if case.left_out:
        out.add("left out")
    if any(p.optional for p in k.inputs + k.outputs):
        out.add("optional")
    if case.dropped:
        out.add("dropped")
    if any(case.sizes.get(a, 1) > 1 for a in BATCH):
        out.add("packed")
    if case.poison:
        out.add("poison")
    return out | case.meta.get("gemms", set())       # what the compiled kernel fused (fuzz/run.py)


def generate(seed: int, has_f16: bool = True) -> Case:
    """The kernel of one seed (deterministic): well-typed by the fuzzer's own rules."""
    for attempt in range(20):
        g = Generator(seed * 1000 + attempt, has_f16)
        case = g.build()
        try:
            Checker(case.kernel).check()
        except ModelError:
            continue
        case.seed = seed
        # drop inputs nothing reads (they would only be dead parameters)
        return case
    raise RuntimeError(f"seed {seed}: no well-typed kernel in 20 attempts")
