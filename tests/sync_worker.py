"""One rank of a file-gradient-sync run, as its own process (used by tests/trainer/test_sync.py).

    python tests/sync_worker.py DIR RANK WORLD --windows W --accum A --out weights.npz
        [--run-id ID] [--timeout S] [--skip-window K] [--hang-after K]

Rank r trains the micro model (seed 0, SGD with momentum, a GradScaler) on its share of the data
(``rank_sequences``) with ``FileGradSyncConfig(DIR, r, WORLD)`` and saves its final weights to
``--out``. ``--skip-window K`` makes window K's step be skipped as a loss-scale overflow would.
With ``--hang-after K`` it writes ``<out>.hang`` after optimizer step K and sleeps until killed.
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import numpy as np

MICRO = dict(vocab_size=64, hidden_size=32, intermediate_size=96, num_hidden_layers=2, num_attention_heads=2,
             num_key_value_heads=1, layer_types=["conv", "full_attention"], block_multiple_of=16)
# SGD with momentum: its update is proportional to the gradient, so a sum instead of a mean over the
# ranks would show (AdamW is nearly scale-invariant, and it amplifies f32 rounding over a few steps).
LR, MOMENTUM, CLIP, BUCKET = 0.5, 0.9, 10.0, 16


def micro_config():
    from lfm2jit.model import Lfm2Config
    return Lfm2Config(**MICRO)


def all_data(n: int, seed: int = 41):
    """n (input_ids, target_ids, loss_mask) triples of lengths 6..16, ids avoiding the padding token."""
    r = np.random.default_rng(seed)
    out = []
    for _ in range(n):
        k = int(r.integers(6, 17))
        ids = r.integers(1, MICRO["vocab_size"], k + 1)
        mask = (r.random(k) > 0.3).astype(np.float32)
        mask[0] = 1.0
        out.append((ids[:-1], ids[1:], mask))
    return out


def rank_sequences(rank: int, world: int, windows: int, accum: int):
    """Rank r's sequences: in window k, the r-th block of ``accum`` among the world*accum sequences
    that one process with grad_accum_steps = world*accum would take as its window k."""
    data = all_data(windows * world * accum)
    w = world * accum
    return [data[k * w + rank * accum + j] for k in range(windows) for j in range(accum)]


def make_trainer(ctx, engine, accum: int, sync=None):
    from lfm2jit.model import Lfm2Model
    from trainer import SGD, GradScaler, Trainer
    model = Lfm2Model(micro_config(), ctx, engine, seed=0)
    tr = (Trainer(model, SGD(lr=LR, momentum=MOMENTUM, weight_decay=0.01), ctx, engine).with_length_bucket(BUCKET)
          .with_grad_accum_steps(accum).with_clip_grad_norm(CLIP).with_file_grad_sync(sync)
          .with_grad_scaler(GradScaler(init_scale=1024.0)))
    return model, tr


def overflow_at_window(k: int):
    """A stand-in for Trainer._record_norm whose k-th call (window k's norm, after the sync) first
    writes a NaN into a gradient on the device, as a loss-scale overflow would leave one: the
    window's step is skipped on whichever side decides it (the host after reading the norm, or
    the GPU's step_gate)."""
    from trainer import Trainer
    real, calls = Trainer._record_norm, [0]

    def record_norm(self, params):
        calls[0] += 1
        if calls[0] == k:
            g = next(p.grad for p in params if p.grad is not None and p.grad.size)
            poisoned = g.numpy()
            poisoned.flat[0] = np.nan
            g.write(poisoned)
        return real(self, params)
    return record_norm


def main(argv=None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("dir")
    ap.add_argument("rank", type=int)
    ap.add_argument("world", type=int)
    ap.add_argument("--windows", type=int, required=True)
    ap.add_argument("--accum", type=int, required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--run-id", default="run")
    ap.add_argument("--timeout", type=float, default=120.0)
    ap.add_argument("--skip-window", type=int, default=None)
    ap.add_argument("--hang-after", type=int, default=None)
    a = ap.parse_args(argv)

    from lfm2jit import ComputeEngine, WgpuContext
    import trainer.trainer as trainer_module
    from trainer import FileGradSyncConfig
    if a.skip_window is not None:
        trainer_module.Trainer._record_norm = overflow_at_window(a.skip_window)
    ctx = WgpuContext.create()
    engine = ComputeEngine(ctx)
    sync = FileGradSyncConfig(a.dir, a.rank, a.world, timeout_s=a.timeout, run_id=a.run_id)
    model, tr = make_trainer(ctx, engine, a.accum, sync)
    for i, t, m in rank_sequences(a.rank, a.world, a.windows, a.accum):
        stats = tr.train_step_masked(i, t, m, model.parameters())
        if stats.stepped and tr.optimizer_steps() == a.hang_after:
            Path(a.out + ".hang").write_text(str(tr.optimizer_steps()))
            while True:                        # a peer that stops responding; the test kills it
                time.sleep(1)
    np.savez(a.out, **model.state_dict(), optimizer_steps=tr.optimizer_steps())
    return 0


if __name__ == "__main__":
    sys.exit(main())
