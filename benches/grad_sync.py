"""Gradient exchange per optimizer step under MPI data parallelism (trainer/mpi_sync.py):

    mpiexec -n 2 python benches/grad_sync.py [--preset 350M] [--shape 1x512] [--lora 8] [--steps 3] [--json PATH]

Each rank trains its share of the windows with Trainer.with_mpi_grad_sync; reported per step (rank
0, the steps after the first): the wait for the step's own GPU work to end (timed apart), the
GPU->host readback of the gradients (seconds and GB/s: the copies into the staging buffers and
their conversion), the time spent waiting for the exchanges (reduce-scatter + allgather) beyond
the readback they overlap, the write back, and the whole step. It needs two ranks or more (one
rank exchanges nothing).
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
    rows = []
    for step in range(a.steps + 1):
        before, bytes_before, t0 = dict(sync.seconds), sync.bytes, time.perf_counter()
        seqs = [(ids[:-1], ids[1:], np.ones(t, np.float32)) for ids in (rng.integers(0, cfg.vocab_size, t + 1)
                                                                        for _ in range(batch))]
        tr.train_sequences(seqs, params)
        engine.synchronize()
        row = {k: sync.seconds[k] - before[k] for k in sync.seconds}
        row.update(step_s=time.perf_counter() - t0, bytes=sync.bytes - bytes_before)
        if step:                                      # the first step compiles
            rows.append(row)
    mean = {k: float(np.mean([r[k] for r in rows])) for k in rows[0]}
    mean["readback_GBps"] = mean["bytes"] / mean["readback"] / 1e9 if mean["readback"] else None
    if sync.rank == 0:
        n = sum(p.size for p in params)
        print(f"{ctx.name}: {a.preset} {'LoRA r=%d' % a.lora if a.lora else 'full'}, {n / 1e6:.2f}M trained "
              f"parameters, {sync.world_size} rank(s), {a.shape} per rank")
        print(f"per step: waiting for the backward {1e3 * mean['backward_wait']:.1f} ms, "
              f"readback {1e3 * mean['readback']:.1f} ms ({mean['readback_GBps'] or 0:.2f} GB/s of "
              f"{mean['bytes'] / 1e6:.1f} MB), exchange wait {1e3 * mean['exchange_wait']:.1f} ms, write "
              f"{1e3 * mean['write']:.1f} ms, step {1e3 * mean['step_s']:.1f} ms")
        if a.json:
            Path(a.json).write_text(json.dumps({"argv": sys.argv, "adapter": ctx.name, "world": sync.world_size,
                                                "trained_params": n, "per_step": mean, "steps": rows}, indent=1))
    sync.finish()             # as the trainer's CLI ends a run: the ranks meet, the mapped staging is released
    return 0


if __name__ == "__main__":
    sys.exit(main())
