"""The decoded-weight GEMMs of a quantized LoRA base beside the f16 base's, per tile: LFM2-2.6B's
linear shapes at T = 2048 with f16 activations, the forward y = x W^T and the input gradient
dx = dy W, with W held as f16, int8 or NF4 (decoded in the operand fetch). A tile taller along T
decodes each weight element fewer times (once per tile row of the grid), so the sweep varies WM.
Each candidate's result is checked against the planner's pick (tile_sweep.py). The table gives each
format's time over f16's, both at their best tile, and both at the planner's.
Usage: python benches/probes/decoded_tiles.py [--quick]"""
from __future__ import annotations

import sys

import numpy as np

from lfm2jit import ComputeEngine, WgpuContext, grad, library
from lfm2jit.model.quantized_base import QuantizedWeight
from lfm2jit.ops import precision, quantized
from lfm2jit.tune.tiles import MatrixTiles

from tile_sweep import sweep

TILES = (MatrixTiles(128, 128, 2, 2, 32, prefetch=False), MatrixTiles(128, 128, 2, 4, 32),
         MatrixTiles(256, 128, 4, 2, 32, prefetch=False), MatrixTiles(256, 128, 4, 2, 32),
         MatrixTiles(128, 256, 2, 4, 32, prefetch=False))


def main(quick: bool) -> None:
    e = ComputeEngine(WgpuContext.create(), timing=True)
    rng = np.random.default_rng(0)
    t, shapes = (256, [(128, 256)]) if quick else (2048, [(2048, 2048), (2048, 10752), (10752, 2048)])
    lin = library.get("linear").without({"r"})
    products = {"fwd": lin, "dx": grad(lin, ["x"])}
    rows = []
    for n_in, n_out in shapes:
        x = e.tensor(rng.standard_normal((t, n_in), dtype=np.float32), "f16")
        dy = e.tensor(rng.standard_normal((t, n_out), dtype=np.float32), "f16")
        w32 = (rng.standard_normal((n_out, n_in)) * 0.02).astype(np.float32)
        weights = {"f16": e.tensor(w32, "f16"), "int8": QuantizedWeight(e.ctx, "w", w32, "int8"),
                   "nf4": QuantizedWeight(e.ctx, "w", w32, "nf4")}
        for product, kernel in products.items():
            best, planner = {}, {}
            for fmt, w in weights.items():
                args = {"x": x, "w": w} if product == "fwd" else {"w": w, "d_y": dy}
                kern, args = quantized.unpacked(kernel, args)
                kern = kern.with_f16(precision.f16_tensors(kern, "f16", args))
                times = sweep(e, kern, args, kern.outputs[0], TILES, f"{product} {fmt}")
                label = min(times, key=times.get)
                best[fmt] = times[label]
                planner[fmt] = times["planner"]
                print(f"in{n_in:<6d} out{n_out:<6d} {product:4s} {fmt:5s} planner {times['planner'] * 1e3:7.3f} ms  "
                      f"best {times[label] * 1e3:7.3f} ms {label}", flush=True)
            rows.append((f"in{n_in} out{n_out}", product, best, planner))
    print(f"\n{'shape':20s} {'product':7s} {'int8/f16':>9s} {'nf4/f16':>8s}   at the planner's tiles: int8/f16 nf4/f16")
    for shape, product, best, planner in rows:
        print(f"{shape:20s} {product:7s} {best['int8'] / best['f16']:9.2f} {best['nf4'] / best['f16']:8.2f}"
              f"   {planner['int8'] / planner['f16']:32.2f} {planner['nf4'] / planner['f16']:7.2f}")


if __name__ == "__main__":
    main("--quick" in sys.argv[1:])
