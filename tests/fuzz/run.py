"""Run a case through the compiler's public API and judge it against the fuzzer's float64 meaning.

Classes (forward and backward separately):

    ok            the numbers agree
    wrong         numbers off (the detail gives the max error and the tolerance)
    invalid_wgsl  the shader compiler rejected the generated WGSL (an exception named ShaderCompileError)
    refused       a DslError (or subclass) with a location (line >= 1 and column >= 1): a legitimate refusal
    unlocated     a DslError (or subclass) without a location
    foreign       any other exception (KeyError, ValueError, AssertionError, AutodiffError, wgpu errors...)
    skipped       no numeric verdict: the inputs sit within the rounding (forward) or FD step (backward)
                  of a discontinuity or kink, or a reduction max has a tie (its gradient is a convention)
    n/a           (backward only) nothing to differentiate: no float tensor input or no float output,
                  or the forward did not compile

Precision model. The reference is float64 over the exact input values (f32 inputs are drawn as f32,
f16 inputs as f16, scalars as f32). The compiler is taken to compute every float value in f32, f16
values included, rounding to f16 only where an f16 buffer is written (f16 outputs) and possibly at
f16(...) casts; both rounding choices pass. Conditioning is estimated, not assumed: the reference is
evaluated again with every rounding op (arithmetic, transcendental functions, sums, f16 stores and
casts) perturbed by a random relative error 32x larger than the op's own (2^-23 for f32, 4x that for
transcendental functions, 2^-11 for f16), with the perturbation of a subtree keyed by its structure.
Those runs must make the same decisions (comparisons, where, float->int casts, abs/max/min branches)
as the exact one, else the inputs are drawn again (up to 8 times); their spread, scaled back by 32,
is the rounding error a correct f32 kernel may show. An output passes when

    max|got - want| <= rtol * max|want| + 8 * spread + 1e-6,   rtol = 1e-4 (3e-3 when f16 is involved)

and integer outputs must match exactly. The backward is checked along 3 random directions v (N(0,1)
entries) per differentiated input with central differences of the reference, step 1e-4:

    |<grad, v> - (L(x + h v) - L(x - h v)) / 2h| <= btol * max(|grad|_2, |fd|) + atol,

L = sum over float outputs of <cotangent, output>, btol = max(1e-3 (1.5e-2 with f16), 100 * the
forward's relative spread), atol = 16 f32 ulps of 1 times sum |cotangent| (a local derivative
from a rounded value, 1 - tanh^2 at saturation, is off by about an ulp absolute). A direction whose x +- h v changes any decision is skipped.

Calls. Inputs in ``case.left_out`` are not passed (the reference gives them their default, and
their gradient is the derivative at the default); tensors are passed without the optional leading
axes in ``case.dropped`` where their type lets them (``expr.passed_shape``), and outputs are expected
back without those the inputs left out (``expr.returned_shape``). A gradient d_x is expected in x's
declared shape without the optional axes that the backward call's own tensors leave out (the same
rule, applied to that call). With ``case.poison``, every T-leading tensor the fuzzer uploads (inputs, saved
outputs, cotangents) whose axes before T are all of size 1 lives in a buffer of bucketed(T) rows
whose rows past the real length hold NaN (integers: a large odd value), and may address all of them:
padded rows must never reach a result.
"""
from __future__ import annotations

import gc
import re
import traceback
from dataclasses import dataclass

import numpy as np

from lfm2jit.ir.partition import find_contraction
from .expr import (FLOATS, GROUPED, INTS, SEQ, Checker, Evaluator, Fn, ModelError, Noise, Red, Ref, check,
                   kernel_text, left_out_axes, passed_shape, returned_shape, walk)
from .generate import INPUT_RANGE, SCALAR_RANGE, Case

CLASSES = ("ok", "wrong", "invalid_wgsl", "refused", "unlocated", "foreign", "skipped", "n/a")
FAILING = ("wrong", "invalid_wgsl", "unlocated", "foreign")
NOISE_SCALE = 32.0
FD_STEP = 1e-4
DIRECTIONS = 3
FILENAME = "fuzz.lk"


