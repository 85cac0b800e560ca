"""Masked cross-entropy fused with the LM head (lfm2jit/lmhead.py, kernels/xent.lk) against torch float64."""
from __future__ import annotations

import re
import time

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from lfm2jit import ComputeEngine, Tensor
from lfm2jit.ops.lmhead import DEFAULT_CHUNK, MAX_CHUNK, MAX_CHUNK_LOGITS, chunk_for, kept_chunks, lm_head_cross_entropy
from lfm2jit.schedule.layout import bucketed
from numerics import rel_err

# f32 on the GPU; the logits are sums of D <= 48 products and dE sums over T <= 64 positions: the
# errors seen are about 1e-6 normwise, and 1e-4 leaves room for other summation orders and GPUs.
TOL = 1e-4
IGNORE = -100


def reference(h, E, targets, mask, normalizer, loss_scale=1.0):
    """loss = sum over unmasked positions of mask * CE / normalizer, and d(loss * loss_scale)/d(h, E)."""
    ht = torch.tensor(h, dtype=torch.float64, requires_grad=True)
    Et = torch.tensor(E, dtype=torch.float64, requires_grad=True)
    mask = np.asarray(mask, np.float64)
    keep = np.flatnonzero(mask != 0)
    logits = ht @ Et.T
    loss = (logits * 0.0).sum()      # keeps the graph when every position is masked
    if keep.size:
        idx = torch.tensor(keep)
        ce = F.cross_entropy(logits[idx], torch.tensor(np.asarray(targets)[keep], dtype=torch.long), reduction="none")
        loss = (ce * torch.tensor(mask[keep])).sum() / normalizer
    (loss * loss_scale).backward()
    grad = lambda t: t.grad.numpy() if t.grad is not None else np.zeros(tuple(t.shape))  # noqa: E731
    return float(loss.detach()), grad(ht), grad(Et)


def problem(rng, T, V, D, holes=True):
    h = rng.standard_normal((T, D)).astype(np.float32)
    E = (rng.standard_normal((V, D)) / np.sqrt(D) * 3).astype(np.float32)   # logits of a few units
    targets = rng.integers(0, V, T).astype(np.int32)
    mask = np.ones(T, np.float32)
    if holes:
        mask = (rng.random(T) < 0.7).astype(np.float32)
        if T > 1:
            mask[0], mask[-1] = 1.0, 0.0      # at least one supervised position and one hole
        # masked targets may hold anything: the ignore index, or ids past the vocabulary
        targets = np.where(mask == 0, rng.choice([IGNORE, V, V + 7], T), targets).astype(np.int32)
    return h, E, targets, mask


def check(engine, rng, T, V, D, chunk, bucket, holes=True, mask_override=None):
    h, E, targets, mask = problem(rng, T, V, D, holes)
    if mask_override is not None:
        mask = mask_override
    norm = max(float(mask.sum()), 1.0)
    res = lm_head_cross_entropy(engine, engine.tensor(h), engine.tensor(E), targets, mask,
                                normalizer=norm, chunk=chunk, bucket=bucket)
    loss, dh, dE = res.loss_value(), res.dh.numpy(), res.dE.numpy()
    want_loss, want_dh, want_dE = reference(h, E, targets, mask, norm)
    if mask.any():
        assert abs(loss - want_loss) / abs(want_loss) < TOL
        assert rel_err(dh, want_dh) < TOL
        assert rel_err(dE, want_dE) < TOL
    else:
        assert loss == 0.0 and not dh.any() and not dE.any()
    assert not dh[mask == 0].any(), "masked positions must have exactly zero gradient rows"
    return loss, dh, dE


@pytest.mark.parametrize("D", [16, 48])
@pytest.mark.parametrize("V", [100, 256, 1000])
@pytest.mark.parametrize("T,bucket", [(1, 1), (37, 16), (64, 1)])
@pytest.mark.parametrize("chunk", [64, 128])
def test_matches_torch(engine, rng, T, bucket, V, D, chunk):
    check(engine, rng, T, V, D, chunk, bucket)


