"""Packed sequences: B sequences stacked into one forward/backward pass give what B separate passes give.

Packing changes only the order of f32 sums (matmuls over more rows, weight gradients summed in one
kernel instead of across calls), so results agree to f32 rounding: logits and per-sequence losses
within 1e-6 relative, gradients within 1e-5.
"""
from __future__ import annotations

from math import lcm
from types import SimpleNamespace

import numpy as np
import pytest

from lfm2jit.ops.lmhead import lm_head_cross_entropy
from lfm2jit.model import Lfm2Model
from trainer import SGD, Trainer
from trainer.packing import concatenating_saves_rows, default_mode, resolve_mode
from numerics import rel_err
from micro_model import make_data, micro, snap

BUCKET = 16


def loss_and_grads(model, ids, targets, mask, segments):
    """Summed loss(es) and every parameter gradient of one pass over ``ids`` ([S] or [B, S])."""
    engine = model.engine
    model.zero_grad()
    trace = model.forward(ids, BUCKET)
    res = lm_head_cross_entropy(engine, trace.hn, model.lm_head, np.asarray(targets).reshape(-1),
                                np.asarray(mask, np.float32).reshape(-1), bucket=BUCKET, dE=model.lm_head.grad,
                                accumulate_dE=True, segments=segments)
    model.backward(trace, res.dh, model.parameters())
    return res.loss.numpy(), {n: t.grad.numpy() for n, t in model.named_parameters().items()}


@pytest.mark.parametrize("dtype", ["f32", "f16"])
def test_packed_pass_equals_separate_passes(ctx, engine, dtype):
    if dtype == "f16" and not ctx.has_f16:
        pytest.skip("adapter has no shader-f16")
    cfg = micro(layer_types=["conv", "full_attention", "conv"], num_hidden_layers=3)
    model = Lfm2Model(cfg, ctx, engine, seed=3, activation_dtype=dtype)
    B, S = 3, 2 * max(model.pack_multiple(), 8)
    rng = np.random.default_rng(5)
    ids = rng.integers(1, cfg.vocab_size, (B, S + 1))
    mask = (rng.random((B, S)) < 0.8).astype(np.float32)
    packed_loss, packed = loss_and_grads(model, ids[:, :-1], ids[:, 1:], mask, B)
    losses, total = [], None
    for b in range(B):
        loss, g = loss_and_grads(model, ids[b, :-1], ids[b, 1:], mask[b], 1)
        losses.append(loss[0])
        total = g if total is None else {n: total[n] + g[n] for n in g}
    tol = 1e-5 if dtype == "f32" else 1e-3     # f16: activations rounded in different places (see test_mixed_precision)
    assert packed_loss == pytest.approx(losses, rel=tol)
    for n in packed:
        assert rel_err(packed[n], total[n]) < tol, n
    logits = model.logits(ids[:, :-1], BUCKET)
    separate = np.concatenate([model.logits(ids[b, :-1], BUCKET) for b in range(B)])
    assert rel_err(logits, separate) < (1e-6 if dtype == "f32" else 1e-3)


def test_packed_lengths_must_meet_the_binding_alignment(ctx, engine):
    model = Lfm2Model(micro(), ctx, engine, seed=0)
    m = model.pack_multiple()
    ids = np.ones((2, m + 1), np.int64)
    if m > 1:
        with pytest.raises(ValueError, match=f"multiple of {m} positions"):
            model.forward(ids, BUCKET)
    model.forward(np.ones((1, m + 1), np.int64), BUCKET)          # one sequence: any length
    with pytest.raises(ValueError, match=r"\[T\] sequence or \[B, T\] batch"):
        model.forward(np.ones((2, 3, 4), np.int64), BUCKET)
    bad = np.ones((2, 2 * m), np.int64)
    bad[1, 2] = 64
    with pytest.raises(ValueError, match=r"input_ids\[1, 2\] = 64 is outside the vocabulary 0..63"):
        model.forward(bad, BUCKET)


