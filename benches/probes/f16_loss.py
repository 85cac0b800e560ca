"""Does --f16 train like fp32? The same run twice, fp32 and --f16, on real English text, and the
loss curves compared window by window.

The text is the docstrings of Python's standard library (this interpreter's), cut into paragraphs:
real prose that any machine has, no download. Both runs start from the same weights (--seed) and
see the same batches; --f16 differs only in storage precision, the matrix units and the loss
scaler. Usage (the issue's target: every 20-step window's mean loss within 2% of fp32's):

    python benches/probes/f16_loss.py --preset 350M --steps 200 --out runs/f16-loss
"""
from __future__ import annotations

import argparse
import importlib
import inspect
import json
import subprocess
import sys
from pathlib import Path

MODULES = ("argparse", "asyncio", "collections", "csv", "dataclasses", "datetime", "decimal", "email", "enum",
           "functools", "heapq", "http.client", "inspect", "itertools", "json", "logging", "os", "pathlib", "pickle",
           "random", "re", "shutil", "socket", "sqlite3", "statistics", "string", "subprocess", "tarfile", "textwrap",
           "threading", "typing", "unittest", "urllib.parse", "uuid", "zipfile")
MIN_CHARS = 200
WINDOW = 20


def paragraphs() -> list[str]:
    """Docstring paragraphs of MODULES and their public members, at least MIN_CHARS long, in a fixed order."""
    seen, out = set(), []
    for name in MODULES:
        module = importlib.import_module(name)
        members = [module] + [v for k, v in sorted(vars(module).items()) if not k.startswith("_")
                              and (inspect.isclass(v) or inspect.isfunction(v))]
        for obj in members:
            for para in (inspect.getdoc(obj) or "").split("\n\n"):
                text = " ".join(para.split())
                if len(text) >= MIN_CHARS and text.isascii() and text not in seen:
                    seen.add(text)
                    out.append(text)
    return out


def train(out: Path, data: Path, args, f16: bool) -> list[dict]:
    run = out / ("f16" if f16 else "fp32")
    cmd = [sys.executable, "-m", "trainer", "--preset", args.preset, "--data", str(data), "--steps", str(args.steps),
           "--lr", str(args.lr), "--schedule", "warmup", "--warmup-steps", str(WINDOW), "--eval-fraction", "0",
           "--seed", "0", "--max-len", str(args.max_len), "--grad-accum", str(args.grad_accum), "--no-progress",
           "--out", str(run)] + (["--f16"] if f16 else [])
    print("$ " + " ".join(cmd), flush=True)
    subprocess.run(cmd, check=True)
    return [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--preset", default="350M", help="model shape trained from scratch (default 350M)")
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--lr", type=float, default=3e-4)
    ap.add_argument("--max-len", type=int, default=512)
    ap.add_argument("--grad-accum", type=int, default=8, help="sequences per optimizer step (default 8)")
    ap.add_argument("--out", type=Path, required=True, help="directory for the data, both runs and f16_loss.json")
    args = ap.parse_args(argv)
    if args.steps < 2 * WINDOW:
        ap.error(f"--steps {args.steps}: need at least {2 * WINDOW} to compare windows of {WINDOW}")
    args.out.mkdir(parents=True, exist_ok=True)
    data = args.out / "stdlib_docstrings.jsonl"
    texts = paragraphs()
    data.write_text("".join(json.dumps({"text": t}) + "\n" for t in texts))
    print(f"{len(texts)} paragraphs, {sum(map(len, texts))} characters -> {data}", flush=True)
    runs = {"fp32": train(args.out, data, args, False), "f16": train(args.out, data, args, True)}
    rows = []
    for start in range(0, args.steps - WINDOW + 1, WINDOW):
        mean = {k: sum(m["loss"] for m in v[start:start + WINDOW]) / WINDOW for k, v in runs.items()}
        rows.append({"steps": f"{start + 1}-{start + WINDOW}", **mean, "rel_diff": mean["f16"] / mean["fp32"] - 1})
    skipped = sum(bool(m.get("skipped")) for m in runs["f16"])
    worst = max(abs(r["rel_diff"]) for r in rows)
    print(f"{'steps':>9s} {'fp32':>8s} {'f16':>8s} {'f16/fp32-1':>11s}")
    for r in rows:
        print(f"{r['steps']:>9s} {r['fp32']:8.4f} {r['f16']:8.4f} {100 * r['rel_diff']:+10.2f}%")
    print(f"worst window {100 * worst:.2f}% (target 2%); f16 steps skipped by the scaler: {skipped}")
    (args.out / "f16_loss.json").write_text(json.dumps({"args": {k: str(v) for k, v in vars(args).items()},
                                                        "paragraphs": len(texts), "windows": rows,
                                                        "worst_rel_diff": worst, "f16_skipped": skipped}, indent=1))
    return 0 if worst <= 0.02 else 1


if __name__ == "__main__":
    sys.exit(main())
