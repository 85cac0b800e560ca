"""Gradients averaged over MPI ranks (``mpiexec -n N python -m trainer --distributed mpi``).

The same contract as the file sync (trainer/sync.py), through an MPI communicator (mpi4py; the
``mpich`` wheel from PyPI is all it takes, a system MPI works too):

* ``handshake``: every rank's run id, world size and trained parameters (names, shapes, dtypes)
  are gathered on every rank, so each one reaches the same verdict; a mismatch is a TrainError
  on every rank before the first step.
* ``average``: each rank reads its gradients back in bucket order (each bucket packed by buffer
  copies into a persistent mappable staging buffer, lfm2jit/runtime/staging.py, and copied out of
  the mapped memory by a few threads, lfm2jit/runtime/host_threads.py, while the GPU still copies
  the next buckets; with ``staged_in_backward``, the default, the window's last pass makes the
  copies itself as its backward finishes each bucket, last layer first, so on Dawn the first
  buckets are read and exchanged while the GPU still runs the backward of earlier layers), and
  averages each bucket in pieces of EXCHANGE_BYTES, one MPI collective at a time (several in
  flight were slower, benches/results/h200_mpi_exchange.log). Two ranks: an in-place
  allreduce (any algorithm gives both ranks a + b = b + a, the same bits); more: a reduce-scatter
  (rank r sums the r-th chunk of every rank's piece, once, in an order fixed by the world size) and
  an allgather of those sums, so every rank holds the same bits whatever MPI's allreduce would do.
  The sums are divided by the world size on the host, and once every bucket has been exchanged they
  go back into the .grad buffers through two staging buffers taken in turn (one is filled while the
  GPU unpacks the other). The file sync (float64 sums in rank order) and one process agree with it
  within float32 rounding.
* Faults: a collective that does not complete within ``timeout_s`` (a rank died or hangs) is a
  TrainError naming the step and the ranks' state; nothing is applied. A dead rank normally makes
  mpiexec end the job; the timeout covers the rest.
"""
from __future__ import annotations

import json
import os
import time

import numpy as np

from lfm2jit.runtime.host_threads import in_ranges
from lfm2jit.runtime.staging import StagedReadback, StagedWrite

from .errors import TrainError
from .sync import sum_in_rank_order

BUCKET_BYTES = 32 << 20        # float32 gradient bytes per readback slot
EXCHANGE_BYTES = 8 << 20       # ... per MPI collective (faster than 32 MiB: benches/results/h200_mpi_exchange.log)
POLL_S = 0.001                 # between tests of a request after SPIN_S seconds of testing back to back
SPIN_S = 1.0
UPLOAD_SLOTS = 2               # staging buffers the means are written back through, in turn


def load_mpi():
    """mpi4py's MPI module, or a TrainError saying what to install."""
    try:
        from mpi4py import MPI
    except ImportError as e:
        raise TrainError(f"--distributed mpi needs mpi4py and an MPI library ({e}): pip install mpi4py mpich") from None
    return MPI


def local_rank() -> int:
    """This process's rank among the ranks on its host (which GPU of the host it takes)."""
    MPI = load_mpi()
    return MPI.COMM_WORLD.Split_type(MPI.COMM_TYPE_SHARED).Get_rank()


