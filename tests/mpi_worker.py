"""One rank of an MPI data-parallel run (used by tests/trainer/test_mpi.py), launched by mpiexec:

    mpiexec -n N python tests/mpi_worker.py --windows W --accum A --out PREFIX
        [--timeout S] [--hang-at K] [--die-at K] [--run-id-of-rank1 ID] [--stage-after]

Rank r (from MPI) trains the micro model of tests/sync_worker.py on its share of each window with
``Trainer.with_mpi_grad_sync`` and saves its final weights to PREFIX.rank<r>.npz. A TrainError is
printed as one ``error:`` line and ends the whole job (exit status 3 on that rank). ``--hang-at K``
makes rank 1 stop responding before window K's sync, ``--die-at K`` makes it kill itself there.
``--stage-after``: gradients are read back after each window's whole pass, not bucket by bucket
as its backward finishes them.
"""
from __future__ import annotations

import argparse
import os
import signal
import sys
import time
from pathlib import Path

# tests/ for sync_worker, and the checkout: without it, tests/trainer/ would import as the trainer package
sys.path[:0] = [str(Path(__file__).resolve().parent), str(Path(__file__).resolve().parents[1])]
from sync_worker import make_trainer, rank_sequences  # noqa: E402


def main(argv=None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--windows", type=int, required=True)
    ap.add_argument("--accum", type=int, required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--timeout", type=float, default=120.0)
    ap.add_argument("--hang-at", type=int)
    ap.add_argument("--die-at", type=int)
    ap.add_argument("--run-id-of-rank1", default="run")
    ap.add_argument("--stage-after", action="store_true")
    a = ap.parse_args(argv)

    from mpi4py import MPI
    from lfm2jit import ComputeEngine, WgpuContext
    from trainer import TrainError
    comm = MPI.COMM_WORLD
    rank, world = comm.Get_rank(), comm.Get_size()
    ctx = WgpuContext.create()
    engine = ComputeEngine(ctx)
    model, tr = make_trainer(ctx, engine, a.accum)
    tr.with_mpi_grad_sync(timeout_s=a.timeout, run_id=a.run_id_of_rank1 if rank == 1 else "run",
                          stage_in_backward=not a.stage_after)
    try:
        for j, (i, t, m) in enumerate(rank_sequences(rank, world, a.windows, a.accum)):
            window = j // a.accum + 1
            if rank == 1 and j % a.accum == a.accum - 1:
                if window == a.die_at:
                    os.kill(os.getpid(), signal.SIGKILL)
                if window == a.hang_at:
                    time.sleep(3600)
            tr.train_step_masked(i, t, m, model.parameters())
    except TrainError as e:
        print(f"error: rank {rank}: {e}", file=sys.stderr, flush=True)
        time.sleep(1.0)                       # let mpiexec forward the line before the job is torn down
        comm.Abort(3)
        return 3          # should Abort return (a rank saved its weights after it once, under load), save nothing
    import numpy as np
    np.savez(f"{a.out}.rank{rank}.npz", **model.state_dict(), optimizer_steps=tr.optimizer_steps())
    return 0


if __name__ == "__main__":
    sys.exit(main())
