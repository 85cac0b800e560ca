"""Where a cold first train window's compile time goes, and which way of issuing its compiles is
fastest. First the window runs with its compiles made one at a time (synchronously, the driver's
shader cache off, an empty lfm2jit cache), each timed; the slowest are listed. Then each mode
compiles that window's shaders again in a fresh process with the driver's cache off:
  serial    one after another on one device
  async     all issued with create_compute_pipeline_async, then one wait (the runtime's way on Dawn,
            whose worker pool runs a few compiles at a time)
  threads   N Python threads making pipelines synchronously on one device (Dawn's device requested
            with implicit-device-synchronization, as its objects are not thread-safe otherwise)
  devices   N devices, one per thread, each compiling a share, with the driver's disk cache on (a
            fresh directory); then the first device makes them all as the runtime does, from that cache
Usage: python benches/probes/compile_times.py [--preset 350M] [--shape 8x512] [--f16] [--top 15]
           [--modes serial,async,threads,devices] [--threads 8]"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

# before lfm2jit and the driver read them: nothing answered from a cache
os.environ.setdefault("LFM2JIT_CACHE_DIR", tempfile.mkdtemp(prefix="lfm2jit-compile-times-"))
os.environ.setdefault("__GL_SHADER_DISK_CACHE", "0")
os.environ.setdefault("MESA_SHADER_CACHE_DISABLE", "true")

from lfm2jit import ComputeEngine, WgpuContext  # noqa: E402
from lfm2jit.runtime import implementations  # noqa: E402
from lfm2jit.runtime.recorder import Shader  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from startup import train_window  # noqa: E402

SYNC_FEATURE = "implicit-device-synchronization"


def first_window(args) -> list[Shader]:
    """Run one train window with every compile made alone and timed; print the slowest; its shaders."""
    from lfm2jit.model import Lfm2Config, Lfm2Model

    ctx = WgpuContext.create()
    ctx.compiles_async = False          # one at a time, so each compile's time is its own
    engine = ComputeEngine(ctx)
    times: list[tuple[float, Shader]] = []
    build = engine.build

    def timed_build(shader):
        start = time.perf_counter()
        compiled = build(shader)
        times.append((time.perf_counter() - start, shader))
        return compiled

    engine.build = timed_build
    model = Lfm2Model(Lfm2Config.preset(args.preset), ctx, engine, seed=0,
                      activation_dtype="f16" if args.f16 else "f32")
    train_window(model, tuple(map(int, args.shape.split("x"))), args.f16)
    total = sum(s for s, _ in times)
    print(f"{'seconds':>8}  {'share':>6}  {'WGSL chars':>10}  kernel")
    for seconds, shader in sorted(times, key=lambda x: -x[0])[:args.top]:
        print(f"{seconds:8.3f}  {seconds / total:6.1%}  {len(shader.wgsl):10d}  {shader.label}")
    print(f"# {len(times)} pipelines one at a time: {total:.2f} s in all, {ctx.name}, {args.preset} {args.shape}"
          + (" f16" if args.f16 else ""))
    return [shader for _, shader in times]


def with_sync_feature() -> None:
    """Dawn's devices requested with implicit-device-synchronization where the adapter has it."""
    dawn = implementations.IMPLEMENTATIONS["dawn"]
    request = dawn.request_device
    dawn.request_device = lambda adapter, features, limits, *rest: request(
        adapter, features | ({SYNC_FEATURE} & set(adapter.features)), limits, *rest)


def engine_for(serial: bool) -> ComputeEngine:
    ctx = WgpuContext.create()
    if serial:
        ctx.compiles_async = False
    return ComputeEngine(ctx)


def compile_all(engine: ComputeEngine, shaders: list[Shader], threads: int = 1) -> None:
    if threads > 1:
        with ThreadPoolExecutor(threads) as pool:
            list(pool.map(engine.build, shaders))
    else:
        for shader in shaders:
            engine.build(shader)
    engine._wait_for_compiles()


def run_mode(mode: str, shaders: list[Shader], threads: int) -> dict:
    """One mode in this (fresh) process: seconds from the first compile issued to the last finished."""
    if mode in ("threads", "devices"):
        with_sync_feature()
    engines = [engine_for(serial=mode != "async") for _ in range(threads if mode == "devices" else 1)]
    start = time.perf_counter()
    if mode == "devices":
        shares = [shaders[i::threads] for i in range(threads)]
        with ThreadPoolExecutor(threads) as pool:
            list(pool.map(compile_all, engines, shares))
        helpers = time.perf_counter() - start
        main = engine_for(serial=False)
        main_start = time.perf_counter()
        compile_all(main, shaders)
        return {"mode": mode, "seconds": time.perf_counter() - start, "helpers_s": helpers,
                "from_cache_s": time.perf_counter() - main_start}
    compile_all(engines[0], shaders, threads if mode == "threads" else 1)
    return {"mode": mode, "seconds": time.perf_counter() - start,
            "sync_feature": SYNC_FEATURE in engines[0].ctx.features}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--preset", default="tiny")
    ap.add_argument("--shape", default="1x64", metavar="BxT")
    ap.add_argument("--f16", action="store_true")
    ap.add_argument("--top", type=int, default=15)
    ap.add_argument("--modes", default="serial,async,threads,devices")
    ap.add_argument("--threads", type=int, default=8)
    ap.add_argument("--child", metavar="JSON", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        shaders = [Shader(d["label"], d["key"], d["wgsl"], tuple(map(tuple, d["bindings"])),
                          tuple((n, tuple(g) if isinstance(g, list) else g) for n, g in d["entry_points"]))
                   for d in json.loads(Path(args.child).read_text())]
        print(json.dumps(run_mode(args.modes, shaders, args.threads)))
        return
    shaders = first_window(args)
    listing = Path(tempfile.mkdtemp(prefix="lfm2jit-shaders-")) / "shaders.json"
    listing.write_text(json.dumps([{"label": s.label, "key": s.key, "wgsl": s.wgsl, "bindings": s.bindings,
                                    "entry_points": s.entry_points} for s in shaders]))
    for mode in args.modes.split(","):
        env = {**os.environ, "LFM2JIT_CACHE_DIR": tempfile.mkdtemp(prefix="lfm2jit-compile-times-")}
        if mode == "devices":       # the helpers leave their binaries in the driver's cache for the main device
            env.update(__GL_SHADER_DISK_CACHE="1", MESA_SHADER_CACHE_DISABLE="false")
        done = subprocess.run([sys.executable, __file__, "--child", str(listing), "--modes", mode,
                               "--threads", str(args.threads)], env=env, capture_output=True, text=True)
        if done.returncode != 0:
            print(f"{mode:>8}: failed: {done.stderr.strip().splitlines()[-1:]}")
            continue
        line = json.loads(done.stdout.strip().splitlines()[-1])
        extra = "".join(f", {k} {v:.2f} s" if isinstance(v, float) else f", {k} {v}" for k, v in line.items()
                        if k not in ("mode", "seconds"))
        print(f"{mode:>8}: {len(shaders)} pipelines in {line['seconds']:.2f} s{extra}")


if __name__ == "__main__":
    main()