def test_segment_losses_are_each_sequences_loss(engine, rng):
    T, V, D, B = 48, 100, 16, 3
    h = rng.standard_normal((T, D)).astype(np.float32)
    E = rng.standard_normal((V, D)).astype(np.float32)
    tgt = rng.integers(0, V, T)
    res = lm_head_cross_entropy(engine, engine.tensor(h), engine.tensor(E), tgt, None, segments=B, grads=False)
    L = T // B
    each = [lm_head_cross_entropy(engine, engine.tensor(h[b * L:(b + 1) * L]), engine.tensor(E), tgt[b * L:(b + 1) * L],
                                  None, grads=False).loss_value() for b in range(B)]
    assert res.loss.shape == (B,)
    assert res.loss.numpy() == pytest.approx(each, rel=1e-6)
    assert res.loss_value() == pytest.approx(sum(each), rel=1e-6)
    with pytest.raises(ValueError, match="segments must be a positive integer dividing T=48, got 5"):
        lm_head_cross_entropy(engine, engine.tensor(h), engine.tensor(E), tgt, None, segments=5)


def test_train_sequences_packs_within_windows_and_matches_one_by_one(ctx, engine, monkeypatch):
    """Seven sequences of mixed lengths, windows of 3: packed groups never cross a window's end,
    pack_tokens caps a group, and losses, steps and weights follow the one-by-one run."""
    cfg = micro()
    data = make_data(cfg, [28, 30, 7, 19, 25, 20, 14], seed=31)
    runs = []
    unit = lcm(Lfm2Model(cfg, ctx, engine).pack_multiple(), BUCKET)   # rows a packed sequence is rounded to
    for pack in (0, 2 * max(32, unit)):
        model = Lfm2Model(cfg, ctx, engine, seed=8)
        tr = (Trainer(model, SGD(lr=0.1, momentum=0.9), ctx, engine).with_length_bucket(BUCKET).with_grad_accum_steps(3)
              .with_clip_grad_norm(1.0).with_packing(pack).with_replay(0))      # every pass runs forward
        passes = []
        forward = model.forward
        monkeypatch.setattr(model, "forward", lambda ids, bucket, f=forward, **kw: passes.append(ids.host.shape) or f(ids, bucket, **kw))
        stats = tr.train_sequences(data[:4], model.parameters()) + tr.train_sequences(data[4:], model.parameters())
        runs.append((stats, snap(model), passes, tr))
    (one, w_one, p_one, _), (packed, w_packed, p_packed, tr) = runs
    assert all(s[0] == 1 for s in p_one) and len(p_one) == 7
    # a group holds two of max(32, unit) rows. Window 1: [28, 30] packed, then [7]; window 2: [19]
    # ends train_sequences' first call, then [25, 20] packed; window 3: [14]
    assert [s[0] for s in p_packed] == [2, 1, 1, 2, 1], p_packed
    assert [s.stepped for s in packed] == [s.stepped for s in one] == [False, False, True] * 2 + [False]
    assert tr.step_in_accum == 1
    for a, b in zip(packed, one):
        assert a.tokens == b.tokens and a.loss == pytest.approx(b.loss, rel=1e-6)
        assert (a.grad_norm is None) == (b.grad_norm is None)
        if a.grad_norm is not None:
            assert a.grad_norm == pytest.approx(b.grad_norm, rel=1e-5)
    for n in w_one:
        assert rel_err(w_packed[n], w_one[n]) < 1e-5, n     # SGD: weights as accurate as the gradients


