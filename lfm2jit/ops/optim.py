"""Optimizer steps and the global gradient norm over lists of tensors (kernels: kernels/optim.lk).

Everything here records dispatches and returns; nothing reads a tensor back except
``global_grad_norm``, which reads one 8-byte buffer (``grad_sumsq`` records its passes and
``norm_of`` turns the two numbers read back into the norm, for callers that read it later). Tensors of any shape are processed through
flat views ``[n]``; arguments are checked before any GPU work, so a bad call changes nothing.

    norm, finite = global_grad_norm(engine, grads)
    coef = min(1.0, max_norm / (norm + 1e-6))            # torch.nn.utils.clip_grad_norm_
    adamw_step(engine, params, grads, ms, vs, lr=1e-3, betas=(0.9, 0.999), eps=1e-8,
               weight_decay=0.01, step=k, gscale=coef / loss_scale)

Hyperparameters and the step count only reach kernels as runtime scalars, so a new lr or step
never compiles anything (``adamw_scalars`` / ``sgd_scalars`` give them by name, so a recorded step
replays with new ones); pipelines are per tensor size (and per power of two of rows for the norm).
The in-place updates run one dispatch per arena run that all their lists share (runtime/arena.py:
a model's parameters, gradients and optimizer state are carved in one order), else per tensor.

Global norm, in three passes and one readback:
  pass 1, one dispatch per tensor, or per run of tensors carved side by side out of an arena
          (runtime/arena.py: a model's gradients are, so ~150 tensors take a dispatch or two;
          their padding is zero), the only pass over the gradients: the flat span is read as
          rows of ``chunk`` elements (its last row masked past the end), one workgroup per row,
          giving per-row sums of squares. They land side by side in one partials buffer, each
          span's at an offset aligned for binding; the gaps (and the padding to whole rows of
          pass 2) are cleared first, a recorded buffer clear of that small buffer.
  pass 2, one dispatch: rows of PASS2_CHUNK partials summed, and the non-finite partials counted
          (an inf or NaN element makes its row's sum inf or NaN).
  pass 3, one dispatch: tot = [sum of squares, non-finite count], the 8 bytes read back.
"""
from __future__ import annotations

import math
import numbers
from typing import Sequence

from ..runtime import arena
from ..runtime.tensor import ITEMSIZE, Tensor

CHUNK = 4096              # elements per row of the norm's first pass (one workgroup each); longer rows ran slower (benches/results/h200_grad_norm_chunks.log)
PASS2_CHUNK = 1024        # partial sums per row of the second pass
MAX_ROWS = 1 << 24        # row and column indices travel as f32: exact up to 2^24
PARTIALS_BUCKET = 1 << 20  # pass 3 loops to the runtime length; one pipeline for every length up to this
F32_MAX = 3.4028234663852886e38   # the largest finite f32


# ---- argument checks (all before any GPU work) ----

def _tensor_list(name: str, xs, n: int | None = None) -> list[Tensor]:
    if isinstance(xs, Tensor) or not isinstance(xs, Sequence):
        raise TypeError(f"{name} must be a list of Tensors, got {type(xs).__name__}")
    xs = list(xs)
    for i, x in enumerate(xs):
        if not isinstance(x, Tensor):
            raise TypeError(f"{name}[{i}] must be a Tensor, got {type(x).__name__}")
        if x.dtype != "f32":
            raise ValueError(f"{name}[{i}] has dtype {x.dtype}; optimizer kernels take f32 tensors")
    if n is not None and len(xs) != n:
        raise ValueError(f"{name} has {len(xs)} tensors but params has {n}")
    return xs


def _same_shapes(params: list[Tensor], **others: list[Tensor]) -> None:
    for name, xs in others.items():
        for i, (p, x) in enumerate(zip(params, xs)):
            if x.shape != p.shape:
                raise ValueError(f"{name}[{i}] has shape {list(x.shape)} but params[{i}] has {list(p.shape)}")


def _where(t: Tensor) -> tuple[int, int]:
    return id(t.buffer), t.offset


def _distinct(**lists: list[Tensor]) -> None:
    """No tensor may be updated twice (a parameter listed twice, m and v one buffer, ...)."""
    seen: dict[tuple[int, int], str] = {}
    for name, xs in lists.items():
        for i, x in enumerate(xs):
            if x.size == 0:
                continue
            key = _where(x)
            if key in seen:
                raise ValueError(f"{name}[{i}] is the same memory as {seen[key]}; each updated tensor must be distinct")
            seen[key] = f"{name}[{i}]"


