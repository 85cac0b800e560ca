"""Train the same LFM2-shaped model with lfm2jit and with PyTorch + transformers, in one run.

    python benches/side_by_side.py [--quick] [--preset 350M] [--ours fp32 f16] [--torch fp32 bf16]
                                   [--torch-compile] [--lora R [--lora-f16-base | --base-dtype nf4]]
                                   [--steps N] [--json PATH] [--shapes 1x512 8x512 1x2048]

``--preset`` names a dense or an MoE preset (350M by default; "8B-A1B" runs transformers'
Lfm2MoeForCausalLM on the PyTorch side). ``--lora R`` trains LoRA adapters of rank R (alpha 2R) on
every decoder linear of a frozen base, PEFT's on the PyTorch side; with ``--lora-f16-base``
lfm2jit's base is f16 and the PyTorch bf16 and f16 sides hold theirs in that dtype, as a LoRA
recipe loads it; ``--base-dtype nf4|int8`` holds lfm2jit's base quantized (QLoRA), the PyTorch
half-precision sides' as with ``--lora-f16-base``.

Every side: random init (one seed), AdamW(lr=1e-4, weight_decay=0.01), gradient clipping at 1.0,
random token ids, a loss read back every sequence, one optimizer step per window. A shape BxT is B
sequences of T tokens per optimizer step: lfm2jit runs them with grad_accum_steps=B through
Trainer.train_sequences, which packs them into passes of up to 4096 rows (8x512 is one pass);
PyTorch runs them as one [B, T] batch.

Sides (``--ours`` and ``--torch`` list them; the defaults are what users run):
  lfm2jit fp32     f32 everywhere (SIMT matmuls)
  lfm2jit f16      ``--f16``: f16 activations, f32 master weights, a loss scaler; its matmuls run on
                   the matrix units where the device lists f16 subgroup matrices (Dawn)
  torch fp32       TF32 off for matmuls and cuDNN
  torch bf16       ``torch.autocast(bfloat16)`` (no loss scaler: bf16 has f32's range)
  torch f16        ``torch.autocast(float16)`` with a GradScaler
  torch bf16-compile   bf16 autocast on ``torch.compile(model)`` (``--torch-compile`` adds it)

Reported per shape: tokens/s (median window after warm-up) and peak memory of every side, and the
ratio of every lfm2jit side to every PyTorch side. lfm2jit's peak = the buffer pool's peak bytes in
use (activations, gradients, AdamW moments and temporaries) + the parameters; PyTorch's =
torch.cuda.max_memory_allocated. Also lfm2jit's first-window compile time and that its second window
compiles nothing. Without torch+CUDA only lfm2jit runs (``--torch-device cpu`` runs the PyTorch
sides on the CPU, for testing the script).
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


TORCH_SIDES = ("fp32", "bf16", "f16", "bf16-compile")
OUR_SIDES = ("fp32", "f16")


def run_torch(torch, cfg, shapes, steps: int, warmup: int, device: str, seed: int = 0, log=print,
              side: str = "fp32", lora=None, half_base: bool = False) -> tuple[list, dict]:
    """One PyTorch side (see TORCH_SIDES) over every shape, on a fresh model; with ``lora`` (a
    LoraConfig) PEFT's adapters alone are trained, on a base in the autocast dtype if ``half_base``."""
    import transformers
    autocast = {"fp32": None, "bf16": torch.bfloat16, "f16": torch.float16, "bf16-compile": torch.bfloat16}[side]
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    torch.set_float32_matmul_precision("highest")
    torch.manual_seed(seed)
    dev = torch.device(device)
    moe = hasattr(cfg, "num_experts")
    hf_cfg = (transformers.Lfm2MoeConfig if moe else transformers.Lfm2Config)(**cfg.to_dict())
    base_dtype = autocast if lora is not None and half_base and autocast is not None else torch.float32
    t0 = time.perf_counter()
    with dev:       # drawn on the device in the base's dtype: an 8B model's f32 init on the host takes minutes
        model = (transformers.Lfm2MoeForCausalLM if moe else transformers.Lfm2ForCausalLM)._from_config(
            hf_cfg, torch_dtype=base_dtype)
    model = model.to(dev).train()
    if lora is not None:
        import peft
        model = peft.get_peft_model(model, peft.LoraConfig(r=lora.r, lora_alpha=lora.alpha, lora_dropout=0.0,
                                                           target_modules=list(lora.target_modules)))
    forward = torch.compile(model) if side.endswith("-compile") else model
    init_s = time.perf_counter() - t0
    params = [p for p in model.parameters() if p.requires_grad]
    n_params = sum(p.numel() for p in params)
    opt = torch.optim.AdamW(params, lr=1e-4, weight_decay=0.01)
    cuda = dev.type == "cuda"
    rng = np.random.default_rng(seed + 1)
    meta = {"torch": torch.__version__, "transformers": transformers.__version__, "n_params": n_params,
            "attn_implementation": getattr(model.config, "_attn_implementation", None), "init_s": init_s,
            "tf32_matmul": torch.backends.cuda.matmul.allow_tf32, "tf32_cudnn": torch.backends.cudnn.allow_tf32,
            "device_name": torch.cuda.get_device_name() if cuda else "cpu", "side": side,
            "base_dtype": str(base_dtype), "peft": _version("peft") if lora is not None else None,
            "autocast": str(autocast) if autocast else None, "compiled": side.endswith("-compile")}
    scaler = torch.amp.GradScaler(dev.type, enabled=side == "f16")
    log(f"# torch {side}: {torch.__version__}, transformers {transformers.__version__}, {n_params / 1e6:.1f}M parameters, "
        f"attention {meta['attn_implementation']}, init {init_s:.1f}s")

    def sync():
        if cuda:
            torch.cuda.synchronize()

    results = []
    for batch, t in shapes:
        def window():
            ids = torch.from_numpy(rng.integers(0, cfg.vocab_size, (batch, t + 1))).to(dev)
            with torch.autocast(dev.type, dtype=autocast or torch.float32, enabled=autocast is not None):
                logits = forward(input_ids=ids[:, :-1]).logits
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
        log(f"torch {side:12s} {r['shape']:8s} " + (f"{r['tokens_per_s']:9.0f} tok/s  window {r['window_s'] * 1e3:8.1f} ms  "
                                           f"peak {(r['peak_bytes'] or 0) / GiB:6.2f} GiB" if "error" not in r
                                           else f"ERROR {r['error']}"))
        results.append(r)
    del model, forward, opt, params
    if cuda:
        torch.cuda.empty_cache()
    return results, meta