def test_a_short_sequence_beside_a_long_one_is_not_padded_to_it(ctx, engine, monkeypatch):
    cfg = micro()
    model = Lfm2Model(cfg, ctx, engine, seed=8)
    unit = lcm(model.pack_multiple(), BUCKET)
    tr = Trainer(model, SGD(lr=0.1), ctx, engine).with_length_bucket(BUCKET).with_grad_accum_steps(2).with_replay(0)
    passes = []
    forward = model.forward
    monkeypatch.setattr(model, "forward", lambda ids, bucket, **kw: passes.append(ids.host.shape) or forward(ids, bucket, **kw))
    tr.train_sequences(make_data(cfg, [4 * unit - 1, 3 * unit + 1], seed=2), model.parameters())   # 4 + 4 units: packed
    tr.train_sequences(make_data(cfg, [4 * unit - 1, unit - 1], seed=3), model.parameters())       # 4 + 1 units: not
    assert passes == [(2, 4 * unit), (1, 4 * unit - 1), (1, unit - 1)]


@pytest.mark.parametrize("replay", [0, 4])
def test_concat_packing_matches_one_by_one(ctx, engine, monkeypatch, replay):
    """with_packing(N, mode="concat"): a window's sequences (mixed lengths, length 1 among them)
    concatenated into one row per pass, up to N positions; losses, steps and weights follow the
    one-by-one run. With replay the same row length comes back with other layouts (written in)."""
    cfg = micro()
    lengths = [28, 1, 7, 19, 25, 1, 14, 9, 30]
    data = make_data(cfg, lengths, seed=31)
    runs = []
    for mode, pack in (("pad", 0), ("concat", 64)):
        model = Lfm2Model(cfg, ctx, engine, seed=8)
        tr = (Trainer(model, SGD(lr=0.1, momentum=0.9), ctx, engine).with_length_bucket(BUCKET).with_grad_accum_steps(3)
              .with_clip_grad_norm(1.0).with_packing(pack, mode=mode).with_replay(replay))
        passes = []
        forward = model.forward
        monkeypatch.setattr(model, "forward", lambda ids, bucket, f=forward, **kw:
                            passes.append((ids.host.shape, ids.segments and ids.segments.lengths)) or f(ids, bucket, **kw))
        stats = []
        for _ in range(2):
            stats += tr.train_sequences(data, model.parameters())
        runs.append((stats, snap(model), passes, tr))
    (one, w_one, _, _), (packed, w_packed, p_packed, tr) = runs
    assert tr.packing_mode == "concat"
    # windows of 3: [28, 1, 7] -> 36 rows in a row of 48, [19, 25, 1] -> 45 in 48, [14, 9, 30] -> 53 in 64
    if not replay:
        assert p_packed[:3] == [((1, 48), (28, 1, 7, 12)), ((1, 48), (19, 25, 1, 3)), ((1, 64), (14, 9, 30, 11))]
    assert [s.stepped for s in packed] == [s.stepped for s in one]
    for a, b in zip(packed, one):
        assert a.tokens == b.tokens and a.loss == pytest.approx(b.loss, rel=1e-5)
        if a.grad_norm is not None:
            assert a.grad_norm == pytest.approx(b.grad_norm, rel=1e-5)
    for n in w_one:
        assert rel_err(w_packed[n], w_one[n]) < 1e-5, n
    if replay:
        assert tr.recorded.replays > 0


def test_packing_mode_is_checked(ctx, engine):
    model = Lfm2Model(micro(), ctx, engine, seed=0)
    tr = Trainer(model, SGD(lr=0.1), ctx, engine)
    assert tr.packing_mode == default_mode(ctx)
    with pytest.raises(ValueError, match="packing mode must be one of pad, concat, auto, got 'tight'"):
        tr.with_packing(64, mode="tight")
    assert tr.with_packing(64, mode="concat").packing_mode == "concat"
    assert tr.with_packing(64, mode="auto").packing_mode == default_mode(ctx)


@pytest.mark.parametrize("adapter_type, mode", [("CPU", "pad"), ("cpu", "pad"), ("DiscreteGPU", "concat"),
                                                ("IntegratedGPU", "concat"), ("VirtualGPU", "concat")])