@pytest.mark.parametrize("T,bucket", [(1, 1), (37, 16), (64, 1)])
def test_every_position_supervised(engine, rng, T, bucket):
    check(engine, rng, T, 1000, 16, 128, bucket, holes=False)


@pytest.mark.parametrize("T,bucket", [(1, 1), (37, 16)])
def test_all_masked_gives_exact_zeros(engine, rng, T, bucket):
    check(engine, rng, T, 256, 16, 64, bucket, mask_override=np.zeros(T, np.float32))


@pytest.mark.parametrize("T,bucket", [(5, 1), (37, 16)])
def test_f16_hidden_states(ctx, engine, rng, T, bucket):
    """Mixed precision: f16 h gives f16 dh; loss and dE stay f32. Against float64 on the same
    f16-rounded h, dh's storage adds error: it is summed over the 3 chunks (V=300, chunk 128) in f16,
    one rounding (relative 2**-11 = 4.9e-4) per chunk. On SIMT the rest is f32 arithmetic, within
    TOL; on the matrix units the f32 operand of each product with h (E for the logits, dlogits for
    dE) is rounded to f16 as it is staged, one more 2**-11 per element."""
    if not ctx.has_f16:
        pytest.skip("adapter has no shader-f16")
    h, E, targets, mask = problem(rng, T, 300, 32)
    h = h.astype(np.float16)
    norm = max(float(mask.sum()), 1.0)
    res = lm_head_cross_entropy(engine, engine.tensor(h), engine.tensor(E), targets, mask, normalizer=norm,
                                chunk=128, bucket=bucket)
    assert (res.dh.dtype, res.dE.dtype) == ("f16", "f32")
    staged_f16 = bool(engine.target.matrix_configs)
    tol = 2 * 2 ** -11 if staged_f16 else TOL
    want_loss, want_dh, want_dE = reference(h.astype(np.float32), E, targets, mask, norm)
    assert abs(res.loss_value() - want_loss) / abs(want_loss) < tol
    assert rel_err(res.dE.numpy(), want_dE) < tol
    assert rel_err(res.dh.numpy().astype(np.float64), want_dh) < 3 * 2 ** -11


def test_one_chunk_wider_than_the_vocabulary(engine, rng):
    check(engine, rng, 37, 100, 16, 4096, 16)


@pytest.mark.parametrize("T", [1, 64, 512, 1000, 2048, 4096, 8192, 16384, 32768])
@pytest.mark.parametrize("D", [16, 1024, 2048, 4096])
@pytest.mark.parametrize("binding", [128 << 20, 1 << 30])
def test_short_sequences_take_longer_chunks_within_the_logits_and_binding_budgets(T, D, binding):
    chunk = chunk_for(T, D, binding)
    assert DEFAULT_CHUNK <= chunk <= MAX_CHUNK and chunk % 64 == 0
    assert chunk == DEFAULT_CHUNK or (T * chunk <= MAX_CHUNK_LOGITS and chunk * max(T, D) * 4 <= binding)
    doubled = 2 * chunk      # the longest such: twice as many rows would break a budget
    assert doubled > MAX_CHUNK or T * doubled > MAX_CHUNK_LOGITS or doubled * max(T, D) * 4 > binding
    assert chunk_for(T, D, binding) >= chunk_for(2 * T, D, binding)


def test_the_default_chunk_is_the_bucketed_lengths(ctx, engine, rng):
    """chunk=None takes chunk_for the bucketed T (one chunk size, so one set of kernels, per bucket),
    not for T itself: the same bits as passing that chunk."""
    T, V, D, bucket = 300, 20000, 16, 4096
    binding = ctx.limits.get("max-storage-buffer-binding-size", 128 << 20)
    chunk = chunk_for(bucket, D, binding)
    assert chunk != chunk_for(T, D, binding)
    h, E = rng.standard_normal((T, D)).astype(np.float32), (rng.standard_normal((V, D)) * 0.1).astype(np.float32)
    targets = rng.integers(0, V, T)
    got = [[x.numpy() for x in lm_head_cross_entropy(engine, engine.tensor(h), engine.tensor(E), targets,
                                                      normalizer=T, bucket=bucket, **kw)] for kw in ({}, {"chunk": chunk})]
    for a, b in zip(*got):
        np.testing.assert_array_equal(a, b)
    want_loss, want_dh, want_dE = reference(h, E, targets, np.ones(T), T)
    loss, dh, dE = got[0]
    assert abs(loss.astype(np.float64).sum() - want_loss) / abs(want_loss) < TOL
    assert rel_err(dh, want_dh) < TOL and rel_err(dE, want_dE) < TOL