def _read_apart(grads: list[Tensor], **updated: list[Tensor]) -> None:
    """A gradient may not live in a buffer its own dispatch writes (WebGPU forbids reading and
    writing one buffer in a dispatch; checked here so no earlier tensor is updated first)."""
    for i, g in enumerate(grads):
        for name, xs in updated.items():
            if xs[i].buffer is g.buffer and g.size:
                raise ValueError(f"grads[{i}] shares a buffer with {name}[{i}], which the same step updates")


def _real(name: str, v, lo: float | None = None, hi: float | None = None, hi_open: bool = False) -> float:
    if not isinstance(v, numbers.Real) or isinstance(v, bool) or not math.isfinite(float(v)):
        raise ValueError(f"{name} must be a finite number, got {v!r}")
    v = float(v)
    if lo is not None and v < lo:
        raise ValueError(f"{name} must be >= {lo}, got {v}")
    if hi is not None and (v >= hi if hi_open else v > hi):
        raise ValueError(f"{name} must be {'<' if hi_open else '<='} {hi}, got {v}")
    return v


def _step(step) -> int:
    if not isinstance(step, numbers.Integral) or isinstance(step, bool) or step < 1:
        raise ValueError(f"step must be an integer >= 1 (the first step is 1), got {step!r}")
    return int(step)


def _flat(t: Tensor) -> Tensor:
    return t.view((t.size,))


# ---- global gradient norm ----

