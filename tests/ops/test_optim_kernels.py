"""Optimizer kernels (kernels/optim.lk via lfm2jit/optim_kernels.py) vs torch.optim and numpy float64:
AdamW and SGD over several steps with a changing lr, the global gradient norm with its non-finite
detection, scale_, gscale folding, argument checks before GPU work, and no recompiles per step."""
from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from lfm2jit import library
from lfm2jit.ops.optim import adamw_step, global_grad_norm, scale_, sgd_step
from numerics import rel_err

TOL = 1e-5
SHAPES = [(1,), (3,), (1000,), (4099,), (33, 17)]
STEPS = 5
LRS = [1e-3, 3e-3, 2e-3, 5e-4, 1e-2]        # a different rate every step


def randn(rng, shape, scale=1.0):
    return (scale * rng.standard_normal(shape)).astype(np.float32)


def upload(engine, arrays):
    return [engine.tensor(a) for a in arrays]


def grads_for(rng, steps=STEPS, shapes=SHAPES):
    return [[randn(rng, s) for s in shapes] for _ in range(steps)]


# ---- AdamW ----

@pytest.mark.parametrize("betas,eps,wd", [((0.9, 0.999), 1e-8, 0.01), ((0.8, 0.99), 1e-6, 0.0), ((0.9, 0.95), 1e-3, 0.1)])
def test_adamw_matches_torch(engine, rng, betas, eps, wd):
    p0 = [randn(rng, s) for s in SHAPES]
    gs = grads_for(rng)
    tp = [torch.nn.Parameter(torch.tensor(a)) for a in p0]
    opt = torch.optim.AdamW(tp, lr=LRS[0], betas=betas, eps=eps, weight_decay=wd, foreach=False)
    params, ms, vs = upload(engine, p0), upload(engine, [np.zeros(s, np.float32) for s in SHAPES]), \
        upload(engine, [np.zeros(s, np.float32) for s in SHAPES])
    for k in range(STEPS):
        for p, g in zip(tp, gs[k]):
            p.grad = torch.tensor(g)
        opt.param_groups[0]["lr"] = LRS[k]
        opt.step()
        grads = upload(engine, gs[k])
        adamw_step(engine, params, grads, ms, vs, lr=LRS[k], betas=betas, eps=eps, weight_decay=wd, step=k + 1)
        for i, p in enumerate(tp):
            st = opt.state[p]
            assert rel_err(params[i].numpy(), p.detach().numpy()) < TOL, (k, SHAPES[i])
            assert rel_err(ms[i].numpy(), st["exp_avg"].numpy()) < TOL, (k, SHAPES[i])
            assert rel_err(vs[i].numpy(), st["exp_avg_sq"].numpy()) < TOL, (k, SHAPES[i])


def test_adamw_state_shapes_are_flat_views(engine, rng):
    """A 2-D parameter is updated through its flat view and keeps its shape."""
    p = engine.tensor(randn(rng, (33, 17)))
    g, m, v = (engine.tensor(np.zeros((33, 17), np.float32)) for _ in range(3))
    adamw_step(engine, [p], [g], [m], [v], lr=1e-3, step=1)
    assert p.shape == (33, 17) and m.shape == (33, 17)


def test_adamw_gscale_is_gradient_scaling(engine, rng):
    """gscale folds unscaling/clipping into the step: gscale=0.5 on g is exactly the step on g*0.5,
    and an arbitrary gscale matches torch on the f32 product g*gscale."""
    p0 = [randn(rng, s) for s in SHAPES]
    gs = grads_for(rng, steps=3)
    runs = {}
    for mode in ("gscale", "prescaled"):
        params = upload(engine, p0)
        ms = upload(engine, [np.zeros(s, np.float32) for s in SHAPES])
        vs = upload(engine, [np.zeros(s, np.float32) for s in SHAPES])
        for k in range(3):
            g = gs[k] if mode == "gscale" else [x * np.float32(0.5) for x in gs[k]]
            adamw_step(engine, params, upload(engine, g), ms, vs, lr=LRS[k], weight_decay=0.01, step=k + 1,
                       gscale=0.5 if mode == "gscale" else 1.0)
        runs[mode] = [(p.numpy(), m.numpy(), v.numpy()) for p, m, v in zip(params, ms, vs)]
    for a, b in zip(runs["gscale"], runs["prescaled"]):
        for x, y in zip(a, b):
            np.testing.assert_array_equal(x, y)

    gscale = 0.37
    tp = [torch.nn.Parameter(torch.tensor(a)) for a in p0]
    opt = torch.optim.AdamW(tp, lr=LRS[0], weight_decay=0.01, foreach=False)
    params = upload(engine, p0)
    ms = upload(engine, [np.zeros(s, np.float32) for s in SHAPES])
    vs = upload(engine, [np.zeros(s, np.float32) for s in SHAPES])
    for k in range(3):
        for p, g in zip(tp, gs[k]):
            p.grad = torch.tensor(g) * gscale
        opt.param_groups[0]["lr"] = LRS[k]
        opt.step()
        adamw_step(engine, params, upload(engine, gs[k]), ms, vs, lr=LRS[k], weight_decay=0.01, step=k + 1,
                   gscale=gscale)
    for got, p in zip(params, tp):
        assert rel_err(got.numpy(), p.detach().numpy()) < TOL


