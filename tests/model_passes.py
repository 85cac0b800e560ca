"""A model's passes as the trainer runs them, for tests that compare gradients with a reference."""
from __future__ import annotations

import numpy as np

from lfm2jit.model import Lfm2Model
from lfm2jit.ops.lmhead import lm_head_cross_entropy

BUCKET = 16


def run_loss_and_grads(model: Lfm2Model, ids, targets, mask, bucket: int = BUCKET, params=None, train: bool = False):
    """The trainer's path: forward, fused LM-head cross-entropy on trace.hn (loss, d_hn and the LM head's
    gradient, added into its .grad), backward. Returns (loss, {name: grad}) for the given params.
    ``train``: a training pass (LoRA dropout, an MoE router's statistics and balance loss)."""
    engine = model.engine
    named = model.named_parameters()
    params = list(named.values()) if params is None else params
    model.zero_grad()
    trace = model.forward(ids, bucket, train=train)
    head = model.lm_head
    n = float(np.count_nonzero(mask))
    res = lm_head_cross_entropy(engine, trace.hn, head, targets, mask, normalizer=n, bucket=bucket,
                                dE=head.grad, accumulate_dE=True)
    model.backward(trace, res.dh, params)
    loss = res.loss_value()
    return loss, {name: t.grad.numpy() for name, t in named.items()}
