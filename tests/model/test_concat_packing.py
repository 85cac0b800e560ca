"""Packing without padding (Lfm2Model.forward(..., segments=lengths)): sequences concatenated in one
row give each sequence's own loss and, summed, the same gradients as running them one by one; and no
sequence reads another (a leak test on the logits)."""
from __future__ import annotations

import numpy as np
import pytest

from lfm2jit.model import Lfm2Model, Lfm2MoeConfig
from lfm2jit.ops.lmhead import lm_head_cross_entropy
from micro_model import make_data, micro
from numerics import rel_err

BUCKET = 16
LENGTHS = [7, 1, 19, 4, 33, 1, 12]


def config(kind):
    return Lfm2MoeConfig.preset("tiny-moe") if kind == "moe" else micro()


def per_sequence(model, data):
    """Each sequence alone (forward, LM head over its supervised tokens, backward, gradients added up)."""
    model.zero_grad()
    losses = []
    for ids, targets, mask in data:
        trace = model.forward(ids, BUCKET)
        res = lm_head_cross_entropy(model.engine, trace.hn, model.lm_head, targets, mask, normalizer=float(mask.sum()),
                                    bucket=BUCKET, dE=model.lm_head.grad, accumulate_dE=True)
        model.backward(trace, res.dh, model.parameters())
        losses.append(res.loss_value())
    return np.array(losses), {n: t.grad.numpy().copy() for n, t in model.named_parameters().items()}


def concatenated(model, data, train: bool = False):
    """One row: per-position weights mask / tokens keep each sequence's mean; per-sequence losses summed
    from the per-position ones."""
    model.zero_grad()
    ids = np.concatenate([d[0] for d in data])
    targets = np.concatenate([d[1] for d in data])
    weights = np.concatenate([d[2] / d[2].sum() for d in data]).astype(np.float32)
    lengths = [len(d[0]) for d in data]
    trace = model.forward(ids, BUCKET, segments=lengths, train=train)
    res = lm_head_cross_entropy(model.engine, trace.hn, model.lm_head, targets, weights, bucket=BUCKET,
                                dE=model.lm_head.grad, accumulate_dE=True, per_position=True)
    model.backward(trace, res.dh, model.parameters())
    per_pos = res.loss.numpy().astype(np.float64)
    ends = np.cumsum(lengths)
    losses = np.array([per_pos[e - n:e].sum() for n, e in zip(lengths, ends)])
    return losses, {n: t.grad.numpy().copy() for n, t in model.named_parameters().items()}


@pytest.fixture(scope="module")
def default_engine(default_limits_ctx):
    from lfm2jit import ComputeEngine
    return ComputeEngine(default_limits_ctx)


# each kind and dtype once; the dense f32 model on WebGPU's default 8 storage buffers a kernel (where
# attention's dk/dv with starts binds all 8, and the group's query heads run one after another: an
# engine of its own, whose kernels compile again, so one case)
@pytest.mark.parametrize("kind,dtype,limits", [("dense", "f32", "default"), ("moe", "f32", "raised"),
                                               ("dense", "f16", "raised"), ("moe", "f16", "raised")])
def test_concatenated_equals_per_sequence(request, kind, dtype, limits):
    engine = request.getfixturevalue("default_engine" if limits == "default" else "engine")
    ctx = engine.ctx
    assert (engine.target.storage_buffers == 8) == (limits == "default")
    if dtype == "f16" and not ctx.has_f16:
        pytest.fail("the adapter has no shader-f16: this test needs it")
    cfg = config(kind)
    model = Lfm2Model(cfg, ctx, engine, seed=5, activation_dtype=dtype)
    data = make_data(cfg, LENGTHS, seed=4)
    want_loss, want = per_sequence(model, data)
    got_loss, got = concatenated(model, data)
    # f32: summation orders differ only (other buckets); f16: each stored activation rounds to 11 bits
    tol = 1e-4 if dtype == "f32" else 2e-2
    assert rel_err(got_loss, want_loss) < tol, (got_loss, want_loss)
    for name in want:
        assert np.all(np.isfinite(got[name])), name
        assert rel_err(got[name], want[name]) < tol, f"{name}: {rel_err(got[name], want[name]):.2e}"


def test_concatenated_on_the_matrix_units(ctx, matrix_engine):
    """f16 activations on the matrix templates (emulated on lavapipe): attention with starts runs there
    too, and concatenation still equals per-sequence training within f16 rounding. Fewer, shorter
    sequences than LENGTHS (length 1 and one over a 16-row tile still): emulated kernels are slow."""
    cfg = micro()
    model = Lfm2Model(cfg, matrix_engine.ctx, matrix_engine, seed=5, activation_dtype="f16")
    data = make_data(cfg, [7, 1, 19, 12], seed=4)
    want_loss, want = per_sequence(model, data)
    got_loss, got = concatenated(model, data)
    assert rel_err(got_loss, want_loss) < 2e-2
    for name in want:
        assert rel_err(got[name], want[name]) < 2e-2, f"{name}: {rel_err(got[name], want[name]):.2e}"


def test_checkpointed_layers_rerun_the_concatenated_row(ctx, engine):
    """Activation checkpointing reruns a layer from its input with the same segments: bit-identical."""
    cfg = micro()
    data = make_data(cfg, LENGTHS, seed=4)
    plain = concatenated(Lfm2Model(cfg, ctx, engine, seed=5), data, train=True)
    ckpt = concatenated(Lfm2Model(cfg, ctx, engine, seed=5, checkpoint_layers="all"), data, train=True)
    np.testing.assert_array_equal(ckpt[0], plain[0])
    for name in plain[1]:
        np.testing.assert_array_equal(ckpt[1][name], plain[1][name], err_msg=name)


@pytest.mark.parametrize("kind", ["dense", "moe"])
def test_no_sequence_reads_another(ctx, engine, kind):
    """Changing one sequence's tokens changes no other sequence's logits, bit for bit."""
    cfg = config(kind)
    model = Lfm2Model(cfg, ctx, engine, seed=2)
    data = make_data(cfg, LENGTHS, seed=6)
    lengths = [len(d[0]) for d in data]
    ids = np.concatenate([d[0] for d in data])

    def logits(row):
        return model.head_logits(model.forward(row, BUCKET, segments=lengths).hn, BUCKET)
    before = logits(ids)
    changed = ids.copy()
    start = sum(lengths[:2])
    changed[start:start + lengths[2]] = (changed[start:start + lengths[2]] + 7) % (cfg.vocab_size - 1) + 1
    after = logits(changed)
    inside = np.zeros(len(ids), bool)
    inside[start:start + lengths[2]] = True
    assert not np.array_equal(before[inside], after[inside])
    np.testing.assert_array_equal(before[~inside], after[~inside])


def test_segments_are_checked(ctx, engine):
    model = Lfm2Model(micro(), ctx, engine, seed=0)
    for bad in ([3, 3], [6, 0, 4], [2.5, 7.5], "10"):
        with pytest.raises(ValueError, match="segments must be the lengths"):
            model.forward(np.arange(1, 11), BUCKET, segments=bad)
    with pytest.raises(ValueError, match="segments are the sequences concatenated in one row"):
        model.forward(np.ones((2, 16), np.int64), BUCKET, segments=[16])
