"""LR schedules: the DESIGN.md formulas at every step (boundaries included), validation, serialisation."""
from __future__ import annotations

import json
import math

import numpy as np
import pytest

from trainer.schedules import (ConstantLR, CosineWithWarmup, LinearDecay, LinearWarmup, LRScheduler,
                               schedule_from_dict)


# ---- independent references, written straight from DESIGN.md ----
def ref_warmup(lr, w, k):
    return lr * min(1.0, k / w) if w > 0 else lr


def ref_cosine(lr, w, n, min_lr, k):
    if k <= w:
        return ref_warmup(lr, w, k)
    if k > n:
        return min_lr
    return min_lr + (lr - min_lr) * (1 + math.cos(math.pi * (k - w) / (n - w))) / 2


def ref_linear(lr, w, n, final_lr, k):
    if k <= w:
        return ref_warmup(lr, w, k)
    if k > n:
        return final_lr
    return lr + (final_lr - lr) * (k - w) / (n - w)


STEPS = list(range(1, 130)) + [500, 10**6]


@pytest.mark.parametrize("lr", [0.0, 1e-4, 3e-3, 1.0])
def test_constant(lr):
    s = ConstantLR(lr)
    assert [s.lr_at(k) for k in STEPS] == [lr] * len(STEPS)


@pytest.mark.parametrize("w", [0, 1, 2, 7, 100])
def test_linear_warmup(w):
    s = LinearWarmup(2e-3, w)
    for k in STEPS:
        assert s.lr_at(k) == pytest.approx(ref_warmup(2e-3, w, k), rel=1e-12, abs=0)
    if w:
        assert s.lr_at(1) == pytest.approx(2e-3 / w)
        assert s.lr_at(w) == 2e-3
    assert s.lr_at(w + 1) == 2e-3 and s.lr_at(10**6) == 2e-3


@pytest.mark.parametrize("w,n,min_lr", [(0, 1, 0.0), (0, 50, 0.0), (10, 100, 0.0), (10, 100, 1e-5), (1, 2, 0.0),
                                        (25, 25, 1e-4), (3, 117, 2e-4)])
def test_cosine_with_warmup(w, n, min_lr):
    lr = 1e-3
    s = CosineWithWarmup(lr, w, n, min_lr)
    for k in STEPS:
        assert s.lr_at(k) == pytest.approx(ref_cosine(lr, w, n, min_lr, k), rel=1e-12, abs=1e-18), k
    # boundaries
    if w:
        assert s.lr_at(1) == pytest.approx(lr / w)
        assert s.lr_at(w) == pytest.approx(lr)
    if n > w:
        assert s.lr_at(n) == pytest.approx(min_lr, abs=1e-18)          # cos(pi) = -1: the floor at total
        mid = w + (n - w) / 2
        if mid == int(mid):
            assert s.lr_at(int(mid)) == pytest.approx((lr + min_lr) / 2)
    assert s.lr_at(n + 1) == min_lr and s.lr_at(n + 1000) == min_lr   # held after total
    after = [s.lr_at(k) for k in range(w + 1, n + 3)]
    assert all(a >= b for a, b in zip(after, after[1:])), "cosine must not increase after warmup"


@pytest.mark.parametrize("w,n,final_lr", [(0, 1, 0.0), (0, 40, 0.0), (5, 45, 0.0), (5, 45, 1e-4), (30, 30, 0.0),
                                          (4, 5, 3e-4)])
def test_linear_decay(w, n, final_lr):
    lr = 1e-3
    s = LinearDecay(lr, w, n, final_lr)
    for k in STEPS:
        assert s.lr_at(k) == pytest.approx(ref_linear(lr, w, n, final_lr, k), rel=1e-12, abs=1e-18), k
    if n > w:
        assert s.lr_at(n) == final_lr
        assert s.lr_at(w + 1) == pytest.approx(lr - (lr - final_lr) / (n - w))
    assert s.lr_at(n + 1) == final_lr and s.lr_at(10**6) == final_lr
    vals = [s.lr_at(k) for k in range(w + 1, n + 2)]
    assert all(a >= b for a, b in zip(vals, vals[1:]))
    diffs = np.diff([s.lr_at(k) for k in range(w + 1, n + 1)])
    assert np.allclose(diffs, diffs[0] if diffs.size else 0.0, rtol=1e-9, atol=1e-18), "decay must be linear"


def test_integer_like_steps_and_call():
    s = CosineWithWarmup(1e-3, 10, 100)
    assert s.lr_at(np.int64(37)) == s.lr_at(37) == s(37)
    assert isinstance(s.lr_at(5), float)
    assert isinstance(LinearWarmup(np.float32(0.5), np.int64(4)).lr_at(2), float)


@pytest.mark.parametrize("s", [ConstantLR(1e-3), LinearWarmup(1e-3, 5), CosineWithWarmup(1e-3, 5, 10),
                               LinearDecay(1e-3, 5, 10)])
@pytest.mark.parametrize("k,exc,words", [(0, ValueError, "numbered from 1"), (-3, ValueError, "numbered from 1"),
                                         (1.0, TypeError, "integer"), (2.5, TypeError, "integer"),
                                         (True, TypeError, "integer"), ("3", TypeError, "integer")])
def test_bad_step(s, k, exc, words):
    with pytest.raises(exc, match=words):
        s.lr_at(k)