def _version(package: str) -> str | None:
    from importlib.metadata import PackageNotFoundError, version
    try:
        return version(package)
    except PackageNotFoundError:
        return None


def main(argv=None) -> int:
    from bench import checkpoint_layers_arg, lora_base_dtype
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="the tiny preset and short sequences (runs on lavapipe)")
    ap.add_argument("--preset", default=None, help="a dense or MoE preset (default 350M; tiny with --quick)")
    ap.add_argument("--shapes", nargs="+", default=None, help="BxT shapes (default 1x512 8x512 1x2048)")
    ap.add_argument("--lora", type=int, metavar="R", help="train LoRA adapters of rank R (alpha 2R) on a frozen base")
    ap.add_argument("--lora-f16-base", action="store_true",
                    help="with --lora: lfm2jit's base as f16, PyTorch's half-precision sides' as their dtype")
    ap.add_argument("--base-dtype", choices=("f16", "int8", "nf4"), default=None,
                    help="with --lora: lfm2jit's base as this (f16 is --lora-f16-base; int8 / nf4 decoded in the "
                         "GEMMs), PyTorch's half-precision sides' as their dtype")
    ap.add_argument("--steps", type=int, default=3, help="timed windows per shape")
    ap.add_argument("--warmup", type=int, default=1, help="windows after the first before timing")
    ap.add_argument("--json", metavar="PATH")
    ap.add_argument("--torch-device", default="cuda", help="cuda (default) or cpu (to test this script)")
    ap.add_argument("--ours", nargs="*", choices=OUR_SIDES, default=list(OUR_SIDES), help="lfm2jit sides")
    ap.add_argument("--torch", nargs="*", choices=TORCH_SIDES, default=["fp32", "bf16"], help="PyTorch sides")
    ap.add_argument("--torch-compile", action="store_true", help="add the bf16-compile PyTorch side")
    ap.add_argument("--replay", type=int, metavar="N", default=None,
                    help="lfm2jit: Trainer.with_replay(N); 0 runs every step's Python (default: the trainer's)")
    ap.add_argument("--recompute-mlp", action="store_true",
                    help="lfm2jit: backward recomputes the MLP's up-projections (less memory, more matmuls)")
    ap.add_argument("--checkpoint-layers", metavar="all|N", default=0, type=checkpoint_layers_arg,
                    help="lfm2jit: activation checkpointing of the first N decoder layers, or all (less memory, "
                         "one more forward of those layers: recompute_flops in each line)")
    ap.add_argument("--lm-head-keep-mib", type=int, metavar="MIB", default=None,
                    help="lfm2jit: Trainer.lm_head_keep_bytes in MiB (LM-head logits kept from the loss pass for "
                         "the gradient pass; default: the trainer's)")
    args = ap.parse_args(argv)
    torch_sides = list(dict.fromkeys(args.torch + (["bf16-compile"] if args.torch_compile else [])))

    from lfm2jit import WgpuContext
    from bench import train_bench
    from lfm2jit.model.config import Lfm2Config
    from lfm2jit.model.lora import LoraConfig
    from lfm2jit.model.moe_config import MOE_PRESETS, Lfm2MoeConfig
    name = args.preset or ("tiny" if args.quick else "350M")
    cfg = Lfm2MoeConfig.preset(name) if name in MOE_PRESETS else Lfm2Config.preset(name)
    if (args.lora_f16_base or args.base_dtype) and not args.lora:
        ap.error("--lora-f16-base and --base-dtype need --lora R")
    base_dtype = lora_base_dtype(args)
    lora = LoraConfig(r=args.lora, alpha=2.0 * args.lora) if args.lora else None
    shapes = [parse_shape(s) for s in (args.shapes or (["1x64", "4x64", "1x128"] if args.quick
                                                       else ["1x512", "8x512", "1x2048"]))]
    torch, why = (None, "no PyTorch side asked for") if not torch_sides else torch_available(args.torch_device)
    doc: dict = {"argv": sys.argv[1:] if argv is None else list(argv), "shapes": [f"{b}x{t}" for b, t in shapes],
                 "preset": name, "config": cfg.to_dict(), "lora": asdict(lora) if lora else None,
                 "lora_base_dtype": base_dtype, "time": time.strftime("%Y-%m-%d %H:%M:%S %Z")}
    cuda = torch is not None and args.torch_device == "cuda"
    if cuda:
        torch.cuda.init()
        free0, _ = torch.cuda.mem_get_info()

    doc["lfm2jit"], ours = {}, {}
    if args.ours:
        ctx = WgpuContext.create()          # one for every side: Dawn gives an adapter one device
        print(f"# lfm2jit adapter: {ctx.name} ({ctx.implementation})", flush=True)
        probe = None
        if cuda:
            def probe():   # what the device really holds for lfm2jit (the pool keeps freed buffers), model alive
                free1, _ = torch.cuda.mem_get_info()
                return {"device_used_bytes": free0 - free1}
        for side in args.ours:
            lines, meta = train_bench(ctx, cfg, shapes, steps=args.steps, warmup=args.warmup,
                                      log=lambda s, side=side: print(f"lfm2jit {side}: {s}", flush=True),
                                      probe=probe, replay=args.replay, recompute_mlp=args.recompute_mlp,
                                      checkpoint_layers=args.checkpoint_layers,
                                      lm_head_keep_bytes=None if args.lm_head_keep_mib is None
                                      else args.lm_head_keep_mib << 20,
                                      activation_dtype="f16" if side == "f16" else "f32", lora=lora,
                                      lora_base_dtype=base_dtype)
            doc["lfm2jit"][side] = {"meta": meta, "lines": [asdict(l) for l in lines]}
            ours[side] = {l.shape: l for l in lines}

    doc["torch"], theirs = {}, {}
    if torch is None and torch_sides:
        print(f"# PyTorch sides skipped: {why}")
    for side in torch_sides if torch is not None else []:
        results, meta = run_torch(torch, cfg, shapes, args.steps, args.warmup, args.torch_device,
                                  log=lambda s: print(s, flush=True), side=side, lora=lora,
                                  half_base=base_dtype != "f32")
        doc["torch"][side] = {"meta": meta, "results": results}
        theirs[side] = {r["shape"]: r for r in results}
    doc["torch_skipped"] = why if torch is None else None

    doc["table"] = rows = [_row(f"{b}x{t}", ours, theirs) for b, t in shapes]
    _print_table(rows, list(ours), list(theirs))
    if args.json:
        Path(args.json).write_text(json.dumps(doc, indent=1, default=str))
        print(f"# wrote {args.json}")
    failed = [l for side in ours.values() for l in side.values() if l.error]
    failed += [r for side in theirs.values() for r in side.values() if "error" in r]
    return 1 if failed else 0