def test_auto_packing_is_concat_on_a_gpu_and_pad_on_a_cpu(adapter_type, mode):
    ctx = SimpleNamespace(info={"adapter_type": adapter_type})
    assert default_mode(ctx) == resolve_mode("auto", ctx) == mode
    assert resolve_mode("pad", ctx) == "pad" and resolve_mode("concat", ctx) == "concat"


def test_concat_equals_pad_in_evaluation_and_token_objectives(ctx, engine, monkeypatch):
    """Held-out loss, per-token log-probs (DPO's and GRPO's reference and old log-probs) and a
    token objective's update (their training pass) come out the same with concat packing as with
    pad packing, to f32 rounding, on mixed lengths with length 1 and an item without answers."""
    from trainer.evaluation import held_out_loss
    cfg = micro()
    data = make_data(cfg, [9, 1, 20, 5, 12], seed=12)
    items = [(i, t, m, (m > 0).astype(np.float32) if k % 2 else None) for k, (i, t, m) in enumerate(data)]
    weights = np.array([1.0, -0.5, 2.0, 0.25, -1.0])

    def objective(logps):        # a nonlinear loss of the per-token log-probs, as DPO's and GRPO's are
        sums = np.array([x.sum() for x in logps])
        return float(np.log1p(np.exp(-weights @ sums))), [-w / (1 + np.exp(weights @ sums)) * np.ones_like(x)
                                                          for w, x in zip(weights, logps)]
    runs = []
    for mode in ("pad", "concat"):
        model = Lfm2Model(cfg, ctx, engine, seed=3)
        tr = Trainer(model, SGD(lr=0.1), ctx, engine).with_length_bucket(BUCKET).with_packing(64, mode=mode)
        rows, forward = [], model.forward
        monkeypatch.setattr(model, "forward", lambda ids, bucket, f=forward, **kw: rows.append(
            list(kw.get("segments") or getattr(ids, "segments", None) and ids.segments.lengths or []) or None)
            or f(ids, bucket, **kw))
        loss = held_out_loss(model, engine, items, BUCKET, packing=mode)
        logps = tr.token_logps(data, temperature=0.7)
        stats = tr.train_token_objective(data, model.parameters(), objective)
        runs.append((loss, logps, stats, snap(model)))
        # concat: each pass one row of all five (47 positions, padded to 48); pad: rows of like lengths
        assert rows == ([[9, 1, 20, 5, 12, 1]] * 3 if mode == "concat" else [None] * len(rows)), rows
    (pad_loss, pad_logps, pad_stats, pad_w), (cat_loss, cat_logps, cat_stats, cat_w) = runs
    np.testing.assert_allclose(cat_loss, pad_loss, rtol=1e-5)
    for a, b in zip(cat_logps, pad_logps):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)
    assert cat_stats.stepped and cat_stats.loss == pytest.approx(pad_stats.loss, rel=1e-5)
    assert cat_stats.grad_norm == pytest.approx(pad_stats.grad_norm, rel=1e-5)
    for n in pad_w:
        assert rel_err(cat_w[n], pad_w[n]) < 1e-5, n


@pytest.mark.parametrize("lengths, unit, bucket, saves", [
    ([64, 64, 64], 64, 64, False),      # 192 rows either way: concat mode keeps the batched layout
    ([128, 128], 64, 32, False),        # 256 either way
    ([500] * 8, 64, 64, True),          # 8 x 512 = 4096 stacked, 4000 -> 4032 concatenated
    ([64, 1], 64, 64, False),           # 2 x 64 stacked, 65 -> 128 concatenated
    ([70, 10, 30], 64, 64, True),       # 3 x 128 stacked, 110 -> 128 concatenated
    ([70, 10, 30], 128, 32, True),      # 3 x 128 stacked, 110 -> 128 concatenated
])
def test_concat_mode_stacks_a_group_that_pads_nothing(lengths, unit, bucket, saves):
    assert concatenating_saves_rows(lengths, unit, bucket) == saves
