"""Cold and warm start-up: seconds from starting a fresh process to its first finished train step.

    python benches/startup.py [--preset 350M] [--shape 8x512] [--f16] [--json PATH] [--cache-dir DIR]

Runs the same step twice, each in a new process with LFM2JIT_CACHE_DIR set to one directory (a
fresh private temporary one unless --cache-dir): cold (the directory empty) and warm (holding what
the cold run left). Each line gives the time to the first finished step (spawn to the step's
synchronize: imports, device, the model (its weights drawn on the GPU), compiles, the step) and what the process compiled:
pipelines made (engine misses), WGSL rendered (misses less disk hits), driver cache entries written
(with Mesa's cache, each a driver compile its cache did not answer; NVIDIA's keeps a few large files).
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def child(args) -> None:
    """One fresh process: a model, one train window, its counts as a JSON line on stdout."""
    from lfm2jit import ComputeEngine, WgpuContext
    from lfm2jit.model import Lfm2Config, Lfm2Model
    from lfm2jit.runtime import driver_cache
    from lfm2jit.settings import settings

    drivers = settings().cache_dir / driver_cache.SUBDIR
    before = driver_cache.snapshot(drivers)
    imported = time.time()
    ctx = WgpuContext.create()
    engine = ComputeEngine(ctx)
    device = time.time()
    cfg = Lfm2Config.preset(args.preset)
    model = Lfm2Model(cfg, ctx, engine, seed=0, activation_dtype="f16" if args.f16 else "f32")
    engine.synchronize()
    ready = time.time()
    stats = train_window(model, args.shape, args.f16)
    done = time.time()
    print(json.dumps({"done": done, "imported": imported, "device_and_model_s": ready - imported,
                      "device_s": device - imported, "model_s": ready - device,
                      "step_s": done - ready, "loss": stats[-1].loss, "adapter": ctx.name,
                      "compile_threads": ctx.compile_threads,
                      "dawn_blobs": ctx.binaries.cache.stats.as_dict() if ctx.binaries is not None else None,
                      "webgpu": ctx.implementation, "pipelines": engine.stats.misses,
                      "wgsl_rendered": engine.stats.misses - engine.stats.disk_hits,
                      "compile_s": engine.stats.compile_seconds,
                      "driver_entries_written": driver_cache.written_since(before, driver_cache.snapshot(drivers))}))


def train_window(model, shape: tuple[int, int], f16: bool) -> list:
    """One window of ``shape`` (sequences x length) of random tokens trained as the trainer does
    (AdamW, clipping, the loss scaler with ``f16``), finished; its step stats."""
    import numpy as np

    from trainer import AdamW, GradScaler, Trainer

    batch, t = shape
    tr = Trainer(model, AdamW(lr=1e-4), model.ctx, model.engine).with_grad_accum_steps(batch).with_length_bucket(64)
    tr.with_clip_grad_norm(1.0)
    if f16:
        tr.with_grad_scaler(GradScaler())
    rng = np.random.default_rng(0)
    seqs = [(ids[:-1], ids[1:], np.ones(t, np.float32)) for ids in (rng.integers(0, model.cfg.vocab_size, t + 1)
                                                                   for _ in range(batch))]
    stats = tr.train_sequences(seqs, model.parameters())
    model.engine.synchronize()
    return stats


def fresh_process(argv: list[str], cache_dir: Path) -> dict:
    """Run this script's child in a new process with ``cache_dir`` as LFM2JIT_CACHE_DIR."""
    env = {**os.environ, "LFM2JIT_CACHE_DIR": str(cache_dir),
           "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    for name in ("MESA_SHADER_CACHE_DIR", "__GL_SHADER_DISK_CACHE_PATH"):
        env.pop(name, None)          # the drivers' caches go under cache_dir, as lfm2jit sets them
    spawned = time.time()
    done = subprocess.run([sys.executable, __file__, "--child", *argv], env=env, cwd=ROOT, capture_output=True,
                          text=True)
    if done.returncode != 0:
        sys.exit(f"the {cache_dir} run failed:\n{done.stderr[-4000:]}")
    line = json.loads(done.stdout.strip().splitlines()[-1])
    line["first_step_s"] = line.pop("done") - spawned
    line["import_s"] = line.pop("imported") - spawned
    return line


def shape(text: str) -> tuple[int, int]:
    batch, _, t = text.partition("x")
    if not (batch.isdigit() and t.isdigit() and int(batch) > 0 and int(t) > 1):
        raise argparse.ArgumentTypeError(f"expected BxT such as 8x512, got {text!r}")
    return int(batch), int(t)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--preset", default="tiny", help="Lfm2Config preset (default tiny; 350M on a GPU)")
    ap.add_argument("--shape", type=shape, default=(1, 64), metavar="BxT", help="sequences x length (default 1x64)")
    ap.add_argument("--f16", action="store_true", help="f16 activations (mixed precision)")
    ap.add_argument("--json", metavar="PATH", help="also write both lines as JSON")
    ap.add_argument("--cache-dir", type=Path, metavar="DIR", help="keep the cache here (default: a temporary "
                    "directory, removed after); it must be empty for the cold run to be cold")
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        return child(args)
    argv = ["--preset", args.preset, "--shape", "x".join(map(str, args.shape))] + (["--f16"] if args.f16 else [])
    cache = args.cache_dir or Path(tempfile.mkdtemp(prefix="lfm2jit-startup-"))
    cache.mkdir(mode=0o700, parents=True, exist_ok=True)
    if any(cache.iterdir()):
        sys.exit(f"--cache-dir {cache} is not empty: the cold run needs an empty cache")
    try:
        lines = {"cold": fresh_process(argv, cache), "warm": fresh_process(argv, cache)}
    finally:
        if args.cache_dir is None:
            shutil.rmtree(cache, ignore_errors=True)
    for name, x in lines.items():
        print(f"{name}: first step after {x['first_step_s']:.2f}s (import {x['import_s']:.2f}s, device "
              f"{x['device_s']:.2f}s, model {x['model_s']:.2f}s, step {x['step_s']:.2f}s; compile {x['compile_s']:.2f}s): "
              f"{x['pipelines']} pipelines, {x['wgsl_rendered']} WGSL rendered, "
              f"{x['driver_entries_written']} driver cache files written"
              + (f", Dawn blobs {b['hits']} hit/{b['misses']} missed/{b['stores']} stored" if (b := x["dawn_blobs"]) else ""))
    print(f"# {lines['cold']['adapter']} ({lines['cold']['webgpu']}), {args.preset} {args.shape[0]}x{args.shape[1]}"
          + (" f16" if args.f16 else ""))
    if args.json:
        Path(args.json).write_text(json.dumps({"preset": args.preset, "shape": args.shape, "f16": args.f16, **lines},
                                              indent=1))


if __name__ == "__main__":
    main()
