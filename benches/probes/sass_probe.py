"""What the NVIDIA driver made of a kernel: registers a thread, shared memory, spills and the count
of each instruction (HMMA, LDSM, LDS, STS, LDG, STG, BAR, local loads and stores), read from the
binary the driver keeps. Each case compiles in its own process with its own LFM2JIT_CACHE_DIR and
Dawn's blob cache on, so the binaries there are that case's; the probe finds the ELF (cubin) images
in those files, reads each .text section's register count from its header (sh_info >> 24) and,
where it finds cuobjdump or nvdisasm (PATH, a CUDA install, Triton's or pip's NVIDIA bundles),
disassembles them. Run on the device (Dawn, LFM2JIT_ADAPTER=NVIDIA); elsewhere it says what it found.
Usage: python benches/probes/sass_probe.py [--cases NAME...] [--out DIR]"""
from __future__ import annotations

import argparse
import collections
import glob
import os
import re
import shutil
import struct
import subprocess
import sys
import zlib
from dataclasses import replace
from pathlib import Path

import numpy as np

EM_CUDA = 190
SQ = 4096
# case -> (product, (M, N, K) or attention T, changes to the planner's tiles)
CASES = {
    "fwd4096": ("fwd", (SQ, SQ, SQ), {}),
    "fwd4096_prefetch": ("fwd", (SQ, SQ, SQ), {"prefetch": True}),
    "fwd4096_stages2": ("fwd", (SQ, SQ, SQ), {"stages": 2, "prefetch": True}),
    "fwd4096_sg2x4": ("fwd", (SQ, SQ, SQ), {"wn": 256, "sg_n": 4}),
    "fwd4096_vec4": ("fwd", (SQ, SQ, SQ), {"vec4": True}),
    "fwd4096_w16": ("fwd16", (SQ, SQ, SQ), {}),
    "dx4096": ("dx", (SQ, SQ, SQ), {}),
    "dw4096": ("dw", (SQ, SQ, SQ), {}),
    "fwd2048x4608x1024": ("fwd", (2048, 4608, 1024), {}),
    "fwd2048x1024x1024": ("fwd", (2048, 1024, 1024), {}),
    "attention_fwd": ("attention", 2048, {}),
    "small": ("fwd", (64, 96, 80), {}),          # a check that the probe runs (any adapter)
}


# ---- the child: compile and run one case ----
def run_case(name: str) -> None:
    from lfm2jit import ComputeEngine, WgpuContext, grad, library
    product, shape, changes = CASES[name]
    e = ComputeEngine(WgpuContext.create())
    rng = np.random.default_rng(0)
    if product == "attention":
        att = library.get("attention").variant("f16")
        q, k, v = (e.tensor(rng.standard_normal(s, dtype=np.float32).astype(np.float16))
                   for s in ((shape, 16, 64), (shape, 8, 64), (shape, 8, 64)))
        pick = att.kernels[0].specialize({"B": 1, "T": shape, "H": 16, "G": 8, "E": 64}, 1, target=e.target).params.tiles
        e.run(att, q=q, k=k, v=v)["o"].numpy()
        print(f"{name}: tiles {pick}", flush=True)
        return
    m, n, kk = shape
    lin = library.get("linear").without({"r"})
    kern, out = {"fwd": (lin.variant("f16", {"w"}), "y"), "fwd16": (lin.variant("f16"), "y"),
                 "dx": (grad(lin, ["x"]).variant("f16", {"w"}), "d_x"),
                 "dw": (grad(lin, ["w"]).variant("f16", {"d_w"}), "d_w")}[product]
    args = {"x": e.tensor(rng.standard_normal((m, kk), dtype=np.float32), "f16"),
            "w": e.tensor(rng.standard_normal((n, kk), dtype=np.float32), "f16" if product == "fwd16" else "f32"),
            "d_y": e.tensor(rng.standard_normal((m, n), dtype=np.float32), "f16")}
    given = {t.name: args[t.name] for t in kern.ir.inputs}
    pick = kern.kernels[0].specialize({"T": m, "K": kk, "N": n}, 1, target=e.target).params.tiles
    tiles = replace(pick, **changes)
    e.run(kern, tiles=tiles, **given)[out].numpy()
    print(f"{name}: tiles {tiles.label}", flush=True)