@dataclass
class Outcome:
    cls: str
    detail: str = ""
    error: float | None = None      # wrong: the worst error / tolerance ratio

    @property
    def failing(self) -> bool:
        return self.cls in FAILING

    def summary(self) -> str:
        """One line: the class and the telling part of the detail."""
        if self.cls == "invalid_wgsl":
            return f"invalid_wgsl: {shader_error(self.detail)}"
        first = self.detail.strip().splitlines()[0] if self.detail.strip() else ""
        return f"{self.cls}: {first}" if first else self.cls

    def kind(self) -> str:
        """A coarse key: the class, and for foreign errors the exception type (``foreign: KeyError``)."""
        if self.cls == "foreign":
            return f"foreign: {self.detail.split(':', 1)[0]}"
        return self.cls

    def cause(self) -> str:
        """A short normalised key that groups outcomes with the same cause."""
        if self.cls in ("ok", "skipped", "n/a"):
            return self.cls
        if self.cls == "wrong":       # wrong numbers, non-finite numbers and wrong shapes are told apart
            kind = "non-finite" if "non-finite" in self.detail else "shape" if ": shape [" in self.detail else ""
            return f"wrong: {kind}" if kind else "wrong"
        return f"{self.cls}: {normalise(self.detail)}"


@dataclass
class Result:
    case: Case
    forward: Outcome
    backward: Outcome

    @property
    def failing(self) -> bool:
        return self.forward.failing or self.backward.failing


def fused_gemms(kernel) -> set[str]:
    """The GEMM fusions a compiled kernel's parts use (the features table counts the cases): an
    epilogue computed from the sum, several contractions summed in one K loop, several outputs
    stored from one sum."""
    found = set()
    for part in kernel.kernels:
        ir = part.ir
        if ir.structure.kind != "contraction":
            continue
        if len(ir.structure.reduced) > 1:
            found.add("sum of gemms")
        if len(ir.outputs) > 1:
            found.add("shared gemm")
        root = ir.results[ir.outputs[0].name]
        if find_contraction(root, ir.outputs[0].shape).epilogue_of(root) is not None:
            found.add("gemm epilogue")
    return found


def shader_error(detail: str) -> str:
    """The shader compiler's own complaint (and the WGSL line it points at) from a ShaderCompileError."""
    text = detail.split("--- WGSL ---")[0]
    lines = [l.strip() for l in text.splitlines()]
    msgs = [l for l in lines if ("error" in l or "Error" in l or l.startswith("= ")) and "rejected kernel" not in l
            and l not in ("Validation Error", "Caused by:")]
    code = [l.split("│", 1)[1].strip() for l in lines if re.match(r"^\d+\s*│", l)]
    out = "; ".join(dict.fromkeys(msgs)) or (lines[0] if lines else "")
    return "ShaderCompileError: " + out + (f" at `{code[0]}`" if code else "")


def normalise(detail: str) -> str:
    line = detail.strip().splitlines()[0] if detail.strip() else ""
    if "ShaderCompileError" in detail:
        line = shader_error(detail).split(" at `")[0]
        line = line.split("; = ")[0]
    line = re.sub(rf"{re.escape(FILENAME)}:\d+:\d+: ", "", line)
    line = re.sub(r"\[[^\]]*\]", "[..]", line)
    line = re.sub(r"\b[A-Z][A-Z0-9]+\[\.\.\]\S*", "NODE", line)       # IR nodes rendered in a message
    line = re.sub(r"\([A-Z0-9]\)", "(AXIS)", line)
    line = re.sub(r"'[A-Za-z_][A-Za-z0-9_]*'", "'NAME'", line)
    line = re.sub(r"`[^`]*`", "`ID`", line)
    line = re.sub(r"\b[0-9a-f]{12,}\b", "HASH", line)
    line = re.sub(r"\d+", "#", line)
    return line[:160]


def classify(exc: BaseException) -> Outcome:
    from lfm2jit import DslError            # the public one; subclasses (a located AutodiffError, say) count too
    name = type(exc).__name__
    text = f"{name}: {exc}"
    if name == "ShaderCompileError":
        return Outcome("invalid_wgsl", text)
    if isinstance(exc, DslError):
        line, col = getattr(exc, "line", 0) or 0, getattr(exc, "column", 0) or 0
        return Outcome("refused" if line >= 1 and col >= 1 else "unlocated", text)
    return Outcome("foreign", text + _where(exc))


