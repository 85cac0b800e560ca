"""LFM2's grouped-query attention: h + out_proj(attention(rope(qn), rope(kn), v)), where q, k, v are
projections of rmsnorm(h) and qn, kn their per-head rmsnorms (H query heads share G kv heads)."""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ...runtime import Tensor
from ...schedule.layout import bucketed
from .base import Residual, ResidualSaved, Rows
from .kernels import LoraSaved, backward_of


class Rope:
    """RoPE's cos and sin tables, computed on the host in float32 as transformers does
    (angle = position * inv_freq) and uploaded once per (padded length, packed sequence length)."""

    def __init__(self, cfg, ctx):
        self.cfg, self.ctx = cfg, ctx
        self._tables: dict[tuple, tuple[Tensor, Tensor]] = {}

    def tables(self, t_pad: int, seq: int | None = None) -> tuple[Tensor, Tensor]:
        """cos and sin (T_pad, R) for positions 0..T_pad-1 (or, packed, 0..seq-1 repeated)."""
        key = (t_pad, seq)
        if key not in self._tables:
            cos, sin = self.angles(np.arange(t_pad) if seq is None else np.arange(t_pad) % seq)
            self._tables[key] = (Tensor.from_numpy(self.ctx, cos), Tensor.from_numpy(self.ctx, sin))
        return self._tables[key]

    def angles(self, positions) -> tuple[np.ndarray, np.ndarray]:
        """float32 cos and sin [len(positions), R]."""
        e = self.cfg.head_dim
        inv_freq = (1.0 / (self.cfg.rope_theta ** (np.arange(0, e, 2, dtype=np.int64).astype(np.float32) / e)))
        ang = np.asarray(positions).astype(np.float32)[:, None] * inv_freq.astype(np.float32)[None]
        return np.cos(ang), np.sin(ang)


@dataclass
class AttentionSaved(ResidualSaved):
    q: Tensor                       # (T, H, E) q_proj(xn), before its per-head norm
    k: Tensor                       # (T, G, E) k_proj(xn)
    v: Tensor                       # (T, G, E) v_proj(xn)
    q_inv: Tensor                   # (T, H) q_layernorm's 1/rms
    k_inv: Tensor                   # (T, G) k_layernorm's 1/rms
    cos: Tensor                     # (T, R) RoPE tables of the rows' positions
    sin: Tensor                     # (T, R)
    qr: Tensor                      # (T, H, E) rope(qn)
    kr: Tensor                      # (T, G, E) rope(kn)
    o: Tensor                       # (T, H, E) attention output: out_proj's input
    lse: Tensor                     # (T, H) attention's log-sum-exp per row and head
    xn: Tensor | None = None        # (T, D) rmsnorm(h): put back by recompute (kept by a checkpoint's rerun)


