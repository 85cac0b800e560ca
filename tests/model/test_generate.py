"""Lfm2Model.generate and its inference state, held to the uncached forward, to transformers'
generate (greedy, golden configs and a trained checkpoint) and to transformers' sampling warpers."""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from lfm2jit import ComputeEngine
from lfm2jit.model import Lfm2Config, Lfm2Model
from lfm2jit.model.generate import InferenceState, Sampling, generate

try:
    import torch
    import transformers
    HAS_TORCH = True
except ImportError:          # the golden-free parts run without the references
    HAS_TORCH = False

needs_torch = pytest.mark.skipif(not HAS_TORCH, reason="torch and transformers are not installed")
GOLDEN = Path(__file__).resolve().parents[1] / "golden"
GOLDEN_CONFIGS = json.loads((GOLDEN / "index.json").read_text())


def _prompts(rng, vocab: int, lengths) -> list[list[int]]:
    return [rng.integers(0, vocab, n).tolist() for n in lengths]


@pytest.mark.parametrize("name", GOLDEN_CONFIGS)
def test_cached_decoding_equals_uncached_logits(ctx, rng, name):
    """Every step's logits against the whole sequence run again without a cache, for a batch of
    prompts of different lengths (one of a single token), past two growths of the cache."""
    model = Lfm2Model.from_pretrained(GOLDEN / name, ctx, ComputeEngine(ctx))
    prompts = _prompts(rng, model.cfg.vocab_size, (5, 1, 11))
    state = InferenceState(model, [np.array(p, np.int32) for p in prompts], grow=8)
    seqs = [list(p) for p in prompts]
    worst = 0.0
    for _ in range(15):                         # the 14th step grows the cache a second time
        logits = state.logits.numpy()
        for b, seq in enumerate(seqs):
            want = model.logits(seq)[-1].astype(np.float64)
            worst = max(worst, float(np.abs(logits[b] - want).max() / np.abs(want).max()))
        tokens = [int(t) for t in rng.integers(0, model.cfg.vocab_size, len(seqs))]   # any continuation
        for seq, t in zip(seqs, tokens):
            seq.append(t)
        state.step(tokens)
    assert worst < 1e-5, worst
    assert state.lengths == [len(s) for s in seqs]


def test_cached_decoding_in_f16(ctx, rng):
    """Each step's logits near the uncached forward's; generate (tokens chosen on the GPU, steps
    replayed) picks what argmax over these steps' logits picks, as the host loop once did."""
    if not ctx.has_f16:
        pytest.skip(f"{ctx.name} has no shader-f16")
    model = Lfm2Model.from_pretrained(GOLDEN / GOLDEN_CONFIGS[0], ctx, ComputeEngine(ctx), activation_dtype="f16")
    prompt = _prompts(rng, model.cfg.vocab_size, (6,))[0]
    seq = list(prompt)
    state = InferenceState(model, [np.array(seq, np.int32)])
    for _ in range(10):
        logits, want = state.logits.numpy()[0], model.logits(seq)[-1]
        assert np.abs(logits - want).max() <= 2e-2 * np.abs(want).max()
        seq.append(int(np.argmax(logits)))
        state.step([seq[-1]])
    assert generate(model, [np.array(prompt, np.int32)], 10, Sampling(), frozenset(), 0, every=2)[0] == seq[6:]


def test_batched_prompts_equal_one_at_a_time(ctx, rng):
    model = Lfm2Model.from_pretrained(GOLDEN / "tied_bias_g4_attn_last", ctx, ComputeEngine(ctx))
    prompts = _prompts(rng, model.cfg.vocab_size, (3, 9, 1, 4))
    batch = model.generate(prompts + [prompts[1]], max_new_tokens=7, eos_token_id=[])   # a repeat: prefilled once
    assert batch == [model.generate(p, max_new_tokens=7, eos_token_id=[]) for p in prompts] + [batch[1]]
    assert all(len(out) == 7 for out in batch)


def test_stops_after_an_end_id_and_keeps_it(ctx, rng):
    model = Lfm2Model.from_pretrained(GOLDEN / "tied_g1_attn_mid", ctx, ComputeEngine(ctx))
    prompt = _prompts(rng, model.cfg.vocab_size, (4,))[0]
    free = model.generate(prompt, max_new_tokens=12, eos_token_id=[])
    stop = free[3]
    got = model.generate(prompt, max_new_tokens=12, eos_token_id=stop)
    assert got == free[:free.index(stop) + 1]
    assert model.generate(prompt, max_new_tokens=0) == []


