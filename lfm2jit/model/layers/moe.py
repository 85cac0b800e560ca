"""LFM2-MoE's sparse block: h + the weighted sum of the SwiGLU experts a router picks for each token,
applied to xf = rmsnorm(h).

The router scores every expert (sigmoid of xf W_r^T), picks the K of highest score + expert_bias,
and weighs each pick by its score (normalised over the K, scaled). A token's j-th pick is slot
t * K + j; slots are sorted by expert so that each expert's MLP runs over its own slots only (a
grouped GEMM, ops/experts.py), the weight applied in its down GEMM's epilogue, and each token's
slot outputs are summed back in expert order, as transformers adds them. The routing stays on the
GPU (ops/kernels/moe.lk): nothing is read back. With f16 activations the hidden rows (xf, the slots'
rows, the experts' activations, y) are f16, while the router's logits, the picks' weights and their
gradients stay f32 (``ROUTING``): f16 logits would flip picks at near-ties. Shapes: T tokens, E
experts, K picks, S = T K slots.
LoRA adapters on the expert tensors (PEFT's target_parameters) run inside the experts' GEMMs.
"""
from __future__ import annotations

from dataclasses import dataclass

from ...ops.experts import ExpertActivations, experts_backward, experts_forward
from ...runtime import Tensor
from .base import Residual, ResidualSaved, Rows
from .kernels import LoraSaved, backward_of

ROUTING = "f32"         # the activation dtype of the router's and the routing's calls


@dataclass
class MoeSaved(ResidualSaved):
    xf: Tensor | None               # (T, D) rmsnorm(h): recomputed for the backward (kept by a checkpoint's rerun)
    logits: Tensor                  # (T, E) the router's
    idx: Tensor                     # (T, K) i32 each token's picks
    w: Tensor                       # (T, K) their weights
    ends: Tensor                    # (E,) i32 where each expert's slots end
    order: Tensor                   # (S,) i32 the picks (t * K + j) in expert order
    tok: Tensor                     # (S,) i32 each sorted slot's token
    ws: Tensor                      # (S,) each sorted slot's weight
    by_token: Tensor                # (S,) i32 the sorted slots grouped by token
    token_offsets: Tensor           # (T + 1,) i32 where each token's run of by_token starts
    xs: Tensor | None               # (S, D) each sorted slot's xf row: gathered again (likewise)
    experts: ExpertActivations      # what the experts' backward reuses (h only with keep_h)
    counts: Tensor | None = None    # (E,) the pass's tokens per expert, with the balance loss on


