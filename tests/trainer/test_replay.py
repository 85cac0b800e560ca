"""Replayed train steps (trainer/recorded.py) give exactly what running every step gives.

A replay runs the same kernels on the same kind of data with the same f32 scalars, so losses,
gradient norms and weights must be bit-identical to a run with replay off, while new inputs
(ids, targets, masks), normalizers, loss scales, learning rates and step counts change each step.
"""
from __future__ import annotations

import numpy as np
import pytest

from lfm2jit.model import Lfm2Model
from trainer import AdamW, CosineWithWarmup, GradScaler, SGD, Trainer
from trainer.recorded import RecordedSteps
from micro_model import make_data, micro, snap

BUCKET = 16


def train(ctx, engine, cfg, data, *, replay: int, optimizer: str, dtype: str, pack: int):
    model = Lfm2Model(cfg, ctx, engine, seed=4, activation_dtype=dtype)
    opt = AdamW(lr=1e-2) if optimizer == "adamw" else SGD(lr=0.1, momentum=0.9, weight_decay=0.01)
    tr = (Trainer(model, opt, ctx, engine).with_length_bucket(BUCKET).with_grad_accum_steps(2)
          .with_clip_grad_norm(0.5).with_packing(pack).with_replay(replay)
          .with_lr_scheduler(CosineWithWarmup(1e-2, warmup_steps=2, total_steps=12, min_lr=1e-3)))
    if dtype == "f16":
        tr.with_grad_scaler(GradScaler(init_scale=256.0, growth_interval=2))     # the scale changes mid-run
    stats = tr.train_sequences(data, model.parameters())
    return stats, snap(model), tr


@pytest.mark.parametrize("optimizer,dtype,pack", [("adamw", "f32", 0), ("adamw", "f32", 4096),
                                                  ("sgd", "f32", 0), ("adamw", "f16", 4096)])
def test_replayed_steps_equal_running_every_step(ctx, engine, optimizer, dtype, pack):
    if dtype == "f16" and not ctx.has_f16:
        pytest.skip("adapter has no shader-f16")
    cfg = micro()
    # shapes repeat, so keys are seen, then captured, then replayed; masks and lengths vary
    data = make_data(cfg, [20, 18, 20, 19, 30, 29, 20, 17, 20, 18, 30, 30, 20, 20, 19, 20], seed=11)
    plain, w_plain, tr_plain = train(ctx, engine, cfg, data, replay=0, optimizer=optimizer, dtype=dtype, pack=pack)
    played, w_played, tr = train(ctx, engine, cfg, data, replay=2, optimizer=optimizer, dtype=dtype, pack=pack)
    assert tr_plain.recorded.replays == 0
    assert tr.recorded.replays >= 6, tr.recorded.replays     # pass, norm and optimizer pieces were replayed
    for a, b in zip(played, plain):
        assert (a.loss, a.tokens, a.stepped, a.skipped, a.grad_norm, a.lr, a.loss_scale) == \
               (b.loss, b.tokens, b.stepped, b.skipped, b.grad_norm, b.lr, b.loss_scale)
    for name in w_plain:
        assert np.array_equal(w_played[name], w_plain[name]), name


def test_replay_keeps_at_most_the_asked_passes(ctx, engine):
    cfg = micro()
    data = make_data(cfg, [20, 20, 20, 30, 30, 30, 50, 50, 50, 20], seed=2)
    model = Lfm2Model(cfg, ctx, engine, seed=1)
    tr = Trainer(model, AdamW(lr=1e-3), ctx, engine).with_length_bucket(BUCKET).with_replay(1)
    for ids, targets, mask in data:
        tr.train_step_masked(ids, targets, mask, model.parameters())
        assert tr.recorded.held_passes() <= 1
    assert tr.recorded.held_passes() == 1 and tr.recorded.replays > 0
    tr.with_replay(0)
    assert tr.recorded.held_passes() == 0


@pytest.mark.parametrize("bad", [-1, 1.5, True, None])
def test_with_replay_rejects_bad_counts(ctx, engine, bad):
    model = Lfm2Model(micro(), ctx, engine, seed=1)
    with pytest.raises(ValueError, match="replay passes"):
        Trainer(model, AdamW(lr=1e-3), ctx, engine).with_replay(bad)


def test_a_rare_shape_does_not_push_out_a_common_one(engine):
    steps = RecordedSteps(engine, passes=1)
    x = engine.tensor(np.ones((4, 16), np.float32))
    ran = []

    def piece(name):
        def record(_):
            ran.append(name)
            return engine.run("scale", x=x, alpha=2.0)["y"]
        return record

    for key in "AAAABBABBBBB":
        y = steps.run(key, piece(key), activations=True)
        assert (y.numpy() == 2.0).all()
    # A: run, captured, then replayed. B stays out while it has occurred less often than A (4, then 5
    # times); its sixth occurrence outnumbers A's five, so it is captured in A's place and replayed.
    assert ran == list("AA" "BBBBBB") and steps.replays == 3 + 1
    assert steps.held_passes() == 1
