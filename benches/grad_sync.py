"""Gradient exchange per optimizer step under MPI data parallelism (trainer/mpi_sync.py):

    mpiexec -n 2 python benches/grad_sync.py [--preset 350M] [--shape 1x512] [--lora 8] [--steps 3]
        [--staging backward after] [--json PATH]

Each rank trains its share of the windows with Trainer.with_mpi_grad_sync, once per staging mode
in one process: "backward" (each bucket copied by the pass as soon as its backward has finished it,
then read and exchanged while the GPU runs the rest) and "after" (every bucket copied after the
whole pass). Reported per step (rank 0, the steps after each mode's first): the wait for the step's
own GPU work before the first read ("after": the whole pass; "backward": nothing where mapping a
buffer waits only for its own copies (Dawn), the reads wait for their buckets; the whole pass on
wgpu-native), the GPU->host readback of the gradients (seconds and GB/s: the copies into the
staging buffers and their conversion; "backward" includes waiting for the backward to reach each
bucket), the time spent waiting for the exchanges (reduce-scatter + allgather) beyond the readback
they overlap, the write back, and the whole step: the number to compare. It needs two ranks or
more (one rank exchanges nothing).
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--preset", default="350M")
    ap.add_argument("--shape", default="1x512", help="BxT per rank and step")
    ap.add_argument("--lora", type=int, metavar="R", help="train LoRA adapters of rank R only")
    ap.add_argument("--steps", type=int, default=3, help="timed steps after the first (at least 1)")
    ap.add_argument("--staging", nargs="+", choices=("backward", "after"), default=["backward", "after"])
    ap.add_argument("--json", metavar="PATH")
    a = ap.parse_args(argv)
    if a.steps < 1:
        ap.error(f"--steps must be at least 1 (the steps timed after the first), got {a.steps}")
    from lfm2jit import ComputeEngine, WgpuContext
    from lfm2jit.model import Lfm2Config, Lfm2Model, LoraConfig
    from trainer import AdamW, Trainer
    ctx = WgpuContext.create()
    engine = ComputeEngine(ctx)
    cfg = Lfm2Config.preset(a.preset)
    model = Lfm2Model(cfg, ctx, engine, seed=0)
    params = model.add_lora(LoraConfig(r=a.lora, alpha=2.0 * a.lora)) if a.lora else model.parameters()
    batch, t = (int(x) for x in a.shape.lower().split("x"))
    tr = Trainer(model, AdamW(lr=1e-4), ctx, engine).with_grad_accum_steps(batch).with_length_bucket(64)
    tr.with_mpi_grad_sync(timeout_s=600)
    sync = tr.distributed_grad_sync
    rng = np.random.default_rng(sync.rank)
    modes = {}
    for mode in a.staging:
        sync.stage_in_backward = mode == "backward"
        rows = []
        for step in range(a.steps + 1):
            before, bytes_before, t0 = dict(sync.seconds), sync.bytes, time.perf_counter()
            seqs = [(ids[:-1], ids[1:], np.ones(t, np.float32)) for ids in (rng.integers(0, cfg.vocab_size, t + 1)
                                                                            for _ in range(batch))]
            tr.train_sequences(seqs, params)
            engine.synchronize()
            row = {k: sync.seconds[k] - before[k] for k in sync.seconds}
            row.update(step_s=time.perf_counter() - t0, bytes=sync.bytes - bytes_before)
            if step:                                  # the mode's first step compiles or records anew
                rows.append(row)
        mean = {k: float(np.mean([r[k] for r in rows])) for k in rows[0]}
        mean["readback_GBps"] = mean["bytes"] / mean["readback"] / 1e9 if mean["readback"] else None
        modes[mode] = {"per_step": mean, "steps": rows}
    if sync.rank == 0:
        n = sum(p.size for p in params)
        print(f"{ctx.name}: {a.preset} {'LoRA r=%d' % a.lora if a.lora else 'full'}, {n / 1e6:.2f}M trained "
              f"parameters, {sync.world_size} rank(s), {a.shape} per rank")
        for mode, m in modes.items():
            mean = m["per_step"]
            print(f"staging {mode:8s} per step: waiting for the GPU {1e3 * mean['backward_wait']:.1f} ms, "
                  f"readback {1e3 * mean['readback']:.1f} ms ({mean['readback_GBps'] or 0:.2f} GB/s of "
                  f"{mean['bytes'] / 1e6:.1f} MB), exchange wait {1e3 * mean['exchange_wait']:.1f} ms, write "
                  f"{1e3 * mean['write']:.1f} ms, step {1e3 * mean['step_s']:.1f} ms")
        if len(modes) == 2:
            print(f"step time, staging in the backward / after the pass: "
                  f"{modes['backward']['per_step']['step_s'] / modes['after']['per_step']['step_s']:.3f}")
        if a.json:
            Path(a.json).write_text(json.dumps({"argv": sys.argv, "adapter": ctx.name, "world": sync.world_size,
                                                "trained_params": n, "modes": modes}, indent=1))
    sync.finish()             # as the trainer's CLI ends a run: the ranks meet, the mapped staging is released
    return 0


if __name__ == "__main__":
    sys.exit(main())
