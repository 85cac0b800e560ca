"""LoRA adapters on the device: their tensors, and the kernel calls they add to a linear layer's
forward and backward (lora.py holds the config and PEFT's files).

Forward, for y = x W^T of a targeted layer (u = s * x' A^T is [T, r], small):
    x' = dropout(x) (training with dropout > 0; else x' = x);  u = linear(x', A);  u = scale(u, s);
    y += linear(u, B)
Backward, given dy and u (kept by the forward: [T, r] per layer, or recomputed when not):
    du = dy B;  B.grad += dy^T u;  du = s * du;  A.grad += du^T x';  dx += dropout'(du A)
Dropout is PEFT's (an element kept with probability 1 - p, times 1 / (1 - p)), its mask drawn on the
GPU from a key per module (schedule/dropout.py); the backward redraws it from the same key, so
nothing of it is kept. ``draw_dropout`` writes the keys of the next training pass.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ..runtime import Tensor
from .lora import LoraConfig, peft_names


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
    def __init__(self, config: LoraConfig, weights: dict[str, Tensor], modules, seed: int = 0):
        self.config = config
        self.seed = seed
        ctx = next(iter(weights.values())).ctx if weights else None
        self.by_module = {m: Adapter(weights[peft_names(m)[0]], weights[peft_names(m)[1]],
                                     Tensor.from_numpy(ctx, dropout_key(config.dropout, (0, 0)), "i32")
                                     if config.dropout else None) for m in modules}
        self.named = dict(weights)            # PEFT name -> tensor, in the model's module order

    def draw_dropout(self, *counters: int) -> None:
        """New dropout keys for a training pass: module i's seed words come from (seed, counters..., i),
        so a pass's masks depend only on where it is in training (resumed runs draw the same)."""
        if not self.config.dropout:
            return
        for i, ad in enumerate(self.by_module.values()):
            words = np.random.default_rng([self.seed, *counters, i]).integers(0, 2 ** 32, 2, dtype=np.uint64)
            ad.key.write(dropout_key(self.config.dropout, words))

    def forward(self, run, x: Tensor, module: str, y: Tensor, bucket: int, dropout: bool = False) -> Tensor:
        """y += s * (x' A^T) B^T; returns u = s * x' A^T."""
        u = self._down(run, self._dropped(run, x, module, bucket, dropout), module, bucket)
        run("linear", bucket=bucket, x=u, w=self.by_module[module].b, out={"y": y}, accumulate={"y"})
        return u

    def _dropped(self, run, x: Tensor, module: str, bucket: int, dropout: bool) -> Tensor:
        """x' = x with dropout applied when ``dropout`` (a training pass) and the config has it."""
        if not (dropout and self.config.dropout):
            return x
        return run("dropout", bucket=bucket, x=x, key=self.by_module[module].key)["y"]

    def _down(self, run, x: Tensor, module: str, bucket: int) -> Tensor:
        u = run("linear", bucket=bucket, x=x, w=self.by_module[module].a)["y"]                    # (T, r)
        return run("scale", bucket=bucket, x=u, alpha=self.config.scaling)["y"]

    def backward(self, run, grad, trained, x: Tensor, module: str, dy: Tensor, dx: Tensor | None, bucket: int,
                 u: Tensor | None = None, dropout: bool = False) -> None:
        """Add A's and B's gradients (those in ``trained``) and, into ``dx`` when given, the adapter's
        part of the input gradient. ``dropout``: the forward was a training pass that applied it."""
        ad = self.by_module[module]
        train_a, train_b = trained(ad.a), trained(ad.b)
        if dx is None and not (train_a or train_b):
            return
        dropped = dropout and bool(self.config.dropout)
        xd = self._dropped(run, x, module, bucket, dropped) if (u is None or train_a) else None
        if u is None:
            u = self._down(run, xd, module, bucket)
        if train_b:
            run(grad("linear", ("w",)), bucket=bucket, x=u, w=ad.b, d_y=dy, out={"d_w": ad.b.grad}, accumulate={"d_w"})
        if dx is None and not train_a:
            return
        du = run(grad("linear", ("x",)), bucket=bucket, x=u, w=ad.b, d_y=dy)["d_x"]                # (T, r)
        du = run("scale", bucket=bucket, x=du, alpha=self.config.scaling)["y"]
        if train_a:
            run(grad("linear", ("w",)), bucket=bucket, x=xd, w=ad.a, d_y=du, out={"d_w": ad.a.grad}, accumulate={"d_w"})
        if dx is None:
            return
        if not dropped:
            run(grad("linear", ("x",)), bucket=bucket, x=x, w=ad.a, d_y=du, out={"d_x": dx}, accumulate={"d_x"})
            return
        dxd = run(grad("linear", ("x",)), bucket=bucket, x=x, w=ad.a, d_y=du)["d_x"]              # (T, in)
        run("dropout", bucket=bucket, x=dxd, key=ad.key, out={"y": dx}, accumulate={"y"})   # dropout's gradient
