"""LoRA adapters on the device: their tensors, and the kernel calls they add to a linear layer's
forward and backward (lora.py holds the config and PEFT's files).

Forward, for y = x W^T of a targeted layer (u = s * x A^T is [T, r], small):
    u = linear(x, A); u = scale(u, s); y += linear(u, B)
Backward, given dy and u (kept by the forward: [T, r] per layer, or recomputed from x when not):
    du = dy B;  B.grad += dy^T u;  du = s * du;  A.grad += du^T x;  dx += du A
"""
from __future__ import annotations

from dataclasses import dataclass

from ..runtime import Tensor
from .lora import LoraConfig, peft_names


@dataclass
class Adapter:
    a: Tensor           # [r, in]
    b: Tensor           # [out, r]


class LoraAdapters:
    def __init__(self, config: LoraConfig, weights: dict[str, Tensor], modules):
        self.config = config
        self.by_module = {m: Adapter(weights[peft_names(m)[0]], weights[peft_names(m)[1]]) for m in modules}
        self.named = dict(weights)            # PEFT name -> tensor, in the model's module order

    def forward(self, run, x: Tensor, module: str, y: Tensor, bucket: int) -> Tensor:
        """y += s * (x A^T) B^T; returns u = s * x A^T."""
        u = self._down(run, x, module, bucket)
        run("linear", bucket=bucket, x=u, w=self.by_module[module].b, out={"y": y}, accumulate={"y"})
        return u

    def _down(self, run, x: Tensor, module: str, bucket: int) -> Tensor:
        u = run("linear", bucket=bucket, x=x, w=self.by_module[module].a)["y"]                    # (T, r)
        return run("scale", bucket=bucket, x=u, alpha=self.config.scaling)["y"]

    def backward(self, run, grad, trained, x: Tensor, module: str, dy: Tensor, dx: Tensor | None, bucket: int,
                 u: Tensor | None = None) -> None:
        """Add A's and B's gradients (those in ``trained``) and, into ``dx`` when given, the adapter's
        part of the input gradient."""
        ad = self.by_module[module]
        train_a, train_b = trained(ad.a), trained(ad.b)
        if dx is None and not (train_a or train_b):
            return
        if u is None:
            u = self._down(run, x, module, bucket)
        if train_b:
            run(grad("linear", ("w",)), bucket=bucket, x=u, w=ad.b, d_y=dy, out={"d_w": ad.b.grad}, accumulate={"d_w"})
        if dx is None and not train_a:
            return
        du = run(grad("linear", ("x",)), bucket=bucket, x=u, w=ad.b, d_y=dy)["d_x"]                # (T, r)
        du = run("scale", bucket=bucket, x=du, alpha=self.config.scaling)["y"]
        if train_a:
            run(grad("linear", ("w",)), bucket=bucket, x=x, w=ad.a, d_y=du, out={"d_w": ad.a.grad}, accumulate={"d_w"})
        if dx is not None:
            run(grad("linear", ("x",)), bucket=bucket, x=x, w=ad.a, d_y=du, out={"d_x": dx}, accumulate={"d_x"})
