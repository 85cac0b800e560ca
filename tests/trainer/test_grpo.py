"""GRPO (trainer/grpo.py) against TRL's definitions: advantages with TRL's own nanstd, the per-token
loss and its gradient against torch autograd on TRL's formula, and whole teacher-forced steps on the
tiny model (fixed completions and rewards) against the same loss on transformers' model in float64,
for every loss type, with and without the KL term, over two iterations with clipping active.
Bad reward functions and configs are refused before any weight changes."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from lfm2jit import ComputeEngine
from lfm2jit.model import Lfm2Config, Lfm2Model
from trainer import SGD, TrainError, Trainer
from trainer.data import default_tokenizer, load_tokenizer
from trainer.grpo import (GrpoConfig, GrpoTrainer, PromptRecord, advantages, load_reward, loss_scale,
                          regex_reward, token_loss)

from test_trainer import hf_model, weights_of

trl_utils = pytest.importorskip("trl.trainer.utils", reason="TRL is the reference")


@pytest.mark.parametrize("scale", ["group", "batch", "none"])
def test_advantages_are_trls(scale):
    rng = np.random.default_rng(0)
    for g in (2, 3, 8):
        rewards = rng.integers(0, 3, 4 * g).astype(np.float64) * rng.random()
        r = torch.tensor(rewards)
        mean = r.view(-1, g).mean(dim=1).repeat_interleave(g)
        std = (trl_utils.nanstd(r.view(-1, g), dim=1).repeat_interleave(g) if scale == "group"
               else trl_utils.nanstd(r).expand_as(r))
        want = r - mean if scale == "none" else (r - mean) / (std + 1e-4)
        # TRL divides its integer counts in float32 (Bessel's correction): agreement to about 1e-7
        np.testing.assert_allclose(advantages(rewards, g, scale), want.numpy(), rtol=1e-6, atol=1e-9)


def torch_token_loss(config, logp, old, ref, adv):
    """TRL's per-token loss (grpo_trainer.py, _compute_loss) for the grpo/dr_grpo/dapo family."""
    low, high = config.clip_range
    coef_1 = torch.exp(logp - old)
    coef_2 = torch.clamp(coef_1, low, high)
    loss = -torch.min(coef_1 * adv, coef_2 * adv)
    if config.beta:
        kl = torch.exp(ref - logp) - (ref - logp) - 1
        loss = loss + config.beta * (kl * coef_1 if config.kl_bias_correction else kl)
    return loss


@pytest.mark.parametrize("beta,correction", [(0.0, True), (0.3, True), (0.3, False)])
def test_the_token_loss_and_its_gradient_are_autograds(beta, correction):
    rng = np.random.default_rng(1)
    config = GrpoConfig(beta=beta, epsilon=0.2, epsilon_high=0.28, kl_bias_correction=correction)
    for adv in (-1.3, 0.0, 0.7):
        old = rng.normal(-2, 1, 50)
        logp = old + rng.normal(0, 0.4, 50)           # ratios well inside and outside the clip range
        ref = old + rng.normal(0, 0.3, 50)
        loss, grad, low, high, _ = token_loss(config, logp, old, ref if beta else None, adv)
        p = torch.tensor(logp, requires_grad=True)
        want = torch_token_loss(config, p, torch.tensor(old), torch.tensor(ref), adv)
        want.sum().backward()
        np.testing.assert_allclose(loss, want.detach().numpy(), rtol=1e-12, atol=1e-12)
        np.testing.assert_allclose(grad, p.grad.numpy(), rtol=1e-12, atol=1e-12)
        ratio = np.exp(logp - old)
        assert (low == ((ratio < 0.8) & (adv < 0))).all() and (high == ((ratio > 1.28) & (adv > 0))).all()
    assert 0 < np.count_nonzero(grad) < grad.size or beta


def _fixed(values):
    def fixed(prompts, completions, **columns):
        return list(values)
    return fixed


def _trl_window_loss(config, logps, old, ref, adv, lengths, groups):
    """TRL's loss over one optimizer step, as a sum over its micro-batches (one group each) of the
    micro-batch loss / gradient_accumulation_steps."""
    total = 0
    g = config.num_generations
    for k in range(groups):
        per_token = [torch_token_loss(config, logps[i], old[i], None if ref is None else ref[i], adv[i])
                     for i in range(k * g, (k + 1) * g)]
        if config.loss_type == "grpo":
            mb = sum(t.mean() for t in per_token) / g
        elif config.loss_type == "dr_grpo":
            mb = sum(t.sum() for t in per_token) / (g * config.max_completion_length)
        else:                                      # dapo: the step's completion tokens / steps_per_generation
            mb = sum(t.sum() for t in per_token) / (sum(lengths) / groups)
        total = total + mb / groups
    return total


@pytest.mark.parametrize("loss_type,beta", [("dapo", 0.0), ("grpo", 0.0), ("dr_grpo", 0.0), ("dapo", 0.2),
                                            ("grpo", 0.1)])