# ---- the parent: the binaries a case left, and what is in them ----
def elf_images(blob: bytes) -> list[bytes]:
    """The CUDA ELF images inside ``blob`` (a cache file, or one decompressed from it)."""
    found, at = [], blob.find(b"\x7fELF")
    while at >= 0:
        image = _elf_at(blob, at)
        if image:
            found.append(image)
        at = blob.find(b"\x7fELF", at + 4)
    return found


def _elf_at(blob: bytes, at: int) -> bytes | None:
    if len(blob) < at + 64 or blob[at + 4] != 2:          # ELF64 only
        return None
    (_, _, machine, _, _, _, shoff, _, _, _, _, shentsize, shnum, _) = struct.unpack_from("<16sHHIQQQIHHHHHH", blob, at)
    if machine != EM_CUDA or shentsize != 64 or not 0 < shnum < 4096 or at + shoff + shnum * 64 > len(blob):
        return None
    end = shoff + shnum * 64
    for i in range(shnum):
        _, typ, _, _, off, size, *_ = struct.unpack_from("<IIQQQQIIQQ", blob, at + shoff + 64 * i)
        if typ != 8:                                        # SHT_NOBITS takes no bytes
            end = max(end, off + size)
    return blob[at:at + end] if at + end <= len(blob) else None


def sections(image: bytes) -> list[tuple[str, int, int]]:
    """(name, size, sh_info) of each section of an ELF64 image."""
    (_, _, _, _, _, _, shoff, _, _, _, _, _, shnum, shstrndx) = struct.unpack_from("<16sHHIQQQIHHHHHH", image, 0)
    heads = [struct.unpack_from("<IIQQQQIIQQ", image, shoff + 64 * i) for i in range(shnum)]
    names_off = heads[shstrndx][4]
    out = []
    for name_at, _, _, _, _, size, _, info, _, _ in heads:
        end = image.index(b"\0", names_off + name_at)
        out.append((image[names_off + name_at:end].decode("latin-1"), size, info))
    return out


def inflated(blob: bytes, limit: int = 64) -> list[bytes]:
    """Whatever zlib streams (and, where the lz4 module is installed, LZ4 frames) ``blob`` holds, at
    most ``limit`` tried of each: a driver may compress its entries."""
    out = []
    for match in list(re.finditer(rb"\x78[\x01\x5e\x9c\xda]", blob))[:limit]:
        try:
            out.append(zlib.decompressobj().decompress(blob[match.start():]))
        except zlib.error:
            continue
    try:
        import lz4.frame
    except ImportError:
        return out
    for match in list(re.finditer(rb"\x04\x22\x4d\x18", blob))[:limit]:
        try:
            out.append(lz4.frame.decompress(blob[match.start():]))
        except RuntimeError:
            continue
    return out


def find_tool(name: str) -> str | None:
    places = [shutil.which(name)] + sorted(glob.glob(f"/usr/local/cuda*/bin/{name}"))
    for root in sys.path:
        places += sorted(glob.glob(f"{root}/triton/backends/nvidia/bin/{name}"))
        places += sorted(glob.glob(f"{root}/nvidia/*/bin/{name}"))
    return next((p for p in places if p and os.access(p, os.X_OK)), None)


def sass_counts(text: str) -> collections.Counter:
    """Instructions by opcode (its first two dotted parts: HMMA.16816, LDS.U, ...) in a SASS listing."""
    counts = collections.Counter()
    for line in text.splitlines():
        m = re.match(r"\s*/\*[0-9a-f]{4,}\*/\s+(?:@!?U?P\w+\s+)?([A-Z][A-Z0-9_]*(?:\.[A-Z0-9_]+)?)", line)
        if m:
            counts[m.group(1)] += 1
    return counts


