"""One fresh process compiling a few kernels with LFM2JIT_CACHE_DIR set (tests/runtime/test_compile_cache.py).

    python tests/compile_cache_worker.py

Runs an elementwise kernel and an autotuned ``linear`` (LFM2JIT_AUTOTUNE=1) on small inputs, checks
them against numpy, and prints one JSON line: the engine's cache counts, the kernel sources parsed and
read back parsed, and the autotuner's trials.
The tuner has one matmul tile candidate to try, not all: on lavapipe the search takes a second each.
"""
from __future__ import annotations

import json

import numpy as np

from lfm2jit import ComputeEngine, WgpuContext, compile_source
from lfm2jit.driver import SOURCE_STATS
from lfm2jit.tune import candidates

SOURCE = "kernel scale(x: f32[N]) -> (y: f32[N]) { y = x * 2.0 + 1.0 }"


def main() -> None:
    candidates.MATMUL = candidates.MATMUL[:1]
    ctx = WgpuContext.create()
    engine = ComputeEngine(ctx)
    rng = np.random.default_rng(0)
    x = rng.standard_normal(8).astype(np.float32)
    y = engine.run(compile_source(SOURCE).scale, x=engine.tensor(x))["y"].numpy()
    a, w = rng.standard_normal((5, 8)).astype(np.float32), rng.standard_normal((6, 8)).astype(np.float32)
    z = engine.run("linear", bucket=4, x=engine.tensor(a), w=engine.tensor(w))["y"].numpy()
    correct = bool(np.allclose(y, 2 * x + 1) and np.allclose(z, a @ w.T, atol=1e-5))
    print(json.dumps({"correct": correct, "trials": engine.tuner.trials, "parsed": SOURCE_STATS.parsed,
                      "read_back": SOURCE_STATS.read_back, **engine.stats.as_dict()}))


if __name__ == "__main__":
    main()