def _where(exc: BaseException) -> str:
    """The innermost compiler frames an exception came through (not the fuzzer's own)."""
    frames = [f for f in traceback.extract_tb(exc.__traceback__)
              if "lfm2jit/" in f.filename.replace("\\", "/") and "tests/fuzz/" not in f.filename.replace("\\", "/")]
    if not frames:
        return ""
    def short(f):
        path = f.filename.replace("\\", "/")
        return f"{path[path.rindex('lfm2jit/'):]}:{f.lineno} in {f.name}"
    return "\n" + "\n".join(f"  at {short(f)}" for f in frames[-3:])


# ---------------------------------------------------------------- the reference side
@dataclass
class Reference:
    inputs: dict                  # name -> numpy array (f32/f16/i32/u32 values) or float (scalar)
    outputs: dict                 # name -> float64 / int64 array
    spread: dict                  # name -> realistic rounding spread (max abs)
    decisions: dict
    disc_stable: bool
    kink_stable: bool
    tries: int


def grouped_ends(kernel) -> dict:
    """The inputs that grouped GEMMs take as ``ends`` -> (the row axis, whether every such call is
    masked to its owned rows: where(<a condition reading those ends>, the call, ..))."""
    found: dict = {}
    masked: dict = {}
    for _, e in kernel.body:
        for n in walk(e):
            if isinstance(n, Fn) and n.name in GROUPED and isinstance(n.args[2], Ref):
                found.setdefault(n.args[2].name, [])
                found[n.args[2].name].append(n)
            if isinstance(n, Fn) and n.name == "where" and isinstance(n.args[1], Fn) and n.args[1].name in GROUPED \
                    and isinstance(n.args[1].args[2], Ref) \
                    and any(isinstance(m, Ref) and m.name == n.args[1].args[2].name for m in walk(n.args[0])):
                masked[n.args[1].args[2].name] = masked.get(n.args[1].args[2].name, 0) + 1
    checker = check(kernel)
    return {name: (checker.ty(calls[0].args[0]).shape[0], masked.get(name, 0) == len(calls))
            for name, calls in found.items()}


def draw_ends(rng: np.random.Generator, experts: int, rows: int, short: bool) -> np.ndarray:
    """A running sum of the experts' row counts (some experts empty): ending at the row count, or
    (``short``) below it, so the rows past the last end belong to no expert."""
    total = rows if not short else int(rng.integers(0, rows)) if rows > 0 else 0
    cuts = np.sort(rng.integers(0, total + 1, size=experts - 1))
    if experts > 1 and rng.random() < 0.3:          # a run of empty experts
        cuts[:int(rng.integers(1, experts))] = cuts[0]
    return np.concatenate([cuts, [total]]).astype(np.int32)


def short_ends(case: Case, inputs: dict) -> list[str]:
    """The ends inputs whose last end leaves rows to no expert at this call."""
    out = []
    for name, (rows, _) in grouped_ends(case.kernel).items():
        if name in inputs and int(np.asarray(inputs[name])[-1]) < case_size(case, rows):
            out.append(name)
    return out


def sample_inputs(case: Case, rng: np.random.Generator) -> dict:
    """Every input's value, in the shape the call passes it (a left-out input: its default over all
    its declared axes). A grouped GEMM's ends: a running sum of row counts (``draw_ends``), below
    the row count only where every call taking it is masked to its owned rows."""
    out = {}
    ends = grouped_ends(case.kernel) if any(p.dtype == "i32" and len(p.shape) == 1 for p in case.kernel.inputs) else {}
    for p in case.kernel.inputs:
        if not p.shape:
            v = float(np.float32(rng.uniform(*SCALAR_RANGE)))
            out[p.name] = float(p.default) if p.name in case.left_out else v
            continue
        dropped = () if p.name in case.left_out else case.dropped     # a left-out input has all its axes
        shape = tuple(case_size(case, a) for a in passed_shape(p, dropped))
        lo, hi = INPUT_RANGE[p.dtype]
        if p.name in ends and p.name not in case.left_out:
            rows, masked = ends[p.name]
            v = draw_ends(rng, shape[0], case_size(case, rows), masked and rng.random() < 0.5)
        elif p.dtype in INTS:
            v = rng.integers(lo, hi + 1, size=shape)
        else:
            v = rng.uniform(lo, hi, size=shape)
        if p.name in case.left_out:
            v = np.full(shape, p.default)
        out[p.name] = v.astype(_np_dtype(p.dtype))
    return out