def test_default_end_ids_come_from_generation_config(ctx, tmp_path):
    model = Lfm2Model.from_pretrained(GOLDEN / "tied_g1_attn_mid", ctx, ComputeEngine(ctx))
    assert model.generation_eos == (model.cfg.eos_token_id,)
    model.save_pretrained(tmp_path)
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": [7, 2]}))
    assert Lfm2Model.from_pretrained(tmp_path, ctx, ComputeEngine(ctx)).generation_eos == (2, 7)
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": "x"}))
    with pytest.raises(ValueError, match="generation_config.json: eos_token_id must be an id or a list of ids"):
        Lfm2Model.from_pretrained(tmp_path, ctx, ComputeEngine(ctx))


def test_sampling_is_reproducible_per_seed(ctx, rng):
    model = Lfm2Model.from_pretrained(GOLDEN / "untied_bias_g2_attn_first", ctx, ComputeEngine(ctx))
    prompts = _prompts(rng, model.cfg.vocab_size, (5, 2))
    kw = dict(max_new_tokens=10, do_sample=True, temperature=1.5, top_k=50, top_p=0.95, eos_token_id=[])
    a, b = model.generate(prompts, seed=1, **kw), model.generate(prompts, seed=1, **kw)
    assert a == b
    assert any(model.generate(prompts, seed=s, **kw) != a for s in (2, 3, 4))
    greedy = model.generate(prompts, max_new_tokens=10, eos_token_id=[])
    assert model.generate(prompts, max_new_tokens=10, do_sample=True, top_k=1, eos_token_id=[], seed=9) == greedy


