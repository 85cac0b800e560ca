"""The MoE experts' grouped GEMMs over rows (forward and dX, f16 operands) at tile heights other than
the planner's, beside the dense GEMM of the same FLOPs: LFM2-8B-A1B's shapes, 2048 tokens routed at
random to 4 of 32 experts (8192 slots, about 256 an expert). An expert's last tile row is mostly
empty at 128 rows; shorter tiles waste fewer rows and stage more often. Each candidate's result is
checked against the planner's (tile_sweep.py). The forward also runs with every slot one expert's: the
grouped kernel's own cost beside the dense GEMM's, without 32 experts' weights to stream; and each
product at the planner's tiles with an f16 output (as --f16 trains). Then gate_up's
dW with the slots split evenly over 1, 4 and 32 experts, its output f32 and f16; last, each dW at
other tiles (a workgroup per tile and expert).
Usage: python benches/probes/grouped_tiles.py [--quick] [--dw: the dW tiles only]"""
from __future__ import annotations

import sys
from dataclasses import replace

import numpy as np

from lfm2jit import ComputeEngine, WgpuContext, grad, library
from lfm2jit.model.moe_config import Lfm2MoeConfig
from lfm2jit.tune.tiles import MatrixTiles

from tile_sweep import sweep

TILES = (MatrixTiles(96, 128, 2, 2, 32), MatrixTiles(96, 128, 2, 4, 32), MatrixTiles(64, 128, 2, 2, 32),
         MatrixTiles(64, 256, 2, 4, 32), MatrixTiles(96, 256, 2, 4, 32), MatrixTiles(128, 128, 2, 4, 32),
         MatrixTiles(96, 128, 2, 2, 64))
DW_TILES = (MatrixTiles(128, 128, 2, 2, 32), MatrixTiles(128, 128, 2, 4, 32), MatrixTiles(128, 128, 2, 2, 64),
            MatrixTiles(128, 128, 2, 2, 32, stages=2), MatrixTiles(64, 128, 2, 2, 32), MatrixTiles(128, 64, 2, 2, 32),
            MatrixTiles(64, 64, 2, 2, 32), MatrixTiles(128, 256, 2, 4, 32), MatrixTiles(256, 128, 4, 2, 32),
            MatrixTiles(128, 128, 2, 2, 32, sg_k=2), MatrixTiles(128, 128, 2, 2, 64, sg_k=2, prefetch=False),
            MatrixTiles(64, 128, 2, 2, 32, sg_k=2))
DW_TILES = tuple(replace(t, group=1) for t in DW_TILES)      # no bands over the experts' matrices (the planner's rule)


def main(quick: bool, dw_only: bool) -> None:
    e = ComputeEngine(WgpuContext.create(), timing=True)
    rng = np.random.default_rng(0)
    cfg = Lfm2MoeConfig.preset("8B-A1B")
    experts, top_k, d, width, t = ((4, 2, 64, 48, 64) if quick else
                                   (cfg.num_experts, cfg.num_experts_per_tok, cfg.hidden_size,
                                    cfg.moe_intermediate_size, 2048))
    slots = t * top_k
    picks = np.argsort(rng.random((t, experts)), axis=1)[:, :top_k]
    ends = e.tensor(np.cumsum(np.bincount(picks.ravel(), minlength=experts)).astype(np.int32))
    shapes = (("gate_up", 2 * width, d), ("down", d, width))
    rows = [] if dw_only else over_rows(e, rng, shapes, ends, experts, slots)
    if not dw_only:
        dw_over_experts(e, rng, shapes[0], slots, experts)
    rows += dw_tiles(e, rng, shapes, ends, slots)
    print(f"\n{'projection':10s} {'product':7s} {'planner/dense':>13s}  best tiles (over dense)")
    for proj, product, planner, best, ratio in rows:
        print(f"{proj:10s} {product:7s} {planner:13.2f}  {best} ({ratio:.2f}x)")


