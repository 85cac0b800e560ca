"""Tune every matmul of LFM2-350M train steps and log what the autotuner measured, per kernel shape.

    LFM2JIT_AUTOTUNE=1 python benches/probes/tune_log.py --json tune_log.json [--shapes 1x512 8x512 1x2048] [--f16]

Runs one train window per shape with the autotuner on, recording for each tuned matmul the
kernel, its template (``matmul``, SIMT; ``matmul_matrix``, the matrix units: ``--f16`` on a device
with f16 subgroup matrices), its M x N x K, how each operand is read (vec4 along k or m, or
scalar), the candidates' seconds and the default tiles' seconds. This is what ``choose_tiles``
and ``choose_matrix_tiles`` defaults are read from.
"""
from __future__ import annotations

import argparse
import json
import sys
from dataclasses import asdict

from lfm2jit import WgpuContext

sys.path.insert(0, __file__.rsplit("/", 2)[0])   # benches/, where bench.py is
from bench import train_bench  # noqa: E402
from lfm2jit.tune.autotune import Tuner
from lfm2jit.model.config import Lfm2Config


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--json", required=True)
    ap.add_argument("--shapes", nargs="+", default=["1x512", "8x512", "1x2048"])
    ap.add_argument("--preset", default="350M", help="model preset (tiny runs on lavapipe)")
    ap.add_argument("--f16", action="store_true", help="train steps as --f16 runs them (f16 activations)")
    args = ap.parse_args()
    log = []
    search = Tuner._search

    def logged(self, key, kernel, dims, bucket, accumulate, options):
        winner = search(self, key, kernel, dims, bucket, accumulate, options)
        spec = kernel.specialize(dims, bucket, accumulate, None, self.engine.target)   # the pick the tuner replaces
        if spec.template in ("matmul", "matmul_matrix"):
            p = spec.params                       # untuned: the planner's default tiles
            sizes = dict(zip("mnk", (spec.sizes[a] for a in p.axes[:3])))
            log.append({"kernel": kernel.ir.name, "template": spec.template, "sizes": sizes, "a": p.a.vec,
                        "b": p.b.vec, "default": asdict(p.tiles), "default_label": p.tiles.label,
                        "winner": asdict(winner), "winner_label": winner.label,
                        "seconds": self.best[key]["seconds"]})
            with open(args.json, "w") as f:      # after every search: a run cut short keeps what it tuned
                json.dump(log, f, indent=1)
        return winner
    Tuner._search = logged
    ctx = WgpuContext.create()
    cfg = Lfm2Config.preset(args.preset)
    shapes = [tuple(int(v) for v in s.split("x")) for s in args.shapes]
    train_bench(ctx, cfg, shapes, steps=1, warmup=0, profile=False, activation_dtype="f16" if args.f16 else "f32")
    for e in log:
        best = min(e["seconds"].values())
        default = e["seconds"].get(str(e["default"]), float("nan"))   # the default may not be a candidate
        print(f"{e['kernel']:24s} {'x'.join(str(e['sizes'][x]) for x in 'mnk'):16s} a={e['a']} b={e['b']} "
              f"best {best * 1e3:7.3f} ms default {default * 1e3:7.3f} ms  winner {e['winner_label']} "
              f"(default {e['default_label']})")


if __name__ == "__main__":
    main()
