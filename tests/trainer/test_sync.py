"""File gradient sync across real processes: two ranks on disjoint halves of the data equal one
process with twice the accumulation on all of it; a killed or missing peer is a TrainError after
the timeout that applies nothing; another run's files are never read; old files are removed."""
from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
from safetensors.numpy import save_file

from numerics import rel_err
import trainer.trainer as trainer_module
from sync_worker import all_data, make_trainer, overflow_at_window, rank_sequences
from trainer import FileGradSyncConfig, TrainError

ROOT = Path(__file__).resolve().parents[2]
WORKER = Path(__file__).resolve().parents[1] / "sync_worker.py"


def start_rank(tmp_path: Path, sync_dir: Path, rank: int, world: int, *args: str) -> tuple[subprocess.Popen, Path]:
    out = tmp_path / f"rank{rank}.npz"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    log = open(tmp_path / f"rank{rank}.log", "wb")
    proc = subprocess.Popen([sys.executable, str(WORKER), str(sync_dir), str(rank), str(world), "--out", str(out),
                             *args], env=env, stdout=log, stderr=subprocess.STDOUT, cwd=ROOT)
    log.close()
    return proc, out


def finish(proc: subprocess.Popen, tmp_path: Path, rank: int, timeout: float = 180) -> None:
    try:
        rc = proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
        raise
    assert rc == 0, (tmp_path / f"rank{rank}.log").read_text()[-4000:]


def snap(model) -> dict[str, np.ndarray]:
    return {n: t.numpy().copy() for n, t in model.named_parameters().items()}


def test_two_processes_on_halves_equal_one_process_on_all(ctx, engine, tmp_path, monkeypatch):
    """Rank r takes the r-th half of each window of a one-process run with grad_accum doubled; the mean
    over ranks of their window means is that run's window mean. Window 2 overflows (its step is
    skipped, as with a loss scale too large) in every process, so optimizer step 2 syncs twice."""
    windows, accum, skip = 4, 2, 2
    sync_dir = tmp_path / "sync"
    sync_dir.mkdir()
    # leftovers of an earlier run (another run id) and a half-written file: garbage that must not be read
    init = snap(make_trainer(ctx, engine, 1)[0])
    garbage = {n: np.full(a.shape, 1e3, np.float32) for n, a in init.items()}
    old = [sync_dir / f"old.{kind}{k:08d}.rank{r}.safetensors" for kind in ("step", "round")
           for k in (1, 2, 3) for r in (0, 1)]
    for p in old:
        save_file(garbage, str(p))
    stale_tmp = "new.round00000001.rank1.safetensors.tmp99999"
    (sync_dir / stale_tmp).write_bytes(b"\0" * 100)

    peer, peer_out = start_rank(tmp_path, sync_dir, 1, 2, "--windows", str(windows), "--accum", str(accum),
                                "--run-id", "new", "--skip-window", str(skip))
    try:
        monkeypatch.setattr(trainer_module.Trainer, "_record_norm", overflow_at_window(skip))
        model, tr = make_trainer(ctx, engine, accum, FileGradSyncConfig(sync_dir, 0, 2, timeout_s=120, run_id="new"))
        mine = [tr.train_step_masked(i, t, m, model.parameters())
                for i, t, m in rank_sequences(0, 2, windows, accum)]
    finally:
        finish(peer, tmp_path, 1)
    assert [s.stepped for s in mine] == [False, True, False, False, False, True, False, True]
    assert mine[3].skipped and tr.optimizer_steps() == windows - 1
    theirs = np.load(peer_out)
    assert int(theirs["optimizer_steps"]) == windows - 1

    # one process, grad_accum doubled, on all the data in the matching order, the same window skipped
    monkeypatch.setattr(trainer_module.Trainer, "_record_norm", overflow_at_window(skip))
    ref_model, ref = make_trainer(ctx, engine, 2 * accum)
    want = [ref.train_step_masked(i, t, m, ref_model.parameters()) for i, t, m in all_data(windows * 2 * accum)]
    assert ref.optimizer_steps() == windows - 1 and want[2 * accum * skip - 1].skipped
    for k in range(windows):                  # rank 0 ran the first half of each of the reference's windows
        for j in range(accum):
            assert mine[k * accum + j].loss == pytest.approx(want[k * 2 * accum + j].loss, rel=1e-6)
        a, b = mine[k * accum + accum - 1], want[k * 2 * accum + 2 * accum - 1]
        assert (a.stepped, a.skipped, a.lr, a.loss_scale) == (b.stepped, b.skipped, b.lr, b.loss_scale)
        if b.stepped:                         # the norm of the averaged gradient, as one process sees it
            assert a.grad_norm == pytest.approx(b.grad_norm, rel=1e-5), f"window {k + 1}"
        else:
            assert a.grad_norm is None
    ours = snap(model)
    final = snap(ref_model)
    for n in final:
        assert rel_err(ours[n], final[n]) < 1e-5, f"rank 0 {n}"
        assert rel_err(theirs[n], final[n]) < 1e-5, f"rank 1 {n}"
        assert np.array_equal(ours[n], theirs[n]), f"ranks disagree on {n}"
        assert not np.array_equal(final[n], init[n]), f"{n} was not trained"

    # each rank removed its file of round k-2 at round k: only the last two rounds are left
    left = sorted(p.name for p in sync_dir.iterdir())
    assert left == sorted([p.name for p in old] + [stale_tmp]
                          + [f"new.round{k:08d}.rank{r}.safetensors" for k in (3, 4) for r in (0, 1)]
                          + [f"new.hello.rank{r}.json" for r in (0, 1)])     # the handshake's announcements


