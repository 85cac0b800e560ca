"""Gradient averaging across processes through a shared directory (no network library needed).

Before the first step every rank announces itself in ``<run_id>.hello.rank<r>.json``: run id,
world size, rank, a random nonce, its pid and host, and the names, shapes and dtypes of the
parameters it trains. It waits until every rank of its world has announced itself and compares:
a different world size, a rank outside the world, other parameters, or a second process with the
same rank (the announcement is created exclusively, so the second one fails) ends the run with a
TrainError before any step. The rank that finds the problem also writes ``<run_id>.abort.json``
with the reason, which every other rank checks while it waits (in the handshake and at every
round), so all of them stop, not only the one that noticed.

At the end of every accumulation window (a sync round) every rank writes its gradients to
``<run_id>.round<n>.rank<r>.safetensors`` (written to a fresh temporary file, created
exclusively and never through a symlink, then renamed, so a reader never sees half a file and a
name planted in the directory is never followed), waits until all ranks' files of round n exist,
checks each (the safetensors layout against the file size; the tensor names, shapes and dtypes
against its own; the run id, rank, round and nonce in its metadata against the peer's
announcement) and replaces its gradients by their mean. A file that fails a check is a TrainError
naming the file and what was expected, raised before anything is applied. Files are numbered by
round, not by optimizer step: a window whose step is skipped (a loss-scale overflow, decided on
the averaged gradients, so by every rank alike) does not advance the step, and the next window
must not read a peer's file of the skipped one. A rank deletes its own file of round n-2 at round
n: every peer that reached round n-1 has read it. Files carry the run id, so leftovers of an
earlier run with another id are never read; a run resumed from a checkpoint of optimizer step k
syncs as ``<run_id>.from<k>``.

Besides gradients, ranks combine a few numbers (a step's loss sum, token counts, held-out sums):
``gather(values)`` writes ``<run_id>.scalars<n>.rank<r>.json`` (run id, rank, number n, nonce and
the values), waits for every rank's file n and returns all ranks' values in rank order;
``allreduce_sum`` adds them up in rank order, so every rank gets the same float. A rank deletes its
own file n-2 at gather n, as for gradients. ``finish()`` ends a run that went well: a last gather
(every rank has read every file before it), then each rank removes its own files (gradients,
numbers, announcement) and writes ``<run_id>.bye.rank<r>``; rank 0 waits for every rank's bye and
removes the last gather's files and the byes, so the directory holds nothing of the run and the same
command can run again.
"""
from __future__ import annotations

import json
import os
import re
import secrets
import socket
import stat
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from safetensors.numpy import save

from .errors import TrainError

# A run id is one file-name component: no path separators, not "." or "..", nothing hidden.
RUN_ID_PATTERN = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,63}")
FORMAT = 1                      # of the announcement files
MAX_HEADER = 100 << 20          # bytes of a peer file's safetensors header
_ST_DTYPES = {"float32": "F32", "float16": "F16", "float64": "F64", "int64": "I64", "int32": "I32",
              "bfloat16": "BF16"}


def run_id_problem(run_id) -> str | None:
    """Why ``run_id`` cannot name a run's files (None when it can)."""
    if not isinstance(run_id, str):
        return f"must be a string, got {type(run_id).__name__}"
    if not RUN_ID_PATTERN.fullmatch(run_id):
        return (f"must be 1 to 64 letters, digits, '.', '_' or '-', starting with a letter or digit, "
                f"got {run_id!r}")
    return None


