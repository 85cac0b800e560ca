"""Trainer semantics on a micro LFM2: accumulation is a step on the mean, buckets and padding change
nothing, masked targets are ignored, loss scaling (overflow skip, backoff, growth, the scale
cancels), the LR schedule, frozen parameters, and every TrainError leaving all state untouched."""
from __future__ import annotations


import numpy as np
import pytest
import torch

import trainer.trainer as trainer_module
from numerics import rel_err
from sync_worker import overflow_at_window
from lfm2jit.model import Lfm2Config, Lfm2Model
from micro_model import make_data, micro, snap
from test_trainer import hf_model, torch_train, weights_of
from trainer import SGD, AdamW, Batch, CosineWithWarmup, GradScaler, TrainError, Trainer

def grads(model) -> dict[str, np.ndarray]:
    return {n: t.grad.numpy().copy() for n, t in model.named_parameters().items() if t.grad is not None}


def assert_same(a: dict, b: dict, tol: float = 0.0, what: str = "") -> None:
    assert a.keys() == b.keys()
    for n in a:
        if tol == 0.0:
            assert np.array_equal(a[n], b[n]), f"{what}{n} changed"
        else:
            err = rel_err(a[n], b[n])
            assert err <= tol, f"{what}{n}: rel err {err:.3g} > {tol:g}"


class RecordingSGD(SGD):
    """SGD that records, per optimizer step, the lr it was given, each parameter's own step count
    and the gradient it applies (``.grad * gscale``: the window's gradient after unscaling and clipping)."""

    def __init__(self, **kw):
        super().__init__(**kw)
        self.calls: list[dict] = []

    def step(self, engine, params, lr, gscale):
        self.calls.append({"lr": lr, "steps": {self.next_step(p) for p in params},
                           "grads": [p.grad.numpy() * gscale for p in params]})
        super().step(engine, params, lr=lr, gscale=gscale)


@pytest.fixture(scope="module")
def cfg():
    return micro()


# ---- accumulation ----

def test_accumulating_four_sequences_is_one_step_on_their_mean(ctx, engine, cfg):
    data = make_data(cfg, [11, 16, 7, 14])
    model = Lfm2Model(cfg, ctx, engine, seed=0)
    params = model.parameters()
    w0 = snap(model)

    # each sequence's own gradient at w0 (lr 0 leaves the weights as they are)
    one = RecordingSGD(lr=0.0)
    tr1 = Trainer(model, one, ctx, engine).with_length_bucket(16)
    single_stats = [tr1.train_step_masked(i, t, m, params) for i, t, m in data]
    assert all(s.stepped for s in single_stats) and len(one.calls) == 4
    assert_same(snap(model), w0, what="lr=0: ")
    mean = [np.mean([c["grads"][j] for c in one.calls], axis=0) for j in range(len(params))]
    for j in range(len(params)):       # the four gradients differ, so a mean is not a copy of one of them
        assert rel_err(one.calls[0]["grads"][j], mean[j]) > 1e-3 or not np.any(mean[j])

    # grad_accum_steps=5, stopped after 4: .grad holds the sum of (gradient / 5), nothing stepped
    tr5 = Trainer(model, RecordingSGD(lr=0.5), ctx, engine).with_length_bucket(16).with_grad_accum_steps(5)
    stats5 = [tr5.train_step_masked(i, t, m, params) for i, t, m in data]
    assert [s.stepped for s in stats5] == [False] * 4 and tr5.step_in_accum == 4 and tr5.optimizer_steps() == 0
    for j, p in enumerate(params):
        assert rel_err(p.grad.numpy() * 5 / 4, mean[j]) < 1e-5, list(model.named_parameters())[j]

    # grad_accum_steps=4: one optimizer step on exactly the mean gradient
    rec = RecordingSGD(lr=0.5)
    tr4 = Trainer(model, rec, ctx, engine).with_length_bucket(16).with_grad_accum_steps(4)
    stats4 = [tr4.train_step_masked(i, t, m, params) for i, t, m in data]
    assert [s.stepped for s in stats4] == [False, False, False, True]
    assert tr4.optimizer_steps() == 1 and tr4.step_in_accum == 0 and len(rec.calls) == 1
    for s, s1 in zip(stats4, single_stats):          # the reported loss is each sequence's own, undivided
        assert s.loss == pytest.approx(s1.loss, rel=1e-6) and s.tokens == s1.tokens
    names = list(model.named_parameters())
    for j, n in enumerate(names):
        assert rel_err(rec.calls[0]["grads"][j], mean[j]) < 1e-5, n
        assert rel_err(model.p(n).numpy(), w0[n] - 0.5 * mean[j]) < 1e-5, n