def test_teacher_forced_steps_follow_trls_loss_on_transformers(ctx, loss_type, beta):
    """Two prompts x 3 completions, fixed rewards, two iterations (the second clipped against the
    first's log-probs) with SGD: every weight after each iteration against torch in float64."""
    cfg = Lfm2Config.preset("tiny")
    rng = np.random.default_rng(3)
    policy, reference = hf_model(cfg, seed=8), hf_model(cfg, seed=8)
    with torch.no_grad():              # the policy a little away from the reference: a KL to pull on
        for p in policy.parameters():
            p.add_(torch.randn_like(p) * 0.01)
    engine = ComputeEngine(ctx)
    model = Lfm2Model(cfg, ctx, engine, tensors=weights_of(policy))
    ref_model = Lfm2Model(cfg, ctx, engine, tensors=weights_of(reference))
    ref_trainer = Trainer(ref_model, SGD(lr=0.0), ctx, engine).with_length_bucket(16)
    lr = 20.0 if loss_type == "dr_grpo" else 2.0          # large enough for the second pass to clip
    tr = Trainer(model, SGD(lr=lr), ctx, engine).with_length_bucket(16).with_grad_accum_steps(2)
    config = GrpoConfig(num_generations=3, max_completion_length=12, loss_type=loss_type, beta=beta,
                        num_iterations=2, epsilon=0.1)
    rewards = [1.0, 0.0, 0.5, 0.0, 0.0, 1.0]
    grpo = GrpoTrainer(tr, config, [("fixed", _fixed(rewards))], load_tokenizer(default_tokenizer()),
                       reference=ref_trainer.token_logps if beta else None)
    records = [PromptRecord(rng.integers(1, cfg.vocab_size, n).astype(np.int32), f"p{n}", {}) for n in (5, 9)]
    completions = [rng.integers(1, cfg.vocab_size, int(rng.integers(2, 12))).tolist() for _ in range(6)]
    passes, metrics = grpo.step(records, model.parameters(), seed=0, completions=completions)
    assert tr.optimizer_steps() == 2 and len(passes) == 4

    def completion_logps(m, k):
        r, c = records[k // 3], completions[k]
        ids = torch.tensor(np.concatenate([r.ids, c]), dtype=torch.long)
        logp = torch.log_softmax(m(ids[None, :-1]).logits[0], dim=-1).gather(1, ids[1:, None])[:, 0]
        return logp[r.ids.size - 1:]
    adv = torch.tensor(advantages(rewards, 3))
    with torch.no_grad():
        old = [completion_logps(policy, k) for k in range(6)]
        ref = [completion_logps(reference, k) for k in range(6)] if beta else None
    lengths = [len(c) for c in completions]
    losses = []
    for _ in range(2):
        policy.zero_grad()
        logps = [completion_logps(policy, k) for k in range(6)]
        loss = _trl_window_loss(config, logps, old, ref, adv, lengths, 2)
        loss.backward()
        losses.append(loss.item())
        with torch.no_grad():
            for p in policy.parameters():
                p.sub_(lr * p.grad)
    assert metrics["loss"] == pytest.approx(np.mean(losses), rel=1e-3, abs=1e-6)
    ours = {n: t.numpy() for n, t in model.named_parameters().items()}
    moved = 0.0
    for n, w in weights_of(policy).items():
        if n in ours:
            np.testing.assert_allclose(ours[n], w, atol=2e-4, rtol=1e-3, err_msg=n)
            moved = max(moved, float(np.abs(w - weights_of(hf_model(cfg, seed=8))[n]).max()))
    assert moved > 1e-3
    assert metrics["clip_ratio/region_mean"] > 0          # the second pass clipped some tokens
    assert metrics["reward"] == pytest.approx(np.mean(rewards))
    assert ("kl" in metrics) == bool(beta)


@pytest.mark.parametrize("fn,message", [
    (lambda p, c, **k: 1 / 0, "reward function bad raised ZeroDivisionError"),
    (lambda p, c, **k: [1.0], "returned 1 rewards for 4 completions"),
    (lambda p, c, **k: [1.0, float("nan"), 0.0, 0.0], "returned nan for completion 1"),
    (lambda p, c, **k: ["a"] * 4, "must return a list of numbers"),
])
def test_a_bad_reward_function_stops_the_step_before_any_weight_changes(ctx, fn, message):
    cfg = Lfm2Config.preset("tiny")
    engine = ComputeEngine(ctx)
    model = Lfm2Model(cfg, ctx, engine, seed=1)
    tr = Trainer(model, SGD(lr=1.0), ctx, engine).with_length_bucket(16)
    grpo = GrpoTrainer(tr, GrpoConfig(num_generations=4, max_completion_length=4), [("bad", fn)],
                       load_tokenizer(default_tokenizer()))
    before = {k: v.numpy() for k, v in model.named_parameters().items()}
    with pytest.raises(TrainError, match=message):
        grpo.step([PromptRecord(np.array([1, 5, 7], np.int32), "p", {})], model.parameters(), seed=0,
                  completions=[[3, 4], [5], [6, 7, 8], [9]])
    assert tr.step_in_accum == 0
    for k, v in model.named_parameters().items():
        np.testing.assert_array_equal(v.numpy(), before[k], err_msg=k)


@pytest.mark.parametrize("kwargs,message", [
    (dict(num_generations=1), "num_generations must be an integer >= 2"),
    (dict(loss_type="bnpo"), "loss_type must be one of grpo, dr_grpo, dapo"),
    (dict(beta=-1.0), "beta must be a finite number >= 0"), (dict(temperature=0.0), "temperature"),
    (dict(scale_rewards="rank"), "scale_rewards"), (dict(epsilon=1.5), "epsilon"),
])
def test_bad_configs_are_refused(kwargs, message):
    with pytest.raises(ValueError, match=message):
        GrpoConfig(**kwargs)


def test_reward_functions_by_name(tmp_path):
    assert load_reward("exact_match")[1](["q"] * 2, [" 5 ", "6"], answer=["5", "5"]) == [1.0, 0.0]
    fmt = regex_reward(r"\d+")
    assert fmt([], ["12", "1 2", " 7\n"]) == [1.0, 0.0, 1.0]
    (tmp_path / "mine.py").write_text("def length(prompts, completions, **kw):\n    return [len(c) for c in completions]\n")
    name, fn = load_reward(f"{tmp_path / 'mine.py'}:length")
    assert fn([], ["ab", "c"]) == [2, 1]
    for spec, message in (("nope", "expected exact_match"), (f"{tmp_path / 'mine.py'}:missing", "has no function"),
                          ("regex:(", "not a regular expression"), ("no_such_module_x:f", "importing no_such_module_x")):
        with pytest.raises(ValueError, match=message):
            load_reward(spec)


def test_loss_scales_make_trls_normalisations():
    c = GrpoConfig(num_generations=4, max_completion_length=10)
    assert loss_scale(GrpoConfig(num_generations=4, loss_type="grpo"), [3] * 8, 2) == 0.25
    assert loss_scale(GrpoConfig(num_generations=4, max_completion_length=10, loss_type="dr_grpo"), [3] * 8, 2) == 1 / 40
    assert loss_scale(c, [3, 5, 2, 6, 4, 4, 4, 4], 2) == 2 / 32


trl_reference = pytest.importorskip("trl_reference", reason="TRL is the reference")


@pytest.mark.parametrize("loss_type,beta,temperature", [("dapo", 0.0, 1.0), ("grpo", 0.0, 1.0), ("dr_grpo", 0.0, 1.0),
                                                        ("dapo", 0.1, 1.0), ("dapo", 0.1, 0.7)])
def test_a_teacher_forced_batch_equals_trls_grpo_trainer(ctx, loss_type, beta, temperature):
    """TRL's own GRPOTrainer (its advantages, padding and compute_loss) on transformers' model as the
    reference for one batch: every parameter's gradient (equal-length prompts: TRL pads them left).
    At a sampling temperature other than 1, TRL's log-probs (policy and reference) are those of the
    logits divided by it."""
    cfg = Lfm2Config.preset("tiny")
    rng = np.random.default_rng(13)
    reference, policy = hf_model(cfg, seed=12), hf_model(cfg, seed=12)
    with torch.no_grad():              # far enough from the reference that the KL's gradient is no rounding noise
        for p in policy.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    g, prompts = 3, [rng.integers(1, cfg.vocab_size, 6).tolist() for _ in range(2)]
    completions = [rng.integers(1, cfg.vocab_size, int(rng.integers(2, 10))).tolist() for _ in range(2 * g)]
    rewards = [1.0, 0.0, 0.5, 0.25, 0.0, 1.0]
    _, want_grads = trl_reference.trl_grpo_loss(policy, reference if beta else None, prompts, completions, rewards,
                                                loss_type=loss_type, beta=beta, epsilon=0.2, num_generations=g,
                                                max_completion_length=10, temperature=temperature)
    engine = ComputeEngine(ctx)
    model = Lfm2Model(cfg, ctx, engine, tensors=weights_of(policy))
    ref_trainer = Trainer(Lfm2Model(cfg, ctx, engine, tensors=weights_of(reference)), SGD(lr=0.0), ctx,
                          engine).with_length_bucket(16)
    tr = Trainer(model, SGD(lr=0.0), ctx, engine).with_length_bucket(16).with_grad_accum_steps(len(prompts))
    grpo = GrpoTrainer(tr, GrpoConfig(num_generations=g, max_completion_length=10, loss_type=loss_type, beta=beta,
                                      temperature=temperature),
                       [("fixed", _fixed(rewards))], load_tokenizer(default_tokenizer()),
                       reference=ref_trainer.token_logps if beta else None)
    records = [PromptRecord(np.array(p, np.int32), "p", {}) for p in prompts]
    grpo.step(records, model.parameters(), seed=0, completions=completions)
    grads = {n: t.grad.numpy() for n, t in model.named_parameters().items()}     # lr 0: the step left them
    assert want_grads
    for n, w in want_grads.items():
        assert np.abs(grads[n] - w).max() <= 2e-3 * max(np.abs(w).max(), 1e-5), n