def _row(shape: str, ours: dict, theirs: dict) -> dict:
    """One shape: every side's tokens/s and peak GiB, lfm2jit's compile facts, and every ratio
    (``"f16/bf16"``: lfm2jit f16 tokens/s over PyTorch bf16's)."""
    row: dict = {"shape": shape, "lfm2jit": {}, "torch": {}, "speed_ratio": {}, "memory_ratio": {}}
    for side, lines in ours.items():
        line = lines.get(shape)
        if line is None or line.error:
            continue
        x = line.extra
        row["lfm2jit"][side] = {"tok_s": x["tokens_per_s"], "peak_gib": x["peak_bytes"] / GiB,
                                "first_s": x["first_window_s"], "compiles": x["first_window_compiles"],
                                "compile_s": x["first_window_compile_s"],
                                "second_compiles": x["second_window_compiles"],
                                "gpu_busy": x.get("gpu_busy_fraction"), "dispatches": x["dispatches_per_window"]}
    for side, results in theirs.items():
        r = results.get(shape)
        if r and "error" not in r:
            row["torch"][side] = {"tok_s": r["tokens_per_s"],
                                  "peak_gib": r["peak_bytes"] / GiB if r.get("peak_bytes") else None}
    for a, ra in row["lfm2jit"].items():
        for b, rb in row["torch"].items():
            row["speed_ratio"][f"{a}/{b}"] = ra["tok_s"] / rb["tok_s"]
            if rb["peak_gib"]:
                row["memory_ratio"][f"{a}/{b}"] = ra["peak_gib"] / rb["peak_gib"]
    return row