def test_accumulation_matches_pytorch(ctx, engine, cfg):
    """AdamW with accumulation 4 over 8 sequences (2 steps) vs the PyTorch reference loop. A large
    eps makes AdamW sensitive to the gradient's magnitude, so a missing /4 would show."""
    ref = hf_model(cfg)
    model = Lfm2Model(cfg, ctx, engine, tensors=weights_of(ref))
    data = make_data(cfg, [11, 16, 7, 14, 9, 15, 12, 6], seed=5)
    opt = AdamW(lr=1e-2, betas=(0.9, 0.95), eps=1e-4, weight_decay=0.01)
    tr = Trainer(model, opt, ctx, engine).with_length_bucket(16).with_grad_accum_steps(4)
    ours = [tr.train_step_masked(i, t, m, model.parameters()) for i, t, m in data]
    want = torch_train(ref, data, steps=2, accum=4, lr_at=lambda k: 1e-2, clip=1e9, betas=(0.9, 0.95),
                       eps=1e-4, wd=0.01)
    assert [s.stepped for s in ours] == [False, False, False, True] * 2
    for s, w in zip(ours, want):
        assert abs(s.loss - w) / abs(w) < 1e-5
    final = weights_of(ref)
    for name, t in model.named_parameters().items():
        assert rel_err(t.numpy(), final[name]) < 1e-4, name


# ---- length buckets, padding, masked targets ----

def test_bucket_1_and_bucket_64_agree(ctx, engine, cfg):
    data = make_data(cfg, [9, 13, 13, 9], seed=7)
    runs = []
    for bucket in (1, 64):
        model = Lfm2Model(cfg, ctx, engine, seed=1)
        tr = (Trainer(model, AdamW(lr=1e-2), ctx, engine).with_length_bucket(bucket)
              .with_grad_accum_steps(2).with_clip_grad_norm(1.0))
        stats = [tr.train_step_masked(i, t, m, model.parameters()) for i, t, m in data]
        runs.append((stats, snap(model)))
    (s1, w1), (s64, w64) = runs
    assert [s.stepped for s in s1] == [s.stepped for s in s64] == [False, True, False, True]
    for a, b in zip(s1, s64):
        assert a.loss == pytest.approx(b.loss, rel=1e-6)
    for a, b in zip(s1[1::2], s64[1::2]):
        assert a.grad_norm == pytest.approx(b.grad_norm, rel=1e-5)
    assert_same(w1, w64, tol=1e-6)


