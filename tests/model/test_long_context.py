"""Long context: a training pass's device memory grows linearly in T (attention keeps no T x T
matrix, the LM head is chunked). Sizes are the pool's accounting (BufferPool.peak_bytes), over what
the parameters and gradients already hold. (16k and 32k positions are for a GPU: benches/h200.sh
longctx; on lavapipe attention's T^2 work makes even 2048 positions take half a minute.)"""
from __future__ import annotations

import numpy as np

from lfm2jit.model import Lfm2Model
from micro_model import micro
from model_passes import run_loss_and_grads

BUCKET = 64


def _peak(engine, cfg, t: int) -> tuple[float, int]:
    """One training pass of ``t`` positions: its loss and the pool's peak bytes above what the
    engine held before it (the model's parameters and zeroed gradients among them)."""
    model = Lfm2Model(cfg, engine.ctx, engine, seed=1)
    model.zero_grad()
    engine.synchronize()
    engine.pool.peak_bytes = base = engine.pool.in_use_bytes
    ids = np.random.default_rng(t).integers(1, cfg.vocab_size, t)
    loss, _ = run_loss_and_grads(model, ids, np.roll(ids, -1), np.ones(t, np.float32), bucket=BUCKET, train=True)
    return loss, engine.pool.peak_bytes - base


def test_peak_memory_grows_linearly_in_t(engine):
    """T and 4T: the peak grows about 4x, not 16x as a T x T score matrix would make it (4.01x from
    512 to 2048 positions on lavapipe; the size classes round each buffer up by at most 1/16)."""
    cfg = micro()
    (_, small), (loss, large) = (_peak(engine, cfg, t) for t in (256, 1024))
    assert np.isfinite(loss)
    assert 3.5 * small <= large <= 4.5 * small, (small, large)
