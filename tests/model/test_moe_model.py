"""Lfm2Model on LFM2-MoE checkpoints (issue 47) against transformers' Lfm2MoeForCausalLM: what the model
holds (experts fused as transformers keeps them in memory, the expert_bias buffers beside the
parameters) and what it writes back; logits, loss and every parameter's gradient against the
reference in float64, over routing variants (top-1/2/4, 4-8 experts, dense layers first, expert
bias on and off, normalisation and scaling on and off, tied and untied heads)."""
from __future__ import annotations

import copy
import dataclasses

import numpy as np
import pytest

from lfm2jit.model import CheckpointError, Lfm2Model, Lfm2MoeConfig
from model_passes import BUCKET, run_loss_and_grads
from numerics import rel_err, worst
from references import moe_hf_model

torch = pytest.importorskip("torch", reason="transformers is the reference")
transformers = pytest.importorskip("transformers")


@pytest.mark.parametrize("name", ["tiny-moe", "tiny-moe-untied"])
def test_the_model_holds_transformers_state_dict_and_writes_it_back(ctx, engine, tmp_path, name):
    cfg = Lfm2MoeConfig.preset(name)
    hf = moe_hf_model(cfg, seed=3)
    hf.save_pretrained(tmp_path / "hf")
    model = Lfm2Model.from_pretrained(tmp_path / "hf", ctx, engine)
    assert isinstance(model.cfg, Lfm2MoeConfig)
    want = {n: t.detach().numpy() for n, t in hf.state_dict().items()
            if not (cfg.tie_word_embeddings and n == "lm_head.weight")}
    have = model.state_dict()
    assert sorted(have) == sorted(want)
    for n, a in want.items():
        np.testing.assert_array_equal(have[n], a, err_msg=n)
    # the expert_bias buffers are not parameters: nothing trains them
    assert not [n for n in model.named_parameters() if n.endswith("expert_bias")]
    assert [n for n in have if n.endswith("expert_bias")]
    model.save_pretrained(tmp_path / "ours")
    back = transformers.Lfm2MoeForCausalLM.from_pretrained(tmp_path / "ours").float()
    for n, t in back.state_dict().items():
        np.testing.assert_array_equal(t.numpy(), hf.state_dict()[n].numpy(), err_msg=n)


def test_load_state_takes_either_expert_form_and_checks_before_writing(ctx, engine):
    cfg = Lfm2MoeConfig.preset("tiny-moe")
    model = Lfm2Model(cfg, ctx, engine, seed=1)
    other = Lfm2Model(cfg, ctx, engine, seed=2).state_dict()
    before = model.state_dict()
    broken = dict(other)
    broken.pop(next(n for n in broken if n.endswith("experts.down_proj")))
    with pytest.raises(CheckpointError, match="missing"):
        model.load_state(broken)
    for n, a in model.state_dict().items():                    # nothing half-written
        np.testing.assert_array_equal(a, before[n], err_msg=n)
    model.load_state(other)
    for n, a in model.state_dict().items():
        np.testing.assert_array_equal(a, other[n], err_msg=n)


# (preset, changes): every routing option the config has, each in some case
VARIANTS = [
    ("tiny-moe", {}),
    ("tiny-moe-untied", {}),
    ("tiny-moe-top1", {}),
    ("tiny-moe", dict(norm_topk_prob=False, routed_scaling_factor=2.5)),
    ("tiny-moe", dict(use_expert_bias=False, num_dense_layers=0)),
    ("tiny-moe-untied", dict(num_experts=8, num_experts_per_tok=4, num_dense_layers=2, routed_scaling_factor=0.5)),
]


def reference(hf, ids, targets, mask):
    """float64 logits, the masked mean loss and every parameter's gradient, from transformers' eager
    experts and attention (its grouped-GEMM experts take no float64)."""
    ref = copy.deepcopy(hf).double()
    ref.config._experts_implementation = "eager"
    ref.config._attn_implementation = "eager"
    logits = ref(input_ids=torch.as_tensor(ids)[None]).logits[0]
    sel = torch.as_tensor(mask != 0)
    loss = torch.nn.functional.cross_entropy(logits[sel], torch.as_tensor(targets)[sel], reduction="sum") / int(sel.sum())
    loss.backward()
    tied = hf.config.tie_word_embeddings
    grads = {n: p.grad.numpy() for n, p in ref.named_parameters() if not (tied and n == "lm_head.weight")}
    return logits.detach().numpy(), loss.item(), grads


