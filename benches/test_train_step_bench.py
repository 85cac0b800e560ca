"""pytest-benchmark: whole Trainer.train_step windows on the tiny LFM2 preset (runs on lavapipe).

Shapes mirror the real benchmark's 1 x T, 1 x 2T and B x T (grad accumulation over B sequences);
``python -m lfm2jit.bench --only train`` and benches/side_by_side.py run LFM2-350M shapes.
The second window of a seen bucket must compile nothing (checked here too).
"""
from __future__ import annotations

import numpy as np
import pytest
from conftest import run_synced

from lfm2jit.model import Lfm2Config, Lfm2Model
from trainer import AdamW, Trainer


@pytest.fixture(scope="module")
def model(ctx, engine):
    return Lfm2Model(Lfm2Config.preset("tiny"), ctx, engine, seed=0)


@pytest.mark.parametrize("batch,t", [(1, 64), (1, 128), (4, 64)])
def test_train_window(benchmark, ctx, engine, model, batch, t):
    tr = (Trainer(model, AdamW(lr=1e-4, weight_decay=0.01), ctx, engine)
          .with_grad_accum_steps(batch).with_clip_grad_norm(1.0).with_length_bucket(64))
    params = model.parameters()
    rng = np.random.default_rng(t)
    vocab = model.cfg.vocab_size

    def window():
        for _ in range(batch):
            ids = rng.integers(0, vocab, t + 1)
            st = tr.train_step(ids[:-1], ids[1:], params)
        assert st.stepped
        return st

    window()                                   # first window of this bucket: compiles
    misses = engine.stats.misses
    st = run_synced(benchmark, engine, window, rounds=3)
    assert engine.stats.misses == misses, "a seen bucket compiled again"
    assert np.isfinite(st.loss)
    benchmark.extra_info.update(tokens_per_window=batch * t, loss=st.loss)
