"""LFM2's SwiGLU MLP: h + w2(silu(a) * b), where a = w1(xf), b = w3(xf) and xf = rmsnorm(h)."""
from __future__ import annotations

from dataclasses import dataclass

from ...runtime import Tensor
from .base import Residual, ResidualSaved, Rows
from .kernels import LoraSaved


@dataclass
class MlpSaved(ResidualSaved):
    a: Tensor | None                # (T, F) w1(xf); None with recompute_mlp or once a backward used it
    b: Tensor | None                # (T, F) w3(xf); likewise
    xf: Tensor | None = None        # (T, D) rmsnorm(h): put back by recompute (kept by a checkpoint's rerun)
    g: Tensor | None = None         # (T, F) silu(a) * b: likewise, when w2's backward reads it


class Mlp(Residual):
    """``keep_ab=False`` (the model's recompute_mlp): forward keeps neither a nor b (the largest
    activations) and backward computes them again, for two more matmuls per layer."""
    norm, out = "ffn_norm.weight", "feed_forward.w2"

    def __init__(self, kernels, cfg, index: int, keep_ab: bool = True):
        super().__init__(kernels, cfg, index)
        self.keep_ab = keep_ab

    def forward(self, h: Tensor, rows: Rows, train: bool) -> tuple[Tensor, MlpSaved]:
        lora = LoraSaved(train)
        xf, inv = self.normed(h, rows.bucket)                                                   # (T, D), (T,)
        a, b = self.up(xf, rows.bucket, lora)                                                   # (T, F), (T, F)
        g = self.kernels.run("silu_mul", bucket=rows.bucket, a=a, b=b)["y"]                     # (T, F) silu(a) * b
        if self.kernels.replaying:            # a checkpointed layer's rerun, right before its backward
            saved = MlpSaved(h, inv, lora, a, b, xf)
        else:
            saved = MlpSaved(h, inv, lora, a, b) if self.keep_ab else MlpSaved(h, inv, lora, None, None)
        return self.project(g, h, rows.bucket, lora), saved                                    # (T, D) h + w2(g)

    def up(self, xf: Tensor, bucket: int, lora: LoraSaved) -> tuple[Tensor, Tensor]:
        """a = w1(xf), b = w3(xf)."""
        return (self.kernels.linear(xf, self.pre + "feed_forward.w1", bucket, lora),
                self.kernels.linear(xf, self.pre + "feed_forward.w3", bucket, lora))

    def recompute(self, s: MlpSaved, rows: Rows) -> None:
        """xf, a and b when forward did not keep them, and g when w2's backward reads it (its
        weight, bias or adapter is trained). The same kernels on the same inputs give bit-identical
        values, so gradients are unchanged."""
        kern, w2 = self.kernels, self.pre + self.out
        if s.xf is None:
            s.xf = self.normed(s.h, rows.bucket)[0]                                             # (T, D)
        if s.a is None:
            s.a, s.b = self.up(s.xf, rows.bucket, s.lora)                                       # (T, F), (T, F)
        if kern.adapted(w2) or kern.trained(w2 + ".weight") or kern.trained(w2 + ".bias"):
            s.g = kern.run("silu_mul", bucket=rows.bucket, a=s.a, b=s.b)["y"]                   # (T, F)

    def backward(self, s: MlpSaved, dh: Tensor, rows: Rows) -> None:
        kern, pre, bucket = self.kernels, self.pre, rows.bucket
        # Each [T, F] tensor is let go (back to the pool) right after its last use, so the peak
        # holds as few of them as possible; a second backward over this trace recomputes them.
        gate, g = (s.a, s.b), s.g
        s.a = s.b = s.g = None
        # h + w2(g), g = silu(a) * b: d_a and d_b from w2's input-gradient GEMM
        gab = kern.linear_backward(g, pre + self.out, dh, bucket, s.lora, gate=gate)
        del gate, g
        # a = w1(xf); b = w3(xf)
        xf, s.xf = s.xf, None
        dxf = kern.linear_backward(xf, pre + "feed_forward.w1", gab.pop("d_a"), bucket, s.lora)  # (T, D)
        kern.linear_backward(xf, pre + "feed_forward.w3", gab.pop("d_b"), bucket, s.lora, into=dxf)
        # xf = rmsnorm(h)
        self.norm_backward(s, dxf, dh, bucket)