def test_killed_peer_is_a_train_error_after_the_timeout(ctx, engine, tmp_path):
    sync_dir = tmp_path / "sync"
    peer, peer_out = start_rank(tmp_path, sync_dir, 1, 2, "--windows", "3", "--accum", "1", "--hang-after", "1")
    try:
        model, tr = make_trainer(ctx, engine, 1, FileGradSyncConfig(sync_dir, 0, 2, timeout_s=120))
        seqs = rank_sequences(0, 2, 3, 1)
        assert tr.train_step_masked(*seqs[0], model.parameters()).stepped        # step 1 syncs with the peer
        marker = Path(str(peer_out) + ".hang")
        deadline = time.monotonic() + 120
        while not marker.exists():
            assert peer.poll() is None, (tmp_path / "rank1.log").read_text()[-4000:]
            assert time.monotonic() < deadline, "the peer never finished step 1"
            time.sleep(0.05)
    finally:
        peer.kill()
        peer.wait()
    assert peer.returncode != 0

    tr.distributed_grad_sync.config.timeout_s = 1.0
    weights = snap(model)
    state = {k: v.copy() for k, v in tr.optimizer.state_arrays({id(t): n for n, t in model.named_parameters().items()}).items()}
    t0 = time.monotonic()
    with pytest.raises(TrainError, match=r"timed out after 1s at optimizer step 2: rank\(s\) \[1\] of 2 did not"):
        tr.train_step_masked(*seqs[1], model.parameters())
    elapsed = time.monotonic() - t0
    assert 1.0 <= elapsed < 30
    assert tr.optimizer_steps() == 1
    for n, a in snap(model).items():
        assert np.array_equal(a, weights[n]), f"{n} changed"
    after = tr.optimizer.state_arrays({id(t): n for n, t in model.named_parameters().items()})
    assert after.keys() == state.keys() and all(np.array_equal(after[k], state[k]) for k in state)