@pytest.mark.parametrize("make,exc,words", [
    (lambda: ConstantLR(-1e-3), ValueError, r"ConstantLR: lr must be >= 0, got -0.001"),
    (lambda: ConstantLR(float("nan")), ValueError, "lr must be finite"),
    (lambda: ConstantLR(float("inf")), ValueError, "lr must be finite"),
    (lambda: ConstantLR("0.1"), TypeError, "lr must be a real number"),
    (lambda: ConstantLR(None), TypeError, "lr must be a real number"),
    (lambda: LinearWarmup(-1.0, 5), ValueError, "LinearWarmup: lr must be >= 0"),
    (lambda: LinearWarmup(1e-3, -1), ValueError, "LinearWarmup: warmup_steps must be >= 0, got -1"),
    (lambda: LinearWarmup(1e-3, 2.5), TypeError, "warmup_steps must be an integer"),
    (lambda: LinearWarmup(1e-3, True), TypeError, "warmup_steps must be an integer"),
    (lambda: CosineWithWarmup(-1e-3, 1, 10), ValueError, "CosineWithWarmup: lr must be >= 0"),
    (lambda: CosineWithWarmup(1e-3, 11, 10), ValueError, r"warmup_steps \(11\) must not exceed total_steps \(10\)"),
    (lambda: CosineWithWarmup(1e-3, 0, 0), ValueError, "total_steps must be >= 1, got 0"),
    (lambda: CosineWithWarmup(1e-3, 0, -5), ValueError, "total_steps must be >= 1, got -5"),
    (lambda: CosineWithWarmup(1e-3, -1, 10), ValueError, "warmup_steps must be >= 0"),
    (lambda: CosineWithWarmup(1e-3, 1, 10, min_lr=-1e-5), ValueError, "min_lr must be >= 0"),
    (lambda: CosineWithWarmup(1e-3, 1, 10, min_lr=1e-2), ValueError, r"min_lr \(0.01\) must not exceed lr"),
    (lambda: CosineWithWarmup(1e-3, 1, 10.0), TypeError, "total_steps must be an integer"),
    (lambda: LinearDecay(-1.0, 1, 10), ValueError, "LinearDecay: lr must be >= 0"),
    (lambda: LinearDecay(1e-3, 20, 10), ValueError, r"LinearDecay: warmup_steps \(20\) must not exceed"),
    (lambda: LinearDecay(1e-3, 0, 0), ValueError, "LinearDecay: total_steps must be >= 1"),
    (lambda: LinearDecay(1e-3, 0, 10, final_lr=-1.0), ValueError, "final_lr must be >= 0"),
    (lambda: LinearDecay(1e-3, 0, 10, final_lr=1.0), ValueError, r"final_lr \(1.0\) must not exceed lr"),
])
def test_validation(make, exc, words):
    with pytest.raises(exc, match=words):
        make()


ALL = [ConstantLR(3e-4), LinearWarmup(1e-3, 20), CosineWithWarmup(1e-3, 10, 200, min_lr=1e-5),
       LinearDecay(5e-5, 7, 70, final_lr=1e-6), CosineWithWarmup(1e-3, 0, 1)]


@pytest.mark.parametrize("s", ALL, ids=lambda s: type(s).__name__)
def test_round_trip_through_json(s):
    d = s.to_dict()
    assert d["type"] == type(s).__name__
    back = schedule_from_dict(json.loads(json.dumps(d)))
    assert back == s and type(back) is type(s)
    assert [back.lr_at(k) for k in STEPS] == [s.lr_at(k) for k in STEPS]
    assert LRScheduler.from_state_dict(s.state_dict()) == s
    assert LRScheduler.from_dict(d) == s


def test_to_dict_contents():
    assert CosineWithWarmup(1e-3, 10, 100).to_dict() == {"type": "CosineWithWarmup", "lr": 1e-3, "warmup_steps": 10,
                                                         "total_steps": 100, "min_lr": 0.0}
    assert LinearDecay(1e-3, 0, 5, 1e-4).to_dict() == {"type": "LinearDecay", "lr": 1e-3, "warmup_steps": 0,
                                                       "total_steps": 5, "final_lr": 1e-4}
    d = LinearWarmup(np.float64(1e-3), np.int64(3)).to_dict()
    assert type(d["lr"]) is float and type(d["warmup_steps"]) is int      # plain JSON types
    json.dumps(d)


def test_equality_and_immutability():
    assert CosineWithWarmup(1e-3, 10, 100) == CosineWithWarmup(1e-3, 10, 100, 0.0)
    assert CosineWithWarmup(1e-3, 10, 100) != CosineWithWarmup(1e-3, 10, 101)
    assert CosineWithWarmup(1e-3, 10, 100) != LinearDecay(1e-3, 10, 100)
    with pytest.raises(Exception):
        ConstantLR(1e-3).lr = 1.0


@pytest.mark.parametrize("d,exc,words", [
    ({"type": "Exponential", "lr": 1.0}, ValueError, "unknown schedule type 'Exponential'; known: .*CosineWithWarmup"),
    ({"lr": 1.0}, ValueError, "no 'type' key"),
    ({"type": "ConstantLR", "lr": 1.0, "gamma": 2}, ValueError, r"unknown key\(s\) \['gamma'\]"),
    ({"type": "CosineWithWarmup", "lr": 1.0, "warmup_steps": 1}, ValueError, r"lacks \['total_steps'\]"),
    ({"type": "LinearDecay", "lr": 1.0, "warmup_steps": 5, "total_steps": 2}, ValueError, "must not exceed"),
    (["ConstantLR"], TypeError, "must be a dict"),
])
def test_from_dict_errors(d, exc, words):
    with pytest.raises(exc, match=words):
        schedule_from_dict(d)


def test_custom_subclass_registers():
    import dataclasses

    @dataclasses.dataclass(frozen=True)
    class StepHalving(LRScheduler):
        lr: float
        every: int

        def _lr(self, k):
            return self.lr * 0.5 ** ((k - 1) // self.every)

    s = StepHalving(1.0, 10)
    assert s.lr_at(10) == 1.0 and s.lr_at(11) == 0.5
    assert schedule_from_dict(s.to_dict()) == s
