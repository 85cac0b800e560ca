"""LFM2's gated short convolution: h + out_proj(C * conv(B * x)), where (B, C, x) = in_proj(rmsnorm(h))
and conv is causal over L taps per channel."""
from __future__ import annotations

from dataclasses import dataclass

from ...runtime import Tensor
from .base import Residual, ResidualSaved, Rows
from .kernels import LoraSaved, backward_of


@dataclass
class ConvSaved(ResidualSaved):
    bcx: Tensor                     # (T, 3D) in_proj(xn): B, C and x side by side
    c: Tensor                       # (T, D) C * conv(B x): out_proj's input
    xn: Tensor | None = None        # (T, D) rmsnorm(h): put back by recompute (kept by a checkpoint's rerun)


class Conv(Residual):
    norm, out = "operator_norm.weight", "conv.out_proj"

    def forward(self, h: Tensor, rows: Rows, train: bool) -> tuple[Tensor, ConvSaved]:
        lora = LoraSaved(train)
        xn, inv = self.normed(h, rows.bucket)                                                   # (T, D), (T,)
        bcx = self.kernels.linear(xn, self.pre + "conv.in_proj", rows.bucket, lora)             # (T, 3D) = B, C, x
        c = self.conv(bcx, rows)                                                                # (T, D)
        keep = xn if self.kernels.replaying else None
        return self.project(c, h, rows.bucket, lora), ConvSaved(h, inv, lora, bcx, c, keep)    # (T, D) h + op

    def conv(self, bcx: Tensor, rows: Rows) -> Tensor:
        """c = C * conv(B x) (T, D) from in_proj's output (T, 3D)."""
        t, d = bcx.shape[0], self.cfg.hidden_size
        if rows.segments is not None:             # concatenated sequences: taps stop at each one's start
            return self.kernels.run("short_conv_segments", bucket=rows.bucket, bcx=bcx.view(t, 3, d),
                                    pos=rows.segments.pos, **self.weights())["y"]
        return self.kernels.run("short_conv", bucket=rows.seq_bucket, bcx=rows.by_sequence(bcx.view(t, 3, d)),
                                **self.weights())["y"].view(t, d)

    def weights(self) -> dict[str, Tensor]:
        """The short conv's w (D, L) and, with conv_bias, b (D,), as its kernel takes them."""
        w = self.kernels.p(self.pre + "conv.conv.weight").view(self.cfg.hidden_size, self.cfg.conv_L_cache)
        return {"w": w, "b": self.kernels.p(self.pre + "conv.conv.bias")} if self.cfg.conv_bias else {"w": w}

    def recompute(self, s: ConvSaved, rows: Rows) -> None:
        if s.xn is None:
            s.xn = self.normed(s.h, rows.bucket)[0]                                             # (T, D)

    def backward(self, s: ConvSaved, dh: Tensor, rows: Rows) -> None:
        kern, pre, bucket = self.kernels, self.pre, rows.bucket
        t, d = s.h.shape[0], self.cfg.hidden_size
        # h + op, op = out_proj(c)
        dc = kern.linear_backward(s.c, pre + self.out, dh, bucket, s.lora)                      # (T, D)
        # c = C * conv(B x)
        params = {"w": pre + "conv.conv.weight", "b": pre + "conv.conv.bias"}
        trained = [x for x, name in params.items() if kern.trained(name)]
        weights = self.weights()
        out = {f"d_{x}": kern.p(params[x]).grad.view(*weights[x].shape) for x in trained}
        if rows.segments is not None:
            g = kern.run(backward_of("short_conv_segments", ("bcx", *trained)), bucket=bucket, out=out,
                         accumulate=set(out), bcx=s.bcx.view(t, 3, d), d_y=dc, pos=rows.segments.pos, **weights)
        else:
            g = kern.run(backward_of("short_conv", ("bcx", *trained)), bucket=rows.seq_bucket, out=out,
                         accumulate=set(out), bcx=rows.by_sequence(s.bcx.view(t, 3, d)), d_y=rows.by_sequence(dc),
                         **weights)
        # bcx = in_proj(xn)
        dxn = kern.linear_backward(s.xn, pre + "conv.in_proj", g["d_bcx"].view(t, 3 * d), bucket, s.lora)  # (T, D)
        s.xn = None
        # xn = rmsnorm(h)
        self.norm_backward(s, dxn, dh, bucket)
