"""Sanity of tests/trl_reference.py, the helper that runs TRL's own DPO/GRPO loss on a tiny transformers
LFM2: it runs, its values are the ones the losses' definitions give at points where they are known
(log 2, IPO's 1/(2 beta)^2, group-normalised advantages), its log-probs are the model's own on the
token sequences as given (no BOS/EOS), its gradients are the loss's (finite differences), and it
leaves the caller's models as it found them."""
from __future__ import annotations

import copy
import math

import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
pytest.importorskip("trl")
pytest.importorskip("datasets")

import trl_reference  # noqa: E402
from trl_reference import trl_dpo, trl_grpo_loss  # noqa: E402

PAIRS = [([5, 6, 7], [8, 9], [10]), ([11, 12], [13, 14, 15], [16, 17]), ([3, 4, 5, 6], [40], [41, 42])]
BETA = 0.1


def tiny(seed: int = 0):
    cfg = transformers.Lfm2Config(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                  num_attention_heads=2, num_key_value_heads=1,
                                  layer_types=["conv", "full_attention"], max_position_embeddings=64)
    torch.manual_seed(seed)
    return transformers.Lfm2ForCausalLM(cfg).double().train()


def perturbed(model, scale: float = 0.05, seed: int = 1):
    out = copy.deepcopy(model)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in out.parameters():
            p.add_(torch.randn(p.shape, generator=gen, dtype=p.dtype) * scale)
    return out


@pytest.fixture(scope="module")
def policy_and_ref():
    ref = tiny().eval()
    return perturbed(ref).train(), ref


def seq_logp(model, prompt, completion) -> float:
    """Sum of log p(completion token | everything before it), the sequence exactly prompt + completion."""
    ids = torch.tensor([list(prompt) + list(completion)])
    with torch.no_grad():
        logits = model(input_ids=ids).logits[0].double()
    logp = torch.log_softmax(logits, -1)
    n = len(prompt)
    return float(sum(logp[n - 1 + k, t] for k, t in enumerate(completion)))


def test_sigmoid_at_reference_is_log2():
    model = tiny()
    loss, metrics, grads = trl_dpo(model, copy.deepcopy(model).eval(), PAIRS, beta=BETA)
    assert loss == pytest.approx(math.log(2), abs=1e-12)
    for k in ("rewards/chosen", "rewards/rejected", "rewards/margins", "rewards/accuracies"):
        assert metrics[k] == pytest.approx(0.0, abs=1e-12), k
    names = {n for n, p in model.named_parameters() if p.requires_grad}
    assert set(grads) == names
    assert all(np.isfinite(g).all() for g in grads.values())
    assert sum(float(np.abs(g).sum()) for g in grads.values()) > 0.0


def test_metrics_are_the_models_log_probs_of_the_given_tokens(policy_and_ref):
    model, ref = policy_and_ref
    loss, metrics, _ = trl_dpo(model, ref, PAIRS, beta=BETA)
    chosen = [seq_logp(model, p, c) for p, c, _ in PAIRS]
    rejected = [seq_logp(model, p, r) for p, _, r in PAIRS]
    ref_c = [seq_logp(ref, p, c) for p, c, _ in PAIRS]
    ref_r = [seq_logp(ref, p, r) for p, _, r in PAIRS]
    assert metrics["logps/chosen"] == pytest.approx(np.mean(chosen), abs=1e-10)
    assert metrics["logps/rejected"] == pytest.approx(np.mean(rejected), abs=1e-10)
    rc = BETA * (np.array(chosen) - ref_c)
    rr = BETA * (np.array(rejected) - ref_r)
    assert metrics["rewards/chosen"] == pytest.approx(rc.mean(), abs=1e-10)
    assert metrics["rewards/rejected"] == pytest.approx(rr.mean(), abs=1e-10)
    assert metrics["rewards/margins"] == pytest.approx((rc - rr).mean(), abs=1e-10)
    assert metrics["rewards/accuracies"] == pytest.approx(float(np.mean(rc > rr)))
    assert loss == pytest.approx(float(np.mean(np.logaddexp(0.0, -(rc - rr)))), abs=1e-10)
    assert metrics["num_tokens"] == sum(2 * len(p) + len(c) + len(r) for p, c, r in PAIRS)
    for k in ("entropy", "logits/chosen", "logits/rejected", "mean_token_accuracy"):
        assert k in metrics