class Moe(Residual):
    """The forward keeps none of the per-slot copies of the hidden states (xf is recomputed, the
    slots' rows gathered again); ``keep_h=False`` (the model's recompute_mlp) keeps not even the
    experts' up-projection h, the largest activation: the backward runs its GEMM again."""
    norm, out = "ffn_norm.weight", "feed_forward.experts.down_proj"

    def __init__(self, kernels, cfg, index: int, keep_h: bool = True):
        super().__init__(kernels, cfg, index)
        self.index = index
        self.keep_h = keep_h

    @property
    def gate_up(self) -> str:
        return self.pre + "feed_forward.experts.gate_up_proj"

    def forward(self, h: Tensor, rows: Rows, train: bool) -> tuple[Tensor, MoeSaved]:
        k, cfg, bucket, pre = self.kernels, self.cfg, rows.bucket, self.pre
        top_k, n_tokens = cfg.num_experts_per_tok, h.shape[0]
        slots, slot_bucket = n_tokens * top_k, bucket * top_k     # slot kernels run over the flat (T K) picks
        lora = LoraSaved(train)
        xf, inv = self.normed(h, bucket)                                                        # (T, D), (T,)
        route = self._route
        logits = k.linear(xf, pre + "feed_forward.gate", bucket, lora, dtype=ROUTING)           # (T, E)
        bias = {"bias": k.buffer(pre + "feed_forward.expert_bias")} if cfg.use_expert_bias else {}
        idx = route("moe_topk", bucket=bucket, dims={"K": top_k}, logits=logits, **bias)["idx"]  # (T, K)
        w = route("moe_weights", bucket=bucket, logits=logits, idx=idx, **self._weighting())["w"]
        ends = route("expert_ends", bucket=bucket, dims={"E": cfg.num_experts}, idx=idx)["ends"]
        counts = None
        if train and rows.ids is not None:            # the step's tokens per expert (Lfm2Model.take_routed_tokens)
            count = {"bucket": bucket, "dims": {"E": cfg.num_experts}, "idx": idx, "ids": rows.ids, "pad": self._pad()}
            tally = not k.replaying                   # a checkpointed layer's rerun: counted the first time
            if tally:
                route("expert_counts", out={"n": k.model.routed_tokens[self.index]}, accumulate={"n"}, **count)
            if k.model.router_aux_loss_coef:          # the balance loss: its value added up for the step
                counts = route("expert_counts", **count)["n"]
                if tally:
                    route("moe_balance", bucket=bucket, logits=logits, counts=counts, ids=rows.ids,
                          out={"aux": k.model.router_balance}, accumulate={"aux"}, **self._balance(rows))
        order = route("sort_keys", bucket=slot_bucket, dims={"V": cfg.num_experts}, keys=idx.view(slots))["order"]
        tokens = route("slot_tokens", bucket=bucket, idx=idx)["tok"]                            # (T, K)
        picked = route("moe_slots", bucket=slot_bucket, w=w.view(slots), tokens=tokens.view(slots), order=order)
        grouped = route("sort_keys", bucket=slot_bucket, dims={"V": n_tokens}, keys=picked["tok"])
        xs = k.run("embedding", bucket=slot_bucket, table=xf, ids=picked["tok"])["y"]          # (S, D)
        ys, acts = experts_forward(k.model.engine, xs, k.p(self.gate_up), k.p(pre + self.out), ends,
                                   picked["ws"], bucket=slot_bucket, keep_h=self.keep_h or k.replaying,
                                   dtype=self._dtype, **self._adapters())
        y = k.run("scatter_rows", bucket=slot_bucket, g=ys, order=grouped["order"], offsets=grouped["offsets"],
                  r=h)["y"]                                                                     # (T, D)
        kept = (xf, xs) if k.replaying else (None, None)     # a checkpointed layer's rerun keeps them
        return y, MoeSaved(h, inv, lora, kept[0], logits, idx, w, ends, order, picked["tok"], picked["ws"],
                           grouped["order"], grouped["offsets"], kept[1], acts, counts)

    def _route(self, kernel, **args):
        """A routing kernel's call: its float tensors f32 whatever the activations are."""
        return self.kernels.run(kernel, dtype=ROUTING, **args)

    @property
    def _dtype(self) -> str:
        return self.kernels.model.activation_dtype

    def _adapters(self) -> dict:
        """The LoRA adapters on this block's expert tensors, as experts_forward takes them."""
        lora = self.kernels.model.lora
        by_parameter = lora.by_parameter if lora is not None else {}
        return {"lora_gate_up": by_parameter.get(self.gate_up), "lora_down": by_parameter.get(self.pre + self.out)}

    def _weighting(self) -> dict[str, float]:
        return {"norm": 1.0 if self.cfg.norm_topk_prob else 0.0, "scaling": float(self.cfg.routed_scaling_factor)}

    def _pad(self) -> float:
        """The padding token, whose rows routing statistics leave out (-1: none)."""
        return -1.0 if self.cfg.pad_token_id is None else float(self.cfg.pad_token_id)

    def _balance(self, rows: Rows) -> dict[str, float]:
        """moe_balance's scalars: E / K, and the pass's weight (its sequences, as each has its own loss)."""
        return {"pad": self._pad(), "spread": self.cfg.num_experts / self.cfg.num_experts_per_tok,
                "weight": float(rows.batch)}

    def recompute(self, s: MoeSaved, rows: Rows) -> None:
        """xf and the slots' rows of it, as the forward computed them (bit-identical: the same
        kernels on the same inputs); the experts' backward computes h again itself."""
        if s.xs is not None:
            return
        s.xf = self.normed(s.h, rows.bucket)[0]                                                 # (T, D)
        s.xs = self.kernels.run("embedding", bucket=rows.bucket * self.cfg.num_experts_per_tok, table=s.xf,
                                ids=s.tok)["y"]                                                 # (S, D)

    def backward(self, s: MoeSaved, dh: Tensor, rows: Rows) -> None:
        k, cfg, bucket, pre = self.kernels, self.cfg, rows.bucket, self.pre
        top_k, n_tokens = cfg.num_experts_per_tok, dh.shape[0]
        slots, slot_bucket = n_tokens * top_k, bucket * top_k
        gate_up, down, route = k.p(self.gate_up), k.p(pre + self.out), self._route
        # y = h + sum of each token's slot outputs: a slot's gradient is its token's
        d_ys = k.run("embedding", bucket=slot_bucket, table=dh, ids=s.tok)["y"]               # (S, D)
        trained = {n: t for n, t in (("d_gate_up", gate_up), ("d_down", down)) if k.is_trained(t)}
        grads = experts_backward(k.model.engine, s.xs, gate_up, down, s.ends, s.ws, s.experts, d_ys,
                                 bucket=slot_bucket, weights=bool(trained),
                                 out={n: t.grad for n, t in trained.items()}, accumulate=set(trained),
                                 trained=k.is_trained, dtype=self._dtype, **self._adapters())
        # xs = xf at each slot's token: the slots' gradients summed back to their tokens
        dxf = k.run("scatter_rows", bucket=slot_bucket, dims={"V": n_tokens}, g=grads["d_x"], order=s.by_token,
                    offsets=s.token_offsets)["y"]                                               # (T, D)
        # ws = w at each sorted slot's pick: back to the picks (the sort's order is a permutation)
        picks = route("sort_keys", bucket=slot_bucket, dims={"V": slots}, keys=s.order)
        d_w = route("scatter_values", bucket=slot_bucket, dims={"V": slots}, g=grads["d_scale"], order=picks["order"],
                    offsets=picks["offsets"])["y"]                                              # (S,) = (T, K)
        # w = the picked scores, normalised and scaled: through the scores only (the picks are discrete)
        d_logits = route(backward_of("moe_weights", ("logits",), ("w",)), bucket=bucket, logits=s.logits,
                         idx=s.idx, w=s.w, d_w=d_w.view(n_tokens, top_k), **self._weighting())["d_logits"]
        if s.counts is not None:       # the balance loss, coefficient times the loss's gradient scale
            seed = route("moe_balance_seed", counts=s.counts,
                         aux_scale=k.model.router_aux_loss_coef * k.model.aux_grad_scale)["d"]
            route(backward_of("moe_balance", ("logits",), ("aux",)), bucket=bucket, logits=s.logits,
                  counts=s.counts, ids=rows.ids, d_aux=seed, out={"d_logits": d_logits}, accumulate={"d_logits"},
                  **self._balance(rows))
        # logits = xf W_r^T
        k.linear_backward(s.xf, pre + "feed_forward.gate", d_logits, bucket, s.lora, into=dxf, dtype=ROUTING)
        self.norm_backward(s, dxf, dh, bucket)
