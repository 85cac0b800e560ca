"""Decoding on the GPU (lfm2jit/model/decode.py): the token choice kernels against the host's
distribution (which test_generate.py holds to transformers' warpers), and the replayed decode
loop: the same tokens whatever the readback batch, end ids inside a batch, programs replayed."""
from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from lfm2jit import ComputeEngine
from lfm2jit.model import Lfm2Model
from lfm2jit.model.decode import TokenChoice
from lfm2jit.model.generate import Sampling, generate
from lfm2jit.runtime.program import Program

GOLDEN = Path(__file__).resolve().parents[1] / "golden"


@pytest.fixture(scope="module")
def engine(ctx):
    """One engine for the choice tests: each kernel compiles once."""
    return ComputeEngine(ctx)


def _choose(engine, sampling: Sampling, logits: np.ndarray, n: np.ndarray) -> np.ndarray:
    """The tokens TokenChoice picks from rows of logits [B, V] at positions ``n`` [B]."""
    out = engine.empty((logits.shape[0],), "i32")
    choice = TokenChoice(engine, sampling, logits.shape[0], logits.shape[1], seed=3)
    choice.choose(engine.tensor(logits), engine.tensor(n.astype(np.float32)), out)
    return out.numpy()


def test_greedy_picks_the_first_of_equal_maxima(engine, rng):
    logits = rng.standard_normal((6, 300)).astype(np.float32)
    logits[2, [5, 77, 200]] = 9.0
    assert _choose(engine, Sampling(), logits, np.zeros(6)).tolist() == np.argmax(logits, axis=1).tolist()


@pytest.mark.parametrize("sampling", [Sampling(True, 0.7), Sampling(True, 1.3, top_k=5), Sampling(True, 1.0, 12, 0.8),
                                      Sampling(True, 0.9, top_p=0.6)], ids=["temperature", "top_k", "top_k_p", "top_p"])
def test_sampled_tokens_follow_the_warped_distribution(engine, sampling):
    """2000 draws from one row of logits (tied at the 5th largest, which top-k keeps with it):
    none outside the kept set, and Pearson's chi-square within five standard deviations."""
    logits = np.random.default_rng(1).standard_normal(40).astype(np.float32)
    logits[[3, 30]] = np.sort(logits)[-5]
    want, n = sampling.probabilities(logits), 2000
    counts = np.bincount(_choose(engine, sampling, np.tile(logits, (n, 1)), np.full(n, 7)), minlength=logits.size)
    kept = want > 0
    assert counts[~kept].sum() == 0 and kept.sum() >= 3
    chi2, dof = float((((counts - n * want) ** 2)[kept] / (n * want[kept])).sum()), int(kept.sum()) - 1
    assert chi2 < dof + 5 * np.sqrt(2 * dof), (chi2, dof)


def test_tokens_do_not_depend_on_the_readback_batch(ctx, rng, monkeypatch):
    """Sampled tokens are the same read back every 2 steps (one capture, then replays) and every
    8; an end id inside a batch ends its sequence there while the others go on."""
    model = Lfm2Model.from_pretrained(GOLDEN / "tied_g1_attn_mid", ctx, ComputeEngine(ctx))
    prompts = [rng.integers(0, model.cfg.vocab_size, n) for n in (3, 9, 1)]
    sampling, replays = Sampling(True, 1.2, 30, 0.9), []
    monkeypatch.setattr(Program, "replay", lambda self, *a, f=Program.replay: replays.append(1) or f(self, *a))
    free = generate(model, prompts, 9, sampling, frozenset(), 4, every=2)
    assert len(replays) == 3                      # 4 batches of 2, the first captured; the 9th step recorded
    end = free[0][5]                              # inside the first batch of 8
    got = generate(model, prompts, 9, sampling, frozenset({end}), 4)
    assert got == [seq[:seq.index(end) + 1] if end in seq else seq for seq in free]
    assert len(got[0]) <= 6


def test_decode_steps_per_readback_are_even_and_checked_first(ctx):
    engine = ComputeEngine(ctx)
    model = Lfm2Model.from_pretrained(GOLDEN / "tied_g1_attn_mid", ctx, engine)
    before = engine.dispatches
    with pytest.raises(ValueError, match="an even number >= 2, got 3"):
        generate(model, [np.array([1, 2], np.int32)], 4, Sampling(), frozenset(), 0, every=3)
    assert engine.dispatches == before