class MpiGradSync:
    """A ``Trainer.distributed_grad_sync`` over an MPI communicator (default: COMM_WORLD)."""

    def __init__(self, comm=None, timeout_s: float = 600.0, run_id: str = "run", stage_in_backward: bool = True):
        MPI = load_mpi()
        self.MPI = MPI
        self.comm = comm if comm is not None else MPI.COMM_WORLD
        self.rank, self.world_size = self.comm.Get_rank(), self.comm.Get_size()
        if not (isinstance(timeout_s, (int, float)) and timeout_s > 0):
            raise ValueError(f"timeout_s must be a positive number of seconds, got {timeout_s!r}")
        if not isinstance(stage_in_backward, bool):
            raise TypeError(f"stage_in_backward must be True or False, got {stage_in_backward!r}")
        self.timeout_s, self.run_id = float(timeout_s), run_id
        self.stage_in_backward = stage_in_backward      # read in staged_in_backward(): may change between windows
        self.ready = False
        self.rounds = 0
        # summed over rounds, for benches: waiting for the step's GPU work, reading the gradients back,
        # waiting for the exchanges beyond the reads they overlap, writing the means back
        self.seconds = {"backward_wait": 0.0, "readback": 0.0, "exchange_wait": 0.0, "write": 0.0}
        self._staging = None                            # StagedReadback and StagedWrite, made on the first average()
        self._upload = None
        self._in_backward: dict = {}                    # gradient layout -> BackwardStaging
        self._host = None                               # _HostArrays of the last average()
        self.bytes = 0                                  # float32 gradient bytes read back, summed

    def resume_from(self, step: int) -> None:
        self.rounds = step

    def _wait(self, request, what: str):
        """Complete a non-blocking MPI request, or raise after timeout_s. MPI moves a large message
        only inside MPI calls, so for the first SPIN_S the request is tested back to back (giving
        up the core between tests, for a GPU driver on the CPU); then every POLL_S (a peer still
        in its backward)."""
        start = time.monotonic()
        deadline = start + self.timeout_s
        while not request.Test():
            now = time.monotonic()
            if now > deadline:
                raise TrainError(f"MPI gradient sync: {what} did not complete within {self.timeout_s:g}s on rank "
                                 f"{self.rank} of {self.world_size} (a rank died, hangs or is elsewhere in the run); "
                                 "nothing was applied")
            if now - start < SPIN_S:
                os.sched_yield()
            else:
                time.sleep(POLL_S)

    def _allgather_json(self, value, what: str) -> list:
        """Every rank's ``value`` (JSON), gathered with non-blocking collectives under the timeout."""
        mine = np.frombuffer(json.dumps(value).encode(), np.uint8)
        lengths = np.zeros(self.world_size, np.int64)
        self._wait(self.comm.Iallgather(np.array([mine.size], np.int64), lengths), what)
        data = np.empty(int(lengths.sum()), np.uint8)
        self._wait(self.comm.Iallgatherv(mine, [data, lengths.tolist()]), what)
        ends = np.cumsum(lengths)
        return [json.loads(bytes(data[e - n:e])) for n, e in zip(lengths, ends)]

    def handshake(self, names: list[str], params: list) -> None:
        me = {"run_id": self.run_id, "world_size": self.world_size, "rank": self.rank,
              "params": [[n, list(p.shape), p.dtype] for n, p in zip(names, params)]}
        hellos = self._allgather_json(me, "the handshake (every rank announcing its run)")
        for other in hellos:
            for key, what in (("run_id", "run id"), ("world_size", "world size")):
                if other[key] != me[key]:
                    raise TrainError(f"MPI gradient sync: rank {other['rank']} has {what} {other[key]!r} but rank "
                                     f"{self.rank} has {me[key]!r}: every rank must run the same job")
            if other["params"] != me["params"]:
                ours, theirs = dict((n, (s, d)) for n, s, d in me["params"]), dict(
                    (n, (s, d)) for n, s, d in other["params"])
                diff = sorted(set(ours) ^ set(theirs)) or [n for n in ours if ours[n] != theirs[n]]
                raise TrainError(f"MPI gradient sync: rank {other['rank']} trains other parameters than rank "
                                 f"{self.rank} (first difference: {diff[0]}): every rank must train the same model")
        self.ready = True

    def gather(self, values, what: str = "numbers") -> list[list[float]]:
        """Every rank's ``values`` (floats, the same count on every rank), in rank order."""
        return [[float(v) for v in row] for row in self._allgather_json([float(v) for v in values], what)]

    def allreduce_sum(self, values, what: str = "numbers") -> list[float]:
        """The sum over ranks of each of ``values``, added in rank order (the same float on every rank)."""
        return sum_in_rank_order(self.gather(values, what))

    def finish(self) -> None:
        """The end of a run that went well: every rank waits for every other (nothing on disk to clean),
        and the mapped staging buffers (as large as every trained gradient) are released (passes
        recorded to copy into them must not replay afterwards)."""
        if self.world_size > 1 and self.ready:
            self.gather([0.0], "the end of the run")
        for staging in (self._staging, self._upload, *(b.staging for b in self._in_backward.values())):
            if staging is not None:
                staging.release()
        self._staging = self._upload = self._host = None
        self._in_backward = {}

    def staged_in_backward(self, engine, params: list) -> "BackwardStaging | None":
        """The staging of a window's last pass that copies each bucket of ``params`` (in the order
        the backward finishes them: Lfm2Model.gradient_order) as soon as the backward has finished
        it, for ``average(..., staged=...)`` to read while the rest of the backward runs; the same
        object (and staging buffers) for the same gradients, so a recorded pass that copies into
        them replays. None with one rank (nothing is exchanged) or without ``stage_in_backward``."""
        if self.world_size == 1 or not self.stage_in_backward:
            return None
        key = tuple((id(p.grad.buffer), p.grad.offset, p.grad.size) for p in params)
        staged = self._in_backward.get(key)
        if staged is None:
            staged = self._in_backward[key] = BackwardStaging(engine, params)
        return staged

    def average(self, engine, names: list[str], params: list, step: int,
                staged: "BackwardStaging | None" = None) -> None:
        """Replace each parameter's .grad by the mean over the ranks of this window's gradients
        (the exchange is described in the module's docstring). ``staged``: the window's last pass
        already recorded the copies into it (``staged_in_backward``), so each bucket is read as
        soon as the GPU has copied it, while it still runs the backward of earlier layers."""
        if self.world_size == 1:
            return
        if not self.ready:
            self.handshake(names, params)
        clock = time.perf_counter
        if self._upload is None:
            self._upload = StagedWrite(engine)
        t0 = clock()
        if staged is None:
            buckets = _buckets(params)
            if self._staging is None:
                self._staging = StagedReadback(engine)
            engine.synchronize()                      # the step's own work ends first: timed apart
            staging, sizes = self._staging, self._staging.submit([[p.grad for p in bucket] for bucket in buckets])
        else:
            staged.start_reading()
            buckets, staging, sizes = staged.buckets, staged.staging, staged.sizes
        t1 = clock()
        self.seconds["backward_wait"] += t1 - t0
        if self._host is None or self._host.sizes != sizes:
            self._host = _HostArrays(sizes, self.world_size, self.rank)
        for i, values in enumerate(self._host.values):  # bucket i is copied out while the GPU copies i + 1
            t0 = clock()
            staging.read(i, values)
            t1 = clock()
            for piece in self._host.pieces[i]:
                self._exchange(piece, step)
            self.seconds["readback"] += t1 - t0
            self.seconds["exchange_wait"] += clock() - t1
            self.bytes += values.nbytes
        t1 = clock()                                    # every mean has arrived before any .grad changes
        for i, bucket in enumerate(buckets):
            self._upload.write(i % UPLOAD_SLOTS, [p.grad for p in bucket], self._host.values[i])
        self.seconds["write"] += clock() - t1
        self.rounds += 1

    def _exchange(self, piece: "_Piece", step: int) -> None:
        """Replace ``piece.values`` by their mean over the ranks, the same bits on every rank."""
        MPI, world = self.MPI, self.world_size
        if piece.mine is None:
            self._wait(self.comm.Iallreduce(MPI.IN_PLACE, piece.values, MPI.SUM),
                       f"the gradient exchange (allreduce) at optimizer step {step}")
            _divide(piece.values, world)
            return
        self._wait(self.comm.Ireduce_scatter(piece.values, piece.mine, piece.counts, MPI.SUM),
                   f"the gradient exchange (reduce-scatter) at optimizer step {step}")
        _divide(piece.mine, world)
        self._wait(self.comm.Iallgatherv(piece.mine, [piece.values, piece.counts]),
                   f"the gradient exchange (allgather) at optimizer step {step}")