@pytest.mark.parametrize("preset,changes", VARIANTS, ids=[f"{p}-{'-'.join(c) or 'as-is'}" for p, c in VARIANTS])
def test_logits_loss_and_every_gradient_match_transformers(ctx, engine, preset, changes):
    cfg = dataclasses.replace(Lfm2MoeConfig.preset(preset), **changes)
    hf = moe_hf_model(cfg, seed=len(changes) + 11)
    model = Lfm2Model(cfg, ctx, engine, tensors={n: t.detach().numpy() for n, t in hf.state_dict().items()})
    rng = np.random.default_rng(len(changes))
    t = 29                                              # not a bucket multiple: slots and tokens are padded
    ids, targets = rng.integers(0, cfg.vocab_size, t), rng.integers(0, cfg.vocab_size, t)
    ids[[3, 17]] = cfg.pad_token_id
    mask = (rng.random(t) < 0.8).astype(np.float32)
    mask[0] = 1.0
    want_logits, want_loss, want_grads = reference(hf, ids, targets, mask)
    assert rel_err(model.logits(ids, bucket=BUCKET), want_logits) < 1e-5
    loss, grads = run_loss_and_grads(model, ids, targets, mask)
    assert abs(loss - want_loss) < 1e-5
    assert any(n.endswith("experts.gate_up_proj") for n in grads) and any(n.endswith("feed_forward.gate.weight")
                                                                         for n in grads)
    if cfg.num_experts_per_tok == 1 and cfg.norm_topk_prob:
        # one pick normalised is w = g / (g + 1e-6): the router's gradient is 1e-6 / g^2 of its score's,
        # f32 rounding itself; it is held to the model's largest gradient instead
        scale = max(np.abs(g).max() for g in want_grads.values())
        routers = [n for n in want_grads if n.endswith("feed_forward.gate.weight")]
        assert max(np.abs(grads[n] - want_grads[n]).max() for n in routers) < 1e-6 * scale
        assert max(np.abs(want_grads[n]).max() for n in routers) < 1e-4 * scale
        grads, want_grads = ({n: g for n, g in d.items() if n not in routers} for d in (grads, want_grads))
    err, name = worst(grads, want_grads)
    assert err < 1e-4, f"worst gradient {name}: rel err {err:.2e}"


def test_a_repeated_step_is_bit_identical_and_so_is_one_that_recomputes_the_experts(ctx, engine):
    """The routing's sorts and sums run in a fixed order: two passes give the same bits, and so does
    a model with recompute_mlp, whose forward keeps no experts' up-projection (h) for the backward."""
    cfg = Lfm2MoeConfig.preset("tiny-moe")
    model = Lfm2Model(cfg, ctx, engine, seed=4)
    recomputing = Lfm2Model(cfg, ctx, engine, seed=4, recompute_mlp=True)
    rng = np.random.default_rng(9)
    ids, targets = rng.integers(0, cfg.vocab_size, 40), rng.integers(0, cfg.vocab_size, 40)
    mask = np.ones(40, np.float32)
    first = run_loss_and_grads(model, ids, targets, mask)[1]
    second = run_loss_and_grads(model, ids, targets, mask)[1]
    third = run_loss_and_grads(recomputing, ids, targets, mask)[1]
    for n, g in first.items():
        np.testing.assert_array_equal(second[n], g, err_msg=n)
        np.testing.assert_array_equal(third[n], g, err_msg=n)
    sparse = [recomputing.forward(ids, BUCKET).layers[i][1] for i in cfg.moe_layers]
    assert sparse and all(s.experts.h is None and s.xs is None and s.xf is None for s in sparse)