@needs_torch
@pytest.mark.parametrize("case", range(40))
def test_sampling_probabilities_equal_transformers_warpers(case):
    """Temperature, top-k and top-p filtered probabilities against transformers' own warpers
    (applied in generate's order), on random logits, a third of the cases with many ties."""
    from transformers.generation.logits_process import (TemperatureLogitsWarper, TopKLogitsWarper,
                                                        TopPLogitsWarper)
    rng = np.random.default_rng(case)
    v = int(rng.integers(2, 300))
    logits = (rng.standard_normal(v) * rng.uniform(0.1, 8)).astype(np.float32)
    if case % 3 == 0:
        logits[rng.integers(0, v, v // 3)] = logits[0]          # ties
    s = Sampling(True, float(rng.uniform(0.3, 2.0)), int(rng.integers(0, v + 2)), float(rng.uniform(0.05, 1.0)))
    x = torch.tensor(logits[None].astype(np.float64))
    for warper in (TemperatureLogitsWarper(s.temperature), s.top_k and TopKLogitsWarper(s.top_k),
                   s.top_p < 1 and TopPLogitsWarper(s.top_p)):
        if warper:
            x = warper(None, x)
    want, got = torch.softmax(x, -1)[0].numpy(), s.probabilities(logits)
    # torch.sort is not stable: which of several equal logits top-p keeps is a tie-break, so
    # the kept probabilities are compared as a multiset, and per id where no logits tie
    np.testing.assert_allclose(np.sort(got), np.sort(want), rtol=1e-9, atol=1e-12)
    if len(set(logits.tolist())) == v:
        np.testing.assert_allclose(got, want, rtol=1e-9, atol=1e-12)


def test_bad_arguments_are_refused_before_gpu_work(ctx):
    engine = ComputeEngine(ctx)
    model = Lfm2Model.from_pretrained(GOLDEN / "tied_g1_attn_mid", ctx, engine)
    before = engine.dispatches
    cases = [
        (dict(prompt_ids=[]), "prompt_ids is an empty list of prompts"),
        (dict(prompt_ids=[[1, 2], []]), r"prompt_ids\[1\] must be a non-empty"),
        (dict(prompt_ids=[1, 999]), r"prompt_ids\[1\] = 999 is outside the vocabulary 0..127"),
        (dict(prompt_ids=[1], max_new_tokens=-1), "max_new_tokens must be an integer >= 0"),
        (dict(prompt_ids=[1], do_sample=True, temperature=0.0), "temperature must be a positive"),
        (dict(prompt_ids=[1], top_p=0.0), r"top_p must be in \(0, 1\]"),
        (dict(prompt_ids=[1], top_k=-2), "top_k must be an integer >= 0"),
        (dict(prompt_ids=[1], eos_token_id=500), "eos_token_id 500 is not a token id"),
        (dict(prompt_ids=[1], seed=1.5), "seed must be an integer"),
    ]
    for kw, match in cases:
        with pytest.raises((ValueError, TypeError), match=match):
            model.generate(**kw)
    assert engine.dispatches == before


# ---- against transformers' generate ----

def _hf_greedy(directory, prompt, n: int) -> tuple[list[int], list[int]]:
    """transformers' greedy continuation twice: its generate (with its cache), and argmax over
    its full forward run again per token (no cache)."""
    hf = transformers.Lfm2ForCausalLM.from_pretrained(directory, torch_dtype=torch.float32).eval()
    with torch.no_grad():
        out = hf.generate(torch.tensor([prompt]), max_new_tokens=n, min_new_tokens=n, do_sample=False,
                          attention_mask=torch.ones(1, len(prompt), dtype=torch.long), pad_token_id=0)
        seq = list(prompt)
        for _ in range(n):
            seq.append(int(hf(torch.tensor([seq])).logits[0, -1].argmax()))
    return out[0, len(prompt):].tolist(), seq[len(prompt):]


def _check_against_transformers(directory, prompts, got) -> None:
    """Token for token against transformers' uncached greedy for every prompt, and against its
    generate for prompts of two tokens or more. On a one-token prompt transformers' generate can
    disagree with its own forward (tied_bias_g4_attn_last, prompt [293]: generate gives 22, 22,
    22, 291, its forward and lfm2jit 22, 22, 2, 2), so there its forward is the reference."""
    for prompt, ours in zip(prompts, got):
        generated, uncached = _hf_greedy(directory, prompt, len(ours))
        assert ours == uncached, prompt
        if len(prompt) > 1:
            assert ours == generated, prompt


@needs_torch
@pytest.mark.parametrize("name", GOLDEN_CONFIGS)
def test_greedy_equals_transformers_on_golden_configs(ctx, rng, name):
    model = Lfm2Model.from_pretrained(GOLDEN / name, ctx, ComputeEngine(ctx))
    prompts = _prompts(rng, model.cfg.vocab_size, (1, 2, 6, 13))
    _check_against_transformers(GOLDEN / name, prompts, model.generate(prompts, max_new_tokens=16, eos_token_id=[]))


@needs_torch
def test_greedy_equals_transformers_on_a_trained_checkpoint(ctx, tmp_path):
    """A tiny model trained to continue a counting pattern (so greedy output is not one repeated
    token), saved and decoded by both."""
    from trainer import AdamW, Trainer
    engine = ComputeEngine(ctx)
    cfg = Lfm2Config.preset("tiny")
    model = Lfm2Model(cfg, ctx, engine, seed=0)
    tr = Trainer(model, AdamW(lr=3e-3), ctx, engine).with_length_bucket(16)
    rng = np.random.default_rng(0)
    for _ in range(100):
        start, step = int(rng.integers(3, 60)), int(rng.integers(1, 4))
        seq = [(start + step * i) % cfg.vocab_size for i in range(24)]
        tr.train_step(seq[:-1], seq[1:], model.parameters())
    model.save_pretrained(tmp_path)
    loaded = Lfm2Model.from_pretrained(tmp_path, ctx, engine)
    prompts = [[10, 12, 14, 16], [40, 41, 42], [7]]
    got = loaded.generate(prompts, max_new_tokens=12, eos_token_id=[])
    _check_against_transformers(tmp_path, prompts, got)
    assert len(set(got[0])) > 3            # the pattern was learned enough to move


@needs_torch
def test_a_prompt_sampled_g_times_in_one_batch_draws_from_transformers_warped_distribution(ctx):
    """GRPO's case: one prompt repeated G times in one batch, sampled with temperature and top-p. Each
    row's first token is an independent draw from transformers' warped distribution of the prompt's
    logits: every draw inside the top-p set, the counts within a few sigma of the probabilities, and
    Pearson's chi-square within five of its standard deviations of its degrees of freedom."""
    from transformers.generation.logits_process import TemperatureLogitsWarper, TopPLogitsWarper
    directory = GOLDEN / "untied_bias_g2_attn_first"
    model = Lfm2Model.from_pretrained(directory, ctx, ComputeEngine(ctx))
    hf = transformers.Lfm2ForCausalLM.from_pretrained(directory).double().eval()
    prompt, n = [3, 17, 9, 40, 2], 500
    with torch.no_grad():
        x = hf(torch.tensor([prompt])).logits[0, -1:].double()
    for warper in (TemperatureLogitsWarper(1.4), TopPLogitsWarper(0.9)):
        x = warper(None, x)
    want = torch.softmax(x, -1)[0].numpy()
    draws = [row[0] for row in model.generate([prompt] * n, max_new_tokens=1, do_sample=True, temperature=1.4,
                                              top_p=0.9, eos_token_id=[], seed=5)]
    counts = np.bincount(draws, minlength=want.size)
    assert counts[want == 0].sum() == 0 and (want > 0).sum() > 5     # only the top-p set, and a real choice
    sigma = np.sqrt(n * want * (1 - want))
    assert np.all(np.abs(counts - n * want) <= 5 * sigma + 1), np.abs(counts - n * want).max()
    kept = want > 0                                                     # Pearson's chi-square over the support
    chi2, dof = float((((counts - n * want) ** 2)[kept] / (n * want[kept])).sum()), int(kept.sum()) - 1
    assert chi2 < dof + 5 * np.sqrt(2 * dof), (chi2, dof)