def test_padded_batch_equals_unpadded_sequences(ctx, engine, cfg):
    r = np.random.default_rng(11)
    data = make_data(cfg, [12, 7, 15], seed=9)
    # right-pad to 20 with garbage ids (mask 0), and add an all-padding row and a row with no supervised target
    L = 20
    ids = r.integers(0, cfg.vocab_size, (5, L))
    tg = r.integers(0, cfg.vocab_size, (5, L))
    mask = np.zeros((5, L), np.float32)
    lengths = [12, 0, 7, 9, 15]
    rows = {0: data[0], 2: data[1], 4: data[2]}
    for b, (i, t, m) in rows.items():
        ids[b, :len(i)], tg[b, :len(t)], mask[b, :len(m)] = i, t, m
    padded = Batch.from_padded(ids, tg, mask, lengths, pad_id=0)
    assert [s.is_empty for s in padded] == [False, True, False, True, False]

    # the same three sequences without padding, one by one
    model_a = Lfm2Model(cfg, ctx, engine, seed=2)
    tr_a = Trainer(model_a, AdamW(lr=1e-2), ctx, engine).with_length_bucket(16).with_grad_accum_steps(3)
    want = [tr_a.train_step_masked(i, t, m, model_a.parameters()) for i, t, m in data]

    model_b = Lfm2Model(cfg, ctx, engine, seed=2)
    tr_b = (Trainer(model_b, AdamW(lr=1e-2), ctx, engine).with_length_bucket(16).with_grad_accum_steps(3)
            .with_packing(0))                # one by one: exactly the sequential run
    got = tr_b.train_batch(padded, model_b.parameters())
    assert len(got) == 3, "the all-padding row and the unsupervised row must be skipped"
    assert [s.stepped for s in got] == [False, False, True] and tr_b.optimizer_steps() == 1
    for a, b in zip(got, want):
        assert (a.loss, a.tokens) == (b.loss, b.tokens)
    assert_same(snap(model_b), snap(model_a))

    # rows whose trailing positions are masked: from_padded without lengths cuts them (causality).
    # One by one again: packing changes f32 summation order, which AdamW's first step turns into
    # visible differences where a gradient is near eps (packing is tested with SGD in test_packing.py)
    model_c = Lfm2Model(cfg, ctx, engine, seed=2)
    tr_c = (Trainer(model_c, AdamW(lr=1e-2), ctx, engine).with_length_bucket(16).with_grad_accum_steps(3)
            .with_packing(0))
    trimmed = Batch.from_padded(ids[[0, 2, 4]], tg[[0, 2, 4]], mask[[0, 2, 4]])
    got_c = tr_c.train_batch(trimmed, model_c.parameters())
    for a, b in zip(got_c, want):
        assert a.loss == pytest.approx(b.loss, rel=1e-6)
    assert_same(snap(model_c), snap(model_a), tol=1e-6)


def test_masked_target_values_do_not_matter(ctx, engine, cfg):
    ids, tgt, mask = make_data(cfg, [14], seed=13)[0]
    mask = mask.copy()
    mask[[3, 4, 9, 13]] = 0.0
    other = tgt.copy()
    other[mask == 0] = (tgt[mask == 0] + 17) % cfg.vocab_size      # any other valid id
    other[13] = 0                                                  # including the padding id
    assert not np.array_equal(other, tgt)
    model = Lfm2Model(cfg, ctx, engine, seed=3)
    rec = RecordingSGD(lr=0.0)
    tr = Trainer(model, rec, ctx, engine).with_length_bucket(16)
    a = tr.train_step_masked(ids, tgt, mask, model.parameters())
    b = tr.train_step_masked(ids, other, mask, model.parameters())
    assert a.loss == b.loss and a.tokens == b.tokens == int(mask.sum())
    for ga, gb in zip(*(c["grads"] for c in rec.calls)):
        assert np.array_equal(ga, gb)
    # ...while changing a supervised target does change the loss
    changed = tgt.copy()
    changed[0] = (tgt[0] + 1) % cfg.vocab_size
    c = tr.train_step_masked(ids, changed, mask, model.parameters())
    assert c.loss != a.loss


# ---- loss scaling ----

def run_windows(tr, model, windows):
    return [[tr.train_step_masked(i, t, m, model.parameters()) for i, t, m in w] for w in windows]


