"""Tune every matmul of LFM2-350M train steps and log what the autotuner measured, per kernel shape.

    LFM2JIT_AUTOTUNE=1 python benches/tune_log.py --json tune_log.json [--shapes 1x512 8x512 1x2048]

Runs one train window per shape with the autotuner on, recording for each tuned matmul the
kernel, its M x N x K, how each operand is read (vec4 along k or m, or scalar), the candidates'
seconds and the default tiles' seconds. This is what ``choose_tiles`` defaults are read from.
"""
from __future__ import annotations

import argparse
import json
from dataclasses import asdict

from lfm2jit import WgpuContext
from bench import train_bench
from lfm2jit.tune.autotune import Tuner
from lfm2jit.model.config import Lfm2Config
from lfm2jit.schedule.matmul import choose_tiles


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--json", required=True)
    ap.add_argument("--shapes", nargs="+", default=["1x512", "8x512", "1x2048"])
    ap.add_argument("--preset", default="350M", help="model preset (tiny runs on lavapipe)")
    args = ap.parse_args()
    log = []
    search = Tuner._search

    def logged(self, key, kernel, dims, bucket, accumulate, options):
        winner = search(self, key, kernel, dims, bucket, accumulate, options)
        spec = kernel.specialize(dims, bucket, accumulate)
        if spec.template == "matmul":
            p = spec.params
            sizes = dict(zip("mnk", (spec.sizes[a] for a in p.axes[:3])))
            log.append({"kernel": kernel.ir.name, "sizes": sizes, "a": p.a.vec, "b": p.b.vec,
                        "default": asdict(choose_tiles(sizes["m"], sizes["n"], sizes["k"])),
                        "winner": asdict(winner), "seconds": self.best[key]["seconds"]})
            with open(args.json, "w") as f:      # after every search: a run cut short keeps what it tuned
                json.dump(log, f, indent=1)
        return winner
    Tuner._search = logged
    ctx = WgpuContext.create()
    cfg = Lfm2Config.preset(args.preset)
    shapes = [tuple(int(v) for v in s.split("x")) for s in args.shapes]
    train_bench(ctx, cfg, shapes, steps=1, warmup=0, profile=False)
    for e in log:
        best = min(e["seconds"].values())
        default = e["seconds"][str(e["default"])]
        w = e["winner"]
        print(f"{e['kernel']:24s} {'x'.join(str(e['sizes'][x]) for x in 'mnk'):16s} a={e['a']} b={e['b']} "
              f"best {best * 1e3:7.3f} ms default {default * 1e3:7.3f} ms  winner {w['bm']}x{w['bn']}/bk{w['bk']}/"
              f"{w['tm']}x{w['tn']}{'/vec' if w['vec'] else ''}{'/split%d' % w['split'] if w['split'] > 1 else ''}"
              f"{'/double' if w['double'] else ''}")


if __name__ == "__main__":
    main()