# ---- SGD ----

SGD_CONFIGS = [
    dict(momentum=0.0, dampening=0.0, nesterov=False, weight_decay=0.0),
    dict(momentum=0.0, dampening=0.0, nesterov=False, weight_decay=0.05),
    dict(momentum=0.9, dampening=0.0, nesterov=False, weight_decay=0.0),
    dict(momentum=0.9, dampening=0.3, nesterov=False, weight_decay=0.01),
    dict(momentum=0.8, dampening=0.0, nesterov=True, weight_decay=0.01),
]


@pytest.mark.parametrize("cfg", SGD_CONFIGS, ids=lambda c: "-".join(f"{k}={v}" for k, v in c.items()))
def test_sgd_matches_torch(engine, rng, cfg):
    p0 = [randn(rng, s) for s in SHAPES]
    gs = grads_for(rng)
    tp = [torch.nn.Parameter(torch.tensor(a)) for a in p0]
    opt = torch.optim.SGD(tp, lr=LRS[0], foreach=False, **cfg)
    params = upload(engine, p0)
    # momentum buffers start as garbage (NaN): step 1 must overwrite them with the gradient
    bufs = upload(engine, [np.full(s, np.nan, np.float32) for s in SHAPES]) if cfg["momentum"] else None
    for k in range(STEPS):
        for p, g in zip(tp, gs[k]):
            p.grad = torch.tensor(g)
        opt.param_groups[0]["lr"] = LRS[k]
        opt.step()
        sgd_step(engine, params, upload(engine, gs[k]), bufs, lr=LRS[k], step=k + 1, **cfg)
        for i, p in enumerate(tp):
            assert rel_err(params[i].numpy(), p.detach().numpy()) < TOL, (k, SHAPES[i])
            if bufs is not None:
                assert rel_err(bufs[i].numpy(), opt.state[p]["momentum_buffer"].numpy()) < TOL, (k, SHAPES[i])


def test_sgd_gscale(engine, rng):
    p0 = [randn(rng, s) for s in SHAPES]
    gs = grads_for(rng, steps=3)
    out = {}
    for mode in ("gscale", "prescaled"):
        params = upload(engine, p0)
        bufs = upload(engine, [np.zeros(s, np.float32) for s in SHAPES])
        for k in range(3):
            g = gs[k] if mode == "gscale" else [x * np.float32(0.25) for x in gs[k]]
            sgd_step(engine, params, upload(engine, g), bufs, lr=LRS[k], momentum=0.9, nesterov=True,
                     weight_decay=0.01, step=k + 1, gscale=0.25 if mode == "gscale" else 1.0)
        out[mode] = [p.numpy() for p in params] + [b.numpy() for b in bufs]
    for a, b in zip(out["gscale"], out["prescaled"]):
        np.testing.assert_array_equal(a, b)


# ---- no recompiles ----

def test_changing_lr_and_step_compiles_nothing(engine, rng):
    params = upload(engine, [randn(rng, s) for s in SHAPES])
    grads = upload(engine, [randn(rng, s) for s in SHAPES])
    ms = upload(engine, [np.zeros(s, np.float32) for s in SHAPES])
    vs = upload(engine, [np.zeros(s, np.float32) for s in SHAPES])
    bufs = upload(engine, [np.zeros(s, np.float32) for s in SHAPES])

    def one_step(k):
        norm, finite = global_grad_norm(engine, grads)
        assert finite
        coef = min(1.0, 0.5 / (norm + 1e-6))
        adamw_step(engine, params, grads, ms, vs, lr=LRS[k], betas=(0.9, 0.999), eps=1e-8,
                   weight_decay=0.01, step=k + 1, gscale=coef / 1024.0)
        sgd_step(engine, params, grads, bufs, lr=LRS[k], momentum=0.9, step=k + 1, gscale=coef)
        sgd_step(engine, params, grads, lr=LRS[k], weight_decay=0.1 * k, step=k + 1)
        scale_(engine, grads, 1.0 + 0.1 * k)
        params[0].numpy()

    one_step(0)
    misses = engine.stats.misses
    for k in range(1, STEPS):
        one_step(k)
    assert engine.stats.misses == misses


