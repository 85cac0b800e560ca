"""Trainer.train_token_objective: a loss that is any function of the sequences' per-token
log-probabilities (what DPO and GRPO are), its gradient taken through the LM head's gradient pass
with the objective's d_logps as per-position weights. Held to torch autograd on transformers'
model in float64 for randomly drawn objectives, and to train_sequences for the plain masked mean;
a bad objective changes nothing."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from lfm2jit import ComputeEngine
from lfm2jit.model import Lfm2Config, Lfm2Model
from trainer import SGD, TrainError, Trainer

from test_trainer import hf_model, sequences, weights_of


def _random_objective(rng):
    """sum_i c_i . logp_i + q (sum of every logp)^2 / n: per-token and whole-group terms, as DPO and
    GRPO mix them; returns the objective for ours (numpy) and the same in torch."""
    c_scale, q = float(rng.uniform(0.2, 2.0)), float(rng.uniform(-0.01, 0.01))
    coefs = {}

    def coef(i, n):
        if i not in coefs:
            coefs[i] = rng.standard_normal(n) * c_scale
        return coefs[i]

    def ours(logps):
        total = sum(x.sum() for x in logps)
        n = sum(x.size for x in logps)
        loss = sum((coef(i, x.size) * x).sum() for i, x in enumerate(logps)) + q * total ** 2 / n
        return loss, [coef(i, x.size) + 2 * q * total / n for i, x in enumerate(logps)]

    def theirs(logps):
        total = sum(x.sum() for x in logps)
        n = sum(x.numel() for x in logps)
        return sum((torch.tensor(coef(i, x.numel())) * x).sum() for i, x in enumerate(logps)) + q * total ** 2 / n
    return ours, theirs


def _torch_logps(m, seq):
    ids, tgt, mask = seq
    logp = torch.log_softmax(m(torch.tensor(ids)[None]).logits[0], dim=-1)
    return logp.gather(1, torch.tensor(tgt, dtype=torch.long)[:, None])[:, 0] * torch.tensor(mask, dtype=logp.dtype)


@pytest.mark.parametrize("seed", range(3))
def test_a_drawn_objective_gives_torch_autograds_loss_and_gradients(ctx, seed):
    cfg = Lfm2Config.preset("tiny")
    rng = np.random.default_rng(seed)
    ref = hf_model(cfg, seed=seed)
    engine = ComputeEngine(ctx)
    model = Lfm2Model(cfg, ctx, engine, tensors=weights_of(ref))
    tr = Trainer(model, SGD(lr=0.0), ctx, engine).with_length_bucket(16).with_grad_accum_steps(2)
    group = sequences(cfg, rng.integers(3, 30, int(rng.integers(1, 4))).tolist(), seed=seed + 10)
    ours, theirs = _random_objective(rng)
    seen = []

    def objective(logps):
        seen.append(logps)
        return ours(logps)
    stats = tr.train_token_objective(group, model.parameters(), objective)      # the window stays open: grads kept
    logps = [_torch_logps(ref, s) for s in group]
    want = theirs(logps)
    want.backward()
    for got, w in zip(seen[0], logps):
        np.testing.assert_allclose(got, w.detach().numpy(), atol=2e-5, rtol=1e-4)
    assert stats.loss == pytest.approx(want.item(), rel=1e-4, abs=1e-5)
    grads = {n: p.grad.numpy() for n, p in model.named_parameters().items()}
    for n, p in ref.named_parameters():
        g = p.grad.numpy()
        scale = max(np.abs(g).max(), 1e-3)
        assert np.abs(grads[n] * 2 - g).max() <= 2e-3 * scale, n       # the window is a mean over its 2 micro-batches


def test_the_masked_mean_as_an_objective_steps_as_train_sequences(ctx):
    """loss = -sum(mask logp) / n, d_logps = -mask / n: the update train_sequences makes."""
    cfg = Lfm2Config.preset("tiny")
    seq = sequences(cfg, [25], seed=5)[0]
    after = []
    for use_objective in (False, True):
        engine = ComputeEngine(ctx)
        model = Lfm2Model(cfg, ctx, engine, seed=2)
        tr = Trainer(model, SGD(lr=0.5), ctx, engine).with_length_bucket(16)
        n = seq[2].sum()
        if use_objective:
            stats = tr.train_token_objective([seq], model.parameters(),
                                             lambda lp: (-lp[0].sum() / n, [-seq[2] / n]))
        else:
            stats = tr.train_sequences([seq], model.parameters())[0]
        assert stats.stepped
        after.append((stats.loss, {k: v.numpy() for k, v in model.named_parameters().items()}))
    assert after[1][0] == pytest.approx(after[0][0], rel=1e-5)
    for name, w in after[0][1].items():
        np.testing.assert_allclose(after[1][1][name], w, rtol=1e-4, atol=1e-6, err_msg=name)


@pytest.mark.parametrize("bad,message", [
    (lambda lp: 1.0, "must return \\(loss, d_logps\\)"),
    (lambda lp: (float("nan"), [np.zeros_like(x) for x in lp]), "non-finite"),
    (lambda lp: (1.0, [np.zeros(3)]), "shape"),
    (lambda lp: (1.0, [np.full_like(x, np.inf) for x in lp]), "inf or NaN"),
    (lambda lp: ("x", [np.zeros_like(x) for x in lp]), "must be a number"),
])
def test_a_bad_objective_is_refused_and_changes_nothing(ctx, bad, message):
    cfg = Lfm2Config.preset("tiny")
    engine = ComputeEngine(ctx)
    model = Lfm2Model(cfg, ctx, engine, seed=1)
    tr = Trainer(model, SGD(lr=0.5), ctx, engine).with_length_bucket(16)
    before = {k: v.numpy() for k, v in model.named_parameters().items()}
    with pytest.raises(TrainError, match=message):
        tr.train_token_objective(sequences(cfg, [12], seed=1), model.parameters(), bad)
    assert tr.step_in_accum == 0 and tr.optimizer_steps() == 0
    for k, v in model.named_parameters().items():
        np.testing.assert_array_equal(v.numpy(), before[k], err_msg=k)


def test_an_objective_that_raises_leaves_the_window_as_it_was(ctx):
    cfg = Lfm2Config.preset("tiny")
    engine = ComputeEngine(ctx)
    model = Lfm2Model(cfg, ctx, engine, seed=1)
    tr = Trainer(model, SGD(lr=0.5), ctx, engine).with_length_bucket(16)

    def boom(logps):
        raise RuntimeError("reward server down")
    with pytest.raises(RuntimeError, match="reward server down"):
        tr.train_token_objective(sequences(cfg, [10], seed=2), model.parameters(), boom)
    assert tr.step_in_accum == 0