def over_rows(e, rng, shapes, ends, experts: int, slots: int) -> list:
    """The forward and dX at TILES beside the dense GEMM; one expert's; an f16 output."""
    gmm, lin = library.get("expert_gate_up"), library.get("linear").without({"r"})
    rows = []
    for proj, n, k in shapes:
        x, dy = (e.tensor(rng.standard_normal((slots, c), dtype=np.float32), "f16") for c in (k, n))
        w, w1 = (e.tensor((rng.standard_normal(s) * 0.02).astype(np.float32), "f16") for s in ((experts, n, k), (n, k)))
        w1_3d = e.tensor((rng.standard_normal((1, n, k)) * 0.02).astype(np.float32), "f16")
        for product, grouped, dense in (
                ("fwd", (gmm, {"x": x, "gate_up": w, "ends": ends}, "h"), (lin, {"x": x, "w": w1}, "y")),
                ("dx", (grad(gmm, ["x"]), {"gate_up": w, "d_h": dy, "ends": ends}, "d_x"),
                 (grad(lin, ["x"]), {"w": w1, "d_y": dy}, "d_x"))):
            (gk, gargs, gout), (dk, dargs, dout) = grouped, dense
            dense_s = sweep(e, dk, {**dargs, "f16": tuple(n_ for n_ in dargs)}, dout, (), f"dense {product}")["planner"]
            times = sweep(e, gk, {**gargs, "f16": tuple(n_ for n_ in gargs if n_ != "ends")}, gout, TILES, f"{proj} {product}")
            if product == "fwd":   # all slots one expert: the grouped kernel's own cost, without 32 weights to stream
                one = {**gargs, "gate_up": w1_3d, "ends": e.tensor(np.array([slots], np.int32))}
                times["one expert"] = sweep(e, gk, {**one, "f16": ("x", "gate_up")}, gout, (), "one expert")["planner"]
            # the output f16 too, as --f16 trains: stored through workgroup memory, not from the fragments
            times["f16 output"] = sweep(e, gk, {**gargs, "f16": tuple(n_ for n_ in gargs if n_ != "ends") + (gout,)},
                                        gout, (), "f16 output")["planner"]
            for label, s in times.items():
                print(f"{proj:8s} {product:4s} {label:34s} {s * 1e3:7.3f} ms  over dense {s / dense_s:5.2f}x", flush=True)
            best = min((t for t in times if t not in ("one expert", "f16 output")), key=times.get)
            rows.append((proj, product, times["planner"] / dense_s, best, times[best] / dense_s))
    return rows


def _dense_dw(e, x, dy) -> float:
    lin_dw = grad(library.get("linear").without({"r"}), ["w"])
    return sweep(e, lin_dw, {"x": x, "d_y": dy, "f16": ("x", "d_y")}, "d_w", (), "dense dw")["planner"]


def dw_over_experts(e, rng, shape, slots: int, experts: int) -> None:
    """gate_up's dW with the same slots split evenly over 1, 4 and all experts (that many times the
    outputs), each output f32 and f16: how much of its time is its short sums and its [E, N, K] output."""
    _, n, k = shape
    x, dy = (e.tensor(rng.standard_normal((slots, c), dtype=np.float32), "f16") for c in (k, n))
    dense_s = _dense_dw(e, x, dy)
    dw_k = grad(library.get("expert_gate_up"), ["gate_up"])
    for count in dict.fromkeys((1, 4, experts)):
        split = e.tensor(np.cumsum(np.full(count, slots // count)).astype(np.int32))
        for out in ("f32", "f16"):
            f16 = ("x", "d_h") + (("d_gate_up",) if out == "f16" else ())
            s = sweep(e, dw_k, {"x": x, "d_h": dy, "ends": split, "f16": f16}, "d_gate_up", (), "grouped dw")["planner"]
            print(f"gate_up  dw   {count:3d} experts, {out} output     {s * 1e3:7.3f} ms  over dense {s / dense_s:5.2f}x",
                  flush=True)


def dw_tiles(e, rng, shapes, ends, slots: int) -> list:
    """Each dW (a workgroup per tile and expert) at DW_TILES: smaller ones overlap more stores with sums."""
    dw_k = grad(library.get("expert_gate_up"), ["gate_up"])
    rows = []
    for proj, n, k in shapes:
        x, dy = (e.tensor(rng.standard_normal((slots, c), dtype=np.float32), "f16") for c in (k, n))
        dense_s = _dense_dw(e, x, dy)
        times = sweep(e, dw_k, {"x": x, "d_h": dy, "ends": ends, "f16": ("x", "d_h")}, "d_gate_up", DW_TILES, f"{proj} dw")
        for label, s in times.items():
            print(f"{proj:8s} dw   {label:34s} {s * 1e3:7.3f} ms  over dense {s / dense_s:5.2f}x", flush=True)
        best = min(times, key=times.get)
        rows.append((proj, "dw", times["planner"] / dense_s, best, times[best] / dense_s))
    return rows


if __name__ == "__main__":
    main("--quick" in sys.argv[1:], "--dw" in sys.argv[1:])
