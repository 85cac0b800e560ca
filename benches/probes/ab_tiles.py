"""The matrix GEMM's planner pick against other tiles, timed in turn: every configuration of a product
compiled and checked first, then rounds in which each is timed once (20 calls, GPU timestamps, the GPU
kept busy with it first), the fastest of the rounds kept. Taking the rounds in turn spreads a clock
dip over every configuration instead of the one timed during it (the mtiles group times each
candidate's rounds back to back). Default: the autotuner's K_GROUPS (subgroup groups sharing a
k-step) at LFM2-350M's linear shapes, T = 512, 2048 and 4096, for the forward, dX and dW of --f16.
Usage: python benches/probes/ab_tiles.py [--rounds N] [--rows T...] [--quick]"""
from __future__ import annotations

import argparse
import sys

import numpy as np

sys.path.insert(0, __file__.rsplit("/", 2)[0])   # benches/, where bench.py is
from bench import time_dispatches  # noqa: E402

from lfm2jit import ComputeEngine, WgpuContext, grad, library  # noqa: E402
from lfm2jit.tune.candidates import K_GROUPS  # noqa: E402

from tile_sweep import WRONG  # noqa: E402


def products():
    lin = library.get("linear").without({"r"})
    return {"fwd": (lin.variant("f16", {"w"}), "y"), "dx": (grad(lin, ["x"]).variant("f16", {"w"}), "d_x"),
            "dw": (grad(lin, ["w"]).variant("f16", {"d_w"}), "d_w")}


def one_shape(e, rng, m: int, n: int, k: int, candidates, rounds: int) -> list[tuple]:
    """(product, shape, planner label, its TFLOP/s, best other label, its TFLOP/s) per product."""
    args = {"x": e.tensor(rng.standard_normal((m, k), dtype=np.float32), "f16"),
            "w": e.tensor(rng.standard_normal((n, k), dtype=np.float32)),
            "d_y": e.tensor(rng.standard_normal((m, n), dtype=np.float32), "f16")}
    rows = []
    for name, (kern, out) in products().items():
        given = {t.name: args[t.name] for t in kern.ir.inputs}
        pick = kern.kernels[0].specialize({"T": m, "K": k, "N": n}, 1, target=e.target).params.tiles
        want = e.run(kern, **given)[out].numpy().astype(np.float64)
        configs = {pick.label: pick}
        for cfg in candidates:
            try:
                got = e.run(kern, tiles=cfg, **given)[out].numpy()
            except ValueError:           # tiles this device or product cannot take
                continue
            err = float(np.abs(got - want).max() / max(np.abs(want).max(), 1e-30))
            if err > WRONG:
                print(f"  WRONG {name} {m}x{n}x{k} {cfg.label} err {err:.3g}", flush=True)
                continue
            configs[cfg.label] = cfg
        best = {label: float("inf") for label in configs}
        for _ in range(rounds):
            for label, cfg in configs.items():
                t = sum(s for _, s in time_dispatches(e, lambda: e.run(kern, tiles=cfg, **given), 20))
                best[label] = min(best[label], t)
        tflops = {label: 2.0 * m * n * k / s * 1e-12 for label, s in best.items()}
        other = max((label for label in configs if label != pick.label), key=tflops.get, default=pick.label)
        rows.append((name, f"{m}x{n}x{k}", pick.label, tflops[pick.label], other, tflops[other]))
        print(f"{name:4s} {m}x{n}x{k}: " + ", ".join(f"{label} {tf:.1f}" for label, tf in tflops.items()), flush=True)
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--rows", type=int, nargs="+", default=[512, 2048, 4096], help="T of the shapes")
    ap.add_argument("--quick", action="store_true", help="two small shapes (a check that it runs)")
    args = ap.parse_args()
    e = ComputeEngine(WgpuContext.create(), timing=True)
    rng = np.random.default_rng(0)
    shapes = ([(64, 96, 80), (128, 64, 128)] if args.quick else
              [(t, n, k) for t in args.rows for n, k in ((1024, 1024), (3072, 1024), (4608, 1024), (1024, 4608))])
    rows = [r for m, n, k in shapes for r in one_shape(e, rng, m, n, k, K_GROUPS, args.rounds)]
    print(f"\n{'product':7s} {'shape':16s} {'planner':36s} {'TFLOP/s':>7s}  {'best other':36s} {'TFLOP/s':>7s}  ratio")
    for name, shape, pick, pick_tf, other, other_tf in rows:
        print(f"{name:7s} {shape:16s} {pick:36s} {pick_tf:7.1f}  {other:36s} {other_tf:7.1f}  {other_tf / pick_tf:4.2f}x")


if __name__ == "__main__":
    main()