def test_missing_peers_are_named_and_other_runs_files_are_not_used(ctx, engine, tmp_path):
    sync_dir = tmp_path / "sync"
    sync_dir.mkdir()
    model, tr = make_trainer(ctx, engine, 1, FileGradSyncConfig(sync_dir, 0, 3, timeout_s=0.5, run_id="b"))
    # run "a" left complete files for ranks 1 and 2 at step 1: run "b" must not take them for its peers'
    grads = {n: np.zeros(t.shape, np.float32) for n, t in model.named_parameters().items()}
    for r in (1, 2):
        save_file(grads, str(sync_dir / f"a.step00000001.rank{r}.safetensors"))
    weights = snap(model)
    t0 = time.monotonic()
    with pytest.raises(TrainError, match=r"rank\(s\) \[1, 2\] of 3 did not announce themselves"):
        tr.train_step_masked(*all_data(1)[0], model.parameters())
    assert time.monotonic() - t0 >= 0.5
    assert tr.optimizer_steps() == 0 and not tr.optimizer.state
    for n, a in snap(model).items():
        assert np.array_equal(a, weights[n]), f"{n} changed"


# ---- the CLI's two ranks: global metrics and evaluation, and no files left behind ----

def trainer_cli(args, cwd=ROOT) -> subprocess.Popen:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    return subprocess.Popen([sys.executable, "-m", "trainer", *map(str, args)], cwd=cwd, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def jsonl(path: Path) -> list[dict]:
    import json
    return [json.loads(line) for line in path.read_text().splitlines()]


@pytest.mark.parametrize("extra", [[], ["--lora-r", 4, "--lora-dropout", 0.3]], ids=["full", "lora_dropout"])
def test_two_cli_ranks_report_the_one_process_runs_metrics_and_evaluation(tmp_path, extra):
    """Two ranks with --grad-accum 1 take the steps of one process with --grad-accum 2: both ranks'
    metrics.jsonl hold that run's losses and token counts, and the held-out loss, answer loss and
    exact match (5 records split 3 + 2 over the ranks, sums combined) are the one-process run's.
    With LoRA dropout, each rank draws the masks of the micro-batch it stands for."""
    import json
    common = ["--preset", "tiny", "--steps", 3, "--schedule", "constant", "--eval-max", 5, "--no-progress", *extra]
    one = trainer_cli([*common, "--grad-accum", 2, "--pack-tokens", 0, "--out", tmp_path / "one"])
    out, err = one.communicate(timeout=300)
    assert one.returncode == 0, err
    sync = tmp_path / "sync"
    two = [["--sync-dir", sync, "--world-size", 2, "--rank", r, "--grad-accum", 1, "--out", tmp_path / "two",
            "--sync-timeout", 120] for r in (0, 1)]
    procs = [trainer_cli(common + a) for a in two]
    results = [p.communicate(timeout=300) for p in procs]
    assert [p.returncode for p in procs] == [0, 0], results
    want = jsonl(tmp_path / "one" / "metrics.jsonl")
    for d in (tmp_path / "two", tmp_path / "two" / "rank1"):
        got = jsonl(d / "metrics.jsonl")
        assert [m["step"] for m in got] == [m["step"] for m in want] == [1, 2, 3]
        for g, w in zip(got, want):
            assert g["loss"] == pytest.approx(w["loss"], rel=1e-6), (d, g, w)
            assert (g["tokens"], g["supervised"]) == (w["tokens"], w["supervised"])
    s1 = json.loads((tmp_path / "one" / "summary.json").read_text())
    for d in (tmp_path / "two", tmp_path / "two" / "rank1"):
        s2 = json.loads((d / "summary.json").read_text())
        for key in ("eval_before", "eval_after", "eval_answer_before", "eval_answer_after", "first_loss", "last_loss"):
            assert s2[key] == pytest.approx(s1[key], rel=1e-5), (d, key)
        for key in ("eval_sequences", "eval_answers_scored", "eval_exact_match", "tokens", "sequences"):
            assert s2[key] == s1[key], (d, key)
    assert s1["eval_sequences"] == 5 and s1["eval_answers_scored"] == 5
    assert "5 sequences" in results[0][0]                        # rank 0 prints the whole held-out set's numbers
    assert sorted(os.listdir(sync)) == []                        # a run that ended well leaves no sync file


def test_readme_two_rank_example_runs_twice_in_a_row(tmp_path):
    """The README's two-rank command, as written (with this interpreter), twice in the same directory."""
    import re
    readme = (ROOT / "README.md").read_text()
    block = re.search(r"```bash\n(for r in 0 1; do\s.*?--world-size 2.*?done; wait)\n```", readme, re.S).group(1)
    script = block.replace(".venv/bin/python", f'"{sys.executable}"')
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    for attempt in (1, 2):
        r = subprocess.run(["bash", "-c", "set -e; " + script.replace("done; wait", "done\nfor j in $(jobs -p); do "
                                                                    "wait $j; done")],
                           cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600)
        assert r.returncode == 0, (attempt, r.stdout[-3000:], r.stderr[-3000:])
        assert r.stdout.count("done: 5 optimizer steps") == 2, (attempt, r.stdout[-3000:])
        assert os.listdir(tmp_path / "runs" / "sync") == [], attempt


class Echo:
    """A gradient sync of one rank: the mean of one is the gradients as they are."""
    world_size, rank, ready = 1, 0, True

    def __init__(self):
        self.windows = 0

    def average(self, engine, names, params, step, staged=None):
        assert staged is None
        self.windows += 1


class StagedEcho(Echo):
    """The same through the MPI sync's backward staging: ``average`` reads every bucket the
    window's last pass copied while its backward ran and checks it against the gradient buffers
    as they are after the pass."""

    def __init__(self):
        super().__init__()
        self.plans: dict = {}

    def staged_in_backward(self, engine, params):
        from trainer.mpi_sync import BackwardStaging
        key = tuple(id(p.grad.buffer) for p in params)
        return self.plans.setdefault(key, BackwardStaging(engine, params))

    def average(self, engine, names, params, step, staged=None):
        assert staged is not None, "the trainer staged nothing for the window's last pass"
        assert sorted(map(id, (p for b in staged.buckets for p in b))) == sorted(map(id, params))
        staged.start_reading()
        for i, bucket in enumerate(staged.buckets):
            got = staged.staging.read(i, np.empty(staged.sizes[i], np.float32))
            want = np.concatenate([p.grad.numpy().reshape(-1) for p in bucket])
            np.testing.assert_array_equal(got, want, err_msg=f"window {self.windows} bucket {i}")
        self.windows += 1


@pytest.mark.parametrize("accum", [1, 3])
def test_gradients_staged_in_the_backward_are_the_windows_gradients(ctx, accum, monkeypatch):
    """A sync that stages gradients in the backward (trainer/mpi_sync.py's BackwardStaging) gets,
    in every window, exactly the gradients the window ends with, whether its last pass ran plainly,
    was captured or replayed (six windows: all three), in buckets small enough that each holds a
    few tensors; and training through it equals training through a sync that reads nothing in the
    backward, bit for bit."""
    import trainer.mpi_sync as mpi_sync
    from lfm2jit import ComputeEngine
    monkeypatch.setattr(mpi_sync, "BUCKET_BYTES", 4 << 10)
    data = [(i[:6], t[:6], m[:6]) for i, t, m in all_data(6 * accum)]    # one length: one recorded pass
    runs = {}
    for sync in (Echo(), StagedEcho()):
        engine = ComputeEngine(ctx)
        model, tr = make_trainer(ctx, engine, accum)
        tr.distributed_grad_sync = sync
        for i, t, m in data:
            tr.train_step_masked(i, t, m, model.parameters())
        # the window's last pass is recorded apart from the others when it stages, and replayed from window 3 on
        assert sync.windows == 6 and tr.recorded.held_passes() == (2 if accum > 1 and sync.__class__ is StagedEcho else 1)
        assert tr.recorded.replays >= 4
        runs[type(sync).__name__] = model.state_dict()
    assert max(len(s.buckets) for s in sync.plans.values()) > 3
    for name, w in runs["Echo"].items():
        np.testing.assert_array_equal(runs["StagedEcho"][name], w, err_msg=name)
