"""Which pipelines a cold first train window spends its compile time on: the window's compiles made
one at a time (synchronously, the driver's shader cache off, an empty lfm2jit cache), each timed,
the slowest listed with their WGSL size. The sum against benches/startup.py's cold compile (all of a
window's compiles issued at once) shows how much of the asynchronous compile runs in parallel.
Usage: python benches/probes/compile_times.py [--preset 350M] [--shape 8x512] [--f16] [--top 15]"""
from __future__ import annotations

import argparse
import os
import tempfile
import time

# before lfm2jit and the driver read them: nothing answered from a cache
os.environ["LFM2JIT_CACHE_DIR"] = tempfile.mkdtemp(prefix="lfm2jit-compile-times-")
os.environ["__GL_SHADER_DISK_CACHE"] = "0"
os.environ["MESA_SHADER_CACHE_DISABLE"] = "true"

import numpy as np  # noqa: E402

from lfm2jit import ComputeEngine, WgpuContext  # noqa: E402
from lfm2jit.model import Lfm2Config, Lfm2Model  # noqa: E402
from trainer import AdamW, GradScaler, Trainer  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--preset", default="tiny")
    ap.add_argument("--shape", default="1x64", metavar="BxT")
    ap.add_argument("--f16", action="store_true")
    ap.add_argument("--top", type=int, default=15)
    args = ap.parse_args()
    batch, t = map(int, args.shape.split("x"))
    ctx = WgpuContext.create()
    ctx.compiles_async = False          # one at a time, so each compile's time is its own
    engine = ComputeEngine(ctx)
    times: list[tuple[float, str, int]] = []
    build = engine.build

    def timed_build(shader):
        start = time.perf_counter()
        compiled = build(shader)
        times.append((time.perf_counter() - start, shader.label, len(shader.wgsl)))
        return compiled

    engine.build = timed_build
    cfg = Lfm2Config.preset(args.preset)
    model = Lfm2Model(cfg, ctx, engine, seed=0, activation_dtype="f16" if args.f16 else "f32")
    tr = Trainer(model, AdamW(lr=1e-4), ctx, engine).with_grad_accum_steps(batch).with_length_bucket(64)
    tr.with_clip_grad_norm(1.0)
    if args.f16:
        tr.with_grad_scaler(GradScaler())
    rng = np.random.default_rng(0)
    seqs = [(ids[:-1], ids[1:], np.ones(t, np.float32)) for ids in (rng.integers(0, cfg.vocab_size, t + 1)
                                                                   for _ in range(batch))]
    tr.train_sequences(seqs, model.parameters())
    engine.synchronize()
    total = sum(s for s, _, _ in times)
    print(f"{'seconds':>8}  {'share':>6}  {'WGSL chars':>10}  kernel")
    for seconds, label, chars in sorted(times, reverse=True)[:args.top]:
        print(f"{seconds:8.3f}  {seconds / total:6.1%}  {chars:10d}  {label}")
    print(f"# {len(times)} pipelines one at a time: {total:.2f} s in all, {ctx.name} ({ctx.implementation}), "
          f"{args.preset} {args.shape}" + (" f16" if args.f16 else ""))


if __name__ == "__main__":
    main()