def test_greedy_decoding_equals_transformers_uncached_forward(ctx, engine, tmp_path):
    """Cached decoding routes one token per sequence each step (a batch of prompts of several
    lengths); token for token against argmax over transformers' full forward, run again per token.
    Weights drawn wider than the default init, so the logits are far apart and argmax is stable."""
    cfg = dataclasses.replace(Lfm2MoeConfig.preset("tiny-moe-untied"), initializer_range=0.3)
    hf = moe_hf_model(cfg, seed=21)
    hf.config._experts_implementation = "eager"
    model = Lfm2Model(cfg, ctx, engine, tensors={n: t.detach().numpy() for n, t in hf.state_dict().items()})
    rng = np.random.default_rng(5)
    prompts = [rng.integers(3, cfg.vocab_size, n).tolist() for n in (1, 4, 11)]
    got = model.generate(prompts, max_new_tokens=10, eos_token_id=[])
    for prompt, ours in zip(prompts, got):
        seq = list(prompt)
        with torch.no_grad():
            for _ in range(10):
                seq.append(int(hf(torch.tensor([seq])).logits[0, -1].argmax()))
        assert ours == seq[len(prompt):], prompt


def test_training_passes_count_each_experts_tokens_as_transformers_routes_them(ctx, engine):
    """The picks per expert of each sparse layer, added up over training passes (not evaluation),
    equal transformers' top-k choices on the same tokens but the padding token's (packing's filler);
    taking them starts the count again."""
    cfg = dataclasses.replace(Lfm2MoeConfig.preset("tiny-moe-untied"), num_experts=8, num_experts_per_tok=3)
    hf = moe_hf_model(cfg, seed=2)
    picked: dict[int, list] = {i: [] for i in cfg.moe_layers}
    for i in cfg.moe_layers:
        hf.model.layers[i].feed_forward.gate.register_forward_hook(
            lambda mod, args, out, i=i: picked[i].append(out[2].numpy()))
    model = Lfm2Model(cfg, ctx, engine, tensors={n: t.detach().numpy() for n, t in hf.state_dict().items()})
    rng = np.random.default_rng(3)
    batches = [rng.integers(1, cfg.vocab_size, n) for n in (11, 30)]
    batches[1][[4, 9, 10]] = cfg.pad_token_id
    for ids in batches:
        with torch.no_grad():
            hf(input_ids=torch.as_tensor(ids)[None])
        model.forward(ids, BUCKET, train=True)
    real = np.concatenate(batches) != cfg.pad_token_id
    model.forward(batches[0], BUCKET)                          # evaluation: not counted
    counts = model.take_routed_tokens()
    assert sorted(counts) == cfg.moe_layers
    for i, n in counts.items():
        want = np.bincount(np.concatenate(picked[i])[real].ravel(), minlength=cfg.num_experts)
        np.testing.assert_array_equal(n, want)
        assert n.sum() == 38 * cfg.num_experts_per_tok
    assert all(not n.any() for n in model.take_routed_tokens().values())
    assert Lfm2Model(Lfm2MoeConfig.preset("tiny-moe"), ctx, engine).take_routed_tokens().keys() == {1, 2, 3}


def routing_gaps(model, ids) -> np.ndarray:
    """Per sparse layer and token, the gap between its K-th and its (K+1)-th score (score + expert
    bias, what the picks are made on) in an f32 forward: how far from a tie its picks are."""
    cfg, trace = model.cfg, model.forward(ids, BUCKET)
    gaps = []
    for i in cfg.moe_layers:
        scores = 1 / (1 + np.exp(-trace.layers[i][1].logits.numpy()[:len(ids)].astype(np.float64)))
        if cfg.use_expert_bias:
            scores = scores + model._buffers[f"model.layers.{i}.feed_forward.expert_bias"].numpy()
        ranked = -np.sort(-scores, axis=1)
        gaps.append(ranked[:, cfg.num_experts_per_tok - 1] - ranked[:, cfg.num_experts_per_tok])
    return np.stack(gaps)


NEAR_TIE = 5e-4     # f16 activations move a router logit by about 3e-4 here, a score by under 1e-4


F16_VARIANTS = [VARIANTS[0], VARIANTS[2]]         # top-2 and top-1 (whose router's gradient is tiny)