def report(case: str, cache: Path, out: Path, tools: dict) -> list[str]:
    lines, images = [], []
    for f in sorted(p for sub in ("driver", "blobs") for p in (cache / sub).rglob("*") if p.is_file()):
        blob = f.read_bytes()
        got = elf_images(blob) or [i for d in inflated(blob) for i in elf_images(d)]
        lines.append(f"  file {f.relative_to(cache)} {len(blob)} B, {len(got)} CUDA ELF, starts {blob[:8].hex()}")
        images += got
    for i, image in enumerate(dict.fromkeys(images)):
        path = out / f"{case}-{i}.cubin"
        path.write_bytes(image)
        secs = sections(image)
        shared = {n.removeprefix(".nv.shared."): s for n, s, _ in secs if n.startswith(".nv.shared.")}
        for name, size, info in secs:
            if name.startswith(".text."):
                fn = name.removeprefix(".text.")
                lines.append(f"  {path.name} {fn}: {info >> 24} registers, {size // 16} instructions, "
                             f"{shared.get(fn, 0)} B static shared")
        if tools.get("cuobjdump"):
            usage = subprocess.run([tools["cuobjdump"], "-res-usage", str(path)], capture_output=True, text=True)
            lines += ["  " + ln.strip() for ln in usage.stdout.splitlines() if "REG" in ln or "Function" in ln]
        dis = tools.get("cuobjdump") and [tools["cuobjdump"], "-sass", str(path)] or (
            tools.get("nvdisasm") and [tools["nvdisasm"], "-c", str(path)])
        if dis:
            text = subprocess.run(dis, capture_output=True, text=True).stdout
            path.with_suffix(".sass").write_text(text)
            counts = sass_counts(text)
            keys = ("HMMA", "LDSM", "LDS", "STS", "LDG", "STG", "BAR", "LDL", "STL", "SEL", "IMNMX", "ISETP")
            lines.append("  " + ", ".join(f"{k} {sum(c for op, c in counts.items() if op.split('.')[0] == k)}"
                                          for k in keys) + f" of {sum(counts.values())}")
            lines.append("  " + ", ".join(f"{op} {c}" for op, c in counts.most_common(12)))
    return lines


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--cases", nargs="+", default=[c for c in CASES if c != "small"], choices=list(CASES))
    ap.add_argument("--out", default=os.environ.get("OUT", "sass_probe"), help="where binaries and listings go")
    ap.add_argument("--compile", help=argparse.SUPPRESS)      # the child's case
    args = ap.parse_args()
    if args.compile:
        return run_case(args.compile)
    out = Path(args.out) / "sass"
    out.mkdir(parents=True, exist_ok=True)
    tools = {t: find_tool(t) for t in ("cuobjdump", "nvdisasm")}
    print(f"tools: {tools}", flush=True)
    for case in args.cases:
        cache = out / "cache" / case
        shutil.rmtree(cache, ignore_errors=True)
        cache.mkdir(parents=True)
        env = dict(os.environ, LFM2JIT_CACHE_DIR=str(cache), LFM2JIT_DAWN_BLOB_CACHE="on")
        for var in ("__GL_SHADER_DISK_CACHE_PATH", "__GL_SHADER_DISK_CACHE", "MESA_SHADER_CACHE_DIR"):
            env.pop(var, None)                        # the case's own directory, not one set outside
        child = subprocess.run([sys.executable, __file__, "--compile", case], env=env, capture_output=True, text=True)
        print(child.stdout.strip() or f"{case}: failed\n{child.stderr[-2000:]}", flush=True)
        print("\n".join(report(case, cache, out, tools)), flush=True)
        shutil.rmtree(cache)                          # the binaries found are kept beside it


if __name__ == "__main__":
    main()
