"""The kernel calls every layer shares: linear (with its LoRA adapter, bias and fused residual),
rmsnorm and their backwards, on one model's parameters and activation dtype."""
from __future__ import annotations

import functools
from dataclasses import dataclass, field

from ... import grad
from ...ops import library, precision, quantized
from ...runtime import Tensor

_BACKWARDS: dict[tuple, object] = {}


def backward_of(name: str, wrt: tuple[str, ...] | None = None, cotangents: tuple[str, ...] | None = None):
    """The backward kernels of a shipped kernel, made once per (wrt, cotangents)."""
    key = (name, wrt, cotangents)
    if key not in _BACKWARDS:
        _BACKWARDS[key] = grad(library.get(name), list(wrt) if wrt else None, list(cotangents) if cotangents else None)
    return _BACKWARDS[key]


@dataclass
class LoraSaved:
    """What a layer's LoRA-adapted linears keep for backward."""
    dropout: bool                                          # a training pass: LoRA dropout was applied
    u: dict[str, Tensor] = field(default_factory=dict)     # module -> (T, r) s * dropout(x) A^T


class Kernels:
    """Kernel calls on ``model``'s parameters, adapters and activation dtype. ``trained_ids`` holds
    the parameters the running backward trains (set by Lfm2Model.backward). ``replaying``: the
    forward running is a backward's rerun of a checkpointed layer (Lfm2Model.checkpoint_layers),
    which keeps everything its backward reads and adds nothing to the model's routing statistics."""

    def __init__(self, model):
        self.model = model
        self.trained_ids: set[int] = set()
        self.replaying = False

    def run(self, kernel, dtype: str | None = None, **args) -> dict[str, Tensor]:
        """engine.run with the kernel's variant for the model's activation dtype (or ``dtype``:
        "f32" stores only the f16 tensors given as f16, as an MoE router's calls do); a weight held
        quantized (QuantizedWeight) is passed packed, to the kernel's variant decoding it."""
        kernel, args = quantized.unpacked(kernel, args)
        return precision.run(self.model.engine, kernel, dtype or self.model.activation_dtype, **args)

    def p(self, name: str) -> Tensor:
        return self.model._params[name]

    def buffer(self, name: str) -> Tensor:
        """A tensor of the checkpoint that is never trained (an MoE router's expert_bias)."""
        return self.model._buffers[name]

    def has(self, name: str) -> bool:
        return name in self.model._params

    def is_trained(self, t: Tensor) -> bool:
        return t.grad is not None and id(t) in self.trained_ids

    def trained(self, name: str) -> bool:
        """Whether the parameter ``name`` exists and the running backward trains it."""
        return self.has(name) and self.is_trained(self.p(name))

    def adapted(self, module: str) -> bool:
        return bool(self.model.lora and module in self.model.lora.by_module)

    def linear(self, x: Tensor, name: str, bucket: int, lora: LoraSaved | None = None,
               residual: Tensor | None = None, dtype: str | None = None) -> Tensor:
        """y = x W^T (+ residual) (+ b): torch.nn.Linear with W stored [out, in]; the residual is
        added in the GEMM's epilogue. A LoRA adapter's low-rank activation is kept in ``lora``.
        ``dtype``: the activation dtype of these calls, when not the model's (see ``run``)."""
        w, run = self.p(name + ".weight"), functools.partial(self.run, dtype=dtype)
        r = {"r": residual} if residual is not None else {}
        if self.adapted(name):
            y, u = self.model.lora.forward(run, x, name, w, bucket, dropout=bool(lora and lora.dropout), **r)
            if lora is not None:
                lora.u[name] = u
        else:
            y = run("linear", bucket=bucket, x=x, w=w, **r)["y"]
        if self.has(name + ".bias"):
            run("bias_add", bucket=bucket, y=y, b=self.p(name + ".bias"))
        return y

    def linear_backward(self, x: Tensor | None, name: str, dy: Tensor, bucket: int, lora: LoraSaved,
                        into: Tensor | None = None, gate: tuple[Tensor, Tensor] | None = None,
                        dtype: str | None = None):
        """y = x W^T (+ b): dx = dy W (new, or added into ``into``), W.grad += dy^T x, b.grad += sum dy.
        ``gate`` = (a, b): x is SwiGLU's silu(a) * b, and the gradients in a and b are returned
        instead ({"d_a", "d_b"}), stored by dx's GEMM from its epilogue; x may then be None when
        nothing else reads it (W and b frozen, no adapter). ``dtype``: as for ``linear``."""
        w, run = self.p(name + ".weight"), functools.partial(self.run, dtype=dtype)
        if self.adapted(name):
            dx = self.model.lora.backward(run, backward_of, self.is_trained, x, name, w, dy, bucket,
                                          lora.u.pop(name, None), dropout=lora.dropout, dx=into, gate=gate)
        elif gate is not None:
            dx = run(backward_of("swiglu_down", ("a", "b")), bucket=bucket, a=gate[0], b=gate[1], w=w, d_y=dy)
        else:
            out = {"d_x": into} if into is not None else {}
            dx = run(backward_of("linear", ("x",)), bucket=bucket, x=x, w=w, d_y=dy, out=out,
                     accumulate={"d_x"} if into is not None else set())["d_x"]
        if self.trained(name + ".weight"):
            run(backward_of("linear", ("w",)), bucket=bucket, x=x, w=w, d_y=dy, out={"d_w": w.grad}, accumulate={"d_w"})
        if self.trained(name + ".bias"):
            run("bias_grad", bucket=bucket, dy=dy, out={"db": self.p(name + ".bias").grad}, accumulate={"db"})
        return dx

    def norm(self, x: Tensor, name: str, bucket: int, kernel: str = "rmsnorm") -> tuple[Tensor, Tensor]:
        """rmsnorm(x) * w (``kernel="head_rmsnorm"``: per head of x (T, heads, E)) and the rows' 1/rms."""
        out = self.run(kernel, bucket=bucket, x=x, w=self.p(name), eps=self.model.cfg.norm_eps)
        return out["y"], out["inv"]

    def norm_backward(self, x: Tensor, inv: Tensor, name: str, dy: Tensor, bucket: int,
                      into: Tensor | None = None, kernel: str = "rmsnorm") -> Tensor:
        """y = x * inv * w: dx (new, or added into ``into``) and, when trained, w.grad += ..."""
        w = self.p(name)
        out = {"d_x": into} if into is not None else {}
        if self.trained(name):
            out["d_w"] = w.grad
        wrt = ("x", "w") if "d_w" in out else ("x",)
        return self.run(backward_of(kernel, wrt, ("y",)), bucket=bucket, x=x, w=w, inv=inv, d_y=dy, out=out,
                        accumulate=set(out))["d_x"]