def test_gradients_are_the_losss(policy_and_ref):
    model, ref = policy_and_ref
    model = copy.deepcopy(model)
    with trl_reference.lfm2_rmsnorm_in_input_dtype():  # else float32 norms: finite differences are noise
        check_gradients(model, ref)


def check_gradients(model, ref):
    loss, _, grads = trl_dpo(model, ref, PAIRS, beta=BETA)
    h = 1e-6
    for name, idx in (("lm_head.weight", (8, 3)), ("model.layers.0.conv.in_proj.weight", (5, 7)),
                      ("model.layers.1.self_attn.q_proj.weight", (2, 1))):
        if name not in grads:  # tied lm_head: the embedding carries it
            name = "model.embed_tokens.weight"
        p = model.get_parameter(name)
        with torch.no_grad():
            p[idx] += h
        up = trl_dpo(model, ref, PAIRS, beta=BETA)[0]
        with torch.no_grad():
            p[idx] -= 2 * h
        down = trl_dpo(model, ref, PAIRS, beta=BETA)[0]
        with torch.no_grad():
            p[idx] += h
        fd = (up - down) / (2 * h)
        assert grads[name][idx] == pytest.approx(fd, rel=1e-6, abs=1e-9), name


def test_ipo_at_reference_and_differs_from_sigmoid(policy_and_ref):
    model = tiny()
    loss, _, _ = trl_dpo(model, copy.deepcopy(model).eval(), PAIRS, beta=BETA, loss_type="ipo")
    assert loss == pytest.approx((1 / (2 * BETA)) ** 2, abs=1e-9)
    model, ref = policy_and_ref
    sig, _, g_sig = trl_dpo(model, ref, PAIRS, beta=BETA)
    ipo, _, g_ipo = trl_dpo(model, ref, PAIRS, beta=BETA, loss_type="ipo")
    assert abs(sig - ipo) > 1e-3
    assert not np.allclose(g_sig["lm_head.weight" if "lm_head.weight" in g_sig else "model.embed_tokens.weight"],
                           g_ipo["lm_head.weight" if "lm_head.weight" in g_ipo else "model.embed_tokens.weight"])


def test_label_smoothing_only_reaches_the_losses_that_read_it(policy_and_ref):
    model, ref = policy_and_ref
    plain = trl_dpo(model, ref, PAIRS, beta=BETA)[0]
    assert trl_dpo(model, ref, PAIRS, beta=BETA, label_smoothing=0.2)[0] == plain  # TRL 1.16's sigmoid ignores it
    robust = trl_dpo(model, ref, PAIRS, beta=BETA, loss_type="robust", label_smoothing=0.2)[0]
    assert abs(robust - plain) > 1e-6


def test_fp64_head_agrees_with_trls_kernel(policy_and_ref, monkeypatch):
    model, ref = policy_and_ref
    loss64, m64, g64 = trl_dpo(model, ref, PAIRS, beta=BETA)
    monkeypatch.setattr(trl_reference, "FP64_LM_HEAD", False)
    loss32, m32, g32 = trl_dpo(model, ref, PAIRS, beta=BETA)
    assert loss32 == pytest.approx(loss64, rel=1e-5)
    for k in m64:
        assert m32[k] == pytest.approx(m64[k], rel=1e-4, abs=1e-5), k
    for n in g64:
        scale = max(float(np.abs(g64[n]).max()), 1e-12)
        assert float(np.abs(g64[n] - g32[n]).max()) / scale < 1e-4, n


def test_leaves_the_models_as_found(policy_and_ref):
    model, ref = policy_and_ref
    pad = model.config.pad_token_id
    torch.manual_seed(123)
    expected = torch.rand(3)
    torch.manual_seed(123)
    trl_dpo(model, ref, PAIRS, beta=BETA)
    assert torch.equal(torch.rand(3), expected)
    assert "forward" not in model.__dict__ and "forward" not in ref.__dict__
    assert model.config.pad_token_id == pad and model.training and not ref.training