def _row_view(t: Tensor, chunk: int) -> Tensor:
    """The flat tensor as [rows, chunk] rows, the last one running past the end (the kernel masks
    it). The binding stays the tensor's own capacity: reads past it are out-of-bounds reads, which
    WebGPU makes safe (zero or an in-bounds value), and the mask discards them."""
    rows = -(-t.size // chunk)
    return Tensor(t.ctx, t.buffer, (rows, chunk), t.dtype, capacity=t.capacity, offset=t.offset, base=t)


def _pow2(n: int) -> int:
    return 1 << max(0, n - 1).bit_length()


def global_grad_norm(engine, grads, *, chunk: int = CHUNK) -> tuple[float, bool]:
    """The L2 norm over every element of ``grads`` (what torch.nn.utils.clip_grad_norm_ computes),
    and whether it is usable: ``finite`` is False when an element is inf or NaN (``norm`` is then
    inf or NaN, as torch's is) or when the sum of squares overflows f32 (``norm`` is inf).
    Records three passes and reads back one 8-byte buffer."""
    tot = grad_sumsq(engine, grads, chunk=chunk)
    return norm_of(tot.numpy() if tot is not None else None)


def grad_sumsq(engine, grads, *, chunk: int = CHUNK) -> Tensor | None:
    """Record the three passes; f32[2] = [sum of squares, non-finite count] (None when no elements)."""
    grads = _tensor_list("grads", grads)
    if not isinstance(chunk, int) or isinstance(chunk, bool) or not 1 <= chunk <= MAX_ROWS:
        raise ValueError(f"chunk must be an integer in [1, {MAX_ROWS}], got {chunk!r}")
    align = max(1, engine.ctx.limits.get("min-storage-buffer-offset-alignment", 256) // ITEMSIZE["f32"])
    plan, total = [], 0
    for run in arena.runs(grads):                         # gradients side by side in an arena: one pass each run
        x = run.span
        rows = -(-x.size // chunk)
        if rows >= MAX_ROWS:
            position = {id(g): i for i, g in reversed(list(enumerate(grads)))}
            where = f"grads[{position[id(run.tensors[0])]}]" + (
                f" to grads[{position[id(run.tensors[-1])]}] (one arena run)" if len(run.tensors) > 1 else "")
            raise ValueError(f"{where} hold {x.size} elements: more than {MAX_ROWS - 1} rows of {chunk}; "
                             f"use a larger chunk")
        plan.append((x, rows, total))
        total += -(-rows // align) * align
    if not plan:
        return None
    rows2 = -(-total // PASS2_CHUNK)
    sq = engine.empty((rows2 * PASS2_CHUNK,))             # every run's row sums, side by side
    engine.zero_(sq)                                      # zeros in the gaps and the padding
    for x, rows, at in plan:
        last, tail = rows - 1, x.size - (rows - 1) * chunk
        engine.run("sumsq_rows", bucket=_pow2(rows), x=_row_view(x, chunk), last=float(last),
                   tail=float(tail), out={"sq": sq.rows(at, at + rows)})
    parts = engine.run("sum_rows", bucket=_pow2(rows2), x=sq.view((rows2, PASS2_CHUNK)))
    return engine.run("sum_partials", bucket=PARTIALS_BUCKET, **parts)["tot"]


def norm_of(tot) -> tuple[float, bool]:
    """(norm, finite) from grad_sumsq's two numbers, read back (None: no elements, norm 0)."""
    if tot is None:
        return 0.0, True
    sumsq, nonfinite = float(tot[0]), float(tot[1])
    norm = math.sqrt(sumsq) if sumsq >= 0 else math.nan       # NaN stays NaN; inf stays inf
    if nonfinite != 0 and math.isfinite(norm):
        norm = math.nan          # only a backend that broke NaN propagation in sums gets here
    return norm, nonfinite == 0 and math.isfinite(norm)


# ---- in-place updates ----

def scale_(engine, tensors, s: float) -> None:
    """x *= s for every tensor, in place; s = 0 writes exact zeros (even over inf or NaN)."""
    tensors = _tensor_list("tensors", tensors)
    s = _real("s", s)
    _distinct(tensors=tensors)
    for (x,) in _together(tensors):
        engine.run("scale_inplace", x=x, s=s)


def adamw_scalars(*, lr: float, betas=(0.9, 0.999), eps: float = 1e-8, weight_decay: float = 1e-2, step: int,
                  gscale: float = 1.0) -> dict[str, float]:
    """The adamw kernel's runtime scalars for one step, checked (a recorded step replays with these)."""
    if not isinstance(betas, Sequence) or len(betas) != 2:
        raise ValueError(f"betas must be a pair (beta1, beta2), got {betas!r}")
    b1 = _real("betas[0]", betas[0], 0.0, 1.0, hi_open=True)
    b2 = _real("betas[1]", betas[1], 0.0, 1.0, hi_open=True)
    lr, eps = _real("lr", lr, 0.0), _real("eps", eps, 0.0)
    wd, gscale, step = _real("weight_decay", weight_decay, 0.0), _real("gscale", gscale), _step(step)
    # torch computes these in double on the host; so do we, and the kernels get them as f32
    return dict(gscale=gscale, decay=1.0 - lr * wd, w1=1.0 - b1, b2=b2, w2=1.0 - b2,
                step_size=lr / (1.0 - b1 ** step), bc2_sqrt=math.sqrt(1.0 - b2 ** step), eps=eps)


def _gate(gate) -> dict:
    """The kernels' ``gate`` argument: step_gate's f32[3] on the device, or nothing (all ones)."""
    if gate is None:
        return {}
    if not isinstance(gate, Tensor) or gate.dtype != "f32" or tuple(gate.shape) != (3,):
        raise ValueError(f"gate must be step_gate's f32 tensor of shape [3], got {gate!r}")
    return {"gate": gate}


def step_gate_scalars(*, loss_scale: float = 1.0, max_norm: float | None = None) -> dict[str, float]:
    """The step_gate kernel's runtime scalars, checked (a recorded gate replays with these):
    1 / loss_scale, which must be an f32, and the clipping norm (F32_MAX: none)."""
    scale = _real("loss_scale", loss_scale)
    if not 0 < scale or not 1.0 / scale <= F32_MAX:
        raise ValueError(f"loss_scale must be > 0 with 1 / loss_scale an f32, got {loss_scale!r}")
    return dict(inv_scale=1.0 / scale, max_norm=F32_MAX if max_norm is None else _real("max_norm", max_norm, 0.0))


def step_gate(engine, tot: Tensor, loss: Tensor, *, loss_scale: float = 1.0, max_norm: float | None = None,
              out: Tensor | None = None) -> Tensor:
    """Record the step's gate, f32[3] = [clip coefficient / loss_scale, go, unscaled norm], from
    grad_sumsq's ``tot`` and the losses of the window's last pass, without reading anything back:
    the optimizer steps take it as ``gate`` and leave everything unchanged where go is 0 (inf or
    NaN gradients, norm or loss). The coefficient is torch.nn.utils.clip_grad_norm_'s on the
    unscaled norm (1 without ``max_norm``), computed in f32. ``out``: an f32[3] to write it into."""
    scalars = step_gate_scalars(loss_scale=loss_scale, max_norm=max_norm)
    outs = {} if out is None else {"out": _gate(out)}
    return engine.run("step_gate", tot=tot, loss=loss.view((loss.size,)), **scalars, **outs)["gate"]


def adamw_step(engine, params, grads, ms, vs, *, lr: float, betas=(0.9, 0.999), eps: float = 1e-8,
               weight_decay: float = 1e-2, step: int, gscale: float = 1.0, gate: Tensor | None = None) -> None:
    """One torch.optim.AdamW step (amsgrad=False) on every parameter, in place (p, m, v), with the
    gradients read as ``g * gscale`` (times gate[0], and no change where gate[1] is 0, with a
    ``step_gate`` gate). ``step`` counts from 1 (m and v start at zero before step 1)."""
    gate = _gate(gate)
    params = _tensor_list("params", params)
    n = len(params)
    grads, ms, vs = (_tensor_list(name, xs, n) for name, xs in (("grads", grads), ("ms", ms), ("vs", vs)))
    _same_shapes(params, grads=grads, ms=ms, vs=vs)
    _distinct(params=params, ms=ms, vs=vs)
    _read_apart(grads, params=params, ms=ms, vs=vs)
    scalars = adamw_scalars(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay, step=step, gscale=gscale)
    # zeros stay zeros only with eps > 0 (0 / (0 + eps)); with eps = 0 the padding between arena
    # slots would turn NaN, so each tensor is then its own dispatch
    for p, g, m, v in _together(params, grads, ms, vs, spans=scalars["eps"] > 0):
        engine.run("adamw", p=p, g=g, m=m, v=v, **scalars, **gate)


def _together(*lists, spans: bool = True):
    """Flat (p, g, state...) views to update: one per arena run shared by every list
    (runtime/arena.py; a model's parameters, gradients and optimizer state are carved in one
    order, so a step is a dispatch or two), else one per non-empty tensor."""
    if spans:
        return arena.runs_together(lists)
    return [piece for xs in zip(*lists) if xs[0].size for piece in arena.cut(*(_flat(x) for x in xs))]


def sgd_scalars(*, lr: float, momentum: float = 0.0, dampening: float = 0.0, weight_decay: float = 0.0,
                nesterov: bool = False, step: int, gscale: float = 1.0) -> dict[str, float]:
    """The runtime scalars of the sgd kernel (no momentum) or sgd_momentum kernel for one step, checked."""
    lr, momentum = _real("lr", lr, 0.0), _real("momentum", momentum, 0.0)
    dampening, wd = _real("dampening", dampening), _real("weight_decay", weight_decay, 0.0)
    gscale, step = _real("gscale", gscale), _step(step)
    if not isinstance(nesterov, bool):
        raise TypeError(f"nesterov must be a bool, got {nesterov!r}")
    if nesterov and (momentum <= 0 or dampening != 0):
        raise ValueError("nesterov momentum requires a momentum > 0 and zero dampening")
    if momentum == 0:
        return dict(gscale=gscale, lr=lr, wd=wd)
    return dict(gscale=gscale, lr=lr, wd=wd, momentum=momentum, damp=1.0 - dampening,
                nesterov=float(nesterov), first=float(step == 1))


def sgd_step(engine, params, grads, bufs=None, *, lr: float, momentum: float = 0.0, dampening: float = 0.0,
             weight_decay: float = 0.0, nesterov: bool = False, step: int, gscale: float = 1.0,
             gate: Tensor | None = None) -> None:
    """One torch.optim.SGD step on every parameter, in place, with gradients read as ``g * gscale``
    (and a ``step_gate`` gate as adamw_step takes it).

    With momentum, ``bufs`` are the momentum buffers (updated in place); on step 1 each is set to
    the gradient, as torch does when it creates them (their old contents are ignored).
    """
    gate = _gate(gate)
    params = _tensor_list("params", params)
    n = len(params)
    grads = _tensor_list("grads", grads, n)
    scalars = sgd_scalars(lr=lr, momentum=momentum, dampening=dampening, weight_decay=weight_decay,
                          nesterov=nesterov, step=step, gscale=gscale)
    _same_shapes(params, grads=grads)
    if "momentum" not in scalars:               # plain SGD: the sgd kernel
        if bufs is not None:
            _tensor_list("bufs", bufs, n)
        _distinct(params=params)
        _read_apart(grads, params=params)
        for p, g in _together(params, grads):
            engine.run("sgd", p=p, g=g, **scalars, **gate)
        return
    if bufs is None:
        raise ValueError("SGD with momentum needs bufs, one momentum buffer per parameter")
    bufs = _tensor_list("bufs", bufs, n)
    _same_shapes(params, bufs=bufs)
    _distinct(params=params, bufs=bufs)
    _read_apart(grads, params=params, bufs=bufs)
    for p, g, b in _together(params, grads, bufs):
        engine.run("sgd_momentum", p=p, g=g, buf=b, **scalars, **gate)