def test_weights_loss_scale_and_normalizer(engine, rng):
    """A non-binary mask weights positions; loss_scale scales gradients only."""
    T, V, D = 37, 300, 16
    h, E, targets, _ = problem(rng, T, V, D, holes=False)
    mask = rng.choice([0.0, 0.5, 1.0, 2.0], T).astype(np.float32)
    res = lm_head_cross_entropy(engine, engine.tensor(h), engine.tensor(E), engine.tensor(targets, "i32"),
                                engine.tensor(mask), normalizer=7.5, loss_scale=1024.0, chunk=128, bucket=16)
    want_loss, want_dh, want_dE = reference(h, E, targets, mask, 7.5, loss_scale=1024.0)
    assert abs(res.loss_value() - want_loss) / abs(want_loss) < TOL
    assert rel_err(res.dh.numpy(), want_dh) < TOL
    assert rel_err(res.dE.numpy(), want_dE) < TOL


def test_accumulates_into_existing_gradients(engine, rng):
    """Tied embeddings: dE already holds the embedding-gather gradient; the LM head's is added."""
    T, V, D = 37, 1000, 48
    h, E, targets, mask = problem(rng, T, V, D)
    prior_dE = rng.standard_normal((V, D)).astype(np.float32)
    prior_dh = rng.standard_normal((T, D)).astype(np.float32)
    dE, dh = engine.tensor(prior_dE), engine.tensor(prior_dh)
    res = lm_head_cross_entropy(engine, engine.tensor(h), engine.tensor(E), targets, mask, normalizer=3.0,
                                chunk=128, bucket=16, dh=dh, dE=dE, accumulate_dh=True, accumulate_dE=True)
    assert res.dE is dE and res.dh is dh
    _, want_dh, want_dE = reference(h, E, targets, mask, 3.0)
    got_dh, got_dE = dh.numpy(), dE.numpy()
    assert rel_err(got_dE - prior_dE, want_dE) < TOL and rel_err(got_dE, prior_dE + want_dE) < TOL
    assert rel_err(got_dh - prior_dh, want_dh) < TOL
    assert (got_dh[mask == 0] == prior_dh[mask == 0]).all(), "masked rows are left exactly as they were"
    # without accumulate the given tensors are overwritten
    res = lm_head_cross_entropy(engine, engine.tensor(h), engine.tensor(E), targets, mask, normalizer=3.0,
                                chunk=128, bucket=16, dh=dh, dE=dE)
    assert rel_err(dE.numpy(), want_dE) < TOL and rel_err(dh.numpy(), want_dh) < TOL


def test_padded_positions_are_never_read_or_written(engine, ctx, rng):
    """Tensors whose buffers extend over the padded rows of the bucket: NaN there changes nothing,
    and the padded rows of dh keep their contents."""
    T, V, D, bucket = 37, 256, 16, 64
    tp = bucketed(T, bucket)
    h, E, targets, mask = problem(rng, T, V, D)

    def padded(arr, fill, dtype):
        full = np.full((tp,) + arr.shape[1:], fill, arr.dtype)
        full[:T] = arr
        base = engine.tensor(full, dtype)
        return Tensor(ctx, base.buffer, arr.shape, dtype, capacity=base.size, base=base), base

    h_t, _ = padded(h, np.nan, "f32")
    tgt_t, _ = padded(targets, 2**31 - 1, "i32")
    mask_t, _ = padded(mask, np.nan, "f32")
    dh_t, dh_full = padded(np.zeros((T, D), np.float32), 123.0, "f32")
    res = lm_head_cross_entropy(engine, h_t, engine.tensor(E), tgt_t, mask_t, normalizer=5.0, chunk=64,
                                bucket=bucket, dh=dh_t)
    want_loss, want_dh, want_dE = reference(h, E, targets, mask, 5.0)
    assert abs(res.loss_value() - want_loss) / abs(want_loss) < TOL
    assert rel_err(res.dh.numpy(), want_dh) < TOL and rel_err(res.dE.numpy(), want_dE) < TOL
    assert (dh_full.numpy()[T:] == 123.0).all()