def output_shape(case: Case, o) -> tuple:
    """The shape the engine returns output o in (without the optional axes the inputs left out)."""
    passed = {p.name for p in case.kernel.inputs if p.name not in case.left_out}
    gone = left_out_axes(case.kernel, case.dropped, passed)
    return tuple(case_size(case, a) for a in returned_shape(o, gone))


POISON = {"f32": np.nan, "f16": np.nan, "i32": -999999937, "u32": 3999999943}


def bucketed(n: int, bucket: int) -> int:
    return -(-n // bucket) * bucket


def case_size(case: Case, axis: str) -> int:
    return int(axis) if axis.isdigit() else case.sizes[axis]


def all_sizes(case: Case) -> dict:
    return {a: case_size(case, a) for a in case.kernel.axes()}


def _same(d1: dict, d2: dict, kinds) -> bool:
    for key, v in d1.items():
        if key[0] in kinds:
            w = d2.get(key)
            if w is None or w.shape != v.shape or not np.array_equal(v, w):
                return False
    return True


def reference(case: Case, checker: Checker, tries: int = 8) -> Reference:
    rng = np.random.default_rng(case.data_seed)
    sizes = all_sizes(case)
    best = None
    for attempt in range(1, tries + 1):
        inputs = sample_inputs(case, rng)
        ev = Evaluator(case.kernel, checker, sizes)
        with np.errstate(all="ignore"):
            outs = ev.run(inputs)
        outs = {o.name: outs[o.name].reshape(output_shape(case, o)) for o in case.kernel.outputs}
        if not all(np.all(np.isfinite(v)) for v in outs.values()):
            continue
        spread = {n: 0.0 for n in outs}
        disc = kink = True
        for _ in range(3):
            nev = Evaluator(case.kernel, checker, sizes, Noise(rng, NOISE_SCALE))
            with np.errstate(all="ignore"):
                nouts = nev.run(inputs)
            for n, v in outs.items():
                d = np.abs(nouts[n] - v)
                spread[n] = max(spread[n], float(np.nanmax(d, initial=0.0)) / NOISE_SCALE
                                if np.all(np.isfinite(d)) else np.inf)
            disc &= _same(ev.decisions, nev.decisions, ("disc",))
            kink &= _same(ev.decisions, nev.decisions, ("kink",))
        kink &= ev.ties == 0
        disc &= ev.near == 0
        ref = Reference(inputs, outs, spread, ev.decisions, disc, kink and disc, attempt)
        if disc and kink:
            return ref
        if best is None or (disc and not best.disc_stable):
            best = ref
    if best is None:
        raise ModelError("the reference is not finite for any sampled input")
    return best


# ---------------------------------------------------------------- the engine side
class Runner:
    """Runs cases on one wgpu device; a fresh engine after any failure, so no state leaks."""

    def __init__(self, ctx=None, backward: bool = True):
        from lfm2jit import WgpuContext
        self.ctx = ctx if ctx is not None else WgpuContext.create()
        self.backward = backward
        self.engine = None
        self._fresh_engine()

    @property
    def has_f16(self) -> bool:
        return bool(self.ctx.has_f16)

    def _fresh_engine(self):
        from lfm2jit import ComputeEngine
        self.engine = None
        gc.collect()
        self.engine = ComputeEngine(self.ctx)

    def upload(self, arr, dtype, axes=None, case: Case | None = None):
        """A tensor holding arr; with ``case.poison`` and axes (the tensor's axis names, as passed)
        led by T (after axes of size 1), in a buffer of bucketed(T) rows, the padded ones poisoned."""
        arr = np.array(arr, order="C")        # not ascontiguousarray: it makes a 0-d array 1-d
        if case is not None and case.poison and axes is not None and SEQ in axes:
            at = list(axes).index(SEQ)
            t = arr.shape[at]
            tb = bucketed(t, case.bucket)
            if tb > t and all(n == 1 for n in arr.shape[:at]):
                from lfm2jit import Tensor
                pad = list(arr.shape)
                pad[at] = tb
                full = np.full(pad, POISON[dtype], dtype=arr.dtype)
                full[(slice(None),) * at + (slice(0, t),)] = arr
                base = self.engine.tensor(full, dtype=dtype)
                return Tensor(self.engine.ctx, base.buffer, arr.shape, base.dtype, capacity=base.capacity, base=base)
        return self.engine.tensor(arr, dtype=dtype)

    def run(self, case: Case) -> Result:
        checker = check(case.kernel)            # the case must be well-typed by the fuzzer's model
        ref = reference(case, checker)
        src = kernel_text(case.kernel)
        from lfm2jit import compile_source
        try:
            kernel = compile_source(src, FILENAME)[case.kernel.name]
        except Exception as e:  # noqa: BLE001 - every exception is a verdict
            return Result(case, classify(e), Outcome("n/a", "the forward did not compile"))
        case.meta["gemms"] = fused_gemms(kernel)
        fwd, got = self.forward(case, kernel, ref)
        if fwd.cls not in ("ok", "wrong", "skipped", "refused"):
            self._fresh_engine()
        bwd = self.backward_check(case, kernel, ref, got) if self.backward else Outcome("n/a", "--no-backward")
        if bwd.cls not in ("ok", "wrong", "skipped", "n/a", "refused"):
            self._fresh_engine()
        return Result(case, fwd, bwd)

    def _args(self, case: Case, ref: Reference) -> dict:
        args = {}
        for p in case.kernel.inputs:
            if p.name in case.left_out:
                continue
            v = ref.inputs[p.name]
            args[p.name] = v if not p.shape else self.upload(v, p.dtype, passed_shape(p, case.dropped), case)
        return args

    def forward(self, case: Case, kernel, ref: Reference) -> tuple[Outcome, dict | None]:
        try:
            args = self._args(case, ref)
            out = self.engine.run(kernel, bucket=case.bucket, dims=dict(case.sizes), **args)
            got = {o.name: out[o.name].numpy() for o in case.kernel.outputs}
        except Exception as e:  # noqa: BLE001
            return classify(e), None
        if not ref.disc_stable:
            return Outcome("skipped", "inputs within rounding of a discontinuity"), got
        return compare_outputs(case, ref, got), got

    def backward_check(self, case: Case, kernel, ref: Reference, fwd_got: dict | None = None) -> Outcome:
        """The saved forward outputs a backward reads are the engine's own forward results, as a user
        passes them (a reduction max's gradient compares entries with the saved maximum bit for bit);
        the reference's values stand in only where the forward did not run. The call passes every
        forward argument (as a user does; the engine takes sizes from those it does not read), except
        in cases with dropped axes and an odd data seed, where it passes only those the backward reads."""
        k = case.kernel
        wrt = [p.name for p in k.inputs if p.shape and p.dtype in FLOATS]
        cots = [o.name for o in k.outputs if o.dtype in FLOATS]
        if not wrt or not cots:
            return Outcome("n/a", "no float input or no float output")
        from lfm2jit import grad
        rng = np.random.default_rng(case.data_seed + 1)
        cot = {}
        gone = left_out_axes(k, case.dropped, {p.name for p in k.inputs if p.name not in case.left_out})
        returned = {o.name: returned_shape(o, gone) for o in k.outputs}
        for o in k.outputs:
            if o.name in cots:
                shape = output_shape(case, o)
                cot[o.name] = rng.uniform(-1, 1, size=shape).astype(np.float32 if o.dtype == "f32" else np.float16)
        try:
            bwd = grad(kernel, wrt=wrt, cotangents=cots)
            args = self._args(case, ref)
            if case.dropped and case.data_seed % 2:
                # only the arguments the backward reads (sizes come from dims=): a forward argument it
                # does not read, passed without its optional axes, is a known engine failure of its own
                args = {n: v for n, v in args.items() if n in bwd.inputs or n in bwd.scalars}
            outputs = {o.name: o for o in k.outputs}
            for name in bwd.inputs:
                if name in outputs and name not in args:
                    o = outputs[name]
                    saved = fwd_got[name] if fwd_got is not None else ref.outputs[name].astype(_np_dtype(o.dtype))
                    args[name] = self.upload(saved, o.dtype, returned[name], case)
            for name, v in cot.items():    # only the cotangents the backward reads (it refuses others)
                if f"d_{name}" in bwd.inputs:
                    args[f"d_{name}"] = self.upload(v, outputs[name].dtype, returned[name], case)
            gone_bwd = _left_out_by_call(k, args)
            res = self.engine.run(bwd, bucket=case.bucket, dims=dict(case.sizes), **args)
            got = {name: res[f"d_{name}"].numpy() for name in wrt}
        except Exception as e:  # noqa: BLE001
            return classify(e)
        if not ref.kink_stable:
            return Outcome("skipped", "inputs within rounding of a kink or a max tie")
        short = short_ends(case, ref.inputs)
        if short:
            # a grouped GEMM's gradient in x (and scale) is, like its product, unspecified on the rows
            # past ends[E-1] (grouped_matmul_dx leaves them as they were)
            return Outcome("skipped", f"rows past the last end of {short}: their gradient is unspecified")
        saved = [n for n in bwd.inputs if n in outputs and n not in {p.name for p in k.inputs}]
        if fwd_got is None and saved and any(isinstance(n, Red) and n.fn == "max" for _, e in k.body for n in walk(e)):
            # a max reduction's gradient compares entries with the saved maximum bit for bit: the
            # reference's rounding of it is no stand-in for the engine's own forward result
            return Outcome("skipped", f"the forward did not run and the backward reads saved {saved} of a max reduction")
        inputs = {p.name: p for p in k.inputs}
        want = {n: tuple(case_size(case, a) for a in returned_shape(inputs[n], gone_bwd)) for n in wrt}
        return compare_gradients(case, ref, got, cot, rng, want)


def _left_out_by_call(k, args: dict) -> set:
    """The optional axes a backward call's tensors leave out (forward inputs, saved outputs and
    cotangents d_<output>, each declared as the forward declares it)."""
    decls = {p.name: p for p in k.inputs + k.outputs}
    decls.update({f"d_{o.name}": o for o in k.outputs})
    gone: set = set()
    for name, v in args.items():
        p = decls.get(name)
        if p is not None and hasattr(v, "shape") and p.shape:
            gone.update(p.optional[:len(p.shape) - len(v.shape)])
    return gone


def _np_dtype(dtype):
    return {"f32": np.float32, "f16": np.float16, "i32": np.int32, "u32": np.uint32}[dtype]


def compare_outputs(case: Case, ref: Reference, got: dict) -> Outcome:
    rtol = 3e-3 if case.kernel.uses_f16() else 1e-4
    worst = (0.0, "")
    for o in case.kernel.outputs:
        want = ref.outputs[o.name]
        g = np.asarray(got[o.name])
        if g.shape != want.shape:
            return Outcome("wrong", f"output {o.name}: shape {list(g.shape)}, expected {list(want.shape)}", np.inf)
        if o.dtype in INTS:
            bad = g.astype(np.int64) != want
            if np.any(bad):
                i = np.argwhere(bad)[0]
                return Outcome("wrong", f"output {o.name} ({o.dtype}): {int(bad.sum())} of {bad.size} entries differ, "
                               f"e.g. at {tuple(int(x) for x in i)} got {g[tuple(i)]} want {want[tuple(i)]}", np.inf)
            continue
        g = g.astype(np.float64)
        if not np.all(np.isfinite(g)):
            i = np.argwhere(~np.isfinite(g))[0]
            return Outcome("wrong", f"output {o.name}: non-finite {g[tuple(i)]} at {tuple(int(x) for x in i)}, "
                           f"want {want[tuple(i)]:.6g}", np.inf)
        scale = float(np.abs(want).max(initial=0.0))
        err = np.abs(g - want)
        tol = rtol * scale + 8.0 * ref.spread[o.name] + 1e-6
        emax = float(err.max(initial=0.0))
        ratio = emax / tol
        if ratio > worst[0]:
            i = np.unravel_index(int(err.argmax()), err.shape) if err.size else ()
            at = tuple(int(x) for x in i)
            worst = (ratio, f"output {o.name}: max error {emax:.3g} (relative {emax / max(scale, 1e-30):.3g}) at {at}: "
                            f"got {g[at]:.6g} want {want[at]:.6g}; tolerance {tol:.3g}")
    if worst[0] > 1.0:
        return Outcome("wrong", worst[1], worst[0])
    return Outcome("ok", worst[1], worst[0])


def compare_gradients(case: Case, ref: Reference, got: dict, cot: dict, rng, want_shapes=None) -> Outcome:
    """want_shapes: the shape each gradient comes back in (its input's, without the optional axes the
    backward call's tensors leave out); the values are then compared in the input's own shape."""
    k = case.kernel
    checker = check(k)
    sizes = all_sizes(case)
    f16 = k.uses_f16()
    rel_spread = max((ref.spread[n] / max(float(np.abs(v).max(initial=0.0)), 1e-30)
                      for n, v in ref.outputs.items() if n in cot), default=0.0)
    btol = max(1.5e-2 if f16 else 1e-3, 100.0 * rel_spread)
    # an absolute floor: a local derivative computed from a rounded value (1 - tanh^2 at saturation,
    # from the saved output) is off by ~ an ulp of 1, absolute, so a gradient that saturation makes
    # tiny is off relatively. The ulp is the saved value's: f16's (2^-11 near 1) where the kernel
    # stores f16, as PyTorch's tanh backward from an f16 output is (seed 2004696725: tanh(-4) saved
    # as f16 gives 1 - y^2 = 0.00098 for 0.00134).
    ulp = 2.0**-11 if f16 else 2.0**-23
    atol = (2.0 if f16 else 16.0) * ulp * sum(float(np.abs(c).sum()) for c in cot.values())
    cots = {n: v.astype(np.float64) for n, v in cot.items()}

    def loss(inputs):
        ev = Evaluator(k, checker, sizes)
        with np.errstate(all="ignore"):
            outs = ev.run(inputs)
        return sum(float((outs[n].reshape(c.shape) * c).sum()) for n, c in cots.items()), ev.decisions

    base_inputs = {n: (v if np.isscalar(v) else np.asarray(v, dtype=np.float64)) for n, v in ref.inputs.items()}
    worst = (0.0, "")
    checked = skipped = 0
    for name, g in got.items():
        g = np.asarray(g, dtype=np.float64)
        x = base_inputs[name]
        want_shape = (want_shapes or {}).get(name, x.shape)
        if g.shape != want_shape:
            return Outcome("wrong", f"d_{name}: shape {list(g.shape)}, expected {list(want_shape)}", np.inf)
        g = g.reshape(x.shape)
        if not np.all(np.isfinite(g)):
            return Outcome("wrong", f"d_{name}: non-finite entries", np.inf)
        gnorm = float(np.sqrt((g * g).sum()))
        for _ in range(DIRECTIONS):
            v = rng.standard_normal(x.shape)
            plus, minus = dict(base_inputs), dict(base_inputs)
            plus[name] = x + FD_STEP * v
            minus[name] = x - FD_STEP * v
            lp, dp = loss(plus)
            lm, dm = loss(minus)
            if not (_same(ref.decisions, dp, ("disc", "kink")) and _same(ref.decisions, dm, ("disc", "kink"))):
                skipped += 1
                continue
            checked += 1
            fd = (lp - lm) / (2 * FD_STEP)
            an = float((g * v).sum())
            scale = max(gnorm, abs(fd))
            err = abs(an - fd)
            ratio = 0.0 if scale < 1e-9 and err < 1e-9 else err / (btol * max(scale, 1e-30) + atol)
            if ratio > worst[0]:
                worst = (ratio, f"d_{name}: <grad, v> = {an:.6g} but finite differences give {fd:.6g} "
                                f"(|grad| {gnorm:.4g}, error {err / max(scale, 1e-30):.3g} relative, tolerance {btol:.3g})")
    if checked == 0:
        return Outcome("skipped", f"every direction crosses a kink ({skipped} skipped)")
    if worst[0] > 1.0:
        return Outcome("wrong", worst[1], worst[0])
    return Outcome("ok", worst[1], worst[0])
