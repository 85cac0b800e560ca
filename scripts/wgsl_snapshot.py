"""Every WGSL shader the compiler generates for a fixed workload, written to one directory, so a
refactor can be checked byte for byte: run it before and after and compare with ``--compare``.

    python scripts/wgsl_snapshot.py OUT_DIR               # write OUT_DIR/<kernel>-<sha12>.wgsl, manifest.txt
    python scripts/wgsl_snapshot.py NEW_DIR --compare OLD_DIR

The workload: every shipped kernel (forward and, where it has one, the backward of its first output),
at three specializations, f32 and f16 storage, on the portable target and on a device with f16 subgroup
matrices; then a tiny LFM2's train steps (f32, f16 activations, LoRA) on this machine's adapter with the
matrix templates emulated, through the engine's on-disk WGSL cache.
"""
from __future__ import annotations

import argparse
import hashlib
import os
import sys
import tempfile
from pathlib import Path

SIZES = ({"bucket": 16, "dims": {"T": 16}, "other": 48},
         {"bucket": 64, "dims": {"T": 64}, "other": 64},
         {"bucket": 256, "dims": {"T": 2048}, "other": 1024})


def library_shaders() -> dict[str, str]:
    from lfm2jit.cli import MATRIX_UNITS
    from lfm2jit.driver import grad, stages
    from lfm2jit.dsl.errors import DslError
    from lfm2jit.ir.nodes import SEQ_AXIS
    from lfm2jit.ops import library
    from lfm2jit.schedule import PORTABLE

    out = {}
    for name, kernel in sorted(library.kernels().items()):
        variants = [kernel]
        try:
            variants.append(grad(kernel, cotangents=[kernel.ir.outputs[0].name]))
        except DslError:
            pass
        for k in variants:
            for storage in ("f32", "f16"):
                try:
                    kk = k.variant(storage)
                except Exception:   # noqa: BLE001 - a kernel with no f16 form (integer-only) is skipped
                    continue
                for size in SIZES:
                    axes = [a for a in kk.ir.axes if a not in kk.ir.fixed_dims]
                    dims = {a: size["dims"].get(a, size["other"]) if a != SEQ_AXIS else size["dims"]["T"] for a in axes}
                    for tname, target in (("portable", PORTABLE), ("matrix", MATRIX_UNITS)):
                        try:
                            wgsl = stages(kk, dims, size["bucket"], target)["wgsl"]
                        except Exception as e:  # noqa: BLE001 - a refusal is part of the snapshot too
                            wgsl = f"// refused: {type(e).__name__}: {e}\n"
                        out[f"{kk.name}.{storage}.{tname}.b{size['bucket']}"] = wgsl
    return out


def model_shaders(cache_dir: Path) -> dict[str, str]:
    os.environ["LFM2JIT_CACHE_DIR"] = str(cache_dir)
    os.environ["LFM2JIT_MATRIX_UNITS"] = "emulate"
    import numpy as np

    from lfm2jit import ComputeEngine, WgpuContext
    from lfm2jit.model import Lfm2Config, Lfm2Model, LoraConfig
    from trainer import AdamW, Trainer

    ctx = WgpuContext.create()
    ids = np.random.default_rng(0).integers(0, 256, 40)
    for dtype, lora in (("f32", False), ("f16", False), ("f32", True)):
        if dtype == "f16" and not ctx.has_f16:
            continue
        engine = ComputeEngine(ctx)
        model = Lfm2Model(Lfm2Config.preset("tiny"), ctx, engine, seed=0, activation_dtype=dtype)
        if lora:
            model.add_lora(LoraConfig(r=4, alpha=8))
        params = model.lora_parameters() if lora else model.parameters()
        tr = Trainer(model, AdamW(lr=1e-3), ctx, engine).with_length_bucket(32).with_clip_grad_norm(1.0)
        tr.train_step(ids[:-1], ids[1:], params)
        model.generate(list(ids[:5]), max_new_tokens=3)
    out = {}
    for f in sorted(cache_dir.glob("*.wgsl")):   # named by a hash of the compiler's source: label by content
        body = f.read_text().partition("\n")[2]
        out[f"model.{f.name.rsplit('-', 1)[0]}.{hashlib.sha256(body.encode()).hexdigest()[:12]}"] = body
    return out


def write(out_dir: Path, shaders: dict[str, str]) -> None:
    out_dir.mkdir(parents=True, exist_ok=True)
    lines = []
    for label, wgsl in sorted(shaders.items()):
        digest = hashlib.sha256(wgsl.encode()).hexdigest()[:12]
        (out_dir / f"{digest}.wgsl").write_text(wgsl)
        lines.append(f"{digest} {label}")
    (out_dir / "manifest.txt").write_text("\n".join(lines) + "\n")


def compare(new: Path, old: Path) -> int:
    """0 when both directories hold the same set of shaders; else each label whose WGSL changed."""
    def read(d):
        return dict(reversed(line.split(" ", 1)) for line in (d / "manifest.txt").read_text().splitlines())
    a, b = read(old), read(new)
    model_old = {v for k, v in a.items() if k.startswith("model.")}
    model_new = {v for k, v in b.items() if k.startswith("model.")}
    a = {k: v for k, v in a.items() if not k.startswith("model.")}
    b = {k: v for k, v in b.items() if not k.startswith("model.")}
    labels_changed = sorted(k for k in a.keys() & b.keys() if a[k] != b[k])
    for k in labels_changed:
        print(f"changed: {k}  ({old / (a[k] + '.wgsl')} -> {new / (b[k] + '.wgsl')})")
    for k in sorted(a.keys() - b.keys()):
        print(f"only before: {k}")
    for k in sorted(b.keys() - a.keys()):
        print(f"only after: {k}")
    print(f"{len(labels_changed)} library shaders changed; model shaders: {len(model_old - model_new)} gone, "
          f"{len(model_new - model_old)} new, {len(model_old & model_new)} the same")
    return int(bool(labels_changed or a.keys() != b.keys() or model_old != model_new))


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("out", type=Path)
    p.add_argument("--compare", type=Path, metavar="OLD_DIR", help="after writing OUT, compare it with OLD_DIR")
    p.add_argument("--library-only", action="store_true", help="skip the tiny model's train steps")
    args = p.parse_args()
    shaders = library_shaders()
    if not args.library_only:
        with tempfile.TemporaryDirectory() as tmp:
            shaders.update(model_shaders(Path(tmp)))
    write(args.out, shaders)
    print(f"{len(shaders)} shaders ({len(set(shaders.values()))} distinct) in {args.out}")
    return compare(args.out, args.compare) if args.compare else 0


if __name__ == "__main__":
    sys.exit(main())
