"""LoRA adapters on the device: their tensors, and the kernel calls they add to a linear layer's
forward and backward (lora.py holds the config and PEFT's files).

Forward, for y = x W^T of a targeted layer (u = s * x' A^T is [T, r], small):
    x' = dropout(x) (training with dropout > 0; else x' = x);  u = lora_down(x', A, s);
    y = linear_lora(x, W, u, B) = x W^T + u B^T (+ the residual, for out_proj and w2): the
    up-projection is a second phase of the layer's own GEMM, so y is written once
Backward, given dy and u (kept by the forward: [T, r] per layer, or recomputed when not):
    B.grad += dy^T u;  du = lora_down_grad(dy, B, s) = s * dy B;  A.grad += du^T x';
    dx = linear_lora_dx(dy, W, du, A) = dy W + du A (one GEMM again); with dropout, dx = dy W
    and then dx += dropout'(du A). For w2, whose input is SwiGLU's silu(a) * b, the same GEMM
    stores the gradients in a and b from its epilogue (swiglu_down_lora's backward)
Dropout is PEFT's (an element kept with probability 1 - p, times 1 / (1 - p)), its mask drawn on the
GPU from a key per module (schedule/dropout.py); the backward redraws it from the same key, so
nothing of it is kept. ``draw_dropout`` writes the keys of the next training pass.

Adapters on an MoE model's expert tensors (``target_parameters``) are ``ExpertLora``s that
ops/experts.py applies inside the experts' grouped GEMMs; they are held as A [E, r, in] and
B [E, out, r] (lora.py says how PEFT's files lay them out) under their PEFT names.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ..ops.experts import ExpertLora
from ..runtime import Tensor
from .lora import LoraConfig, experts_to_peft, parameter_peft_names, peft_names


@dataclass
class Adapter:
    a: Tensor           # [r, in]
    b: Tensor           # [out, r]
    key: Tensor | None  # i32[4], the dropout key (dropout > 0 only)


def dropout_key(p: float, seed_words) -> np.ndarray:
    """The key (schedule/dropout.py) of drop probability p and two 32-bit seed words, as i32[4]."""
    words = np.array([int(seed_words[0]), int(seed_words[1]), min(round(p * 2 ** 32), 2 ** 32 - 1),
                      int(np.float32(1.0 / (1.0 - p)).view(np.uint32))], np.uint64).astype(np.uint32)
    return words.view(np.int32)


class LoraAdapters:
    def __init__(self, config: LoraConfig, weights: dict[str, Tensor], modules, seed: int = 0, parameters=()):
        """``weights``: by PEFT name, the expert tensors' in lfm2jit's layout (A [E, r, in], B [E, out, r])."""
        self.config = config
        self.seed = seed
        ctx = next(iter(weights.values())).ctx if weights else None
        self.by_module = {m: Adapter(weights[peft_names(m)[0]], weights[peft_names(m)[1]],
                                     Tensor.from_numpy(ctx, dropout_key(config.dropout, (0, 0)), "i32")
                                     if config.dropout else None) for m in modules}
        self.by_parameter = {p: ExpertLora(weights[a], weights[b], config.scaling)
                             for p, (a, b) in parameter_peft_names(parameters).items()}
        self.named = dict(weights)            # PEFT name -> tensor, in the model's module order

    def peft_arrays(self) -> dict[str, np.ndarray]:
        """Every A and B by PEFT name, in PEFT's shapes (what adapter_model.safetensors holds)."""
        out = {n: t.numpy() for n, t in self.named.items()}
        for p, (a, b) in parameter_peft_names(self.by_parameter).items():
            out[a], out[b] = experts_to_peft(out[a], out[b])
        return out

    def draw_dropout(self, *counters: int) -> None:
        """New dropout keys for a training pass: module i's seed words come from (seed, counters..., i),
        so a pass's masks depend only on where it is in training (resumed runs draw the same)."""
        if not self.config.dropout:
            return
        for i, ad in enumerate(self.by_module.values()):
            words = np.random.default_rng([self.seed, *counters, i]).integers(0, 2 ** 32, 2, dtype=np.uint64)
            ad.key.write(dropout_key(self.config.dropout, words))

    def forward(self, run, x: Tensor, module: str, w: Tensor, bucket: int, dropout: bool = False,
                **residual: Tensor) -> tuple[Tensor, Tensor]:
        """(y, u) of the targeted layer of weight ``w``: y = x W^T + u B^T (+ r, the residual when
        given), u = s * x' A^T."""
        u = self._down(run, self._dropped(run, x, module, bucket, dropout), module, bucket)
        y = run("linear_lora", bucket=bucket, x=x, w=w, u=u, b=self.by_module[module].b, **residual)["y"]
        return y, u

    def _dropped(self, run, x: Tensor, module: str, bucket: int, dropout: bool) -> Tensor:
        """x' = x with dropout applied when ``dropout`` (a training pass) and the config has it."""
        if not (dropout and self.config.dropout):
            return x
        return run("dropout", bucket=bucket, x=x, key=self.by_module[module].key)["y"]

    def _down(self, run, x: Tensor, module: str, bucket: int) -> Tensor:
        return run("lora_down", bucket=bucket, x=x, a=self.by_module[module].a, s=self.config.scaling)["u"]   # (T, r)

    def backward(self, run, grad, trained, x: Tensor, module: str, w: Tensor, dy: Tensor, bucket: int,
                 u: Tensor | None = None, dropout: bool = False, dx: Tensor | None = None,
                 need_dx: bool = True, gate: tuple[Tensor, Tensor] | None = None):
        """Add A's and B's gradients (those in ``trained``) and return the layer's input gradient
        (dy W + the adapter's part; added into ``dx`` when given), or None without ``need_dx``.
        ``dropout``: the forward was a training pass that applied it. ``gate`` = (a, b): the input
        is SwiGLU's silu(a) * b (w2), and its gradients in a and b are returned ({"d_a", "d_b"}):
        one GEMM with the gate's derivative as its epilogue (after dropout, the input gradient
        through silu_mul's backward)."""
        ad = self.by_module[module]
        train_a, train_b = trained(ad.a), trained(ad.b)
        dropped = dropout and bool(self.config.dropout)
        xd = self._dropped(run, x, module, bucket, dropped) if (train_a or (u is None and train_b)) else None
        if train_b:
            if u is None:
                u = self._down(run, xd, module, bucket)
            run(grad("linear", ("w",)), bucket=bucket, x=u, w=ad.b, d_y=dy, out={"d_w": ad.b.grad}, accumulate={"d_w"})
        du = None
        if train_a or need_dx:
            du = run("lora_down_grad", bucket=bucket, d_y=dy, b=ad.b, s=self.config.scaling)["du"]          # (T, r)
        if train_a:
            run(grad("linear", ("w",)), bucket=bucket, x=xd, w=ad.a, d_y=du, out={"d_w": ad.a.grad}, accumulate={"d_w"})
        if not need_dx:
            return None
        if gate is not None and not dropped:
            return run(grad("swiglu_down_lora", ("a", "b"), ("y", "z")), bucket=bucket, a=gate[0], b=gate[1], w=w,
                       al=ad.a, d_y=dy, d_z=du)
        out, acc = ({"d_x": dx}, {"d_x"}) if dx is not None else ({}, set())
        if not dropped:
            return run("linear_lora_dx", bucket=bucket, d_y=dy, w=w, du=du, a=ad.a, out=out, accumulate=acc)["d_x"]
        dx = run(grad("linear", ("x",)), bucket=bucket, x=x, w=w, d_y=dy, out=out, accumulate=acc)["d_x"]
        dxd = run(grad("linear", ("x",)), bucket=bucket, x=x, w=ad.a, d_y=du)["d_x"]              # (T, in)
        run("dropout", bucket=bucket, x=dxd, key=ad.key, out={"y": dx}, accumulate={"y"})   # dropout's gradient
        if gate is not None:
            return run(grad("silu_mul"), bucket=bucket, a=gate[0], b=gate[1], d_y=dx)
        return dx
