"""The experts of an LFM2-MoE sparse block as a model layer calls them: SwiGLU MLPs over token slots
sorted by expert, forward and backward (kernels/experts.lk; the backward is grad() of those kernels).

    x        f32 [S, D]     each slot's token (the hidden states gathered in expert order)
    gate_up  [E, 2I, D]     transformers' experts.gate_up_proj: each expert's w1 rows, then its w3 rows
                            (f32; a frozen base also f16, or packed NF4 / int8 decoded in the GEMMs)
    down     [E, D, I]      experts.down_proj (w2), as gate_up
    ends     i32 [E]        where each expert's slots end: expert e owns slots ends[e-1] .. ends[e] - 1
    scale    f32 [S]        each slot's combine weight, applied in the down GEMM's epilogue
    y        f32 [S, D]     scale[s] * (silu(x w1^T) * (x w3^T)) w2^T for slot s's expert

Either expert tensor may carry a LoRA adapter (``ExpertLora``, PEFT's target_parameters): its
expert e's matrix is then W[e] + s B[e] A[e], applied as x W[e]^T + u B[e]^T with u = s x A[e]^T
[S, r] (expert_lora_down): the same product kernel runs again with u for x and B for the weight,
adding into the first one's output. Backward, for either (dz the product's gradient, x its input):
    du = dz B[e] and B.grad += dz^T u per expert (that second product's gradient; the down
    product's also adds its part of d_scale);  A.grad += s du^T x per expert and dx += s du A[e]
    (expert_lora_down's gradient).

Slots past ends[E-1] (a bucket's padding) belong to no expert: y and d_x there are left as they
were, the other per-slot values there (h, g, u, d_scale) are unspecified, and nothing there reaches
the owned slots or the weight gradients. The routing (top-k, sorting the slots, gathering x and
scattering y back to the tokens) is the layer's.
"""
from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache
from typing import Callable

from ..driver import Backward, grad
from . import library, precision, quantized


@dataclass
class ExpertLora:
    """A LoRA adapter on one expert tensor W [E, N, K]: W[e] + s * B[e] A[e]."""
    a: object           # [E, r, K]
    b: object           # [E, N, r]
    s: float


@dataclass
class ExpertActivations:
    """What the backward reuses: h [S, 2I] (x gate_up^T, both halves; None when the forward did
    not keep it and the backward computes it again) and the adapters' low-rank activations u [S, r]
    (None without one). The gate g = silu(h1) h2 is never kept: the backward computes it from h."""
    h: object
    u_gate_up: object = None
    u_down: object = None


@lru_cache(maxsize=None)
def _backward(kernel: str, wrt: tuple[str, ...]) -> Backward:
    return grad(library.get(kernel), wrt=list(wrt))


def _runner(engine, dtype: str) -> Callable:
    """engine.run of a kernel with activations of ``dtype``: the variant the tensors given make (a
    frozen f16 base's; with f16 activations, every tensor not given as f32; a quantized base's
    decoding variant, quantized.unpacked)."""
    def run(kernel, **args):
        kernel, args = quantized.unpacked(kernel, args)
        return precision.run(engine, kernel, dtype, **args)
    return run


def _low_rank(run, x, lora: ExpertLora | None, ends, bucket: int):
    if lora is None:
        return None
    return run("expert_lora_down", bucket=bucket, x=x, a=lora.a, ends=ends, s=lora.s)["u"]


def _gate_up(run, x, gate_up, ends, lora: ExpertLora | None, u, bucket: int):
    """h = x gate_up[e]^T (+ u B[e]^T with an adapter; u = s x A[e]^T, computed here when None)."""
    h = run("expert_gate_up", bucket=bucket, x=x, gate_up=gate_up, ends=ends)["h"]          # (S, 2I)
    if lora is not None:
        u = _low_rank(run, x, lora, ends, bucket) if u is None else u                       # (S, r)
        run("expert_gate_up", bucket=bucket, x=u, gate_up=lora.b, ends=ends, out={"h": h}, accumulate={"h"})
    return h, u


