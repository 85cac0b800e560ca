"""Arenas (runtime/arena.py): tensors carved side by side, found again as runs, and the passes
that use them (a model's zero_grad, the gradient norm) against float64."""
from __future__ import annotations

import math

import numpy as np
import pytest

from lfm2jit.model import Lfm2Config, Lfm2Model
from lfm2jit.ops.optim import global_grad_norm
from lfm2jit.runtime import arena


def norm64(arrays) -> float:
    return math.sqrt(sum(float((np.asarray(a, np.float64) ** 2).sum()) for a in arrays))


def random_shapes(rng, n):
    """Sizes that are and are not whole binding-alignment slots, empty ones among them."""
    shapes = []
    for _ in range(n):
        kind = rng.integers(0, 4)
        if kind == 0:
            shapes.append((int(rng.integers(1, 70)),))
        elif kind == 1:
            shapes.append((int(rng.integers(1, 40)), int(rng.integers(1, 40))))
        elif kind == 2:
            shapes.append((64 * int(rng.integers(1, 5)),))
        else:
            shapes.append((int(rng.integers(0, 3)), 5))
    return shapes


def test_carved_tensors_are_zero_aligned_and_exact_even_in_a_reused_buffer(engine, rng):
    dirty = engine.tensor(np.full(4096, np.nan, np.float32))   # freed below: the pool may hand it out again
    del dirty
    shapes = [(3,), (64,), (7, 9), (0, 4), (65,)]
    ts = arena.carve(engine, shapes)
    align = engine.ctx.limits.get("min-storage-buffer-offset-alignment", 256)
    assert [t.shape for t in ts] == shapes
    assert all(t.offset % align == 0 and t.capacity == t.size for t in ts)
    assert len({id(t.buffer) for t in ts}) == 1
    for t in ts:
        np.testing.assert_array_equal(t.numpy(), np.zeros(t.shape, np.float32))
    (run,) = arena.runs(ts)                  # the empty tensor is skipped, the rest is one run
    assert run.tensors == (ts[0], ts[1], ts[2], ts[4]) and run.span.offset == 0
    np.testing.assert_array_equal(run.span.numpy(), np.zeros(run.span.size, np.float32))


def test_runs_take_only_whole_carved_neighbours(engine):
    a, b, c, d = arena.carve(engine, [(2, 32), (64,), (10,), (64,)])
    assert [r.tensors for r in arena.runs([a, b, c, d])] == [(a, b, c, d)]
    assert [r.tensors for r in arena.runs([a, c, d])] == [(a,), (c, d)]        # a hole splits a run
    assert [r.tensors for r in arena.runs([b, a])] == [(b,), (a,)]            # order is kept, not sorted
    assert [r.tensors for r in arena.runs([a.view(64), b])][0][1] is b          # a reshaped view is still whole
    head = a.rows(0, 1)                                                       # its second row is data, not padding
    assert [r.tensors for r in arena.runs([head, b])] == [(head,), (b,)]
    plain = [engine.tensor(np.ones(10, np.float32)), engine.tensor(np.ones(64, np.float32))]
    assert [r.tensors for r in arena.runs(plain)] == [(plain[0],), (plain[1],)]


@pytest.mark.parametrize("seed", range(6))
def test_norm_over_arena_runs_matches_float64(engine, seed):
    """Random shapes carved, written, then the norm over a random selection in random order
    (runs, holes and repeats), against float64 over the same selection."""
    rng = np.random.default_rng(seed)
    shapes = random_shapes(rng, int(rng.integers(2, 30)))
    ts = arena.carve(engine, shapes)
    arrays = [(rng.standard_normal(s) * 10.0 ** rng.integers(-3, 3)).astype(np.float32) for s in shapes]
    for t, a in zip(ts, arrays):
        if t.size:
            t.write(a)
    order = list(range(len(ts))) if seed % 2 == 0 else [int(i) for i in rng.permutation(len(ts))]
    picked = [i for i in order if rng.random() < 0.8] + ([order[0]] if seed == 5 else [])
    if not any(ts[i].size for i in picked):
        picked = order
    norm, finite = global_grad_norm(engine, [ts[i] for i in picked])
    want = norm64([arrays[i] for i in picked])
    assert finite and abs(norm - want) <= 1e-5 * want, (norm, want)