def test_grad_scaler_cancels(ctx, engine, cfg):
    """With a loss scale (growing during the run), losses, norms and weights match the unscaled run."""
    data = make_data(cfg, [10, 14, 8, 12, 15, 9], seed=17)
    out = []
    for scaler in (None, GradScaler(init_scale=2.0 ** 12, growth_interval=2)):
        model = Lfm2Model(cfg, ctx, engine, seed=4)
        tr = (Trainer(model, AdamW(lr=1e-2), ctx, engine).with_length_bucket(16).with_grad_accum_steps(2)
              .with_clip_grad_norm(0.5).with_grad_scaler(scaler))
        stats = [tr.train_step_masked(i, t, m, model.parameters()) for i, t, m in data]
        out.append((stats, snap(model), tr))
    (plain, w_plain, _), (scaled, w_scaled, tr_s) = out
    assert [s.loss_scale for s in scaled] == [4096.0] * 4 + [8192.0] * 2
    assert tr_s.scaler.scale == 8192.0          # grew after 2 clean steps, not yet after the third
    assert not any(s.skipped for s in scaled) and tr_s.optimizer_steps() == 3
    for a, b in zip(plain, scaled):
        assert a.loss == pytest.approx(b.loss, rel=1e-6)
        assert (a.grad_norm is None) == (b.grad_norm is None)
        if a.grad_norm is not None:
            assert a.grad_norm == pytest.approx(b.grad_norm, rel=1e-5)
    assert_same(w_scaled, w_plain, tol=1e-5)


def test_grad_scaler_overflow_skips_exactly_that_step(ctx, engine, cfg, monkeypatch):
    data = make_data(cfg, [10, 14, 8, 12, 15, 9, 11, 13, 7, 16, 12, 10], seed=19)
    W = [data[i:i + 2] for i in range(0, 12, 2)]                  # six windows of two sequences
    sched = CosineWithWarmup(1e-2, warmup_steps=1, total_steps=8, min_lr=1e-3)
    model = Lfm2Model(cfg, ctx, engine, seed=5)
    scaler = GradScaler(init_scale=1024.0, growth_interval=2)
    tr = (Trainer(model, AdamW(lr=1e-2), ctx, engine).with_length_bucket(16).with_grad_accum_steps(2)
          .with_grad_scaler(scaler).with_lr_scheduler(sched))
    params = model.parameters()

    def window(w):
        return [tr.train_step_masked(i, t, m, params) for i, t, m in w]

    s = window(W[0])                                               # clean: step 1
    assert s[1].stepped and not s[1].skipped and s[1].lr == sched.lr_at(1) and scaler.scale == 1024.0

    # an overflow (a NaN in a gradient when the norm runs): skipped, scale halved, nothing applied
    real = trainer_module.Trainer._record_norm
    monkeypatch.setattr(trainer_module.Trainer, "_record_norm", overflow_at_window(1))
    before = snap(model)
    s = window(W[1])
    assert [x.stepped for x in s] == [False, False] and [x.skipped for x in s] == [False, True]
    assert s[1].grad_norm is None and s[1].loss_scale == 512.0 and s[0].loss_scale == 1024.0
    assert scaler.scale == 512.0 and scaler.growth_tracker == 0 and tr.optimizer_steps() == 1
    assert_same(snap(model), before, what="skipped window: ")
    monkeypatch.setattr(trainer_module.Trainer, "_record_norm", real)

    s = window(W[2])                                               # clean: step 2 at lr_at(2), tracker 1
    assert s[1].stepped and s[1].lr == sched.lr_at(2) and s[0].loss_scale == 512.0 and scaler.scale == 512.0
    s = window(W[3])                                               # clean: step 3; 2 clean in a row -> growth
    assert s[1].stepped and tr.optimizer_steps() == 3 and scaler.scale == 1024.0

    # a real overflow: a loss scale of 2**127 makes the scaled gradients overflow f32
    scaler.scale = 2.0 ** 127
    before = snap(model)
    s = window(W[4])
    assert s[1].skipped and not s[1].stepped and scaler.scale == 2.0 ** 126 and tr.optimizer_steps() == 3
    assert_same(snap(model), before, what="overflowed window: ")
    scaler.scale = 256.0
    s = window(W[5])
    assert s[1].stepped and not s[1].skipped and s[1].lr == sched.lr_at(4) and tr.optimizer_steps() == 4

    # the same run without a scaler, without the two skipped windows: same weights (AdamW state untouched)
    ref = Lfm2Model(cfg, ctx, engine, seed=5)
    tr_ref = (Trainer(ref, AdamW(lr=1e-2), ctx, engine).with_length_bucket(16).with_grad_accum_steps(2)
              .with_lr_scheduler(sched))
    for w in (W[0], W[2], W[3], W[5]):
        for i, t, m in w:
            tr_ref.train_step_masked(i, t, m, ref.parameters())
    assert_same(snap(model), snap(ref), tol=1e-5)