class Attention(Residual):
    norm, out = "operator_norm.weight", "self_attn.out_proj"

    def __init__(self, kernels, cfg, index: int, rope: Rope):
        super().__init__(kernels, cfg, index)
        self.rope, self.attn = rope, self.pre + "self_attn."

    def forward(self, h: Tensor, rows: Rows, train: bool) -> tuple[Tensor, AttentionSaved]:
        kern, a, bucket, cfg = self.kernels, self.attn, rows.bucket, self.cfg
        t, heads, groups, e = h.shape[0], cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
        lora = LoraSaved(train)
        xn, inv = self.normed(h, bucket)                                                        # (T, D), (T,)
        q = kern.linear(xn, a + "q_proj", bucket, lora).view(t, heads, e)                       # (T, H, E)
        k = kern.linear(xn, a + "k_proj", bucket, lora).view(t, groups, e)                      # (T, G, E)
        v = kern.linear(xn, a + "v_proj", bucket, lora).view(t, groups, e)                      # (T, G, E)
        qn, q_inv = kern.norm(q, a + "q_layernorm.weight", bucket, "head_rmsnorm")              # (T, H, E), (T, H)
        kn, k_inv = kern.norm(k, a + "k_layernorm.weight", bucket, "head_rmsnorm")              # (T, G, E), (T, G)
        seg = rows.segments
        if seg is not None:                        # concatenated sequences: each turns from position 0
            cos, sin = seg.cos, seg.sin                                                         # (T, R)
        else:
            cos, sin = self.rope.tables(bucketed(t, bucket), rows.seq if rows.batch > 1 else None)
            cos, sin = cos.rows(0, t), sin.rows(0, t)                                           # (T, R)
        qr = kern.run("rope", bucket=bucket, x=qn.view(t, heads, 2, e // 2), cos=cos, sin=sin)["y"]
        kr = kern.run("rope", bucket=bucket, x=kn.view(t, groups, 2, e // 2), cos=cos, sin=sin)["y"]
        qr, kr = qr.view(t, heads, e), kr.view(t, groups, e)                                    # (T, H, E), (T, G, E)
        by_seq = rows.by_sequence
        if seg is not None:                        # query t sees keys starts[t]..t
            att = kern.run("attention_segments", bucket=bucket, q=qr, k=kr, v=v, starts=seg.starts)
        else:
            att = kern.run("attention", bucket=rows.seq_bucket, q=by_seq(qr), k=by_seq(kr), v=by_seq(v))
        o, lse = att["o"].view(t, heads, e), att["lse"].view(t, heads)                          # (T, H, E), (T, H)
        saved = AttentionSaved(h, inv, lora, q, k, v, q_inv, k_inv, cos, sin, qr, kr, o, lse,
                               xn if kern.replaying else None)
        return self.project(o.view(t, heads * e), h, bucket, lora), saved                      # (T, D) h + op

    def recompute(self, s: AttentionSaved, rows: Rows) -> None:
        if s.xn is None:
            s.xn = self.normed(s.h, rows.bucket)[0]                                             # (T, D)

    def backward(self, s: AttentionSaved, dh: Tensor, rows: Rows) -> None:
        kern, a, bucket, cfg = self.kernels, self.attn, rows.bucket, self.cfg
        t, heads, groups, e = s.h.shape[0], cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
        # h + op, op = out_proj(o)
        do = kern.linear_backward(s.o.view(t, heads * e), self.pre + self.out, dh, bucket, s.lora)  # (T, H*E)
        # o, lse = attention(qr, kr, v)
        by_seq = rows.by_sequence
        if rows.segments is not None:
            ga = kern.run(backward_of("attention_segments", ("q", "k", "v"), ("o",)), bucket=bucket, q=s.qr, k=s.kr,
                          v=s.v, o=s.o, lse=s.lse, d_o=do.view(t, heads, e), starts=rows.segments.starts)
        else:
            ga = kern.run(backward_of("attention", ("q", "k", "v"), ("o",)), bucket=rows.seq_bucket, q=by_seq(s.qr),
                          k=by_seq(s.kr), v=by_seq(s.v), o=by_seq(s.o), lse=by_seq(s.lse),
                          d_o=by_seq(do.view(t, heads, e)))
        ga = {x: ga[x].view(t, *ga[x].shape[-2:]) for x in ("d_q", "d_k", "d_v")}             # (T, heads, E)
        d_pre = {}                                  # the gradients in q and k, before their norms
        for x, n, pre_norm, inv in (("q", heads, s.q, s.q_inv), ("k", groups, s.k, s.k_inv)):
            # xr = rope(xn)
            dn = kern.run(backward_of("rope", ("x",)), bucket=bucket, cos=s.cos, sin=s.sin,
                          d_y=ga[f"d_{x}"].view(t, n, 2, e // 2))["d_x"]                        # (T, heads, 2, R)
            # xn = head_rmsnorm(x)
            d_pre[x] = kern.norm_backward(pre_norm, inv, a + f"{x}_layernorm.weight", dn.view(t, n, e), bucket,
                                          kernel="head_rmsnorm")                                # (T, heads, E)
        # q, k, v = projections of xn
        dxn = kern.linear_backward(s.xn, a + "q_proj", d_pre["q"].view(t, heads * e), bucket, s.lora)  # (T, D)
        kern.linear_backward(s.xn, a + "k_proj", d_pre["k"].view(t, groups * e), bucket, s.lora, into=dxn)
        kern.linear_backward(s.xn, a + "v_proj", ga["d_v"].view(t, groups * e), bucket, s.lora, into=dxn)
        s.xn = None
        # xn = rmsnorm(h)
        self.norm_backward(s, dxn, dh, bucket)