def test_a_small_binding_limit_spreads_the_arena_and_the_norm_still_holds(engine, rng, monkeypatch):
    monkeypatch.setitem(engine.ctx.limits, "max-storage-buffer-binding-size", 4096)
    shapes = [(300,), (700,), (1000,), (24, 10), (200,)]
    ts = arena.carve(engine, shapes)
    assert all(t.offset + t.nbytes <= 4096 for t in ts)
    assert len({id(t.buffer) for t in ts}) == 3                  # 1280 + 2816 | 4096 | 1024 + 1024 bytes
    assert [len(r.tensors) for r in arena.runs(ts)] == [2, 1, 2]
    arrays = [rng.standard_normal(s).astype(np.float32) for s in shapes]
    for t, a in zip(ts, arrays):
        t.write(a)
    norm, finite = global_grad_norm(engine, ts)
    assert finite and abs(norm - norm64(arrays)) <= 1e-5 * norm64(arrays)
    small, big, after = arena.carve(engine, [(10,), (2000,), (10,)])  # larger than a binding: a buffer alone
    assert len({id(small.buffer), id(big.buffer), id(after.buffer)}) == 3
    pieces = arena.runs([small, big, after])       # big (8000 bytes) is cut into spans of one binding each
    assert [r.tensors for r in pieces] == [(small,), (big,), (big,), (after,)]
    assert [r.span.nbytes for r in pieces] == [40, 4096, 8000 - 4096, 40]
    arrays = [rng.standard_normal(t.shape).astype(np.float32) for t in (small, big, after)]
    for t, a in zip((small, big, after), arrays):
        t.write(a)
    norm, finite = global_grad_norm(engine, [small, big, after])
    assert finite and abs(norm - norm64(arrays)) <= 1e-5 * norm64(arrays)


def test_nonfinite_gradient_in_a_run_is_reported(engine, rng):
    ts = arena.carve(engine, [(5,), (70,), (3, 3)])
    for t in ts:
        t.write(rng.standard_normal(t.shape).astype(np.float32))
    bad = rng.standard_normal(70).astype(np.float32)
    bad[69] = np.inf
    ts[1].write(bad)
    norm, finite = global_grad_norm(engine, ts)
    assert not finite and math.isinf(norm)


def test_a_models_gradients_are_one_run_zeroed_in_one_clear(ctx, engine, rng):
    cfg = Lfm2Config(vocab_size=96, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                     num_attention_heads=4, num_key_value_heads=2, layer_types=["conv", "full_attention"])
    model = Lfm2Model(cfg, ctx, engine, seed=3)
    params = model.parameters()
    model.zero_grad(params)
    (run,) = arena.runs([p.grad for p in params])
    assert run.tensors == tuple(p.grad for p in params)
    for p in params:                                      # dirty every gradient, then zero them again
        p.grad.write(rng.standard_normal(p.shape).astype(np.float32))
    before = engine.dispatches
    model.zero_grad(params)
    for p in params:
        np.testing.assert_array_equal(p.grad.numpy(), np.zeros(p.shape, np.float32))
    assert engine.dispatches == before                    # clears, not dispatches
    norm, finite = global_grad_norm(engine, [p.grad for p in params])
    assert finite and norm == 0.0


def test_upload_holds_the_arrays_with_zero_padding_outside_the_pool(ctx, engine, rng):
    shapes = random_shapes(rng, 12)
    arrays = [rng.standard_normal(s).astype(np.float32) for s in shapes]
    in_use = engine.pool.in_use_bytes
    ts = arena.upload(ctx, arrays)
    assert engine.pool.in_use_bytes == in_use                  # parameters are not the pool's
    for t, a in zip(ts, arrays):
        assert t.shape == a.shape
        np.testing.assert_array_equal(t.numpy(), a)
    (run,) = arena.runs(ts)
    want = np.zeros(run.span.size, np.float32)                 # the arrays at their slots, zeros between
    for t, a in zip(ts, arrays):
        at = (t.offset - run.span.offset) // 4
        want[at:at + a.size] = a.reshape(-1)
    np.testing.assert_array_equal(run.span.numpy(), want)


def test_runs_together_break_wherever_one_list_does(engine):
    shapes = [(3,), (64,), (0,), (7, 9), (65,), (5,)]
    ps, gs = arena.carve(engine, shapes), arena.carve(engine, shapes)
    (whole,) = arena.runs_together([ps, gs])
    assert whole[0].offset == ps[0].offset and whole[1].offset == gs[0].offset
    assert whole[0].size == whole[1].size == (ps[5].offset + ps[5].nbytes - ps[0].offset) // 4
    alone = engine.zero_(engine.empty((7, 9)))                 # not carved: a run of its own
    spans = arena.runs_together([ps, gs[:3] + [alone] + gs[4:]])
    ranges = [(0, 1), (3, 3), (4, 5)]                          # the empty tensor belongs to none
    assert len(spans) == len(ranges)
    for (p_span, g_span), (i, j) in zip(spans, ranges):
        assert p_span.offset == ps[i].offset and p_span.size == (ps[j].offset + ps[j].nbytes - ps[i].offset) // 4
        assert g_span.size == p_span.size
    assert spans[1][1].buffer is alone.buffer
    with pytest.raises(ValueError, match="shapes and dtypes must match"):
        arena.runs_together([ps, gs[:-1] + [engine.empty((6,))]])
    with pytest.raises(ValueError, match="one length"):
        arena.runs_together([ps, gs[:-1]])


