"""How fast MPI alone averages float32 gradients between ranks, host arrays only (no GPU):

    mpiexec -n 2 python benches/mpi_exchange.py [--mib 1352] [--bucket-mib 8 32 128] [--label TEXT] [--json PATH]

The exchange of trainer/mpi_sync.py without its readback: ``--mib`` of float32 values per rank
(LFM2-350M's gradients by default) cut into buckets, averaged five ways, each timed (best of 3,
rank 0's clock between barriers):

* ``pipelined``: what MpiGradSync did until 2026-12-03: a non-blocking reduce-scatter per bucket,
  all started before the first wait, then an allgather of each chunk's mean;
* ``stepwise``: the same non-blocking collectives one at a time: a bucket's reduce-scatter, its
  wait, its allgather and that wait before the next bucket's (waits test back to back, as
  MpiGradSync's do, so that a dead peer can still be timed out);
* ``blocking``: a blocking reduce-scatter then allgather per bucket;
* ``iallreduce`` / ``allreduce``: MPI's own in-place allreduce per bucket, non-blocking one at a
  time / blocking (MPI picks the algorithm; MPI does not promise every rank the same bits, which
  two ranks get anyway: a + b = b + a). MpiGradSync now runs the one-at-a-time allreduce at two
  ranks and the stepwise reduce-scatter + allgather at more.

A host-to-host copy of one bucket is the reference (the CPU's copy speed). Run it under MPICH's
CVARs (MPIR_CVAR_CH4_NETMOD, MPIR_CVAR_CH4_SHM_POSIX_IQUEUE_CELL_SIZE, ...) to compare transports:
``bash benches/h200.sh mpi`` does.
"""
from __future__ import annotations

import argparse
import json
import time

import numpy as np

MIB = 1 << 20


def _buckets(total: int, bucket: int, world: int) -> list[np.ndarray]:
    """Kept arrays of ``bucket`` float32 values each (the last shorter), padded to world chunks."""
    sizes = [min(bucket, total - at) for at in range(0, total, bucket)]
    return [np.ones(-(-n // world) * world, np.float32) for n in sizes]


def _timed(comm, fn, reps: int = 3) -> float:
    best = float("inf")
    for _ in range(reps):
        comm.Barrier()
        t0 = time.perf_counter()
        fn()
        comm.Barrier()
        best = min(best, time.perf_counter() - t0)
    return best


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--mib", type=int, default=1352, help="float32 MiB averaged per rank")
    ap.add_argument("--bucket-mib", type=int, nargs="+", default=[8, 32, 128])
    ap.add_argument("--label", default="default", help="what this run's MPI settings are, for the table")
    ap.add_argument("--json", metavar="PATH")
    a = ap.parse_args(argv)
    if a.mib < 1 or min(a.bucket_mib) < 1:
        ap.error(f"--mib and --bucket-mib must be positive, got {a.mib} and {a.bucket_mib}")
    from mpi4py import MPI
    comm = MPI.COMM_WORLD
    world, rank = comm.Get_size(), comm.Get_rank()
    if world < 2:
        ap.error("run it under mpiexec with two ranks or more: one rank exchanges nothing")
    total = a.mib * MIB // 4
    rows = []
    for bucket_mib in a.bucket_mib:
        sends = _buckets(total, bucket_mib * MIB // 4, world)
        sums = [np.empty(s.size // world, np.float32) for s in sends]
        means = [np.empty_like(s) for s in sends]

        def pipelined():
            reqs = [comm.Ireduce_scatter_block(s, r, MPI.SUM) for s, r in zip(sends, sums)]
            gathers = []
            for req, r, m in zip(reqs, sums, means):
                req.Wait()
                r /= np.float32(world)
                gathers.append(comm.Iallgather(r, m))
            MPI.Request.Waitall(gathers)

        def spin(request):
            while not request.Test():
                pass

        def stepwise():
            for s, r, m in zip(sends, sums, means):
                spin(comm.Ireduce_scatter_block(s, r, MPI.SUM))
                r /= np.float32(world)
                spin(comm.Iallgather(r, m))

        def iallreduce():
            for m in means:
                spin(comm.Iallreduce(MPI.IN_PLACE, m, MPI.SUM))

        def blocking():
            for s, r, m in zip(sends, sums, means):
                comm.Reduce_scatter_block(s, r, MPI.SUM)
                r /= np.float32(world)
                comm.Allgather(r, m)

        def allreduce():
            for m in means:
                comm.Allreduce(MPI.IN_PLACE, m, MPI.SUM)

        for name, fn in (("pipelined", pipelined), ("stepwise", stepwise), ("blocking", blocking),
                         ("iallreduce", iallreduce), ("allreduce", allreduce)):
            s = _timed(comm, fn)
            rows.append({"label": a.label, "bucket_mib": bucket_mib, "pattern": name, "s": s,
                         "GBps": 4 * total / s / 1e9})
        copy_to = np.empty_like(sends[0])
        c = _timed(comm, lambda: np.copyto(copy_to, sends[0]))
        rows.append({"label": a.label, "bucket_mib": bucket_mib, "pattern": "host copy of a bucket",
                     "s": c, "GBps": sends[0].nbytes / c / 1e9})
    if rank == 0:
        print(f"{MPI.Get_library_version().splitlines()[0]}; {world} ranks; {a.mib} MiB per rank; settings: {a.label}")
        print(f"{'bucket MiB':>10}  {'pattern':<22} {'ms':>9} {'GB/s':>7}")
        for r in rows:
            print(f"{r['bucket_mib']:>10}  {r['pattern']:<22} {1e3 * r['s']:9.1f} {r['GBps']:7.2f}")
        if a.json:
            with open(a.json, "w") as f:
                json.dump({"world": world, "mib": a.mib, "label": a.label, "rows": rows}, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