@dataclass
class FileGradSyncConfig:
    dir: str | os.PathLike
    rank: int
    world_size: int
    timeout_s: float = 600.0
    run_id: str = "run"
    poll_s: float = 0.02

    def __post_init__(self):
        if not isinstance(self.world_size, int) or isinstance(self.world_size, bool) or self.world_size < 1:
            raise ValueError(f"world_size must be a positive integer, got {self.world_size!r}")
        if not isinstance(self.rank, int) or isinstance(self.rank, bool) or not 0 <= self.rank < self.world_size:
            raise ValueError(f"rank must be in 0..{self.world_size - 1}, got {self.rank!r}")
        if not self.timeout_s > 0:
            raise ValueError(f"timeout_s must be positive, got {self.timeout_s!r}")
        problem = run_id_problem(self.run_id)
        if problem:
            raise ValueError(f"run_id {problem}")


def write_new(path: Path, data: bytes, exclusive: bool = False) -> None:
    """Write ``data`` to ``path`` through a fresh temporary file beside it, created with
    O_CREAT | O_EXCL | O_NOFOLLOW (so never an existing file or a symlink planted there), then
    published: renamed over ``path`` (a symlink at ``path`` is replaced, not followed) or, when
    ``exclusive``, hard-linked to it, which fails with FileExistsError if ``path`` exists."""
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_BINARY", 0)
    while True:
        tmp = path.with_name(f"{path.name}.tmp{os.getpid()}.{secrets.token_hex(6)}")
        try:
            fd = os.open(tmp, flags, 0o644)
            break
        except FileExistsError:
            continue
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        if not exclusive:
            os.replace(tmp, path)
            return
        try:
            os.link(tmp, path)
        except FileExistsError:
            raise
        except OSError:              # no hard links here: create the name itself exclusively
            fd = os.open(path, flags, 0o644)
            with os.fdopen(fd, "wb") as f:
                f.write(data)
    finally:
        try:
            os.unlink(tmp)
        except FileNotFoundError:
            pass