def _divide(values: np.ndarray, world: int) -> None:
    in_ranges(lambda a, b: np.divide(values[a:b], np.float32(world), out=values[a:b]), values.size, values.nbytes)


class BackwardStaging:
    """A window's gradients, in buckets of the order the backward finishes them, each copied into
    its own staging buffer by the recorded pass as soon as its last gradient is final: the pass
    calls ``start()``, ``ready(params)`` as the backward finishes parameters (Lfm2Model.backward's
    on_ready) and ``finish()`` at its end, which copies whatever is left. A bucket therefore never
    waits for more than its own parameters, and one whose parameters are never reported is copied
    after the whole backward: late, never wrong."""

    def __init__(self, engine, params: list):
        self.engine = engine
        self.buckets = _buckets(params)
        self.staging = StagedReadback(engine)
        self.sizes = self.staging.reserve([sum(p.grad.size for p in b) for b in self.buckets])
        self._bucket_of = {id(p): i for i, b in enumerate(self.buckets) for p in b}
        self._waiting: list[int] = []                   # bucket -> parameters not finished yet (-1: copied)

    def start(self) -> None:
        self._waiting = [len(b) for b in self.buckets]

    def ready(self, params) -> None:
        for p in params:
            i = self._bucket_of.get(id(p))
            if i is not None and self._waiting[i] > 0:
                self._waiting[i] -= 1
                if self._waiting[i] == 0:
                    self._copy(i)

    def finish(self) -> None:
        for i, left in enumerate(self._waiting):
            if left >= 0:
                self._copy(i)

    def start_reading(self) -> None:
        """Submit the recorded pass with its copies. Where mapping a buffer waits only for the
        submissions that used it (Dawn), each bucket is then read as soon as its copy has run;
        elsewhere (wgpu-native) this waits for the whole pass first, or a read could see the
        last window's values."""
        if self.engine.ctx.maps_after_last_use:
            self.engine.flush()
        else:
            self.engine.synchronize()

    def _copy(self, i: int) -> None:
        self.staging.record(i, [p.grad for p in self.buckets[i]], replayed=True)
        self._waiting[i] = -1


