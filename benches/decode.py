"""Decode speed: Lfm2Model.generate against transformers' generate, in one run on the same GPU.

    python benches/decode.py [--preset 350M] [--batches 1 8] [--prompt 128] [--new 128] [--sample] [--json PATH]

Both sides decode from the same random weights (saved once, loaded by each) and prompts, with no end id, so every
sequence makes ``--new`` tokens: greedily, and with ``--sample`` also sampled (temperature 0.8, top-k
50, top-p 0.95). Each side runs once to warm up (kernels compiled, caches sized) and is timed on the
second run. Reported: prefill seconds (to the first new token, which comes from the prefill), and
decode tokens/s = batch * (new - 1) / the time after it. lfm2jit chooses tokens on the GPU and reads
them back in batches (model/decode.py), so its first token is timed by a run of one new token.
transformers runs in fp32 and in bf16 (the model cast, as an inference user loads it), with its
default cache, and is timed per token through a stopping criterion.
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


SAMPLING = dict(do_sample=True, temperature=0.8, top_k=50, top_p=0.95)   # --sample, on both sides


def ours(weights: Path, prompts, new: int, dtype: str, log, sample: bool) -> dict:
    from lfm2jit import ComputeEngine, WgpuContext
    from lfm2jit.model import Lfm2Model
    from lfm2jit.model.decode import READBACK_EVERY
    ctx = WgpuContext.create()
    model = Lfm2Model.from_pretrained(weights, ctx, ComputeEngine(ctx), activation_dtype=dtype)
    kw = dict(eos_token_id=[], **(SAMPLING if sample else {}))
    result = {}
    for run in ("warm", "timed"):
        t0 = time.perf_counter()
        model.generate(prompts, max_new_tokens=1, **kw)
        t1 = time.perf_counter()
        out = model.generate(prompts, max_new_tokens=new, **kw)
        total = time.perf_counter() - t1
        result = {"prefill_s": t1 - t0, "decode_s": total - (t1 - t0), "total_s": total, "tokens": out,
                  "readback_every": READBACK_EVERY, "adapter": ctx.name, "webgpu": ctx.implementation}
        log(f"  lfm2jit {dtype} {run}: {total:.2f}s")
    return result


def transformers_side(weights: Path, prompts, new: int, dtype: str, log, sample: bool) -> dict:
    import torch
    import transformers
    dev = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    model = transformers.Lfm2ForCausalLM.from_pretrained(weights, torch_dtype=torch.float32)
    model = model.to(dev, {"fp32": torch.float32, "bf16": torch.bfloat16}[dtype]).eval()
    ids = torch.tensor(prompts, device=dev)
    result = {}
    for run in ("warm", "timed"):
        class Stamp(transformers.StoppingCriteria):
            def __init__(self):
                self.stamps = []

            def __call__(self, input_ids, scores, **kw):
                if dev.type == "cuda":
                    torch.cuda.synchronize()
                self.stamps.append(time.perf_counter())
                return torch.zeros(input_ids.shape[0], dtype=torch.bool, device=input_ids.device)
        stamp = Stamp()
        if dev.type == "cuda":
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        with torch.no_grad():
            out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new, min_new_tokens=new,
                                 pad_token_id=0, stopping_criteria=[stamp],
                                 **(SAMPLING if sample else {"do_sample": False}))
        if dev.type == "cuda":
            torch.cuda.synchronize()
        total = time.perf_counter() - t0
        result = {"prefill_s": stamp.stamps[0] - t0, "decode_s": total - (stamp.stamps[0] - t0), "total_s": total,
                  "tokens": out[:, ids.shape[1]:].tolist(), "device": str(dev),
                  "torch": torch.__version__, "transformers": transformers.__version__}
        log(f"  transformers {dtype} {run}: {total:.2f}s")
    return result


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--preset", default="350M")
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 8])
    ap.add_argument("--prompt", type=int, default=128, help="prompt tokens")
    ap.add_argument("--new", type=int, default=128, help="new tokens per sequence")
    ap.add_argument("--ours", nargs="*", default=["f32", "f16"], choices=["f32", "f16"])
    ap.add_argument("--torch", nargs="*", default=["fp32", "bf16"], choices=["fp32", "bf16"])
    ap.add_argument("--sample", action="store_true", help="also time sampled decoding (%s)" % SAMPLING)
    ap.add_argument("--json", metavar="PATH")
    args = ap.parse_args(argv)
    import tempfile
    from lfm2jit import ComputeEngine, WgpuContext
    from lfm2jit.model import Lfm2Config, Lfm2Model
    cfg = Lfm2Config.preset(args.preset)
    weights = Path(tempfile.mkdtemp(prefix="decode-bench-"))       # one set of random weights for every side
    ctx = WgpuContext.create()
    Lfm2Model(cfg, ctx, ComputeEngine(ctx), seed=0).save_pretrained(weights)
    rng = np.random.default_rng(0)
    lines = []
    for batch in args.batches:
        prompts = rng.integers(3, cfg.vocab_size, (batch, args.prompt)).tolist()
        sides = [("lfm2jit", d, ours) for d in args.ours] + [("transformers", d, transformers_side) for d in args.torch]
        for mode in ("greedy", "sample") if args.sample else ("greedy",):
            for name, dtype, fn in sides:
                print(f"# {name} {dtype} batch {batch} {mode}", flush=True)
                try:
                    r = fn(weights, prompts, args.new, dtype, lambda s: print(s, flush=True), mode == "sample")
                except Exception as e:           # one side failing still reports the others
                    lines.append({"side": name, "dtype": dtype, "batch": batch, "mode": mode,
                                  "error": f"{type(e).__name__}: {e}"})
                    continue
                r.update(side=name, dtype=dtype, batch=batch, mode=mode,
                         decode_tokens_per_s=batch * (args.new - 1) / r["decode_s"])
                lines.append(r)
    ref = {(l["batch"]): l["tokens"] for l in lines if l.get("side") == "transformers" and l["dtype"] == "fp32"
           and l["mode"] == "greedy" and "tokens" in l}
    print(f"\n{'side':<14}{'dtype':<6}{'batch':>6}{'mode':>7}{'prefill s':>11}{'decode tok/s':>14}  "
          "greedy == transformers fp32")
    for l in lines:
        if "error" in l:
            print(f"{l['side']:<14}{l['dtype']:<6}{l['batch']:>6}{l['mode']:>7}  ERROR {l['error'][:80]}")
            continue
        same = ref.get(l["batch"]) if l["mode"] == "greedy" else None
        agree = "-" if same is None else f"{sum(a == b for x, y in zip(l['tokens'], same) for a, b in zip(x, y))}" \
                                         f"/{sum(len(x) for x in same)} tokens"
        print(f"{l['side']:<14}{l['dtype']:<6}{l['batch']:>6}{l['mode']:>7}{l['prefill_s']:>11.3f}"
              f"{l['decode_tokens_per_s']:>14.1f}  {agree}")
    if args.json:
        Path(args.json).write_text(json.dumps({"argv": sys.argv, "config": cfg.to_dict(), "prompt": args.prompt,
                                               "new": args.new, "lines": lines}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