def adamw64(p, g, m, v, *, lr, b1, b2, eps, wd, step):
    """torch.optim.AdamW's update in float64."""
    p, g, m, v = (np.asarray(x, np.float64) for x in (p, g, m, v))
    m = b1 * m + (1 - b1) * g
    v = b2 * v + (1 - b2) * g * g
    p = p * (1 - lr * wd) - lr / (1 - b1 ** step) * m / (np.sqrt(v) / math.sqrt(1 - b2 ** step) + eps)
    return p, m, v


@pytest.mark.parametrize("seed", range(4))
def test_adamw_over_arena_runs_equals_one_dispatch_per_tensor(engine, rng, seed):
    """Parameters uploaded, gradients and moments carved: a step is one dispatch, bitwise equal
    to per-tensor dispatches on plain tensors and to float64, and the padding stays zero; with
    eps = 0 (zeros would turn NaN) each tensor is its own dispatch."""
    from lfm2jit.ops.optim import adamw_step
    r = np.random.default_rng(seed)
    shapes = random_shapes(r, int(r.integers(2, 20)))
    host = {k: [r.standard_normal(s).astype(np.float32) * (0.1 if k != "v" else 0.01) for s in shapes] for k in "pgmv"}
    host["v"] = [np.abs(a) for a in host["v"]]
    eps = 0.0 if seed == 3 else 1e-8
    carved = {"p": arena.upload(engine.ctx, host["p"])}
    for k in "gmv":
        carved[k] = arena.carve(engine, shapes)
        for t, a in zip(carved[k], host[k]):
            if t.size:
                t.write(a)
    plain = {k: [engine.tensor(a) for a in host[k]] for k in "pgmv"}
    hyper = dict(lr=1e-2, betas=(0.9, 0.99), eps=eps, weight_decay=0.1)
    nonempty = sum(1 for s in shapes if math.prod(s))
    for step in (1, 2, 3):
        before = engine.dispatches
        adamw_step(engine, carved["p"], carved["g"], carved["m"], carved["v"], step=step, **hyper)
        assert engine.dispatches - before == (nonempty if eps == 0 else 1)
        adamw_step(engine, plain["p"], plain["g"], plain["m"], plain["v"], step=step, **hyper)
    for k in "pmv":
        for a, b in zip(carved[k], plain[k]):
            np.testing.assert_array_equal(a.numpy(), b.numpy())
    want = [host[k] for k in "pgmv"]
    for i in range(len(shapes)):
        p, g, m, v = (w[i] for w in want)
        for step in (1, 2, 3):
            p, m, v = adamw64(p, g, m, v, lr=1e-2, b1=0.9, b2=0.99, eps=eps, wd=0.1, step=step)
        if p.size and eps:
            assert np.abs(carved["p"][i].numpy() - p).max() <= 1e-5 * max(1.0, np.abs(p).max())
    for k in "pmv":
        (run,) = arena.runs(carved[k])
        span = run.span.numpy()
        inside = np.zeros(span.size, bool)
        for t in carved[k]:
            at = (t.offset - run.span.offset) // 4
            inside[at:at + t.size] = True
        np.testing.assert_array_equal(span[~inside], 0.0)


def test_a_models_optimizer_step_is_one_dispatch(ctx, engine):
    from trainer import AdamW, SGD
    cfg = Lfm2Config(vocab_size=96, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                     num_attention_heads=4, num_key_value_heads=2, layer_types=["conv", "full_attention"])
    model = Lfm2Model(cfg, ctx, engine, seed=3)
    params = model.parameters()
    model.zero_grad(params)
    for opt in (AdamW(lr=1e-3), SGD(lr=1e-3, momentum=0.9)):
        before = engine.dispatches
        opt.step(engine, params, lr=1e-3, gscale=1.0)
        assert engine.dispatches - before == 1, type(opt).__name__


def test_an_arena_takes_just_its_bytes_from_the_pool(engine):
    """Not its size class: 1/16 of a moment arena's size is tens of MB at LFM2-350M."""
    from lfm2jit.runtime.pool import size_class
    align = engine.ctx.limits.get("min-storage-buffer-offset-alignment", 256)
    shapes = [(1000001,), (3, 70001)]
    want = sum(-(-math.prod(s) * 4 // align) * align for s in shapes)
    assert size_class(want) > want                       # a class would round it up
    before = engine.pool.in_use_bytes
    a, b = arena.carve(engine, shapes)
    assert a.buffer is b.buffer and a.buffer.size == want
    assert engine.pool.in_use_bytes - before == want