def test_second_call_compiles_nothing(engine, rng):
    h, E, targets, mask = problem(rng, 37, 1000, 16)
    args = dict(normalizer=1.0, chunk=128, bucket=16)
    lm_head_cross_entropy(engine, engine.tensor(h), engine.tensor(E), targets, mask, **args).loss_value()
    misses = engine.stats.misses
    h2, _, t2, m2 = problem(rng, 40, 1000, 16)          # another length in the same bucket
    lm_head_cross_entropy(engine, engine.tensor(h2), engine.tensor(E), t2, m2, **args).loss_value()
    assert engine.stats.misses == misses


def _temporary_peak(ctx, T, V, D, chunk, **kw):
    """Peak bytes the call takes from a fresh engine's pool beyond what its operands hold, the loss,
    and the call's wall time (recording plus running)."""
    rng = np.random.default_rng(0)
    eng = ComputeEngine(ctx)
    h, E, targets, _ = problem(rng, T, V, D, holes=False)
    h, E = eng.tensor(h), eng.tensor(E)
    dh, dE = eng.tensor(np.zeros((T, D), np.float32)), eng.tensor(np.zeros((V, D), np.float32))
    targets = eng.tensor(targets, "i32")
    mask = eng.tensor(np.ones(T, np.float32))
    eng.synchronize()
    before = eng.pool.in_use_bytes
    assert eng.pool.peak_bytes == before
    start = time.perf_counter()
    res = lm_head_cross_entropy(eng, h, E, targets, mask, normalizer=T, chunk=chunk, dh=dh, dE=dE, **kw)
    loss = res.loss_value()
    seconds = time.perf_counter() - start
    return eng.pool.peak_bytes - before, loss, seconds, res, (h, E, targets)


def test_temporary_memory_grows_with_the_chunk_not_the_vocabulary(ctx):
    small, _, _, _, _ = _temporary_peak(ctx, 64, 4096, 16, 64)
    large, _, _, _, _ = _temporary_peak(ctx, 64, 4096, 16, 512)
    # the [T, chunk] logits buffer plus a handful of [T] vectors (each at least one 256-byte class)
    assert 64 * 64 * 4 <= small <= 64 * 64 * 4 + 16 * 1024
    assert 64 * 512 * 4 <= large <= 64 * 512 * 4 + 16 * 1024


def test_real_vocabulary_in_chunk_sized_memory(ctx):
    """T=256 over LFM2's 65536-entry vocabulary: full logits would take 64 MiB; the call takes one
    [T, chunk] buffer (4 MiB) and a few [T] vectors."""
    T, V, D, chunk = 256, 65536, 16, 4096
    peak, loss, seconds, res, (h, E, targets) = _temporary_peak(ctx, T, V, D, chunk)
    assert peak <= T * chunk * 4 * 1.05 + 64 * 1024, f"{peak} bytes of temporaries"
    assert peak < T * V * 4 // 8
    print(f"\nT={T} V={V} D={D} chunk={chunk}: {peak} bytes of temporaries "
          f"(full logits: {T * V * 4}), {seconds:.2f} s")
    want_loss, want_dh, want_dE = reference(h.numpy(), E.numpy(), targets.numpy(), np.ones(T), T)
    assert abs(loss - want_loss) / abs(want_loss) < TOL
    assert rel_err(res.dh.numpy(), want_dh) < TOL
    assert rel_err(res.dE.numpy(), want_dE) < TOL