@pytest.mark.parametrize("preset,changes", F16_VARIANTS, ids=[f"{p}-{'-'.join(c) or 'as-is'}" for p, c in F16_VARIANTS])
def test_f16_activations_match_transformers_within_f16_rounding(ctx, engine, preset, changes):
    """activation_dtype="f16": the hidden rows (normed input, the slots' rows, the experts' h, the
    outputs) are stored as f16, the router's logits and the picks' weights stay f32; logits, loss
    and every gradient within the f16 bounds of test_mixed_precision.py (logits 1e-2, gradients
    2e-2: a few units of f16 rounding per layer; tiny ones see below). Rounding may flip a pick where two scores tie
    within it, which changes that token's output by far more: where the picks differ from the f32
    model's, the scores must be that close; the comparison is made on a sequence with no such tie."""
    if not ctx.has_f16:
        pytest.skip("adapter has no shader-f16")
    cfg = dataclasses.replace(Lfm2MoeConfig.preset(preset), **changes)
    hf = moe_hf_model(cfg, seed=len(changes) + 11)
    tensors = {n: t.detach().numpy() for n, t in hf.state_dict().items()}
    model = Lfm2Model(cfg, ctx, engine, tensors=tensors, activation_dtype="f16")
    exact = Lfm2Model(cfg, ctx, engine, tensors=tensors)
    rng, t = np.random.default_rng(len(changes)), 29
    for _ in range(5):          # the first sparse layer whose picks differ differs at near-ties only
        ids = rng.integers(0, cfg.vocab_size, t)
        ours, theirs = exact.forward(ids, BUCKET), model.forward(ids, BUCKET)
        flipped = [np.flatnonzero((ours.layers[i][1].idx.numpy() != theirs.layers[i][1].idx.numpy())[:t].any(1))
                   for i in cfg.moe_layers]
        first = next((layer for layer, rows in enumerate(flipped) if rows.size), None)
        if first is not None:
            assert (routing_gaps(exact, ids)[first, flipped[first]] < NEAR_TIE).all()
    ids = next(ids for ids in (rng.integers(0, cfg.vocab_size, t) for _ in range(500))
               if routing_gaps(exact, ids).min() > NEAR_TIE)
    targets = rng.integers(0, cfg.vocab_size, t)
    mask = (rng.random(t) < 0.8).astype(np.float32)
    mask[0] = 1.0
    want_logits, want_loss, want_grads = reference(hf, ids, targets, mask)
    sparse = [model.forward(ids, BUCKET, train=True).layers[i][1] for i in cfg.moe_layers]
    assert sparse and all(s.h.dtype == s.experts.h.dtype == "f16" and s.logits.dtype == s.w.dtype == s.ws.dtype
                          == "f32" for s in sparse)
    assert rel_err(model.logits(ids, bucket=BUCKET), want_logits) < 1e-2
    loss, grads = run_loss_and_grads(model, ids, targets, mask)
    assert abs(loss - want_loss) / want_loss < 1e-3
    # f16 rounds the activation gradients, which are of the model's largest gradient's scale: a
    # gradient a thousand times smaller than that (a random init's conv-layer norms, a top-1
    # router's) is a cancellation of such terms, held to a thousandth of that scale instead
    floor = 1e-3 * max(float(np.abs(g).max()) for g in want_grads.values())
    err, name = max((float(np.abs(grads[n] - g).max()) / max(float(np.abs(g).max()), floor), n)
                    for n, g in want_grads.items())
    assert err < 2e-2, f"worst gradient {name}: rel err {err:.2e}"


