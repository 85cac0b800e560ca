"""Train the same LFM2-350M-shaped model with lfm2jit and with PyTorch + transformers, in one run.

    python benches/side_by_side.py [--quick] [--f16] [--steps N] [--json PATH] [--shapes 1x512 8x512 1x2048]

Both sides: random init, fp32 (PyTorch with TF32 off for matmuls and cuDNN), AdamW(lr=1e-4,
weight_decay=0.01), gradient clipping at 1.0, random token ids, a loss read back every sequence,
one optimizer step per window. A shape BxT is B sequences of T tokens per optimizer step: lfm2jit
runs them with grad_accum_steps=B through Trainer.train_sequences, which packs them into passes of
up to 4096 rows (8x512 is one pass); PyTorch runs them as one [B, T] batch.

With --f16 both sides run mixed precision: lfm2jit with f16 activations (``--f16``), PyTorch
under ``torch.autocast(float16)``; both with a dynamic loss scaler.

Reported per shape: tokens/s (median window after warm-up), peak memory and the ratios.
lfm2jit's peak = the buffer pool's peak bytes in use (activations, gradients, AdamW moments and
temporaries) + the parameters; PyTorch's = torch.cuda.max_memory_allocated (parameters,
gradients, AdamW state, activations). Also lfm2jit's first-window compile time and that its second
window compiles nothing. Without torch+CUDA only the lfm2jit side runs (``--torch-device cpu``
exercises the PyTorch path on the CPU, for testing the script).
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from dataclasses import asdict
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))   # lfm2jit from this checkout
sys.path.insert(0, str(Path(__file__).resolve().parent))       # bench.py beside this script

import numpy as np  # noqa: E402

GiB = float(1 << 30)


def parse_shape(s: str) -> tuple[int, int]:
    b, t = s.lower().split("x")
    return int(b), int(t)


def torch_available(device: str):
    try:
        import torch
    except ImportError:
        return None, "torch is not importable"
    if device == "cuda" and not torch.cuda.is_available():
        return None, "torch has no CUDA device"
    try:
        import transformers  # noqa: F401
    except ImportError:
        return None, "transformers is not importable"
    return torch, None


def run_torch(torch, cfg, shapes, steps: int, warmup: int, device: str, seed: int = 0, log=print,
              f16: bool = False) -> tuple[list, dict]:
    import transformers
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    torch.set_float32_matmul_precision("highest")
    torch.manual_seed(seed)
    dev = torch.device(device)
    hf_cfg = transformers.Lfm2Config(**cfg.to_dict())
    t0 = time.perf_counter()
    with dev:
        model = transformers.Lfm2ForCausalLM(hf_cfg)
    model = model.to(dev, torch.float32).train()
    init_s = time.perf_counter() - t0
    params = [p for p in model.parameters() if p.requires_grad]
    n_params = sum(p.numel() for p in params)
    opt = torch.optim.AdamW(params, lr=1e-4, weight_decay=0.01)
    cuda = dev.type == "cuda"
    rng = np.random.default_rng(seed + 1)
    meta = {"torch": torch.__version__, "transformers": transformers.__version__, "n_params": n_params,
            "attn_implementation": getattr(model.config, "_attn_implementation", None), "init_s": init_s,
            "tf32_matmul": torch.backends.cuda.matmul.allow_tf32, "tf32_cudnn": torch.backends.cudnn.allow_tf32,
            "device_name": torch.cuda.get_device_name() if cuda else "cpu", "autocast_f16": f16}
    scaler = torch.amp.GradScaler(dev.type, enabled=f16)
    log(f"# torch {torch.__version__}, transformers {transformers.__version__}, {n_params / 1e6:.1f}M parameters, "
        f"attention {meta['attn_implementation']}, init {init_s:.1f}s")

    def sync():
        if cuda:
            torch.cuda.synchronize()

    results = []
    for batch, t in shapes:
        def window():
            ids = torch.from_numpy(rng.integers(0, cfg.vocab_size, (batch, t + 1))).to(dev)
            with torch.autocast(dev.type, dtype=torch.float16, enabled=f16):
                logits = model(input_ids=ids[:, :-1]).logits
            loss = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(),
                                                     ids[:, 1:].reshape(-1))
            scaler.scale(loss).backward()
            value = loss.item()
            scaler.unscale_(opt)
            torch.nn.utils.clip_grad_norm_(params, 1.0)
            scaler.step(opt)
            scaler.update()
            opt.zero_grad(set_to_none=True)
            return value

        try:
            if cuda:
                torch.cuda.reset_peak_memory_stats()
            t_a = time.perf_counter()
            first_loss = window()
            sync()
            first_s = time.perf_counter() - t_a
            for _ in range(warmup):
                window()
            sync()
            walls = []
            for _ in range(steps):
                t_a = time.perf_counter()
                last_loss = window()
                sync()
                walls.append(time.perf_counter() - t_a)
            wall = statistics.median(walls)
            r = {"shape": f"{batch}x{t}", "tokens": batch * t, "tokens_per_s": batch * t / wall, "window_s": wall,
                 "window_walls_s": walls, "first_window_s": first_s,
                 "peak_bytes": torch.cuda.max_memory_allocated() if cuda else None,
                 "reserved_bytes": torch.cuda.max_memory_reserved() if cuda else None,
                 "losses_first_last": [first_loss, last_loss]}
        except Exception as e:   # noqa: BLE001
            r = {"shape": f"{batch}x{t}", "error": f"{type(e).__name__}: {e}"[:300]}
        log(f"torch     {r['shape']:8s} " + (f"{r['tokens_per_s']:9.0f} tok/s  window {r['window_s'] * 1e3:8.1f} ms  "
                                           f"peak {(r['peak_bytes'] or 0) / GiB:6.2f} GiB" if "error" not in r
                                           else f"ERROR {r['error']}"))
        results.append(r)
    del model, opt, params
    if cuda:
        torch.cuda.empty_cache()
    return results, meta


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="the tiny preset and short sequences (runs on lavapipe)")
    ap.add_argument("--shapes", nargs="+", default=None, help="BxT shapes (default 1x512 8x512 1x2048)")
    ap.add_argument("--steps", type=int, default=3, help="timed windows per shape")
    ap.add_argument("--warmup", type=int, default=1, help="windows after the first before timing")
    ap.add_argument("--json", metavar="PATH")
    ap.add_argument("--torch-device", default="cuda", help="cuda (default) or cpu (to test this script)")
    ap.add_argument("--f16", action="store_true", help="mixed precision on both sides (see above)")
    ap.add_argument("--replay", type=int, metavar="N", default=None,
                    help="lfm2jit: Trainer.with_replay(N); 0 runs every step's Python (default: the trainer's)")
    ap.add_argument("--recompute-mlp", action="store_true",
                    help="lfm2jit: backward recomputes the MLP's up-projections (less memory, more matmuls)")
    ap.add_argument("--skip-torch", action="store_true")
    ap.add_argument("--skip-ours", action="store_true")
    args = ap.parse_args(argv)

    from lfm2jit import WgpuContext
    from bench import train_bench
    from lfm2jit.model.config import Lfm2Config
    cfg = Lfm2Config.preset("tiny" if args.quick else "350M")
    shapes = [parse_shape(s) for s in (args.shapes or (["1x64", "4x64", "1x128"] if args.quick
                                                       else ["1x512", "8x512", "1x2048"]))]
    torch, why = (None, "skipped") if args.skip_torch else torch_available(args.torch_device)
    doc: dict = {"argv": sys.argv[1:] if argv is None else list(argv), "shapes": [f"{b}x{t}" for b, t in shapes],
                 "config": cfg.to_dict(), "time": time.strftime("%Y-%m-%d %H:%M:%S %Z")}
    cuda = torch is not None and args.torch_device == "cuda"
    if cuda:
        torch.cuda.init()
        free0, total = torch.cuda.mem_get_info()

    ours, ours_meta = [], {}
    if not args.skip_ours:
        ctx = WgpuContext.create()
        print(f"# lfm2jit adapter: {ctx.name} ({ctx.implementation})", flush=True)
        probe = None
        if cuda:
            def probe():   # what the device really holds for lfm2jit (the pool keeps freed buffers), model alive
                free1, _ = torch.cuda.mem_get_info()
                return {"device_used_bytes": free0 - free1}
        ours, ours_meta = train_bench(ctx, cfg, shapes, steps=args.steps, warmup=args.warmup,
                                      log=lambda s: print(s, flush=True), probe=probe, replay=args.replay,
                                      recompute_mlp=args.recompute_mlp,
                                      activation_dtype="f16" if args.f16 else "f32")
    doc["lfm2jit"] = {"meta": ours_meta, "lines": [asdict(l) for l in ours]}

    theirs, theirs_meta = [], {}
    if torch is not None:
        theirs, theirs_meta = run_torch(torch, cfg, shapes, args.steps, args.warmup, args.torch_device,
                                        log=lambda s: print(s, flush=True), f16=args.f16)
    else:
        print(f"# PyTorch side skipped: {why}")
    doc["torch"] = {"meta": theirs_meta, "results": theirs, "skipped": why if torch is None else None}

    # ---- the table ----
    rows = []
    by_shape = {r["shape"]: r for r in theirs}
    for line in ours:
        x = line.extra
        r = by_shape.get(line.shape, {})
        row = {"shape": line.shape}
        if not line.error:
            row.update(ours_tok_s=x["tokens_per_s"], ours_peak_gib=x["peak_bytes"] / GiB,
                       ours_first_s=x["first_window_s"], ours_compiles=x["first_window_compiles"],
                       ours_compile_s=x["first_window_compile_s"], second_compiles=x["second_window_compiles"],
                       gpu_busy=x.get("gpu_busy_fraction"), dispatches=x["dispatches_per_window"])
        if r and "error" not in r:
            row.update(torch_tok_s=r["tokens_per_s"],
                       torch_peak_gib=r["peak_bytes"] / GiB if r.get("peak_bytes") else None)
        if row.get("ours_tok_s") and row.get("torch_tok_s"):
            row["speed_ratio"] = row["ours_tok_s"] / row["torch_tok_s"]
        if row.get("ours_peak_gib") and row.get("torch_peak_gib"):
            row["memory_ratio"] = row["ours_peak_gib"] / row["torch_peak_gib"]
        rows.append(row)
    doc["table"] = rows

    def f(v, fmt):
        return format(v, fmt) if isinstance(v, (int, float)) and v is not None else "-"
    print("\nshape     lfm2jit tok/s  torch tok/s  ratio   lfm2jit GiB  torch GiB  ratio   first window "
          "(compiles, compile s)  2nd compiles  GPU busy")
    for row in rows:
        print(f"{row['shape']:9s} {f(row.get('ours_tok_s'), '13.0f')} {f(row.get('torch_tok_s'), '12.0f')} "
              f"{f(row.get('speed_ratio'), '6.2f')}x {f(row.get('ours_peak_gib'), '11.2f')} "
              f"{f(row.get('torch_peak_gib'), '10.2f')} {f(row.get('memory_ratio'), '6.2f')}x  "
              f"{f(row.get('ours_first_s'), '8.1f')}s ({row.get('ours_compiles', '-')}, "
              f"{f(row.get('ours_compile_s'), '.1f')}s)  {row.get('second_compiles', '-'):>12}  "
              f"{f(100 * row['gpu_busy'] if row.get('gpu_busy') else None, '5.0f')}%")
    if args.json:
        Path(args.json).write_text(json.dumps(doc, indent=1, default=str))
        print(f"# wrote {args.json}")
    return 0 if all("error" not in r for r in theirs) and not any(l.error for l in ours) else 1


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    sys.exit(main())