# ---- bad arguments raise before any GPU work ----

T_BAD, V_BAD, D_BAD = 8, 100, 16

# case -> (the changed arguments, built from (engine, valid arguments); exception; message)
BAD = {
    "h_not_tensor": (lambda e, a: dict(h=np.zeros((8, 16), np.float32)), TypeError, "h must be a Tensor"),
    "h_1d": (lambda e, a: dict(h=e.tensor(np.zeros(16, np.float32))), ValueError, "h must be 2-D"),
    "h_i32": (lambda e, a: dict(h=e.tensor(np.zeros((8, 16), np.int32))), ValueError, "h must be f32 or f16, got i32"),
    "E_f16": (lambda e, a: dict(E=e.tensor(np.zeros((100, 16), np.float16))), ValueError, "E must be f32, got f16"),
    "dh_f32_for_f16_h": (lambda e, a: dict(h=e.tensor(np.zeros((8, 16), np.float16)),
                                           dh=e.tensor(np.zeros((8, 16), np.float32))), ValueError,
                         "dh is f32[8, 16], expected f16[8, 16]"),
    "hidden_mismatch": (lambda e, a: dict(E=e.tensor(np.zeros((100, 8), np.float32))), ValueError,
                        "hidden sizes differ"),
    "target_out_of_range": (lambda e, a: dict(targets=np.where(np.arange(8) == 2, 100, 0), mask=np.ones(8)),
                            ValueError, "targets[2] = 100 is out of range for a vocabulary of 100"),
    "negative_target": (lambda e, a: dict(targets=np.where(np.arange(8) == 2, IGNORE, 0), mask=np.ones(8)),
                        ValueError, "targets[2] = -100 is out of range"),
    "float_targets": (lambda e, a: dict(targets=np.zeros(8, np.float32)), TypeError, "targets must be integers"),
    "targets_wrong_length": (lambda e, a: dict(targets=np.zeros(7, np.int32)), ValueError,
                             "targets has shape [7], expected [8]"),
    "targets_tensor_f32": (lambda e, a: dict(targets=e.tensor(np.zeros(8, np.float32))), ValueError,
                           "expected i32[8]"),
    "mask_wrong_length": (lambda e, a: dict(mask=np.ones(9, np.float32)), ValueError, "mask has shape [9]"),
    "mask_nan": (lambda e, a: dict(mask=np.where(np.arange(8) == 3, np.nan, 1.0)), ValueError,
                 "mask[3] = nan is not finite"),
    "chunk_not_multiple": (lambda e, a: dict(chunk=100), ValueError, "positive multiple of 64"),
    "chunk_zero": (lambda e, a: dict(chunk=0), ValueError, "positive multiple of 64"),
    "normalizer_zero": (lambda e, a: dict(normalizer=0.0), ValueError, "normalizer must be nonzero"),
    "loss_scale_inf": (lambda e, a: dict(loss_scale=float("inf")), ValueError, "loss_scale must be a finite number"),
    "accumulate_without_dE": (lambda e, a: dict(accumulate_dE=True), ValueError, "needs a dE tensor"),
    "dE_wrong_shape": (lambda e, a: dict(dE=e.tensor(np.zeros((100, 17), np.float32))), ValueError,
                       "expected f32[100, 16]"),
    "dh_aliases_h": (lambda e, a: dict(dh=a["h"]), ValueError, "dh shares a buffer with h"),
    "dE_aliases_E": (lambda e, a: dict(dE=a["E"]), ValueError, "dE shares a buffer with E"),
    "bucket_zero": (lambda e, a: dict(bucket=0), ValueError, "bucket must be a positive integer"),
    "keep_logits_negative": (lambda e, a: dict(keep_logits=-1), ValueError, "keep_logits must be a whole number"),
    "keep_logits_fraction": (lambda e, a: dict(keep_logits=1.5), ValueError, "got 1.5"),
    "keep_logits_bool": (lambda e, a: dict(keep_logits=True), ValueError, "got True"),
}