def test_the_routers_balance_loss_adds_its_gradient_as_torch_differentiates_it(ctx, engine):
    """With router_aux_loss_coef c, the gradients are those of CE + c * sum over sparse layers of
    (E / K) * sum_e share_e * P_e over the non-padding tokens (share_e: the picks expert e got over
    the tokens, P_e: its mean normalised sigmoid score), computed here in torch float64 from
    transformers' own router logits and picks; the value is reported, without c."""
    cfg = dataclasses.replace(Lfm2MoeConfig.preset("tiny-moe"), num_experts=6, num_experts_per_tok=2)
    hf = moe_hf_model(cfg, seed=8)
    coef = 0.3
    rng = np.random.default_rng(8)
    t = 23
    ids, targets = rng.integers(1, cfg.vocab_size, t), rng.integers(0, cfg.vocab_size, t)
    ids[[5, 6]] = cfg.pad_token_id
    mask = (rng.random(t) < 0.8).astype(np.float32)
    mask[0] = 1.0
    ref = copy.deepcopy(hf).double()
    ref.config._experts_implementation = "eager"
    ref.config._attn_implementation = "eager"
    routed = []
    for i in cfg.moe_layers:
        ref.model.layers[i].feed_forward.gate.register_forward_hook(lambda mod, args, out: routed.append(out))
    logits = ref(input_ids=torch.as_tensor(ids)[None]).logits[0]
    sel = torch.as_tensor(mask != 0)
    ce = torch.nn.functional.cross_entropy(logits[sel], torch.as_tensor(targets)[sel], reduction="sum") / int(sel.sum())
    keep = torch.as_tensor(ids != cfg.pad_token_id, dtype=torch.float64)
    n = keep.sum()
    balance = 0.0
    for router_logits, _, picks in routed:
        counts = (torch.nn.functional.one_hot(picks, cfg.num_experts).sum(1) * keep[:, None]).sum(0).double()
        s = router_logits.sigmoid()
        mean_p = (keep[:, None] * s / s.sum(-1, keepdim=True)).sum(0)
        balance = balance + cfg.num_experts / cfg.num_experts_per_tok * (counts * mean_p).sum() / (n * n)
    (ce + coef * balance).backward()
    want = {n_: p.grad.numpy() for n_, p in ref.named_parameters() if not (cfg.tie_word_embeddings and n_ == "lm_head.weight")}
    model = Lfm2Model(cfg, ctx, engine, tensors={n_: t_.detach().numpy() for n_, t_ in hf.state_dict().items()})
    model.router_aux_loss_coef = coef
    model.take_router_balance()
    loss, grads = run_loss_and_grads(model, ids, targets, mask, train=True)
    assert abs(loss - ce.item()) < 1e-5                          # the loss reported is the cross-entropy
    assert abs(model.take_router_balance() - balance.item()) < 1e-5 * balance.item()
    err, name = worst(grads, want)
    assert err < 1e-4, f"worst gradient {name}: rel err {err:.2e}"
    routers = [n_ for n_ in want if n_.endswith("feed_forward.gate.weight")]
    model.router_aux_loss_coef = 0.0                              # off: the router's gradient differs
    assert rel_err(run_loss_and_grads(model, ids, targets, mask, train=True)[1][routers[0]], want[routers[0]]) > 1e-3
    for bad in (-1.0, float("nan"), "0.1", True):
        with pytest.raises(ValueError, match="router_aux_loss_coef"):
            model.router_aux_loss_coef = bad


def test_adamw_steps_of_full_fine_tuning_equal_torch(ctx, engine):
    """Three AdamW steps of every parameter (router and experts included) through the Trainer equal
    torch.optim.AdamW on transformers' model; the expert_bias buffers stay as they were."""
    from trainer import AdamW, Trainer
    cfg = Lfm2MoeConfig.preset("tiny-moe-untied")
    hf = moe_hf_model(cfg, seed=17)
    hf.config._experts_implementation = "eager"
    model = Lfm2Model(cfg, ctx, engine, tensors={n: t.detach().numpy() for n, t in hf.state_dict().items()})
    # eps 1e-6 as in tests/trainer/test_trainer.py: with 1e-8 Adam's first steps move a weight whose
    # gradient is rounding noise by a sizeable part of lr, whichever sign the noise has
    opt = torch.optim.AdamW(hf.parameters(), lr=3e-3, eps=1e-6, weight_decay=0.01)
    tr = Trainer(model, AdamW(lr=3e-3, eps=1e-6, weight_decay=0.01), ctx, engine).with_length_bucket(BUCKET)
    rng = np.random.default_rng(30)
    for _ in range(3):
        ids, targets = rng.integers(1, cfg.vocab_size, 21), rng.integers(0, cfg.vocab_size, 21)
        stats = tr.train_step(ids, targets, model.parameters())
        logits = hf(input_ids=torch.as_tensor(ids)[None]).logits[0]
        loss = torch.nn.functional.cross_entropy(logits, torch.as_tensor(targets))
        assert abs(stats.loss - loss.item()) < 1e-4 * loss.item()
        opt.zero_grad()
        loss.backward()
        opt.step()
    have = model.state_dict()
    for n, t in hf.state_dict().items():
        if n.endswith("expert_bias"):
            np.testing.assert_array_equal(have[n], t.numpy(), err_msg=n)
        else:
            assert rel_err(have[n], t.detach().numpy()) < 1e-3, n