@pytest.mark.parametrize("opt", [lambda: AdamW(lr=1e-2), lambda: SGD(lr=1e-2, momentum=0.9)])
def test_clip_skip_and_update_run_before_the_host_reads_anything(ctx, engine, cfg, monkeypatch, opt):
    """The clip coefficient and the skip decision are made on the GPU: the optimizer's kernels are
    recorded before the step's first read-back, so the step waits for the GPU once."""
    from lfm2jit.runtime.tensor import Tensor
    model = Lfm2Model(cfg, ctx, engine, seed=5)
    tr = (Trainer(model, opt(), ctx, engine).with_length_bucket(16).with_replay(0).with_clip_grad_norm(0.5)
          .with_grad_scaler(GradScaler(init_scale=256.0)))
    log = []
    run, numpy = engine.run, Tensor.numpy
    monkeypatch.setattr(engine, "run", lambda kernel, *a, **k: log.append(str(kernel)) or run(kernel, *a, **k))
    monkeypatch.setattr(Tensor, "numpy", lambda self: log.append("read") or numpy(self))
    for step, (ids, tgt, mask) in enumerate(make_data(cfg, [9, 7]), start=1):
        log.clear()
        s = tr.train_step_masked(ids, tgt, mask, model.parameters())
        assert s.stepped and s.grad_norm > 0.5         # clipped
        updates = [i for i, name in enumerate(log) if name in ("adamw", "sgd", "sgd_momentum")]
        assert updates and log.count("read") == 2, log
        first_read = log.index("read")
        assert max(updates) < first_read and "step_gate" in log, (step, log)


def test_overflow_without_scaler_is_an_error_that_applies_nothing(ctx, engine, cfg, monkeypatch):
    model = Lfm2Model(cfg, ctx, engine, seed=5)
    tr = Trainer(model, AdamW(lr=1e-2), ctx, engine).with_length_bucket(16)
    monkeypatch.setattr(trainer_module.Trainer, "_record_norm", overflow_at_window(1))
    before = snap(model)
    ids, tgt, mask = make_data(cfg, [9])[0]
    with pytest.raises(TrainError, match="inf or NaN"):
        tr.train_step_masked(ids, tgt, mask, model.parameters())
    assert_same(snap(model), before)
    assert tr.optimizer_steps() == 0 and tr.step_in_accum == 0 and not tr.optimizer.state


# ---- learning-rate schedule ----

def test_lr_schedule_step_k_uses_lr_at_k(ctx, engine, cfg):
    sched = CosineWithWarmup(0.1, warmup_steps=2, total_steps=8, min_lr=0.01)
    data = make_data(cfg, [8, 12, 10, 9, 11, 7], seed=23)
    model = Lfm2Model(cfg, ctx, engine, seed=6)
    rec = RecordingSGD(lr=123.0)                    # never used: the schedule rules
    tr = Trainer(model, rec, ctx, engine).with_length_bucket(16).with_grad_accum_steps(2).with_lr_scheduler(sched)
    params = model.parameters()
    stats = []
    for i, t, m in data[:4]:
        before = snap(model)
        stats.append(tr.train_step_masked(i, t, m, params))
    assert [s.stepped for s in stats] == [False, True, False, True]
    assert [s.lr for s in stats] == [sched.lr_at(1), sched.lr_at(1), sched.lr_at(2), sched.lr_at(2)]
    assert [(c["lr"], c["steps"]) for c in rec.calls] == [(sched.lr_at(1), {1}), (sched.lr_at(2), {2})]
    assert sched.lr_at(1) != sched.lr_at(2)
    # the rate really applied: plain SGD moves each weight by -lr * gradient
    for j, (n, p) in enumerate(model.named_parameters().items()):
        step = sched.lr_at(2) * rec.calls[1]["grads"][j]
        err = np.abs(p.numpy().astype(np.float64) - (before[n] - step)).max()
        ulps = 2 * np.finfo(np.float32).eps * np.abs(before[n]).max()      # rounding of w - lr*g in f32
        assert err <= 1e-4 * np.abs(step).max() + ulps, n

    tr.set_optimizer_steps(5)                       # resume at step 5: the next step is 6
    assert tr.optimizer_steps() == 5
    s = [tr.train_step_masked(i, t, m, params) for i, t, m in data[4:]]
    assert s[0].lr == s[1].lr == sched.lr_at(6) and s[1].stepped
    # the schedule follows the trainer's step; each parameter's own count is its third update
    assert (rec.calls[-1]["lr"], rec.calls[-1]["steps"]) == (sched.lr_at(6), {3}) and tr.optimizer_steps() == 6


