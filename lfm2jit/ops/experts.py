"""The experts of an LFM2-MoE sparse block as a model layer calls them: SwiGLU MLPs over token slots
sorted by expert, forward and backward (kernels/experts.lk; the backward is grad() of those kernels).

    x        f32 [S, D]     each slot's token (the hidden states gathered in expert order)
    gate_up  [E, 2I, D]     transformers' experts.gate_up_proj: each expert's w1 rows, then its w3 rows
                            (f32, or f16 for a frozen base)
    down     [E, D, I]      experts.down_proj (w2), f32 or f16
    ends     i32 [E]        where each expert's slots end: expert e owns slots ends[e-1] .. ends[e] - 1
    scale    f32 [S]        each slot's combine weight, applied in the down GEMM's epilogue
    y        f32 [S, D]     scale[s] * (silu(x w1^T) * (x w3^T)) w2^T for slot s's expert

Slots past ends[E-1] (a bucket's padding) belong to no expert: y and d_x there are left as they
were, the other per-slot values there (h, g, d_scale) are unspecified, and nothing there reaches the
owned slots or the weight gradients. The routing (top-k, sorting the
slots, gathering x and scattering y back to the tokens) is the layer's.
"""
from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

from ..driver import Backward, grad
from . import library


@dataclass
class ExpertActivations:
    """What the backward reuses: h [S, 2I] (x gate_up^T, both halves) and g [S, I] (the gate)."""
    h: object
    g: object


@lru_cache(maxsize=None)
def _backward(kernel: str, wrt: tuple[str, ...]) -> Backward:
    return grad(library.get(kernel), wrt=list(wrt))


def _f16(**tensors) -> tuple[str, ...]:
    """The names of the tensors stored as f16 (a frozen base): the kernels' dtype variant."""
    return tuple(n for n, t in tensors.items() if getattr(t, "dtype", None) == "f16")


def experts_forward(engine, x, gate_up, down, ends, scale, *, bucket: int = 1, out=None,
                    accumulate: bool = False):
    """y [S, D] (into ``out`` when given, added to it with ``accumulate``) and the activations the
    backward needs."""
    h = engine.run("expert_gate_up", bucket=bucket, f16=_f16(x=x, gate_up=gate_up), x=x, gate_up=gate_up,
                   ends=ends)["h"]
    slots, width = h.shape
    g = engine.run("expert_gate", bucket=bucket, h=h.view(slots, 2, width // 2))["g"]
    kwargs = {"out": {"y": out}, "accumulate": {"y"} if accumulate else ()} if out is not None else {}
    y = engine.run("expert_down", bucket=bucket, f16=_f16(down=down), g=g, down=down, ends=ends, scale=scale,
                   **kwargs)["y"]
    return y, ExpertActivations(h, g)


def experts_backward(engine, x, gate_up, down, ends, scale, saved: ExpertActivations, d_y, *, bucket: int = 1,
                     weights: bool = True, out=None, accumulate=()) -> dict:
    """Gradients from d_y [S, D]: d_x [S, D] and d_scale [S], and with ``weights`` d_gate_up
    [E, 2I, D] and d_down [E, D, I] (each expert's sum over its own slots, in a fixed order). ``out``
    and ``accumulate`` name tensors to write or add the weight gradients into (gradient accumulation)."""
    out = dict(out or {})

    def run(kernel: str, wrt: tuple[str, ...], **args):
        bwd = _backward(kernel, wrt)
        mine = {n: t for n, t in out.items() if n in bwd.outputs}
        args = {n: t for n, t in args.items() if n in bwd.inputs}
        return engine.run(bwd, bucket=bucket, out=mine, accumulate={n for n in accumulate if n in mine},
                          f16=_f16(**args), **args)
    down_grads = run("expert_down", ("g", "scale") + (("down",) if weights else ()),
                     g=saved.g, down=down, ends=ends, scale=scale, d_y=d_y)
    slots, width = saved.h.shape
    d_h = run("expert_gate", ("h",), h=saved.h.view(slots, 2, width // 2), d_g=down_grads["d_g"])["d_h"]
    up_grads = run("expert_gate_up", ("x",) + (("gate_up",) if weights else ()),
                   x=x, gate_up=gate_up, ends=ends, d_h=d_h.view(slots, width))
    grads = {"d_x": up_grads["d_x"], "d_scale": down_grads["d_scale"]}
    if weights:
        grads.update(d_gate_up=up_grads["d_gate_up"], d_down=down_grads["d_down"])
    return grads