def test_peft_reference_is_the_adapters_disabled():
    peft = pytest.importorskip("peft")
    base = tiny()
    model = peft.get_peft_model(base, peft.LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"]))
    model = model.double().train()
    loss, metrics, grads = trl_dpo(model, None, PAIRS, beta=BETA)
    assert loss == pytest.approx(math.log(2), abs=1e-12)  # B = 0: the policy is the base
    assert grads and all("lora_" in n for n in grads)
    gen = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for n, p in model.named_parameters():
            if "lora_B" in n:
                p.copy_(torch.randn(p.shape, generator=gen, dtype=p.dtype) * 0.3)
    loss, metrics, _ = trl_dpo(model, None, PAIRS, beta=BETA)
    with model.disable_adapter():
        ref_c = [seq_logp(model, p, c) for p, c, _ in PAIRS]
    pol_c = [seq_logp(model, p, c) for p, c, _ in PAIRS]
    assert metrics["rewards/chosen"] == pytest.approx(BETA * (np.mean(pol_c) - np.mean(ref_c)), abs=1e-10)
    assert abs(metrics["rewards/chosen"]) > 1e-6
    assert set(model.peft_config) == {"default"}


GRPO_PROMPTS = [[5, 6, 7], [11, 12, 13]]
GRPO_COMPLETIONS = [[8, 9], [10, 3, 4], [13], [14, 15, 16], [20, 21], [22], [23, 24, 25, 26], [27, 28]]
GRPO_REWARDS = [1.0, 0.0, 0.5, 0.25, 0.0, 1.0, 1.0, 0.0]


def group_advantages(rewards, g):
    r = np.array(rewards).reshape(-1, g)
    return ((r - r.mean(1, keepdims=True)) / (r.std(1, ddof=1, keepdims=True) + 1e-4)).ravel()


@pytest.mark.parametrize("loss_type", ["grpo", "dr_grpo", "dapo"])
def test_grpo_on_policy_without_kl(policy_and_ref, loss_type):
    model, _ = policy_and_ref
    loss, grads, details = trl_grpo_loss(model, None, GRPO_PROMPTS, GRPO_COMPLETIONS, GRPO_REWARDS,
                                         loss_type=loss_type, beta=0.0, epsilon=0.2, num_generations=4,
                                         return_details=True)
    adv = group_advantages(GRPO_REWARDS, 4)
    np.testing.assert_allclose(details["advantages"], adv, rtol=1e-12)
    n = np.array([len(c) for c in GRPO_COMPLETIONS])
    # ratio 1, no KL: every token's loss is -A
    expected = {"grpo": -adv.mean(), "dapo": -(adv * n).sum() / n.sum(),
                "dr_grpo": -(adv * n).sum() / (len(n) * n.max())}[loss_type]
    assert loss == pytest.approx(expected, abs=1e-12)
    assert details["num_items_in_batch"] == n.sum()
    assert sum(float(np.abs(g).sum()) for g in grads.values()) > 0.0


def test_grpo_kl_and_clipping(policy_and_ref):
    model, ref = policy_and_ref
    kw = dict(loss_type="dapo", epsilon=0.2, num_generations=4, return_details=True)
    base, g0, _ = trl_grpo_loss(model, ref, GRPO_PROMPTS, GRPO_COMPLETIONS, GRPO_REWARDS, beta=0.0, **kw)
    with_kl, g1, d = trl_grpo_loss(model, ref, GRPO_PROMPTS, GRPO_COMPLETIONS, GRPO_REWARDS, beta=0.04, **kw)
    assert d["metrics"]["kl"] > 0 and with_kl > base
    assert d["ref_per_token_logps"].shape == (8, 4)
    same, _, d0 = trl_grpo_loss(model, copy.deepcopy(model).eval(), GRPO_PROMPTS, GRPO_COMPLETIONS, GRPO_REWARDS,
                                beta=0.04, **kw)
    assert same == pytest.approx(base, abs=1e-12) and d0["metrics"]["kl"] == pytest.approx(0.0, abs=1e-12)
    # old log-probs far below the current ones: ratios > 1 + eps, positive advantages clipped (no gradient)
    old = [[-20.0] * len(c) for c in GRPO_COMPLETIONS]
    _, _, dc = trl_grpo_loss(model, None, GRPO_PROMPTS, GRPO_COMPLETIONS, GRPO_REWARDS, beta=0.0,
                             old_per_token_logps=old, **kw)
    assert dc["metrics"]["clip_ratio/high_mean"] > 0.0