# ---- global gradient norm ----

def norm64(arrays) -> float:
    return math.sqrt(sum(float((np.asarray(a, np.float64) ** 2).sum()) for a in arrays))


def test_global_norm_odd_sizes(engine, rng):
    arrays = [randn(rng, s) for s in SHAPES]
    norm, finite = global_grad_norm(engine, upload(engine, arrays))
    assert finite
    assert abs(norm - norm64(arrays)) / norm64(arrays) < TOL


def test_global_norm_large_tensor(engine, rng):
    """One tensor past 65535 * 256 elements among small ones, magnitudes over decades; then scale_
    over it (a pointwise dispatch folded into 2-D) halves the norm and reaches its last element."""
    n = 20_000_000
    big = rng.standard_normal(n, dtype=np.float32)
    big[: n // 2] *= np.float32(1e-3)
    big[n // 2: n // 2 + 1000] *= np.float32(1e3)
    arrays = [randn(rng, (4099,)), big, randn(rng, (33, 17), 1e-3)]
    tensors = upload(engine, arrays)
    want = norm64(arrays)
    norm, finite = global_grad_norm(engine, tensors)
    assert finite and abs(norm - want) / want < TOL
    scale_(engine, tensors, 0.5)
    norm, finite = global_grad_norm(engine, tensors)
    assert finite and abs(norm - want / 2) / want < TOL
    np.testing.assert_array_equal(tensors[1].rows(n - 64, n).numpy(), big[-64:] * np.float32(0.5))


def test_global_norm_more_rows_than_a_dispatch_dimension(engine, rng):
    """70000 rows of one element: the first pass's workgroups fold into 2-D."""
    arrays = [randn(rng, (70_000,)), randn(rng, (3,))]
    norm, finite = global_grad_norm(engine, upload(engine, arrays), chunk=1)
    assert finite and abs(norm - norm64(arrays)) / norm64(arrays) < TOL


@pytest.mark.parametrize("chunk", [1, 2, 7, 64, 100, 1000])
def test_global_norm_chunking(engine, rng, chunk):
    """Small chunks exercise the row split: exact multiples, one short last row, single rows."""
    shapes = [(1,), (chunk,), (chunk + 1,), (3 * chunk,), (3 * chunk - 1,), (5, 13), (997,)]
    arrays = [randn(rng, s) for s in shapes]
    norm, finite = global_grad_norm(engine, upload(engine, arrays), chunk=chunk)
    assert finite
    assert abs(norm - norm64(arrays)) / norm64(arrays) < TOL


def test_global_norm_ignores_data_past_the_end(engine):
    """The last row's masked part must not read the neighbours of a view (huge values around it)."""
    whole = engine.tensor(np.full(1024, 1e6, np.float32))
    head, mid = whole.rows(0, 100), whole.rows(256, 356)
    head.write(np.ones(100, np.float32))
    mid.write(np.full(100, 2.0, np.float32))
    for chunk in (64, 4096):
        norm, finite = global_grad_norm(engine, [head, mid.view((10, 10))], chunk=chunk)
        assert finite and abs(norm - math.sqrt(500.0)) < 1e-5


def test_global_norm_empty(engine):
    assert global_grad_norm(engine, []) == (0.0, True)
    assert global_grad_norm(engine, [engine.tensor(np.zeros((0,), np.float32))]) == (0.0, True)
    norm, finite = global_grad_norm(engine, [engine.tensor(np.zeros((5, 3), np.float32))])
    assert norm == 0.0 and finite


@pytest.mark.parametrize("bad", [np.inf, -np.inf, np.nan], ids=["inf", "-inf", "nan"])
@pytest.mark.parametrize("where", ["first", "last"])
@pytest.mark.parametrize("which", [0, 2, 4])
def test_global_norm_detects_nonfinite(engine, rng, bad, where, which):
    arrays = [randn(rng, s) for s in SHAPES]
    flat = arrays[which].reshape(-1)
    flat[0 if where == "first" else -1] = bad
    norm, finite = global_grad_norm(engine, upload(engine, arrays))
    assert not finite
    assert math.isnan(norm) if np.isnan(bad) else norm == math.inf
    assert global_grad_norm(engine, upload(engine, arrays[:which] + arrays[which + 1:]))[1]


def test_global_norm_overflowing_squares_are_not_finite(engine):
    """Finite gradients whose squares overflow f32 give an infinite norm, flagged unusable."""
    norm, finite = global_grad_norm(engine, [engine.tensor(np.array([1e20, 1.0], np.float32))])
    assert norm == math.inf and not finite


def test_row_sums_mask_and_propagate_nonfinite(engine):
    """Pass 1 masks the last row past its tail, and an inf or NaN element makes its row's sum so."""
    x = np.ones((4, 64), np.float32)
    x[0, 3] = np.nan
    x[1, 5], x[1, 6] = np.inf, -np.inf
    x[2, 60:] = np.nan         # masked away: row 2 is the last row and holds 60 elements
    sq = engine.run(library.get("sumsq_rows"), bucket=4, x=engine.tensor(x[:3]), last=2.0, tail=60.0)["sq"].numpy()
    assert np.isnan(sq[0]) and sq[1] == np.inf and sq[2] == 60.0


def test_nonfinite_counts_in_the_kernel(engine):
    """Pass 2 counts inf and NaN itself (x == x fails only for NaN, only an infinity exceeds the
    largest finite f32): the comparisons survive this backend's shader compiler."""
    x = np.ones((3, 8), np.float32)
    x[0, 3] = np.nan
    x[1, 5], x[1, 6] = np.inf, -np.inf
    x[2, 0], x[2, 1] = 3.4028235e38, -3.4028235e38      # the largest finite f32 is not counted
    out = engine.run(library.get("sum_rows"), bucket=4, x=engine.tensor(x))
    np.testing.assert_array_equal(out["bad"].numpy(), [1, 2, 0])


# ---- scale_ ----

def test_scale_inplace(engine, rng):
    arrays = [randn(rng, s) for s in SHAPES]
    tensors = upload(engine, arrays)
    scale_(engine, tensors, 0.3)
    for t, a in zip(tensors, arrays):
        assert t.shape == a.shape
        np.testing.assert_array_equal(t.numpy(), a * np.float32(0.3))
    tensors[1].write(np.array([np.nan, np.inf, 1.0], np.float32))
    scale_(engine, tensors, 0.0)            # zeroing clears even non-finite values
    for t in tensors:
        np.testing.assert_array_equal(t.numpy(), np.zeros(t.shape, np.float32))


# ---- argument checks before any GPU work ----

def _state(engine, shapes=SHAPES, dtype=np.float32):
    rng = np.random.default_rng(0)
    mk = lambda: [engine.tensor(rng.standard_normal(s).astype(dtype)) for s in shapes]  # noqa: E731
    return mk(), mk(), mk(), mk()


def _bad_calls(engine):
    p, g, m, v = _state(engine)
    ints = [engine.tensor(np.zeros(s, np.int32)) for s in SHAPES]
    wrong = [engine.tensor(np.zeros((5,), np.float32))] + g[1:]
    kw = dict(lr=1e-3, step=1)
    return [
        (ValueError, "grads has 4", lambda: adamw_step(engine, p, g[:-1], m, v, **kw)),
        (ValueError, "shape", lambda: adamw_step(engine, p, wrong, m, v, **kw)),
        (ValueError, "dtype i32", lambda: adamw_step(engine, p, g, ints, v, **kw)),
        (TypeError, "must be a Tensor", lambda: adamw_step(engine, p, [np.zeros(1)] + g[1:], m, v, **kw)),
        (TypeError, "list of Tensors", lambda: adamw_step(engine, p[0], g, m, v, **kw)),
        (ValueError, "step", lambda: adamw_step(engine, p, g, m, v, lr=1e-3, step=0)),
        (ValueError, "betas", lambda: adamw_step(engine, p, g, m, v, lr=1e-3, betas=(0.9, 1.0), step=1)),
        (ValueError, "lr", lambda: adamw_step(engine, p, g, m, v, lr=float("nan"), step=1)),
        (ValueError, "same memory", lambda: adamw_step(engine, p, g, m, m, **kw)),
        (ValueError, "same memory", lambda: adamw_step(engine, p + p[:1], g + g[:1], m + m[:1], v + v[:1], **kw)),
        (ValueError, "shares a buffer", lambda: adamw_step(engine, p, g[:-1] + [v[-1]], m, v, **kw)),
        (ValueError, "shares a buffer", lambda: sgd_step(engine, p, g[:-1] + [p[-1]], **kw)),
        (ValueError, "nesterov", lambda: sgd_step(engine, p, g, m, nesterov=True, **kw)),
        (ValueError, "bufs", lambda: sgd_step(engine, p, g, momentum=0.9, **kw)),
        (ValueError, "shape", lambda: sgd_step(engine, p, g, wrong, momentum=0.9, **kw)),
        (ValueError, "dtype i32", lambda: global_grad_norm(engine, g + ints)),
        (ValueError, "finite", lambda: scale_(engine, g, float("inf"))),
    ]


def test_bad_arguments_raise_before_gpu_work(engine):
    for exc, text, call in _bad_calls(engine):
        engine.flush()
        before = engine.dispatches
        with pytest.raises(exc, match=text):
            call()
        assert engine.dispatches == before, text