def _read_regular(path: Path, limit: int) -> bytes:
    """The bytes of a regular file (not through a symlink), at most ``limit`` of them."""
    fd = os.open(path, os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_BINARY", 0))
    with os.fdopen(fd, "rb") as f:
        st = os.fstat(f.fileno())
        if not stat.S_ISREG(st.st_mode):
            raise OSError("not a regular file")
        if st.st_size > limit:
            raise OSError(f"{st.st_size} bytes, more than the {limit} expected")
        return f.read(limit + 1)


def _describe(hello) -> str:
    if not isinstance(hello, dict):
        return "an unreadable announcement"
    pid, host = hello.get("pid"), hello.get("host")
    text = f"pid {pid!r} on {host!r}"
    if host == socket.gethostname() and type(pid) is int and pid > 0:
        try:
            os.kill(pid, 0)              # signal 0: only asks whether the process exists
        except ProcessLookupError:
            text += " (no longer running)"
        except OSError:
            pass
    return text


def sum_in_rank_order(rows: list[list[float]]) -> list[float]:
    """Column sums of every rank's row, added in rank order: each rank computes the same float."""
    total = [0.0] * len(rows[0])
    for row in rows:
        total = [a + b for a, b in zip(total, row)]
    return total


class FileGradSync:
    def __init__(self, config: FileGradSyncConfig):
        self.config = config
        self.dir = Path(config.dir)
        if self.dir.exists() and not self.dir.is_dir():
            raise ValueError(f"sync directory {self.dir} is not a directory")
        self.dir.mkdir(parents=True, exist_ok=True)
        self.rounds = 0          # sync rounds completed: one per accumulation window, skipped or not
        self.run_id = config.run_id
        self.nonce = secrets.token_hex(8)
        self.ready = config.world_size == 1   # the handshake is done
        self.peers: dict[int, dict] = {}      # rank -> its announcement
        self.gathers = 0                      # scalar gathers completed

    @property
    def rank(self) -> int:
        return self.config.rank

    @property
    def world_size(self) -> int:
        return self.config.world_size

    def resume_from(self, step: int) -> None:
        """Sync as run ``<run_id>.from<step>`` from round 1: every rank resumes from the same
        checkpoint, so all pick the same name, and the interrupted run's files are left unread."""
        self.run_id = f"{self.config.run_id}.from{step}"
        self.rounds = 0
        self.gathers = 0
        self.ready = self.config.world_size == 1
        self.peers = {}

    # ---- file names ----
    def path(self, round_: int, rank: int) -> Path:
        return self.dir / f"{self.run_id}.round{round_:08d}.rank{rank}.safetensors"

    def hello_path(self, rank: int) -> Path:
        return self.dir / f"{self.run_id}.hello.rank{rank}.json"

    def abort_path(self) -> Path:
        return self.dir / f"{self.run_id}.abort.json"

    def scalars_path(self, n: int, rank: int) -> Path:
        return self.dir / f"{self.run_id}.scalars{n:08d}.rank{rank}.json"

    def bye_path(self, rank: int) -> Path:
        return self.dir / f"{self.run_id}.bye.rank{rank}.json"

    # ---- stopping every rank ----
    def _fail(self, reason: str) -> TrainError:
        """Record ``reason`` for the other ranks (the first reason written stays) and return the error."""
        cfg = self.config
        note = {"rank": cfg.rank, "pid": os.getpid(), "host": socket.gethostname(), "reason": reason}
        try:
            write_new(self.abort_path(), json.dumps(note).encode(), exclusive=True)
        except OSError:
            pass
        return TrainError(f"{reason}; nothing was applied")

    def _check_abort(self) -> None:
        p = self.abort_path()
        if not os.path.lexists(p):
            return
        try:
            note = json.loads(_read_regular(p, 1 << 20))
            who, reason = f"rank {note['rank']} ({_describe(note)})", str(note["reason"])
        except (OSError, ValueError, KeyError, TypeError):
            who, reason = "a process", f"{p} exists but is unreadable"
        raise TrainError(f"{who} stopped the run ({p}): {reason}; nothing was applied")

    # ---- the handshake ----
    def handshake(self, names: list[str], params: list) -> None:
        """Announce this rank and wait until every rank of the world has announced the same run:
        same world size, distinct ranks, the same parameter names, shapes and dtypes. Raises a
        TrainError (and stops the other ranks) on a mismatch, a duplicate rank or a timeout."""
        cfg = self.config
        if self.ready:
            return
        mine = [[n, [int(d) for d in p.shape], str(p.dtype)] for n, p in zip(names, params)]
        me = {"lfm2jit_sync": FORMAT, "run_id": self.run_id, "rank": cfg.rank, "world_size": cfg.world_size,
              "nonce": self.nonce, "pid": os.getpid(), "host": socket.gethostname(), "time": time.time(),
              "params": mine}
        where = f"gradient sync in {self.dir}, run {self.run_id!r}"
        own = self.hello_path(cfg.rank)
        try:
            write_new(own, json.dumps(me).encode(), exclusive=True)
        except FileExistsError:
            holder = self._read_hello(own)
            if not (isinstance(holder, dict) and holder.get("nonce") == self.nonce):   # not a retry of ours
                raise self._fail(
                    f"{where}: rank {cfg.rank} was announced twice, by {_describe(holder)} and by pid {os.getpid()} "
                    f"on {socket.gethostname()!r}: every process of a run needs its own rank (if {own.name} is left "
                    f"from an earlier run, remove {self.run_id}.* there or pass a new run id to every rank)") from None
        except OSError as e:
            raise TrainError(f"{where}: cannot write {own}: {e}") from None
        deadline = time.monotonic() + cfg.timeout_s
        seen: dict[int, dict] = {cfg.rank: me}
        unreadable: dict[Path, float] = {}
        prefix, suffix = f"{self.run_id}.hello.rank", ".json"
        while True:
            self._check_abort()
            try:
                entries = os.listdir(self.dir)
            except OSError as e:
                raise TrainError(f"{where}: cannot list the directory: {e}") from None
            for name in entries:
                middle = name[len(prefix):-len(suffix)] if name.startswith(prefix) and name.endswith(suffix) else ""
                if not middle.isdigit() or int(middle) in seen:
                    continue
                r, p = int(middle), self.dir / name
                if r >= cfg.world_size:
                    raise self._fail(f"{where}: {name} announces rank {r}, outside this rank's world of "
                                     f"{cfg.world_size} (ranks 0..{cfg.world_size - 1}): every rank needs the same "
                                     "world size")
                hello = self._read_hello(p)
                if not isinstance(hello, dict):
                    first = unreadable.setdefault(p, time.monotonic())
                    if time.monotonic() - first > 2.0:
                        raise self._fail(f"{where}: {p} is not an announcement (expected JSON with run_id, rank, "
                                         "world_size, nonce and params)")
                    continue
                problem = self._compare(hello, r, me)
                if problem:
                    raise self._fail(f"{where}: {problem}")
                seen[r] = hello
            if len(seen) == cfg.world_size:
                break
            if time.monotonic() > deadline:
                missing = [r for r in range(cfg.world_size) if r not in seen]
                raise TrainError(f"gradient sync timed out after {cfg.timeout_s:g}s before the first step: rank(s) "
                                 f"{missing} of {cfg.world_size} did not announce themselves in {self.dir} (start "
                                 "one process per rank with the same world size, sync directory and run id); "
                                 "nothing was applied")
            time.sleep(cfg.poll_s)
        self.peers = {r: h for r, h in seen.items() if r != cfg.rank}
        self.ready = True

    def _read_hello(self, p: Path):
        try:
            hello = json.loads(_read_regular(p, 64 << 20))
        except (OSError, ValueError):
            return None
        return hello if isinstance(hello, dict) and hello.get("lfm2jit_sync") == FORMAT else None

    def _compare(self, hello: dict, rank: int, me: dict) -> str | None:
        """What differs between rank ``rank``'s announcement and this rank's (None: they agree)."""
        who = f"rank {rank} ({_describe(hello)})"
        if hello.get("run_id") != self.run_id or hello.get("rank") != rank:
            return (f"{self.hello_path(rank).name} announces run {hello.get('run_id')!r} rank {hello.get('rank')!r}, "
                    f"not run {self.run_id!r} rank {rank}")
        if not isinstance(hello.get("nonce"), str):
            return f"{self.hello_path(rank).name} has no nonce"
        if hello.get("world_size") != me["world_size"]:
            return (f"{who} was started with world size {hello.get('world_size')!r} but rank {me['rank']} with "
                    f"{me['world_size']}: every rank of a run needs the same world size")
        theirs = hello.get("params")
        try:
            theirs = {str(n): (list(s), str(d)) for n, s, d in theirs}
        except (TypeError, ValueError):
            return f"{self.hello_path(rank).name} lists its parameters unreadably"
        ours = {n: (s, d) for n, s, d in me["params"]}
        if theirs == ours:
            return None
        diff = []
        only_theirs, only_ours = sorted(set(theirs) - set(ours)), sorted(set(ours) - set(theirs))
        if only_ours:
            diff.append(f"{len(only_ours)} not trained by rank {rank} (e.g. {only_ours[0]})")
        if only_theirs:
            diff.append(f"{len(only_theirs)} trained only by rank {rank} (e.g. {only_theirs[0]})")
        for n in sorted(set(ours) & set(theirs)):
            if ours[n] != theirs[n]:
                diff.append(f"{n} is {theirs[n][1]}{theirs[n][0]} on rank {rank} but {ours[n][1]}{ours[n][0]} on "
                            f"rank {me['rank']}")
                break
        return (f"{who} trains other parameters than rank {me['rank']} ({len(theirs)} vs {len(ours)}: "
                + "; ".join(diff) + "): every rank must train the same model and parameters")

    # ---- a round ----
    def average(self, engine, names: list[str], params: list, step: int) -> None:
        """Replace each parameter's .grad by the mean over all ranks of this window's gradients
        (the window that would be optimizer step ``step``; named in errors)."""
        cfg = self.config
        if cfg.world_size == 1:
            return
        self.handshake(names, params)
        self._check_abort()
        n_round = self.rounds + 1
        mine = {n: p.grad.numpy() for n, p in zip(names, params)}
        target = self.path(n_round, cfg.rank)
        meta = {"run_id": self.run_id, "rank": str(cfg.rank), "round": str(n_round), "nonce": self.nonce}
        try:
            write_new(target, save(mine, metadata=meta))
        except OSError as e:
            raise TrainError(f"gradient sync at optimizer step {step}: cannot write {target}: {e}; "
                             "nothing was applied") from None
        peers = [r for r in range(cfg.world_size) if r != cfg.rank]
        deadline = time.monotonic() + cfg.timeout_s
        waiting = list(peers)
        while waiting:
            waiting = [r for r in waiting if not os.path.lexists(self.path(n_round, r))]
            if not waiting:
                break
            self._check_abort()
            if time.monotonic() > deadline:
                raise TrainError(f"gradient sync timed out after {cfg.timeout_s:g}s at optimizer step {step}: "
                                 f"rank(s) {waiting} of {cfg.world_size} did not write their gradients to "
                                 f"{self.dir}; nothing was applied")
            time.sleep(cfg.poll_s)
        total = {n: a.astype(np.float64) for n, a in mine.items()}
        for r in peers:
            theirs = self._read_peer(r, n_round, mine, step)
            for n in total:
                total[n] += theirs[n]
        self._check_abort()
        for n, p in zip(names, params):
            p.grad.write((total[n] / cfg.world_size).astype(np.float32))
        self.rounds = n_round
        old = self.path(n_round - 2, cfg.rank)
        try:
            old.unlink()
        except FileNotFoundError:
            pass

    # ---- a few numbers ----
    def gather(self, values, what: str = "numbers") -> list[list[float]]:
        """Every rank's ``values`` (a list of floats, the same length on every rank), in rank order.
        Every rank must call it at the same points of the run (``what`` names the point in errors).
        Needs the handshake done (the CLI does it before the first step)."""
        cfg = self.config
        mine = [float(v) for v in values]
        if cfg.world_size == 1:
            return [mine]
        if not self.ready:
            raise TrainError(f"gather of {what} before the sync handshake (call Trainer.sync_handshake first)")
        self._check_abort()
        n = self.gathers + 1
        own = self.scalars_path(n, cfg.rank)
        note = {"run_id": self.run_id, "rank": cfg.rank, "n": n, "nonce": self.nonce, "what": what, "values": mine}
        try:
            write_new(own, json.dumps(note).encode())
        except OSError as e:
            raise TrainError(f"gathering {what} in {self.dir}: cannot write {own}: {e}") from None
        out: dict[int, list[float]] = {cfg.rank: mine}
        deadline = time.monotonic() + cfg.timeout_s
        while len(out) < cfg.world_size:
            for r in range(cfg.world_size):
                if r in out:
                    continue
                got = self._read_scalars(r, n, len(mine), what)
                if got is not None:
                    out[r] = got
            if len(out) == cfg.world_size:
                break
            self._check_abort()
            if time.monotonic() > deadline:
                missing = [r for r in range(cfg.world_size) if r not in out]
                raise TrainError(f"gradient sync timed out after {cfg.timeout_s:g}s gathering {what}: rank(s) "
                                 f"{missing} of {cfg.world_size} did not write {self.scalars_path(n, missing[0]).name} "
                                 f"to {self.dir}")
            time.sleep(cfg.poll_s)
        self.gathers = n
        try:
            self.scalars_path(n - 2, cfg.rank).unlink()     # every peer that reached n-1 has read it
        except FileNotFoundError:
            pass
        return [out[r] for r in range(cfg.world_size)]

    def allreduce_sum(self, values, what: str = "numbers") -> list[float]:
        """The sum over ranks of each of ``values``, added in rank order (the same float on every rank)."""
        return sum_in_rank_order(self.gather(values, what))

    def _read_scalars(self, rank: int, n: int, count: int, what: str) -> list[float] | None:
        """Rank ``rank``'s values of gather n; None while its file is not there (or is an earlier
        run's, which the peer's write replaces)."""
        p = self.scalars_path(n, rank)
        if not os.path.lexists(p):
            return None
        try:
            note = json.loads(_read_regular(p, 1 << 20))
        except (OSError, ValueError) as e:
            raise self._fail(f"gathering {what}: {p} is unreadable ({e})") from None
        hello = self.peers.get(rank, {})
        if not isinstance(note, dict) or note.get("nonce") != hello.get("nonce"):
            return None
        values = note.get("values")
        if (note.get("run_id") != self.run_id or note.get("rank") != rank or note.get("n") != n
                or not isinstance(values, list) or len(values) != count
                or not all(type(v) in (int, float) for v in values)):
            raise self._fail(f"gathering {what}: {p} is not rank {rank}'s gather {n} of run {self.run_id!r} with "
                             f"{count} numbers (expected {{run_id, rank, n, nonce, values}}); a rank at another "
                             "point of the run?")
        return [float(v) for v in values]

    # ---- the end of a run ----
    def finish(self) -> None:
        """End a run that went well and remove its files (see the module docstring). Every rank calls
        it once, after its last step and gather. Raises a TrainError when a peer never says goodbye."""
        cfg = self.config
        if cfg.world_size == 1 or not self.ready:
            return
        self.gather([0.0], "the end of the run")        # every rank has read every earlier file
        last = self.gathers
        own = ([self.path(k, cfg.rank) for k in range(max(1, self.rounds - 1), self.rounds + 1)]
               + [self.scalars_path(k, cfg.rank) for k in range(max(1, last - 2), last)]
               + [self.hello_path(cfg.rank)])
        for p in own:
            try:
                p.unlink()
            except FileNotFoundError:
                pass
        if cfg.rank != 0:
            try:
                write_new(self.bye_path(cfg.rank), json.dumps({"rank": cfg.rank, "nonce": self.nonce}).encode())
            except OSError as e:
                raise TrainError(f"cannot write {self.bye_path(cfg.rank)}: {e}") from None
            return
        deadline = time.monotonic() + cfg.timeout_s
        waiting = list(range(1, cfg.world_size))
        while waiting:
            waiting = [r for r in waiting if not self._said_bye(r)]
            if not waiting:
                break
            if time.monotonic() > deadline:
                raise TrainError(f"rank(s) {waiting} did not finish within {cfg.timeout_s:g}s; their files of run "
                                 f"{self.run_id!r} stay in {self.dir}")
            time.sleep(cfg.poll_s)
        for p in [self.scalars_path(last, r) for r in range(cfg.world_size)] + [self.bye_path(r) for r in
                                                                                 range(1, cfg.world_size)]:
            try:
                p.unlink()
            except FileNotFoundError:
                pass

    def _said_bye(self, rank: int) -> bool:
        """Whether rank ``rank`` of this run (its nonce, not an earlier run's) wrote its bye."""
        try:
            note = json.loads(_read_regular(self.bye_path(rank), 1 << 16))
        except (OSError, ValueError):
            return False
        return isinstance(note, dict) and note.get("nonce") == self.peers.get(rank, {}).get("nonce")

    def _read_peer(self, rank: int, n_round: int, mine: dict[str, np.ndarray], step: int) -> dict[str, np.ndarray]:
        """Rank ``rank``'s gradients of round ``n_round``, checked against this rank's own."""
        p = self.path(n_round, rank)
        want = {n: (list(a.shape), _ST_DTYPES.get(a.dtype.name, a.dtype.name.upper())) for n, a in mine.items()}
        nbytes = {n: int(a.nbytes) for n, a in mine.items()}
        expected = (f"expected the safetensors gradients of rank {rank}, round {n_round}: {len(want)} tensors "
                    f"named as this rank's, each of this rank's shape and dtype")

        def bad(what: str) -> TrainError:
            return self._fail(f"gradient sync at optimizer step {step}: {p}: {what} ({expected})")

        try:
            data = _read_regular(p, 8 + MAX_HEADER + sum(nbytes.values()))
        except OSError as e:
            raise bad(f"cannot read it: {e.strerror or e}") from None
        if len(data) < 8:
            raise bad(f"{len(data)} bytes, shorter than a safetensors header")
        hlen = int.from_bytes(data[:8], "little")
        if hlen > len(data) - 8 or hlen > MAX_HEADER:
            raise bad(f"its header length says {hlen} bytes but only {len(data) - 8} follow (truncated, or not a "
                      "safetensors file?)")
        try:
            header = json.loads(bytes(data[8:8 + hlen]).decode("utf-8"))
        except (UnicodeDecodeError, ValueError) as e:
            raise bad(f"its header is not JSON ({e})") from None
        if not isinstance(header, dict):
            raise bad(f"its header is a JSON {type(header).__name__}, not an object")
        meta = header.pop("__metadata__", None)
        hello = self.peers.get(rank, {})
        want_meta = {"run_id": self.run_id, "rank": str(rank), "round": str(n_round), "nonce": hello.get("nonce")}
        if not isinstance(meta, dict) or any(meta.get(k) != v for k, v in want_meta.items()):
            got = {k: meta.get(k) for k in want_meta} if isinstance(meta, dict) else meta
            raise bad(f"its metadata {got!r} is not that of rank {rank}'s file of round {n_round} of this run "
                      f"(rank {rank} announced itself as {_describe(hello)})")
        missing, extra = sorted(set(want) - set(header)), sorted(set(header) - set(want))
        if missing or extra:
            raise bad(", ".join(x for x in (f"{len(missing)} tensor(s) missing (e.g. {missing[0]})" if missing else "",
                                            f"{len(extra)} unexpected tensor(s) (e.g. {extra[0]})" if extra else "")
                                if x))
        body = memoryview(data)[8 + hlen:]
        spans = []
        out = {}
        for n, (shape, dtype) in want.items():
            e = header[n]
            if not isinstance(e, dict):
                raise bad(f"tensor {n}: its entry is not an object")
            if e.get("dtype") != dtype:
                raise bad(f"tensor {n} has dtype {e.get('dtype')!r}; expected {dtype}")
            sh = e.get("shape")
            if sh != shape or not all(type(d) is int for d in sh):
                raise bad(f"tensor {n} has shape {sh!r}; expected {shape}")
            off = e.get("data_offsets")
            if (not isinstance(off, list) or len(off) != 2 or not all(type(o) is int for o in off)
                    or not 0 <= off[0] <= off[1]):
                raise bad(f"tensor {n} has data_offsets {off!r}; expected [begin, end]")
            if off[1] - off[0] != nbytes[n]:
                raise bad(f"tensor {n} spans {off[1] - off[0]} bytes; expected {nbytes[n]}")
            if off[1] > len(body):
                raise bad(f"tensor {n} ends at byte {off[1]} of the data but the file holds {len(body)} (truncated?)")
            spans.append((off[0], off[1], n))
            out[n] = np.frombuffer(body, dtype=mine[n].dtype.newbyteorder("<"), count=mine[n].size,
                                   offset=off[0]).reshape(shape)
        spans.sort()
        for (_, end, a), (begin, _, b) in zip(spans, spans[1:]):
            if begin < end:
                raise bad(f"tensors {a} and {b} overlap")
        if spans and spans[-1][1] != len(body):
            raise bad(f"{len(body) - spans[-1][1]} bytes after the last tensor")
        return out