# ---- frozen parameters ----

def test_frozen_parameters_stay_bit_identical_and_match_pytorch(ctx, engine, cfg):
    ref = hf_model(cfg, seed=1)
    model = Lfm2Model(cfg, ctx, engine, tensors=weights_of(ref))
    w0 = snap(model)
    trained = [n for n in w0 if ".feed_forward." in n]
    assert len(trained) == 6
    params = [model.p(n) for n in trained]
    data = make_data(cfg, [11, 16, 7, 14], seed=29)
    tr = (Trainer(model, AdamW(lr=1e-2, eps=1e-6, weight_decay=0.1), ctx, engine).with_length_bucket(16)
          .with_grad_accum_steps(2).with_clip_grad_norm(0.05))
    ours = [tr.train_step_masked(i, t, m, params) for i, t, m in data]
    assert ours[1].grad_norm > 0.05, "make the clip active, so that its norm over the trained subset matters"

    for n, p in ref.named_parameters():
        p.requires_grad_(n in trained)
    want = torch_train(ref, data, steps=2, accum=2, lr_at=lambda k: 1e-2, clip=0.05, betas=(0.9, 0.999),
                       eps=1e-6, wd=0.1)
    for s, w in zip(ours, want):
        assert abs(s.loss - w) / abs(w) < 1e-5
    final = weights_of(ref)
    now = snap(model)
    for n in w0:
        if n in trained:
            assert rel_err(now[n], final[n]) < 1e-4, n
            assert not np.array_equal(now[n], w0[n]), n
        else:
            assert np.array_equal(now[n], w0[n]), f"frozen {n} changed"


# ---- TrainError: bad input changes nothing ----