@pytest.mark.parametrize("case", sorted(BAD))
def test_bad_arguments_raise_before_gpu_work(engine, rng, case):
    make, exc, message = BAD[case]
    h, E, targets, mask = problem(rng, T_BAD, V_BAD, D_BAD)
    args = dict(h=engine.tensor(h), E=engine.tensor(E), targets=targets, mask=mask, chunk=64)
    args.update(make(engine, args))
    engine.flush()
    before = engine.dispatches
    with pytest.raises(exc, match=re.escape(message)):
        lm_head_cross_entropy(engine, **args)
    assert engine.dispatches == before


def test_out_of_range_target_in_a_tensor_is_caught_by_reading_it_back(engine, rng):
    h, E, targets, mask = problem(rng, 8, 100, 16, holes=False)
    targets[5] = 100
    before = engine.dispatches
    with pytest.raises(ValueError, match=r"targets\[5\] = 100 is out of range for a vocabulary of 100"):
        lm_head_cross_entropy(engine, engine.tensor(h), engine.tensor(E), engine.tensor(targets, "i32"),
                              engine.tensor(mask), chunk=64)
    assert engine.dispatches == before


def test_loss_only_skips_the_gradients(ctx, rng):
    """grads=False gives the same loss, returns no gradients and records only pass 1."""
    T, V, D = 37, 300, 16
    h = rng.standard_normal((T, D)).astype(np.float32)
    E = rng.standard_normal((V, D)).astype(np.float32)
    targets = rng.integers(0, V, T).astype(np.int32)
    mask = (rng.random(T) > 0.3).astype(np.float32)
    full, only = ComputeEngine(ctx), ComputeEngine(ctx)
    a = lm_head_cross_entropy(full, full.tensor(h), full.tensor(E), targets, mask, normalizer=5.0, chunk=64, bucket=16)
    b = lm_head_cross_entropy(only, only.tensor(h), only.tensor(E), targets, mask, normalizer=5.0, chunk=64,
                              bucket=16, grads=False)
    assert b.dh is None and b.dE is None
    assert b.loss_value() == a.loss_value()
    assert only.dispatches < full.dispatches
    with pytest.raises(ValueError, match="grads=False"):
        lm_head_cross_entropy(only, only.tensor(h), only.tensor(E), targets, mask, grads=False, accumulate_dE=True)


