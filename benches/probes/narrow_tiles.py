"""A sweep of matrix-unit tiles for LoRA's thin products (an output r = 8 wide) at LFM2-1.2B shapes,
T = 2048, f16 activations: u = s x A^T, du = s dY B, dB += dY^T u and dA += du^T x. These move a
few MB each and read back nothing big, so what counts is how many bytes are in flight: the sweep
varies the tile along the long side, the k-step and split-K, on the matrix template and on the SIMT
one with tiles as thin as the output. Each candidate's result is
checked against the planner's pick; times are the best of 3 rounds of 20 calls (GPU timestamps;
tile_sweep.py).
Usage: python benches/probes/narrow_tiles.py [IN OUT ...]   (default 2048 2048 2048 8192)"""
from __future__ import annotations

import itertools
import sys

import numpy as np

from lfm2jit import ComputeEngine, WgpuContext, grad, library
from lfm2jit.ops import precision
from lfm2jit.tune.tiles import MatrixTiles, TileConfig

from tile_sweep import sweep

R = 8
T = 2048


def candidates(thin: str):
    """Matrix tiles one fragment (16) across the thin side, the long side 64 or 128 in 1 or 4 subgroups
    (around the H200's best), then SIMT tiles as thin as the output (8), whose fetch reads the long
    side's rows whole: a GEMV's access pattern, on the SIMT template."""
    for long, sgs, bk, split in itertools.product((64, 128), (1, 4), (32, 64), (4, 8)):
        if long // sgs < 16:
            continue
        shape = (16, long, 1, sgs) if thin == "m" else (long, 16, sgs, 1)
        yield MatrixTiles(*shape, bk, split=split)
    for (long, bk, t_long, t_thin), split in itertools.product(SIMT_THIN, (1, 4, 8)):
        yield (TileConfig(R, long, bk, t_thin, t_long, split=split) if thin == "m"
               else TileConfig(long, R, bk, t_long, t_thin, split=split))


SIMT_THIN = ((128, 16, 1, 8), (128, 16, 2, 4), (128, 8, 2, 8), (256, 8, 4, 8))   # (long, bk, micro-tile long, thin)


def main(pairs):
    e = ComputeEngine(WgpuContext.create(), timing=True)
    rng = np.random.default_rng(0)
    rows = []
    lin = library.get("linear")
    dw = grad(lin, ["w"])
    for n_in, n_out in pairs:
        x = e.tensor(rng.standard_normal((T, n_in), dtype=np.float32), "f16")
        dy = e.tensor(rng.standard_normal((T, n_out), dtype=np.float32), "f16")
        a = e.tensor(rng.standard_normal((R, n_in), dtype=np.float32))
        b = e.tensor(rng.standard_normal((n_out, R), dtype=np.float32))
        u = e.tensor(rng.standard_normal((T, R), dtype=np.float32), "f16")
        products = {
            "down": ("lora_down", dict(x=x, a=a, s=2.0), "u", "n", 2 * T * n_in),
            "down_grad": ("lora_down_grad", dict(d_y=dy, b=b, s=2.0), "du", "n", 2 * T * n_out),
            "d_b": (dw, dict(x=u, w=b, d_y=dy), "d_w", "n", 2 * T * n_out),
            "d_a": (dw, dict(x=x, w=a, d_y=u), "d_w", "m", 2 * T * n_in),
        }
        for name, (kernel, args, out, thin, nbytes) in products.items():
            kern = library.get(kernel) if isinstance(kernel, str) else kernel
            kern = kern.with_f16(precision.f16_tensors(kern, "f16", args))
            times = sweep(e, kern, args, out, candidates(thin), name)
            base = times["planner"]
            best = min((s, label) for label, s in times.items())
            rows.append((f"in{n_in} out{n_out}", name, base, best, nbytes))
            print(f"{rows[-1][0]:18s} {name:10s} planner {base * 1e6:7.1f} us ({nbytes / base / 1e9:6.0f} GB/s)  "
                  f"best {best[0] * 1e6:7.1f} us ({nbytes / best[0] / 1e9:6.0f} GB/s) {best[1]}", flush=True)


if __name__ == "__main__":
    args = [int(v) for v in sys.argv[1:]] or [2048, 2048, 2048, 8192]
    main(list(zip(args[::2], args[1::2])))