def _gate(run, h, bucket: int):
    slots, width = h.shape
    return run("expert_gate", bucket=bucket, h=h.view(slots, 2, width // 2))["g"]           # (S, I)


def experts_forward(engine, x, gate_up, down, ends, scale, *, bucket: int = 1, out=None,
                    accumulate: bool = False, lora_gate_up: ExpertLora | None = None,
                    lora_down: ExpertLora | None = None, keep_h: bool = True, dtype: str = "f32"):
    """y [S, D] (into ``out`` when given, added to it with ``accumulate``) and the activations the
    backward needs; ``lora_gate_up`` / ``lora_down``: the adapters on the expert tensors.
    ``keep_h=False`` keeps not even h (the largest): the backward runs the gate_up GEMM again.
    ``dtype``: the activation dtype ("f16": x, y and what is kept stored as f16; scale stays f32)."""
    run = _runner(engine, dtype)
    h, u1 = _gate_up(run, x, gate_up, ends, lora_gate_up, None, bucket)
    g = _gate(run, h, bucket)
    kwargs = {"out": {"y": out}, "accumulate": {"y"} if accumulate else ()} if out is not None else {}
    y = run("expert_down", bucket=bucket, g=g, down=down, ends=ends, scale=scale, **kwargs)["y"]
    u2 = _low_rank(run, g, lora_down, ends, bucket)                                           # (S, r)
    if lora_down is not None:                                                                 # y += scale u2 B[e]^T
        run("expert_down", bucket=bucket, g=u2, down=lora_down.b, ends=ends, scale=scale, out={"y": y},
             accumulate={"y"})
    return y, ExpertActivations(h if keep_h else None, u1, u2)


def experts_backward(engine, x, gate_up, down, ends, scale, saved: ExpertActivations, d_y, *, bucket: int = 1,
                     weights: bool = True, out=None, accumulate=(), lora_gate_up: ExpertLora | None = None,
                     lora_down: ExpertLora | None = None, trained: Callable = lambda t: False,
                     dtype: str = "f32") -> dict:
    """Gradients from d_y [S, D]: d_x [S, D] and d_scale [S], and with ``weights`` d_gate_up
    [E, 2I, D] and d_down [E, D, I] (each expert's sum over its own slots, in a fixed order). ``out``
    and ``accumulate`` name tensors to write or add the weight gradients into (gradient accumulation).
    The adapters' A and B for which ``trained(tensor)`` holds get their gradients added into their
    ``.grad``. ``dtype``: the forward's activation dtype; d_scale is f32 either way (the router's
    gradient comes from it)."""
    out, engine_run = dict(out or {}), _runner(engine, dtype)
    out.setdefault("d_scale", engine.empty(scale.shape, "f32"))

    def run(kernel: str, wrt: tuple[str, ...], into=None, adds=(), **args):
        """``kernel``'s gradients in ``wrt``, written into ``out`` (added where ``accumulate`` says)
        or, given ``into``, into those tensors (added where ``adds`` says)."""
        bwd = _backward(kernel, wrt)
        targets, added = (into, set(adds)) if into is not None else (out, set(accumulate))
        mine = {n: t for n, t in targets.items() if n in bwd.outputs}
        args = {n: t for n, t in args.items() if n in bwd.inputs or n in bwd.scalars}
        return engine_run(bwd, bucket=bucket, out=mine, accumulate=added & set(mine), **args)

    def low_rank_backward(lora: ExpertLora, x_in, d_u, d_x) -> None:
        """A.grad += s du^T x per expert and d_x += s du A[e]: expert_lora_down's gradient."""
        train_a = trained(lora.a)
        run("expert_lora_down", ("x",) + (("a",) if train_a else ()),
            into={"d_x": d_x, **({"d_a": lora.a.grad} if train_a else {})}, adds={"d_x", "d_a"},
            x=x_in, a=lora.a, ends=ends, s=lora.s, d_u=d_u)

    # what the forward did not keep, as it computed it: the same kernels give bit-identical values
    h = saved.h if saved.h is not None else _gate_up(engine_run, x, gate_up, ends, lora_gate_up, saved.u_gate_up,
                                                     bucket)[0]
    g = _gate(engine_run, h, bucket)
    down_grads = run("expert_down", ("g", "scale") + (("down",) if weights else ()),
                     g=g, down=down, ends=ends, scale=scale, d_y=d_y)
    if lora_down is not None:       # y += scale u2 B[e]^T: d_u2, B's gradient and its part of d_scale
        train_b = trained(lora_down.b)
        d_u = run("expert_down", ("g", "scale") + (("down",) if train_b else ()),
                  into={"d_scale": down_grads["d_scale"], **({"d_down": lora_down.b.grad} if train_b else {})},
                  adds={"d_scale", "d_down"}, g=saved.u_down, down=lora_down.b, ends=ends, scale=scale,
                  d_y=d_y)["d_g"]
        low_rank_backward(lora_down, g, d_u, down_grads["d_g"])
    slots, width = h.shape
    d_h = run("expert_gate", ("h",), h=h.view(slots, 2, width // 2), d_g=down_grads["d_g"])["d_h"]
    d_h = d_h.view(slots, width)
    up_grads = run("expert_gate_up", ("x",) + (("gate_up",) if weights else ()),
                   x=x, gate_up=gate_up, ends=ends, d_h=d_h)
    if lora_gate_up is not None:    # h += u1 B[e]^T: d_u1 and B's gradient
        train_b = trained(lora_gate_up.b)
        d_u = run("expert_gate_up", ("x",) + (("gate_up",) if train_b else ()),
                  into={"d_gate_up": lora_gate_up.b.grad} if train_b else {}, adds={"d_gate_up"},
                  x=saved.u_gate_up, gate_up=lora_gate_up.b, ends=ends, d_h=d_h)["d_x"]
        low_rank_backward(lora_gate_up, x, d_u, up_grads["d_x"])
    grads = {"d_x": up_grads["d_x"], "d_scale": down_grads["d_scale"]}
    if weights:
        grads.update(d_gate_up=up_grads["d_gate_up"], d_down=down_grads["d_down"])
    return grads
