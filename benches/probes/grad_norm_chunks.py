"""The global gradient norm at several row lengths of its first pass (``grad_sumsq``'s chunk):

    python benches/probes/grad_norm_chunks.py [PRESET]     # default 350M; tiny runs on lavapipe

Gradients of every parameter shape of the preset (random, on the GPU), ``global_grad_norm`` at
each chunk on an engine timing every dispatch: GPU time per call (summed over its dispatches, 5
calls after 3), the effective read bandwidth, the error against float64, the longest dispatches.
What ``lfm2jit.ops.optim.CHUNK`` is read from.
"""
import math, sys, time
import numpy as np
from lfm2jit import ComputeEngine, WgpuContext
from lfm2jit.model.checkpoint import parameter_shapes
from lfm2jit.model.config import Lfm2Config
from lfm2jit.ops.optim import global_grad_norm
ctx = WgpuContext.create()
e = ComputeEngine(ctx, timing=True)
cfg = Lfm2Config.preset(sys.argv[1] if len(sys.argv) > 1 else "350M")
rng = np.random.default_rng(0)
gs = [e.tensor((rng.standard_normal(s) * 0.02).astype(np.float32)) for s in parameter_shapes(cfg).values()]
n = sum(g.size for g in gs)
want = math.sqrt(sum(float((g.numpy().astype(np.float64) ** 2).sum()) for g in gs))
for chunk in (4096, 16384, 65536, 262144):
    for _ in range(3):
        norm, ok = global_grad_norm(e, gs, chunk=chunk)
    e.timings.clear()
    for _ in range(5):
        norm, ok = global_grad_norm(e, gs, chunk=chunk)
    per = sum(s for _, s in e.timings) / 5
    big = sorted((s for k, s in e.timings), reverse=True)[:5]
    e.timings.clear()
    print(f"chunk {chunk:7d}: {per * 1e3:.3f} ms GPU ({4 * n / per / 1e9:.0f} GB/s), norm rel err {abs(norm - want) / want:.1e}, "
          f"largest dispatches {[round(b * 1e6, 1) for b in big]} us")