class _Piece:
    """One MPI collective's share of a bucket: a view of its values and, with more than two ranks
    (reduce-scatter + allgather; two ranks allreduce in place), the element count of each rank's
    chunk of it and this rank's chunk of the sums (``mine``, None with two ranks)."""

    def __init__(self, values: np.ndarray, world: int, rank: int):
        self.values = values
        chunk = -(-values.size // world)
        self.counts = [max(0, min(chunk, values.size - r * chunk)) for r in range(world)]
        self.mine = np.zeros(self.counts[rank], np.float32) if world > 2 else None


class _HostArrays:
    """The host arrays of one bucket layout, kept from step to step: a fresh array's pages are
    mapped in when first written, which made a readback into fresh arrays about half as fast
    (benches/readback.py). Per bucket: its values (read back, then averaged in place) and
    their pieces of EXCHANGE_BYTES."""

    def __init__(self, sizes: list[int], world: int, rank: int):
        self.sizes = list(sizes)
        self.values = [np.zeros(n, np.float32) for n in sizes]
        per = EXCHANGE_BYTES // 4
        self.pieces = [[_Piece(v[at:at + per], world, rank) for at in range(0, v.size, per)] for v in self.values]


def _buckets(params: list) -> list[list]:
    """The parameters in order, cut into groups of about BUCKET_BYTES of float32 gradients."""
    buckets, current, size = [], [], 0
    for p in params:
        current.append(p)
        size += 4 * p.grad.size
        if size >= BUCKET_BYTES:
            buckets.append(current)
            current, size = [], 0
    return buckets + [current] if current else buckets
