"""DPO (trainer/dpo.py) on the tiny model against torch autograd on transformers' model in float64:
loss, TRL's logged rewards and log-probs, and every parameter's gradient, for the sigmoid loss (with
and without label smoothing) and IPO; AdamW steps; the reference log-probs; bad configs."""
from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from lfm2jit import ComputeEngine
from lfm2jit.model import Lfm2Config, Lfm2Model
from trainer import SGD, AdamW, Trainer
from trainer.dpo import DpoConfig, DpoTrainer, dpo_loss
from trainer.preferences import PreferencePair

from test_trainer import hf_model, weights_of


def random_pairs(cfg, n: int, seed: int) -> list[PreferencePair]:
    rng = np.random.default_rng(seed)
    draw = lambda lo, hi: rng.integers(1, cfg.vocab_size, int(rng.integers(lo, hi))).astype(np.int32)  # noqa: E731
    return [PreferencePair(draw(1, 12), draw(1, 15), draw(1, 15), f"pair {i}") for i in range(n)]


def torch_completion_logps(m, pair: PreferencePair):
    """Summed log p of each completion's tokens given the prompt (and the completion before them)."""
    out = []
    for completion in (pair.chosen, pair.rejected):
        ids = torch.tensor(np.concatenate([pair.prompt, completion]), dtype=torch.long)
        logp = torch.log_softmax(m(ids[None, :-1]).logits[0], dim=-1)
        picked = logp.gather(1, ids[1:, None])[:, 0]
        out.append(picked[pair.prompt.size - 1:].sum())
    return out


def torch_dpo(config: DpoConfig, pc, pr, rc, rr, nc, nr):
    """TRL's formulas (trl/trainer/dpo_trainer.py, _compute_loss) written in torch."""
    if config.loss_type == "ipo":
        return ((pc - rc) / nc - (pr - rr) / nr - 1 / (2 * config.beta)) ** 2
    z = config.beta * ((pc - pr) - (rc - rr))
    eps = config.label_smoothing
    return -(1 - eps) * F.logsigmoid(z) - eps * F.logsigmoid(-z)


@pytest.mark.parametrize("config", [DpoConfig(), DpoConfig(beta=0.5, label_smoothing=0.2),
                                    DpoConfig(beta=0.3, loss_type="ipo")], ids=["sigmoid", "cdpo", "ipo"])
def test_a_window_of_pairs_gives_torchs_loss_metrics_and_gradients(ctx, config):
    cfg = Lfm2Config.preset("tiny")
    ref_model = hf_model(cfg, seed=3)
    policy = hf_model(cfg, seed=3)
    with torch.no_grad():              # the policy moved away from the reference, so z != 0
        for p in policy.parameters():
            p.add_(torch.randn_like(p) * 0.02)
    engine = ComputeEngine(ctx)
    reference = Lfm2Model(cfg, ctx, engine, tensors=weights_of(ref_model))
    pairs = random_pairs(cfg, 3, seed=7)
    ref_logps = DpoTrainer(Trainer(reference, SGD(lr=0.0), ctx, engine).with_length_bucket(16)).reference_logps(pairs)
    with torch.no_grad():
        want_ref = np.array([[x.item() for x in torch_completion_logps(ref_model, p)] for p in pairs])
    np.testing.assert_allclose(ref_logps, want_ref, rtol=1e-5, atol=1e-4)

    model = Lfm2Model(cfg, ctx, engine, tensors=weights_of(policy))
    tr = Trainer(model, SGD(lr=0.0), ctx, engine).with_length_bucket(16).with_grad_accum_steps(len(pairs) + 1)
    dpo = DpoTrainer(tr, config)
    got = [dpo.train_pair(p, r, model.parameters()) for p, r in zip(pairs, ref_logps)]   # the window stays open
    losses = []
    for (stats, metrics), pair, (rc, rr) in zip(got, pairs, ref_logps):
        pc, pr = torch_completion_logps(policy, pair)
        loss = torch_dpo(config, pc, pr, rc, rr, pair.chosen.size, pair.rejected.size)
        losses.append(loss)
        assert stats.loss == pytest.approx(loss.item(), rel=1e-4, abs=1e-6)
        chosen, rejected = config.beta * (pc.item() - rc), config.beta * (pr.item() - rr)
        assert metrics["rewards/chosen"] == pytest.approx(chosen, abs=1e-4)
        assert metrics["rewards/rejected"] == pytest.approx(rejected, abs=1e-4)
        assert metrics["rewards/margins"] == pytest.approx(chosen - rejected, abs=2e-4)
        assert metrics["logps/chosen"] == pytest.approx(pc.item(), rel=1e-5, abs=1e-4)
        assert metrics["logps/rejected"] == pytest.approx(pr.item(), rel=1e-5, abs=1e-4)
        if abs(chosen - rejected) > 1e-3:
            assert metrics["rewards/accuracies"] == float(chosen > rejected)
    (sum(losses) / (len(pairs) + 1)).backward()                  # our window's mean divides by accum
    grads = {n: p.grad.numpy() for n, p in model.named_parameters().items()}
    for n, p in policy.named_parameters():
        g = p.grad.numpy()
        assert np.abs(grads[n] - g).max() <= 2e-3 * max(np.abs(g).max(), 1e-4), n


