"""Per product and shape of a bench JSON's mtiles lines: the planner's tiles and the fastest
candidate, with how much faster it ran.
Usage: python benches/probes/best_tiles.py RESULT.json"""
from __future__ import annotations

import json
import sys


def table(path: str) -> list[tuple[str, str, str, float, str, float]]:
    """(product, shape, planner's label, its TFLOP/s, fastest label, its TFLOP/s) per product and shape."""
    lines = [x for x in json.load(open(path))["lines"] if x["group"] == "mtiles" and x.get("tflops")]
    rows = {}
    for x in lines:
        product, label = x["name"].split("[", 1)
        key = (product, x["shape"])
        pick, best = rows.get(key, (None, None))
        if x["extra"].get("default"):
            pick = (label[:-1], x["tflops"])
        if best is None or x["tflops"] > best[1]:
            best = (label[:-1], x["tflops"])
        rows[key] = (pick, best)
    return [(p, s, *(pick or ("?", float("nan"))), *best) for (p, s), (pick, best) in sorted(rows.items())]


if __name__ == "__main__":
    print(f"{'product':8s} {'shape':16s} {'planner':38s} {'TFLOP/s':>8s}  {'fastest':38s} {'TFLOP/s':>8s}  gain")
    for product, shape, pick, pick_tf, best, best_tf in table(sys.argv[1]):
        print(f"{product:8s} {shape:16s} {pick:38s} {pick_tf:8.1f}  {best:38s} {best_tf:8.1f}  {best_tf / pick_tf:4.2f}x")
