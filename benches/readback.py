"""Where the GPU->host readback of data parallelism spends its time, piece by piece, one process:

    python benches/readback.py [--mib 1352] [--bucket-mib 8 32 128] [--threads 1 4] [--json PATH]

``--mib`` of float32 gradients (LFM2-350M's 1352 MiB by default) in tensors of 4 MiB are read back
through ``StagedReadback`` (lfm2jit/runtime/staging.py) in buckets of each ``--bucket-mib``, and
into host arrays made afresh or kept from the last round, by each of ``--threads`` copy threads; each bucket's read is split into the wait for the GPU's copies (``map_sync``) and the conversion
out of the mapped memory (``copy_out``, lfm2jit/runtime/host_threads.py); a second conversion of the same mapped bytes tells
whether reading that memory is slow in itself (uncached) or the first touch is. References from
the same run: a host-to-host ``np.copyto`` of one bucket (the CPU's copy speed) and, where torch
has CUDA, device-to-host copies into pinned and into pageable host memory (the link's speed).
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

MIB = 1 << 20
TENSOR_MIB = 4


def _gbps(nbytes: float, seconds: float) -> float:
    return nbytes / seconds / 1e9 if seconds > 0 else float("inf")


def host_copy(nbytes: int) -> dict:
    """np.copyto between two host arrays of ``nbytes`` (warm), best of 5."""
    a = np.ones(nbytes // 4, np.float32)
    b = np.empty_like(a)
    np.copyto(b, a)
    best = min(_timed(lambda: np.copyto(b, a)) for _ in range(5))
    return {"bytes": nbytes, "s": best, "GBps": _gbps(nbytes, best)}


def _timed(fn) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def torch_link(nbytes_total: int, chunk: int) -> dict | None:
    """torch device-to-host copies of ``nbytes_total`` in ``chunk``-byte pieces, into pinned and into
    pageable host memory: the PCIe link's speed as CUDA reaches it."""
    try:
        import torch
    except ImportError:
        return None
    if not torch.cuda.is_available():
        return None
    n = chunk // 4
    src = [torch.ones(n, device="cuda") for _ in range(nbytes_total // chunk)]
    out = {}
    for kind, pin in (("pinned", True), ("pageable", False)):
        dst = [torch.empty(n, pin_memory=pin) for _ in src]
        for d, s in zip(dst, src):
            d.copy_(s, non_blocking=pin)
        torch.cuda.synchronize()
        times = []
        for _ in range(3):
            t0 = time.perf_counter()
            for d, s in zip(dst, src):
                d.copy_(s, non_blocking=pin)
            torch.cuda.synchronize()
            times.append(time.perf_counter() - t0)
        best = min(times)
        out[kind] = {"s": best, "GBps": _gbps(len(src) * chunk, best)}
        del dst
    del src
    torch.cuda.empty_cache()
    return out


def staged(engine, tensors, bucket_bytes: int, reuse: bool, threads: int, rounds: int = 3) -> dict:
    """StagedReadback of ``tensors`` in buckets of about ``bucket_bytes``: per round the GPU wait
    (map) and the conversion of every bucket, and a second conversion of the last bucket. ``reuse``:
    the host arrays are kept from round to round (else made afresh, as np.empty: their pages are
    first touched by the conversion). ``threads``: how many copy the mapped bytes out (copy_out)."""
    from lfm2jit.runtime.host_threads import copy_out
    from lfm2jit.runtime.staging import StagedReadback
    import wgpu
    per = max(1, bucket_bytes // (TENSOR_MIB * MIB))
    groups = [tensors[i:i + per] for i in range(0, len(tensors), per)]
    reader = StagedReadback(engine)
    rows, outs = [], None
    for _ in range(rounds + 1):
        engine.synchronize()
        t0 = time.perf_counter()
        sizes = reader.submit(groups)
        t_submit = time.perf_counter() - t0
        if outs is None or not reuse:
            outs = [np.empty(n, np.float32) for n in sizes]
        wait = convert = again = 0.0
        for slot, out in enumerate(outs):
            buf, nbytes = reader._slots[slot], 4 * sizes[slot]
            t1 = time.perf_counter()
            buf.map_sync(wgpu.MapMode.READ, 0, nbytes)
            t2 = time.perf_counter()
            view = np.frombuffer(buf.read_mapped(0, nbytes, copy=False), dtype=np.float32, count=sizes[slot])
            copy_out(out, view, threads)
            t3 = time.perf_counter()
            if slot == len(outs) - 1:
                copy_out(out, view, threads)
                again = time.perf_counter() - t3
            del view
            buf.unmap()
            wait, convert = wait + t2 - t1, convert + t3 - t2
        total = time.perf_counter() - t0
        rows.append({"submit_s": t_submit, "map_wait_s": wait, "convert_s": convert, "total_s": total,
                     "last_bucket_again_s": again})
    reader.release()
    rows = rows[1:]                                   # the first round makes the staging buffers
    nbytes = sum(4 * t.size for t in tensors)
    med = {k: statistics.median(r[k] for r in rows) for k in rows[0]}
    last = 4 * sum(t.size for t in groups[-1])
    return {"bucket_bytes": bucket_bytes, "buckets": len(groups), "reused_host_arrays": reuse, "threads": threads, **med,
            "GBps": _gbps(nbytes, med["total_s"]), "convert_GBps": _gbps(nbytes, med["convert_s"]),
            "map_GBps": _gbps(nbytes, med["map_wait_s"]), "again_GBps": _gbps(last, med["last_bucket_again_s"])}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--mib", type=int, default=1352, help="float32 MiB read back per round")
    ap.add_argument("--bucket-mib", type=int, nargs="+", default=[8, 32, 128])
    ap.add_argument("--threads", type=int, nargs="+", default=[1, 4], help="copy threads to compare")
    ap.add_argument("--json", metavar="PATH")
    a = ap.parse_args(argv)
    if a.mib < TENSOR_MIB or any(b < 1 for b in a.bucket_mib) or any(n < 1 for n in a.threads):
        ap.error(f"--mib must be at least {TENSOR_MIB}, every --bucket-mib and --threads at least 1")
    from lfm2jit import ComputeEngine, Tensor, WgpuContext
    ctx = WgpuContext.create()
    engine = ComputeEngine(ctx)
    rng = np.random.default_rng(0)
    tensors = [Tensor.from_numpy(ctx, rng.standard_normal(TENSOR_MIB * MIB // 4, dtype=np.float32))
               for _ in range(a.mib // TENSOR_MIB)]
    nbytes = sum(4 * t.size for t in tensors)
    result = {"adapter": ctx.info, "bytes": nbytes, "host_copy": host_copy(32 * MIB),
              "torch_link": torch_link(nbytes, 32 * MIB), "staged": []}
    for b in a.bucket_mib:
        for reuse in (False, True):
            for threads in a.threads:
                result["staged"].append(staged(engine, tensors, b * MIB, reuse, threads))
    print(f"{ctx.info.get('device')} ({ctx.info.get('backend_type')}): {nbytes / 1e9:.2f} GB per round")
    print(f"host np.copyto 32 MiB: {result['host_copy']['GBps']:.1f} GB/s")
    for kind, row in (result["torch_link"] or {}).items():
        print(f"torch device->host {kind}: {row['GBps']:.1f} GB/s")
    print(f"{'bucket MiB':>10} {'host out':>8} {'threads':>7} {'buckets':>7} {'total s':>8} {'GB/s':>6} {'map s':>7} {'conv s':>7} {'conv GB/s':>9} {'again GB/s':>10}")
    for r in result["staged"]:
        print(f"{r['bucket_bytes'] // MIB:>10} {'kept' if r['reused_host_arrays'] else 'fresh':>8} {r['threads']:>7} {r['buckets']:>7} {r['total_s']:>8.3f} {r['GBps']:>6.1f} "
              f"{r['map_wait_s']:>7.3f} {r['convert_s']:>7.3f} {r['convert_GBps']:>9.1f} {r['again_GBps']:>10.1f}")
    if a.json:
        Path(a.json).write_text(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