def test_dpo_loss_gradient_is_the_derivative_of_the_loss():
    """The closed-form gradients of dpo_loss against central differences, every loss type."""
    rng = np.random.default_rng(0)
    for config in (DpoConfig(), DpoConfig(beta=2.0, label_smoothing=0.3), DpoConfig(beta=0.2, loss_type="ipo")):
        for _ in range(20):
            policy, ref = tuple(rng.normal(-20, 5, 2)), tuple(rng.normal(-20, 5, 2))
            lengths = tuple(int(x) for x in rng.integers(1, 30, 2))
            _, grad = dpo_loss(config, policy, ref, lengths)
            for k in range(2):
                h = 1e-6
                up, down = list(policy), list(policy)
                up[k] += h
                down[k] -= h
                numeric = (dpo_loss(config, tuple(up), ref, lengths)[0]
                           - dpo_loss(config, tuple(down), ref, lengths)[0]) / (2 * h)
                assert grad[k] == pytest.approx(numeric, rel=1e-5, abs=1e-7)


def test_adamw_steps_of_dpo_follow_torch(ctx):
    """Four optimizer steps of two pairs each (sigmoid, beta 0.1, clipping): weights against torch."""
    cfg = Lfm2Config.preset("tiny")
    ref = hf_model(cfg, seed=5)
    engine = ComputeEngine(ctx)
    model = Lfm2Model(cfg, ctx, engine, tensors=weights_of(ref))
    start = {n: t.numpy() for n, t in model.named_parameters().items()}
    tr = (Trainer(model, AdamW(lr=1e-3, weight_decay=0.01), ctx, engine).with_length_bucket(16)
          .with_grad_accum_steps(2).with_clip_grad_norm(1.0))
    dpo = DpoTrainer(tr, DpoConfig(beta=0.1))
    pairs = random_pairs(cfg, 8, seed=11)
    ref_logps = dpo.reference_logps(pairs)
    for pair, r in zip(pairs, ref_logps):
        dpo.train_pair(pair, r, model.parameters())
    assert tr.optimizer_steps() == 4

    with torch.no_grad():
        want_ref = [[x.item() for x in torch_completion_logps(ref, p)] for p in pairs]
    params = list(ref.parameters())
    opt = torch.optim.AdamW(params, lr=1e-3, weight_decay=0.01)
    for k in range(4):
        opt.zero_grad()
        for pair, (rc, rr) in zip(pairs[2 * k:2 * k + 2], want_ref[2 * k:2 * k + 2]):
            pc, pr = torch_completion_logps(ref, pair)
            (torch_dpo(DpoConfig(beta=0.1), pc, pr, rc, rr, 1, 1) / 2).backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
    ours = {n: t.numpy() for n, t in model.named_parameters().items()}
    # Adam's update is about lr per weight whatever the gradient's size: a weight whose gradient is
    # near 0 may move either way, so the bound is a fraction of the 4 steps' 4e-3
    for n, w in weights_of(ref).items():
        if n in ours:
            np.testing.assert_allclose(ours[n], w, atol=4e-4, err_msg=n)
            assert np.abs(ours[n] - start[n]).max() > 2e-3, n          # every tensor moved


@pytest.mark.parametrize("kwargs,message", [
    (dict(beta=0.0), "beta must be"), (dict(beta=float("nan")), "beta must be"),
    (dict(loss_type="hinge"), "loss_type must be one of sigmoid, ipo"),
    (dict(label_smoothing=0.5), "label_smoothing must be in"),
    (dict(loss_type="ipo", label_smoothing=0.1), "sigmoid loss only"),
])
def test_bad_configs_are_refused(kwargs, message):
    with pytest.raises(ValueError, match=message):
        DpoConfig(**kwargs)


trl_reference = pytest.importorskip("trl_reference", reason="TRL is the reference")


def _pairs_for_trl(pairs):
    return [(p.prompt.tolist(), p.chosen.tolist(), p.rejected.tolist()) for p in pairs]


def _ours_window(model, ctx, engine, config, pairs, reference, params):
    """Our pairs as one open window (accum one more than the pairs, so the gradients stay); the
    metrics averaged over the pairs as TRL averages its batch; gradients times (n + 1) / n: TRL's mean."""
    tr = Trainer(model, SGD(lr=0.0), ctx, engine).with_length_bucket(16).with_grad_accum_steps(len(pairs) + 1)
    dpo = DpoTrainer(tr, config)
    got = [dpo.train_pair(p, r, params) for p, r in zip(pairs, reference)]
    metrics = {k: float(np.mean([m[k] for _, m in got])) for k in got[0][1]}
    loss = float(np.mean([s.loss for s, _ in got]))
    return loss, metrics, (len(pairs) + 1) / len(pairs)