def test_frozen_head_skips_its_gradient(ctx, rng):
    """grad_E=False (a frozen head, as under LoRA) gives the same loss and dh bit for bit, no dE, and
    one dispatch fewer per chunk; asking for a dE it will not compute is refused before GPU work."""
    T, V, D = 37, 300, 16
    h = rng.standard_normal((T, D)).astype(np.float32)
    E = rng.standard_normal((V, D)).astype(np.float32)
    targets = rng.integers(0, V, T).astype(np.int32)
    full, frozen = ComputeEngine(ctx), ComputeEngine(ctx)
    a = lm_head_cross_entropy(full, full.tensor(h), full.tensor(E), targets, None, chunk=64, bucket=16)
    b = lm_head_cross_entropy(frozen, frozen.tensor(h), frozen.tensor(E), targets, None, chunk=64, bucket=16,
                              grad_E=False)
    assert b.dE is None
    assert b.loss_value() == a.loss_value()
    np.testing.assert_array_equal(b.dh.numpy(), a.dh.numpy())
    assert full.dispatches - frozen.dispatches == -(-V // 64)
    before = frozen.dispatches
    with pytest.raises(ValueError, match="grad_E=False computes no dE"):
        lm_head_cross_entropy(frozen, frozen.tensor(h), frozen.tensor(E), targets, None, grad_E=False,
                              dE=frozen.empty((V, D)))
    assert frozen.dispatches == before


@pytest.mark.parametrize("f16", [False, True])
def test_kept_logits_change_nothing_but_the_dispatches_and_memory(ctx, rng, f16):
    """Pass 1 keeping chunks' logits for pass 2: loss, dh and dE bit for bit those of the one-buffer
    walk, one logits dispatch fewer per kept chunk, one [bucketed T, chunk] buffer more each, and the
    kept count bounded by the budget and by the chunks before the last (random sizes and budgets)."""
    for _ in range(4):
        T, D, chunk = int(rng.integers(1, 80)), int(rng.choice([16, 32])), 64 * int(rng.integers(1, 3))
        V = int(rng.integers(chunk + 1, 6 * chunk))          # two to six chunks, the last one often partial
        bucket = int(rng.choice([1, 16]))
        h, E, targets, mask = problem(rng, T, V, D)
        h = h.astype(np.float16) if f16 else h
        chunks, per = -(-V // chunk), bucketed(T, bucket) * chunk * 4
        budget = int(rng.integers(0, chunks + 1)) * per + int(rng.integers(0, per))
        want_kept = min(chunks - 1, budget // per)
        assert kept_chunks(V, T, chunk=chunk, bucket=bucket, keep_logits=budget) == want_kept
        runs = []
        for keep in (0, budget):
            eng = ComputeEngine(ctx)
            ht, Et = eng.tensor(h, "f16" if f16 else "f32"), eng.tensor(E)
            eng.synchronize()
            before = eng.pool.in_use_bytes
            res = lm_head_cross_entropy(eng, ht, Et, targets, mask, normalizer=3.0, chunk=chunk, bucket=bucket,
                                        keep_logits=keep)
            runs.append((res.loss.numpy(), res.dh.numpy(), res.dE.numpy(), eng.dispatches,
                         eng.pool.peak_bytes - before))
        (l0, dh0, dE0, n0, peak0), (l1, dh1, dE1, n1, peak1) = runs
        np.testing.assert_array_equal(l1, l0)
        np.testing.assert_array_equal(dh1, dh0)
        np.testing.assert_array_equal(dE1, dE0)
        assert n0 - n1 == want_kept, (T, V, chunk, budget)
        assert peak1 - peak0 >= want_kept * per
        assert peak1 - peak0 <= want_kept * per * 1.3 + 4096


def test_kept_logits_are_not_made_for_the_loss_alone(ctx, rng):
    h, E, targets, mask = problem(rng, 20, 300, 16)
    eng = ComputeEngine(ctx)
    ht, Et = eng.tensor(h), eng.tensor(E)
    eng.synchronize()
    before = eng.pool.in_use_bytes
    res = lm_head_cross_entropy(eng, ht, Et, targets, mask, chunk=64, grads=False, keep_logits=1 << 30)
    res.loss_value()
    assert eng.pool.peak_bytes - before <= 20 * 64 * 4 + 16 * 1024


def test_per_position_losses_are_torchs_and_compile_once_per_bucket(ctx, rng):
    """per_position=True: each position's mask * cross-entropy against torch, padded positions left
    out; two lengths of one bucket share the kernels (no compile per length)."""
    engine = ComputeEngine(ctx)
    V, D = 300, 16
    E = rng.standard_normal((V, D)).astype(np.float32)
    for T in (21, 30):
        h = rng.standard_normal((T, D)).astype(np.float32)
        targets = rng.integers(0, V, T).astype(np.int32)
        mask = (rng.random(T) > 0.3).astype(np.float32) * 2.0
        before = engine.stats.as_dict()["misses"]
        got = lm_head_cross_entropy(engine, engine.tensor(h), engine.tensor(E), targets, mask, chunk=64, bucket=32,
                                    grads=False, per_position=True).loss.numpy()
        want = torch.tensor(mask) * F.cross_entropy(torch.tensor(h) @ torch.tensor(E).T, torch.tensor(targets).long(),
                                                    reduction="none")
        assert got.shape == (T,)
        np.testing.assert_allclose(got, want.numpy(), rtol=1e-5, atol=1e-5)
        if T == 30:
            assert engine.stats.as_dict()["misses"] == before
    with pytest.raises(ValueError, match="per_position must be True or False, and True only with segments=1"):
        lm_head_cross_entropy(engine, engine.tensor(h), engine.tensor(E), targets, mask, per_position=True,
                              segments=2)