def test_every_input_error_changes_nothing(ctx, engine, cfg, monkeypatch):
    V = cfg.vocab_size
    (i1, t1, m1), (i2, t2, m2) = make_data(cfg, [10, 12], seed=31)
    model = Lfm2Model(cfg, ctx, engine, seed=7)
    params = model.parameters()
    tr = Trainer(model, AdamW(lr=1e-2), ctx, engine).with_length_bucket(16).with_grad_accum_steps(2)
    tr.train_step_masked(i1, t1, m1, params)                      # mid-window: .grad holds sequence 1
    assert tr.step_in_accum == 1
    w, g, opt_state = snap(model), grads(model), dict(tr.optimizer.state)
    assert any(np.any(a) for a in g.values())

    other = Lfm2Model(cfg, ctx, engine, seed=7)
    bad_in = i1.copy()
    bad_in[3] = V
    bad_tg = t1.copy()
    bad_tg[5] = -1
    mask_2 = m1.copy()
    mask_2[4] = 2.0
    mask_half = m1.copy()
    mask_half[2] = 0.5
    mask_nan = m1.copy()
    mask_nan[1] = np.nan
    cases = [
        ((bad_in, t1, m1, params), rf"input_ids\[3\] = {V} is outside the vocabulary 0\.\.{V - 1}"),
        ((np.r_[i1[:-1], -2], t1, m1, params), r"input_ids\[9\] = -2 is outside the vocabulary"),
        ((i1, bad_tg, m1, params), r"target_ids\[5\] = -1 is outside the vocabulary"),
        ((i1, np.r_[t1[:4], V + 5, t1[5:]], m1, params), rf"target_ids\[4\] = {V + 5} is outside"),
        ((i1, t1[:-1], m1[:-1], params), "input_ids has 10 tokens but target_ids has 9"),
        ((i1, t1, m1[:-1], params), r"loss_mask has shape \[9\]; expected \[10\]"),
        ((i1, t1, np.r_[m1, 1.0], params), r"loss_mask has shape \[11\]; expected \[10\]"),
        ((i1, t1, m1[None], params), r"loss_mask has shape \[1, 10\]"),
        ((i1, t1, mask_2, params), r"loss_mask must hold only 0 and 1; found \[2\.0\]"),
        ((i1, t1, mask_half, params), r"loss_mask must hold only 0 and 1; found \[0\.5\]"),
        ((i1, t1, mask_nan, params), r"loss_mask must hold only 0 and 1"),
        ((i1, t1, np.zeros_like(m1), params), "loss_mask selects no target"),
        (([], [], [], params), "input_ids is empty"),
        ((i1, [], [], params), "input_ids has 10 tokens but target_ids has 0|target_ids is empty"),
        ((i1[None], t1[None], m1, params), "input_ids must be a 1-D sequence"),
        ((i1.astype(np.float32), t1, m1, params), "input_ids must hold integers"),
        ((i1, t1, m1, params[:-1]), "params changed in the middle of an accumulation window"),
        ((i1, t1, m1, params[::-1]), "params changed in the middle of an accumulation window"),
        ((i1, t1, m1, params[:3] + [other.parameters()[3]] + params[4:]), r"params\[3\] is not a parameter of this model"),
        ((i1, t1, m1, params + [params[0]]), "params lists a tensor twice"),
        ((i1, t1, m1, None), "params is None"),
        ((i1, t1, m1, []), "params is empty"),
    ]

    def no_gpu(*a, **k):
        raise AssertionError("GPU work was recorded before the input was checked")
    with monkeypatch.context() as mp:
        mp.setattr(engine, "run", no_gpu)
        mp.setattr(engine, "zero_", no_gpu)
        mp.setattr(model, "forward", no_gpu)
        for args, message in cases:
            with pytest.raises(TrainError, match=message):
                tr.train_step_masked(*args)
            assert tr.step_in_accum == 1 and tr.optimizer_steps() == 0, message
            assert dict(tr.optimizer.state) == opt_state, message
    assert_same(snap(model), w, what="weight: ")
    assert_same(grads(model), g, what="grad: ")
    with pytest.raises(TrainError, match=r"input_ids\[0\] = 64"):        # train_step checks the same way
        tr.train_step(np.r_[V, i1[1:]], t1, params)
    assert tr.step_in_accum == 1

    # the window then completes exactly as if no bad call had happened
    tr.train_step_masked(i2, t2, m2, params)
    ref = Lfm2Model(cfg, ctx, engine, seed=7)
    tr_ref = Trainer(ref, AdamW(lr=1e-2), ctx, engine).with_length_bucket(16).with_grad_accum_steps(2)
    tr_ref.train_step_masked(i1, t1, m1, ref.parameters())
    tr_ref.train_step_masked(i2, t2, m2, ref.parameters())
    assert tr.optimizer_steps() == tr_ref.optimizer_steps() == 1
    assert_same(snap(model), snap(ref))


def test_a_bad_sequence_in_a_batch_fails_before_the_window_moves(ctx, engine, cfg):
    """train_batch checks each sequence as it comes to it; an out-of-vocabulary id is a TrainError."""
    model = Lfm2Model(cfg, ctx, engine, seed=8)
    tr = Trainer(model, AdamW(lr=1e-2), ctx, engine).with_length_bucket(16).with_grad_accum_steps(2)
    batch = Batch.from_token_lists([[cfg.vocab_size + 3, 5, 6, 7]])
    w = snap(model)
    with pytest.raises(TrainError, match="outside the vocabulary"):
        tr.train_batch(batch, model.parameters())
    assert tr.step_in_accum == 0 and tr.optimizer_steps() == 0
    assert_same(snap(model), w)