@pytest.mark.parametrize("loss_type,beta", [("sigmoid", 0.1), ("sigmoid", 1.0), ("ipo", 0.5)])
def test_full_fine_tuning_equals_trls_dpo_trainer(ctx, loss_type, beta):
    """TRL's own DPOTrainer.compute_loss on transformers' model (float64) as the reference: loss,
    every logged reward and log-prob metric, every parameter's gradient."""
    cfg = Lfm2Config.preset("tiny")
    reference, policy = hf_model(cfg, seed=4), hf_model(cfg, seed=4)
    with torch.no_grad():
        for p in policy.parameters():
            p.add_(torch.randn_like(p) * 0.03)
    pairs = random_pairs(cfg, 4, seed=21)
    want_loss, want, want_grads = trl_reference.trl_dpo(policy, reference, _pairs_for_trl(pairs), beta=beta,
                                                        loss_type=loss_type)
    engine = ComputeEngine(ctx)
    ref_logps = DpoTrainer(Trainer(Lfm2Model(cfg, ctx, engine, tensors=weights_of(reference)), SGD(lr=0.0), ctx,
                                   engine).with_length_bucket(16)).reference_logps(pairs)
    model = Lfm2Model(cfg, ctx, engine, tensors=weights_of(policy))
    loss, metrics, factor = _ours_window(model, ctx, engine, DpoConfig(beta=beta, loss_type=loss_type), pairs,
                                         ref_logps, model.parameters())
    assert loss == pytest.approx(want_loss, rel=1e-4, abs=1e-6)
    for key in ("rewards/chosen", "rewards/rejected", "rewards/margins", "logps/chosen", "logps/rejected"):
        assert metrics[key] == pytest.approx(want[key], rel=1e-4, abs=1e-4 * beta), key
    if abs(want["rewards/margins"]) > 1e-3:
        assert metrics["rewards/accuracies"] == pytest.approx(want["rewards/accuracies"])
    grads = {n: t.grad.numpy() * factor for n, t in model.named_parameters().items()}
    for n, g in want_grads.items():
        assert np.abs(grads[n] - g).max() <= 2e-3 * max(np.abs(g).max(), 1e-4), n


def test_lora_equals_trl_with_peft_whose_reference_is_the_adapters_off(ctx):
    """A new adapter's first window, as TRL runs DPO on a PeftModel (reference: adapters disabled):
    every A and B gradient (B randomised so that A's gradient is not zero)."""
    peft = pytest.importorskip("peft")
    from lfm2jit.model import LoraConfig
    from lfm2jit.model.lora import DEFAULT_TARGETS
    cfg = Lfm2Config.preset("tiny")
    base = hf_model(cfg, seed=6)
    base_weights = weights_of(base)          # get_peft_model wraps the model's layers in place
    theirs = peft.get_peft_model(base, peft.LoraConfig(r=2, lora_alpha=4, lora_dropout=0.0,
                                                       target_modules=list(DEFAULT_TARGETS)))
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for n, p in theirs.named_parameters():
            if "lora_B" in n:
                p.copy_(torch.randn(p.shape, generator=gen, dtype=p.dtype) * 0.3)
    pairs = random_pairs(cfg, 3, seed=31)
    want_loss, want, want_grads = trl_reference.trl_dpo(theirs, None, _pairs_for_trl(pairs), beta=0.2)
    engine = ComputeEngine(ctx)
    model = Lfm2Model(cfg, ctx, engine, tensors=base_weights)
    ref_logps = DpoTrainer(Trainer(model, SGD(lr=0.0), ctx, engine).with_length_bucket(16)).reference_logps(pairs)
    params = model.add_lora(LoraConfig(r=2, alpha=4))
    state = {n.replace(".default", ""): p for n, p in theirs.named_parameters() if "lora_" in n}
    for n, t in model.lora.named.items():
        t.write(state[n].detach().numpy())
    loss, metrics, factor = _ours_window(model, ctx, engine, DpoConfig(beta=0.2), pairs, ref_logps, params)
    assert loss == pytest.approx(want_loss, rel=1e-4, abs=1e-6)
    assert metrics["rewards/margins"] == pytest.approx(want["rewards/margins"], rel=1e-3, abs=1e-5)
    by_peft_name = {n.replace(".default", ""): g for n, g in want_grads.items()}
    assert by_peft_name
    for n, t in model.lora.named.items():
        g = by_peft_name[n]
        assert np.abs(t.grad.numpy() * factor - g).max() <= 2e-3 * max(np.abs(g).max(), 1e-5), n