def _print_table(rows: list[dict], ours: list[str], theirs: list[str]) -> None:
    def f(v, fmt):
        return format(v, fmt) if isinstance(v, (int, float)) else "-"
    sides = [("lfm2jit", s) for s in ours] + [("torch", s) for s in theirs]
    print("\ntokens/s (peak GiB)")
    print("shape    " + "".join(f"{who + ' ' + s:>24s}" for who, s in sides))
    for row in rows:
        cells = []
        for who, s in sides:
            r = row[who].get(s, {})
            cells.append(f"{f(r.get('tok_s'), '.0f')} ({f(r.get('peak_gib'), '.2f')})")
        print(f"{row['shape']:9s}" + "".join(f"{c:>24s}" for c in cells))
    pairs = [f"{a}/{b}" for a in ours for b in theirs]
    if pairs:
        print("\nlfm2jit / PyTorch tokens/s")
        print("shape    " + "".join(f"{p:>18s}" for p in pairs))
        for row in rows:
            print(f"{row['shape']:9s}" + "".join(f"{f(row['speed_ratio'].get(p), '17.2f')}x" for p in pairs))
    print("\nlfm2jit compiles: first window (compiles, compile s), second window")
    for row in rows:
        print(f"{row['shape']:9s}" + "".join(
            f"  {s}: {f(r.get('first_s'), '.1f')}s ({r.get('compiles', '-')}, {f(r.get('compile_s'), '.1f')}s), "
            f"{r.get('second_compiles', '-')}" for s, r in row["lfm2jit"].items()))


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    sys.exit(main())
