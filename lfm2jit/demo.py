"""``python -m lfm2jit.demo``: run every shipped kernel on the GPU and check it against numpy.

Two sequence lengths share one length bucket, so the second pass must reuse every pipeline the
first one compiled: the cache statistics printed at the end show it. Exits 1 if any kernel misses
its tolerance or the second length compiled anything.
"""
from __future__ import annotations

import sys

import numpy as np

from . import ComputeEngine, WgpuContext

LENGTHS = (50, 61)
BUCKET = 64
HIDDEN = 256
TOLERANCE = 1e-5


def silu(a):
    return a / (1.0 + np.exp(-a))


def softmax(x):
    m = x.max(axis=-1, keepdims=True)
    e = np.exp(x - m)
    s = e.sum(axis=-1, keepdims=True)
    return {"y": e / s, "lse": (m + np.log(s))[:, 0]}


def rmsnorm(x, w, eps):
    return {"y": x / np.sqrt((x * x).mean(axis=-1, keepdims=True) + eps) * w}


# kernel -> (arguments: "TD" a random [T, HIDDEN] array, "D" a random [HIDDEN] one, a number as is;
#            the float64 reference computing every output from those arguments)
CASES = {
    "rmsnorm": ({"x": "TD", "w": "D", "eps": 1e-6}, rmsnorm),
    "softmax": ({"x": "TD"}, softmax),
    "silu_mul": ({"a": "TD", "b": "TD"}, lambda a, b: {"y": silu(a) * b}),
    "scale_add": ({"x": "TD", "z": "TD", "alpha": 0.75, "beta": -1.5},
                  lambda x, z, alpha, beta: {"y": alpha * x + beta * z}),
    "scale": ({"x": "TD", "alpha": 0.125}, lambda x, alpha: {"y": alpha * x}),
    "add": ({"x": "TD", "z": "TD"}, lambda x, z: {"y": x + z}),
}


def rel_err(got: np.ndarray, want: np.ndarray) -> float:
    """Normwise relative error max|got - want| / max|want|: scale-free, and meaningful near zeros."""
    return float(np.abs(got - want).max() / max(np.abs(want).max(), 1e-30))


def check(engine: ComputeEngine, name: str, t: int, rng: np.random.Generator) -> tuple[str, float]:
    """Run one kernel at length t; returns (input shapes, worst relative error over its outputs)."""
    spec, reference = CASES[name]
    shape = {"TD": (t, HIDDEN), "D": (HIDDEN,)}
    # float32 inputs, so the reference sees exactly what the GPU sees.
    args = {k: rng.standard_normal(shape[v]).astype(np.float32) if isinstance(v, str) else v for k, v in spec.items()}
    arrays = {k: v for k, v in args.items() if isinstance(v, np.ndarray)}
    got = engine.run(name, bucket=BUCKET, **(args | {k: engine.tensor(v) for k, v in arrays.items()}))
    want = reference(**(args | {k: v.astype(np.float64) for k, v in arrays.items()}))
    shapes = " ".join(f"{k}{list(v.shape)}" for k, v in arrays.items())
    return shapes, max(rel_err(got[k].numpy().astype(np.float64), want[k]) for k in want)


def main() -> int:
    ctx = WgpuContext.create()
    engine = ComputeEngine(ctx)
    rng = np.random.default_rng(0)
    failed = 0
    misses = []
    print(f"{'kernel':<10} {'inputs':<36} {'max rel err':>11}  result")
    for t in LENGTHS:
        before = engine.stats.misses
        for name in CASES:
            shapes, err = check(engine, name, t, rng)
            ok = err <= TOLERANCE
            failed += not ok
            print(f"{name:<10} {shapes:<36} {err:>11.2e}  {'pass' if ok else 'FAIL'}")
        misses.append(engine.stats.misses - before)
    s = engine.stats
    print(f"\nadapter: {ctx.name}")
    print(f"pipeline cache: {s.hits} hits, {s.misses} misses, {s.compile_seconds:.2f} s compiling")
    for t, m in zip(LENGTHS, misses):
        print(f"  T={t} (bucket {BUCKET}): {m} pipelines compiled")
    if misses[-1]:
        print(f"FAIL: T={LENGTHS[-1]} shares T={LENGTHS[0]}'s bucket but compiled {misses[-1]} pipelines")
    if failed:
        print(f"FAIL: {failed} kernel runs exceeded the relative error tolerance {TOLERANCE:g}")
    return 1 if failed or misses[-1] else 0


if __name__ == "__main__":
    sys.exit(main())
