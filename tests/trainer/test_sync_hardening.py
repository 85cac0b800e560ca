"""The file gradient sync against hostile or unlucky peers and flags: the handshake before the first
step (a world-size mismatch, other parameters, a duplicate rank end every rank with a TrainError),
peer gradient files that are truncated, garbage, of another shape, dtype or set of names (each a
TrainError naming the file and what was expected, with the weights unchanged), names planted in
the sync directory as symlinks (never followed), and run ids / output directories the CLI refuses
in one line."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np
import pytest
from safetensors.numpy import save

from sync_worker import make_trainer, rank_sequences
from trainer import FileGradSyncConfig, TrainError
from trainer.sync import FileGradSync

ROOT = Path(__file__).resolve().parents[2]
WORKER = Path(__file__).resolve().parents[1] / "sync_worker.py"
PEER_NONCE = "0123456789abcdef"


# ---------------------------------------------------------------------------------------------
# a real rank 0 (the micro model on the device) against a peer simulated by the test's files
# ---------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def rank0(ctx, engine):
    model, tr = make_trainer(ctx, engine, 1)
    params = model.parameters()
    by_id = {id(t): n for n, t in model.named_parameters().items()}
    names = [by_id[id(p)] for p in params]
    return model, tr, params, names


def snap(model, tr):
    weights = {n: t.numpy().copy() for n, t in model.named_parameters().items()}
    state = tr.optimizer.state_arrays({id(t): n for n, t in model.named_parameters().items()})
    return weights, {k: v.copy() for k, v in state.items()}, tr.optimizer_steps()


def assert_unchanged(model, tr, before):
    weights, state, steps = snap(model, tr)
    assert steps == before[2]
    for n, a in weights.items():
        assert np.array_equal(a, before[0][n]), f"{n} changed"
    assert state.keys() == before[1].keys() and all(np.array_equal(state[k], before[1][k]) for k in state)


def peer_hello(sync_dir: Path, tensors, tensor_names, rank=1, world=2, run_id="run", **changes) -> None:
    """Announce a simulated peer (``changes`` replace fields of a matching announcement)."""
    hello = {"lfm2jit_sync": 1, "run_id": run_id, "rank": rank, "world_size": world, "nonce": PEER_NONCE,
             "pid": 1, "host": "peer-host", "time": time.time(),
             "params": [[n, list(p.shape), p.dtype] for n, p in zip(tensor_names, tensors)], **changes}
    (sync_dir / f"{run_id}.hello.rank{rank}.json").write_text(json.dumps(hello))


def peer_grads(params, names) -> dict[str, np.ndarray]:
    r = np.random.default_rng(5)
    return {n: (1e-3 * r.standard_normal(p.shape)).astype(np.float32) for n, p in zip(names, params)}


META = {"run_id": "run", "rank": "1", "round": "1", "nonce": PEER_NONCE}


def start(tr, sync_dir: Path, timeout: float = 5.0) -> None:
    tr.with_file_grad_sync(FileGradSyncConfig(sync_dir, 0, 2, timeout_s=timeout, run_id="run", poll_s=0.005))


def one_step(model, tr, params):
    i, t, m = rank_sequences(0, 2, 1, 1)[0]
    return tr.train_step_masked(i, t, m, params)


# ---- mutations of a valid peer file (bytes -> bytes), each with a fragment its error must hold ----

def _split(b: bytes):
    n = int.from_bytes(b[:8], "little")
    return json.loads(b[8:8 + n]), b[8 + n:]


def _join(header, body: bytes) -> bytes:
    hb = json.dumps(header).encode()
    hb += b" " * (-len(hb) % 8)
    return len(hb).to_bytes(8, "little") + hb + body


def edit_header(fn):
    def mutate(good, grads):
        header, body = _split(good)
        fn(header, grads)
        return _join(header, body)
    return mutate


def resave(fn, metadata=META):
    def mutate(good, grads):
        g = dict(grads)
        fn(g)
        return save(g, metadata=metadata)
    return mutate


def _first(grads, ndim=None):
    return next(n for n, a in grads.items() if ndim is None or (a.ndim == ndim and a.shape[0] != a.shape[1]))


def _same_size_pair(grads):
    sizes = {}
    for n, a in grads.items():
        sizes.setdefault(a.nbytes, []).append(n)
    return next(v for v in sizes.values() if len(v) > 1)[:2]


def _overlap(h, grads):
    a, b = _same_size_pair(grads)
    h[b]["data_offsets"] = list(h[a]["data_offsets"])


def _shift_past_end(h, grads):
    n = _first(grads)
    size = grads[n].nbytes
    end = max(e["data_offsets"][1] for k, e in h.items() if k != "__metadata__")
    h[n]["data_offsets"] = [end, end + size]


MUTATIONS = {
    "empty": (lambda g, _: b"", "shorter than a safetensors header"),
    "seven bytes": (lambda g, _: g[:7], "shorter than a safetensors header"),
    "header length only": (lambda g, _: g[:8], "truncated"),
    "header cut": (lambda g, _: g[:8 + int.from_bytes(g[:8], "little") // 2], "truncated"),
    "no data": (lambda g, _: g[:8 + int.from_bytes(g[:8], "little")], "truncated"),
    "half the data": (lambda g, _: g[:len(g) // 2 + 8 + int.from_bytes(g[:8], "little") // 2], "truncated"),
    "one byte short": (lambda g, _: g[:-1], "truncated"),
    "huge header length": (lambda g, _: (1 << 62).to_bytes(8, "little") + g[8:], "truncated"),
    "random bytes": (lambda g, _: np.random.default_rng(3).bytes(len(g)), "header"),
    "garbage header": (lambda g, _: g[:8] + b"\xff" * int.from_bytes(g[:8], "little")
                       + g[8 + int.from_bytes(g[:8], "little"):], "not JSON"),
    "text instead of a file": (lambda g, _: b"left by an earlier run, not gradients at all", "truncated"),
    "header is a list": (lambda g, _: _join([], _split(g)[1]), "JSON list, not an object"),
    "transposed shape": (edit_header(lambda h, gr: h[_first(gr, 2)].update(shape=h[_first(gr, 2)]["shape"][::-1])),
                         "has shape"),
    "extra dimension": (edit_header(lambda h, gr: h[_first(gr)].update(shape=h[_first(gr)]["shape"] + [1])),
                        "has shape"),
    "shape as text": (edit_header(lambda h, gr: h[_first(gr)].update(shape="big")), "has shape"),
    "f16 tensor": (resave(lambda g: g.update({_first(g): g[_first(g)].astype(np.float16)})),
                   "has dtype 'F16'; expected F32"),
    "int64 tensor": (resave(lambda g: g.update({_first(g): g[_first(g)].astype(np.int64)})),
                     "has dtype 'I64'; expected F32"),
    "f64 tensor": (resave(lambda g: g.update({_first(g): g[_first(g)].astype(np.float64)})),
                   "has dtype 'F64'; expected F32"),
    "dtype relabelled": (edit_header(lambda h, gr: h[_first(gr)].update(dtype="I32")), "has dtype 'I32'"),
    "missing tensor": (resave(lambda g: g.pop(_first(g))), "1 tensor(s) missing"),
    "all tensors missing": (resave(lambda g: g.clear()), "missing"),
    "extra tensor": (resave(lambda g: g.update({"model.extra.weight": np.zeros(3, np.float32)})),
                     "1 unexpected tensor(s) (e.g. model.extra.weight)"),
    "renamed tensor": (resave(lambda g: g.update({"renamed": g.pop(_first(g))})), "missing"),
    "entry not an object": (edit_header(lambda h, gr: h.update({_first(gr): 5})), "not an object"),
    "offsets past the end": (edit_header(_shift_past_end), "truncated"),
    "offsets of the wrong size": (edit_header(lambda h, gr: h[_first(gr)].update(
        data_offsets=[h[_first(gr)]["data_offsets"][0], h[_first(gr)]["data_offsets"][0] + 4])), "spans 4 bytes"),
    "offsets as text": (edit_header(lambda h, gr: h[_first(gr)].update(data_offsets=["0", "4"])), "data_offsets"),
    "overlapping tensors": (edit_header(_overlap), "overlap"),
    "trailing bytes": (lambda g, _: g + b"\0" * 8, "8 bytes after the last tensor"),
    "no metadata": (resave(lambda g: None, metadata=None), "metadata"),
    "another process's nonce": (resave(lambda g: None, metadata={**META, "nonce": "feedfacefeedface"}), "metadata"),
    "another round's file": (resave(lambda g: None, metadata={**META, "round": "7"}), "metadata"),
    "another rank's file": (resave(lambda g: None, metadata={**META, "rank": "0"}), "metadata"),
}


@pytest.mark.parametrize("case", list(MUTATIONS))
def test_a_bad_peer_file_is_a_train_error_naming_it_and_nothing_changes(case, rank0, tmp_path):
    model, tr, params, names = rank0
    sync_dir = tmp_path / "sync"
    sync_dir.mkdir()
    peer_hello(sync_dir, params, names)
    grads = peer_grads(params, names)
    mutate, fragment = MUTATIONS[case]
    peer = sync_dir / "run.round00000001.rank1.safetensors"
    peer.write_bytes(mutate(save(grads, metadata=META), grads))
    start(tr, sync_dir)
    before = snap(model, tr)
    with pytest.raises(TrainError) as e:
        one_step(model, tr, params)
    msg = str(e.value)
    assert str(peer) in msg and "expected" in msg and fragment in msg, msg
    assert "nothing was applied" in msg
    assert_unchanged(model, tr, before)
    assert (sync_dir / "run.abort.json").is_file()      # the other ranks stop too, with the reason


def test_a_peer_file_that_is_a_symlink_or_a_directory_is_refused(rank0, tmp_path):
    model, tr, params, names = rank0
    grads = peer_grads(params, names)
    for kind in ("symlink", "directory"):
        sync_dir = tmp_path / kind
        sync_dir.mkdir()
        peer_hello(sync_dir, params, names)
        peer = sync_dir / "run.round00000001.rank1.safetensors"
        if kind == "symlink":
            real = tmp_path / f"{kind}.safetensors"
            real.write_bytes(save(grads, metadata=META))
            peer.symlink_to(real)
        else:
            peer.mkdir()
        start(tr, sync_dir)
        before = snap(model, tr)
        with pytest.raises(TrainError, match="cannot read it") as e:
            one_step(model, tr, params)
        assert str(peer) in str(e.value)
        assert_unchanged(model, tr, before)


def test_a_valid_peer_file_is_averaged_in_and_planted_symlinks_are_not_followed(rank0, tmp_path):
    model, tr, params, names = rank0
    sync_dir = tmp_path / "sync"
    sync_dir.mkdir()
    peer_hello(sync_dir, params, names)
    grads = peer_grads(params, names)
    (sync_dir / "run.round00000001.rank1.safetensors").write_bytes(save(grads, metadata=META))
    victim = tmp_path / "victim.txt"
    victim.write_text("precious")
    pid = os.getpid()
    planted = [sync_dir / "run.round00000001.rank0.safetensors",            # the final name
               sync_dir / f"run.round00000001.rank0.safetensors.tmp{pid}",   # the old predictable temp names
               sync_dir / f"run.hello.rank0.json.tmp{pid}",
               sync_dir / "run.round00000000.rank0.safetensors"]
    for p in planted:
        p.symlink_to(victim)
    start(tr, sync_dir)
    steps = tr.optimizer_steps()
    stats = one_step(model, tr, params)
    assert stats.stepped and tr.optimizer_steps() == steps + 1
    assert victim.read_text() == "precious"
    mine = planted[0]
    assert mine.is_file() and not mine.is_symlink()      # the link was replaced by the real file, not written through
    assert all(p.is_symlink() for p in planted[1:]), "a planted name was removed or followed"
    hello = json.loads((sync_dir / "run.hello.rank0.json").read_text())
    assert hello["rank"] == 0 and hello["world_size"] == 2 and len(hello["params"]) == len(params)
    assert not (sync_dir / "run.abort.json").exists()


def test_a_symlink_planted_at_the_announcement_is_not_followed(rank0, tmp_path):
    model, tr, params, names = rank0
    sync_dir = tmp_path / "sync"
    sync_dir.mkdir()
    victim = tmp_path / "victim.txt"
    victim.write_text("precious")
    (sync_dir / "run.hello.rank0.json").symlink_to(victim)
    peer_hello(sync_dir, params, names)
    start(tr, sync_dir)
    before = snap(model, tr)
    with pytest.raises(TrainError, match="rank 0 was announced twice"):
        one_step(model, tr, params)
    assert victim.read_text() == "precious"
    assert_unchanged(model, tr, before)


@pytest.mark.parametrize("change, fragment", [
    (dict(world_size=3), "started with world size 3 but rank 0 with 2"),
    (dict(params=[]), "trains other parameters"),
    ("drop", "1 not trained by rank 1"),
    ("shape", "trains other parameters"),
    ("dtype", "is f16"),
    ("run_id", "announces run 'other' rank 1, not run 'run' rank 1"),
])
def test_a_peer_announcing_another_run_stops_before_the_first_step(change, fragment, rank0, tmp_path):
    model, tr, params, names = rank0
    sync_dir = tmp_path / "sync"
    sync_dir.mkdir()
    if change == "drop":
        peer_hello(sync_dir, params[1:], names[1:])
    elif change in ("shape", "dtype"):
        entries = [[n, list(p.shape), p.dtype] for n, p in zip(names, params)]
        if change == "shape":
            entries[0][1] = entries[0][1][::-1] + [2]
        else:
            entries[0][2] = "f16"
        peer_hello(sync_dir, params, names, params=entries)
    elif change == "run_id":                  # the right file name, another run inside
        peer_hello(sync_dir, params, names)
        f = sync_dir / "run.hello.rank1.json"
        f.write_text(f.read_text().replace('"run_id": "run"', '"run_id": "other"'))
    else:
        peer_hello(sync_dir, params, names, **change)
    start(tr, sync_dir)
    before = snap(model, tr)
    with pytest.raises(TrainError, match="nothing was applied") as e:
        one_step(model, tr, params)
    assert fragment in str(e.value), str(e.value)
    assert_unchanged(model, tr, before)
    assert not (sync_dir / "run.round00000001.rank0.safetensors").exists()   # failed before the first window


def test_a_peer_of_a_larger_world_is_detected(rank0, tmp_path):
    model, tr, params, names = rank0
    sync_dir = tmp_path / "sync"
    sync_dir.mkdir()
    peer_hello(sync_dir, params, names, rank=2, world=3)
    start(tr, sync_dir)
    before = snap(model, tr)
    with pytest.raises(TrainError, match=r"announces rank 2, outside this rank's world of 2"):
        one_step(model, tr, params)
    assert_unchanged(model, tr, before)


# ---------------------------------------------------------------------------------------------
# ranks as threads (no device): the handshake's symmetric outcomes, duplicates, a good average
# ---------------------------------------------------------------------------------------------

class FakeGrad:
    def __init__(self, a):
        self.a = a

    def numpy(self):
        return self.a.copy()

    def write(self, a):
        self.a = np.asarray(a, np.float32)


class FakeParam:
    dtype = "f32"

    def __init__(self, shape, value):
        self.shape = tuple(shape)
        self.grad = FakeGrad(np.full(shape, value, np.float32))


SHAPES = {"a.weight": (3, 4), "b.bias": (5,)}


def fake_rank(sync_dir, rank, world, value, shapes=SHAPES, timeout=10.0):
    sync = FileGradSync(FileGradSyncConfig(sync_dir, rank, world, timeout_s=timeout, poll_s=0.005))
    return sync, [FakeParam(s, value) for s in shapes.values()], list(shapes)


def run_threads(jobs):
    """Run each (sync, params, names) through the handshake and one round; the result or the error."""
    results = [None] * len(jobs)

    def go(k, sync, params, names):
        try:
            sync.handshake(names, params)
            sync.average(None, names, params, 1)
            results[k] = [p.grad.a for p in params]
        except TrainError as e:
            results[k] = e
    threads = [threading.Thread(target=go, args=(k, *job)) for k, job in enumerate(jobs)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    return results


def test_three_thread_ranks_agree_and_average(tmp_path):
    res = run_threads([fake_rank(tmp_path, r, 3, float(r + 1)) for r in range(3)])
    for got in res:
        assert not isinstance(got, Exception), got
        assert all(np.all(a == 2.0) for a in got)          # the mean of 1, 2, 3


def test_world_size_mismatch_stops_both_ranks(tmp_path):
    res = run_threads([fake_rank(tmp_path, 0, 2, 1.0), fake_rank(tmp_path, 1, 3, 2.0)])
    for got in res:
        assert isinstance(got, TrainError), got
        assert "world size" in str(got) and "nothing was applied" in str(got)


def test_other_parameters_stop_both_ranks(tmp_path):
    res = run_threads([fake_rank(tmp_path, 0, 2, 1.0),
                       fake_rank(tmp_path, 1, 2, 2.0, shapes={"a.weight": (4, 3), "b.bias": (5,)})])
    for got in res:
        assert isinstance(got, TrainError) and "a.weight is f32[4, 3] on rank 1 but f32[3, 4] on rank 0" in str(got) \
            or "a.weight is f32[3, 4] on rank 0" in str(got), got


def test_a_duplicate_rank_stops_every_rank(tmp_path):
    """Two processes as rank 0 and one as rank 1: all three end with a TrainError, nobody averages."""
    first = fake_rank(tmp_path, 0, 2, 1.0)
    second = fake_rank(tmp_path, 0, 2, 5.0)
    other = fake_rank(tmp_path, 1, 2, 3.0)
    results = {}
    t = threading.Thread(target=lambda: results.update(first=run_threads([first])[0]))
    t.start()
    deadline = time.monotonic() + 10
    while not (tmp_path / "run.hello.rank0.json").exists():
        assert time.monotonic() < deadline
        time.sleep(0.01)
    results["second"] = run_threads([second])[0]
    results["other"] = run_threads([other])[0]
    t.join(30)
    assert isinstance(results["second"], TrainError) and "rank 0 was announced twice" in str(results["second"])
    for k in ("first", "other"):
        assert isinstance(results[k], TrainError), (k, results[k])
        assert "stopped the run" in str(results[k]) and "announced twice" in str(results[k])
    for sync, params, _ in (first, second, other):
        assert sync.rounds == 0 and all(np.all(p.grad.a == p.grad.a.flat[0]) for p in params)
    assert not list(tmp_path.glob("*.safetensors"))         # no rank wrote gradients


def test_a_handshake_timeout_names_the_missing_ranks_and_can_be_retried(tmp_path):
    sync, params, names = fake_rank(tmp_path, 0, 2, 1.0, timeout=0.3)
    with pytest.raises(TrainError, match=r"timed out after 0.3s before the first step: rank\(s\) \[1\] of 2 did not"):
        sync.handshake(names, params)
    other = fake_rank(tmp_path, 1, 2, 3.0)
    res = run_threads([(sync, params, names), other])        # the same process again: its own announcement
    assert all(not isinstance(r, Exception) and np.all(r[0] == 2.0) for r in res), res


# ---------------------------------------------------------------------------------------------
# real processes: tests/sync_worker.py ranks against an in-process rank 0
# ---------------------------------------------------------------------------------------------

def start_worker(tmp_path, sync_dir, rank, world, name):
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    log = tmp_path / f"{name}.log"
    with open(log, "wb") as f:
        proc = subprocess.Popen([sys.executable, str(WORKER), str(sync_dir), str(rank), str(world), "--windows", "2",
                                 "--accum", "1", "--out", str(tmp_path / f"{name}.npz"), "--timeout", "60"],
                                env=env, stdout=f, stderr=subprocess.STDOUT, cwd=ROOT)
    return proc, log


def wait(proc, log):
    try:
        rc = proc.wait(timeout=120)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
        raise
    return rc, log.read_text()


def test_processes_with_different_world_sizes_stop_before_the_first_step(rank0, tmp_path):
    model, tr, params, names = rank0
    sync_dir = tmp_path / "sync"
    peer, log = start_worker(tmp_path, sync_dir, 1, 3, "rank1")
    try:
        start(tr, sync_dir, timeout=60)
        before = snap(model, tr)
        with pytest.raises(TrainError, match="world size") as e:
            one_step(model, tr, params)
        assert "3" in str(e.value) and "2" in str(e.value)
        assert_unchanged(model, tr, before)
    finally:
        rc, text = wait(peer, log)
    assert rc != 0 and "TrainError" in text and "world size" in text, text[-3000:]
    assert not (tmp_path / "rank1.npz").exists()
    assert not list(sync_dir.glob("*.safetensors"))


def test_two_processes_with_the_same_rank_and_the_other_rank_all_stop(rank0, tmp_path):
    model, tr, params, names = rank0
    sync_dir = tmp_path / "sync"
    dup, dup_log = start_worker(tmp_path, sync_dir, 0, 2, "dup0")
    try:
        deadline = time.monotonic() + 90
        while not (sync_dir / "run.hello.rank0.json").exists():      # the duplicate has announced rank 0
            assert dup.poll() is None, dup_log.read_text()[-3000:]
            assert time.monotonic() < deadline
            time.sleep(0.05)
        start(tr, sync_dir, timeout=60)
        before = snap(model, tr)
        with pytest.raises(TrainError, match="rank 0 was announced twice"):
            one_step(model, tr, params)
        assert_unchanged(model, tr, before)
        other, other_log = start_worker(tmp_path, sync_dir, 1, 2, "rank1")
        rc1, text1 = wait(other, other_log)
    finally:
        rc0, text0 = wait(dup, dup_log)
    for rc, text in ((rc0, text0), (rc1, text1)):
        assert rc != 0 and "TrainError" in text and "announced twice" in text, text[-3000:]
    assert not (tmp_path / "dup0.npz").exists() and not (tmp_path / "rank1.npz").exists()
    assert not list(sync_dir.glob("*.safetensors"))


# ---------------------------------------------------------------------------------------------
# the CLI: run ids, --out, --sync-dir, and sync settings that only a checkpoint supplies
# ---------------------------------------------------------------------------------------------

def cli_error(capsys, *argv) -> str:
    from trainer.cli import main
    rc = main([str(a) for a in argv])
    err = capsys.readouterr().err
    assert rc == 2, err
    lines = [line for line in err.splitlines() if line.startswith("error:")]
    assert len(lines) == 1 and "Traceback" not in err, err
    return lines[0]


@pytest.mark.parametrize("run_id", ["..", ".", "", "a/b", "../up", ".hidden", "x" * 65, "tab\tid"])
def test_unsafe_run_ids_are_usage_errors(run_id, tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "metrics.jsonl").write_text("keep me\n")
    msg = cli_error(capsys, "--world-size", 2, "--rank", 0, "--sync-dir", tmp_path / "sync", "--run-id", run_id,
                    "--steps", 1)
    assert "--run-id must be 1 to 64 letters" in msg
    assert (tmp_path / "metrics.jsonl").read_text() == "keep me\n"
    assert not (tmp_path / "sync").exists() and not (tmp_path / "runs").exists()


def test_out_and_sync_dir_naming_files_are_usage_errors(tmp_path, capsys):
    f = tmp_path / "a_file"
    f.write_text("x")
    assert cli_error(capsys, "--out", f, "--steps", 1) == f"error: --out {f}: exists and is not a directory"
    assert f"{f} exists and is not a directory" in cli_error(capsys, "--out", f / "sub", "--steps", 1)
    assert "--out must name a directory" in cli_error(capsys, "--out", "", "--steps", 1)
    msg = cli_error(capsys, "--world-size", 2, "--rank", 1, "--sync-dir", f, "--steps", 1)
    assert msg.startswith(f"error: --sync-dir {f}: exists and is not a directory")
    assert f.read_text() == "x"


def _resolve_resume(ckpt: Path, saved: dict, *argv):
    """resolve() as prepare() calls it for ``--resume CKPT ARGV`` with ``saved`` as the checkpoint's
    run settings (trainer.json itself is read and checked by trainer/cli/resume.py)."""
    from trainer.cli.options import build_parser
    from trainer.cli.resolve import resolve
    return resolve(build_parser().parse_args(["--resume", str(ckpt), *map(str, argv)]), False, saved, ckpt)


def test_sync_settings_from_a_checkpoint_are_confirmed_and_reported(tmp_path):
    from trainer.cli.usage import UsageError
    ckpt = tmp_path / "run" / "checkpoints" / "step-000003"
    ckpt.mkdir(parents=True)
    elsewhere = tmp_path / "outside" / "sync"
    saved = {"source": "scratch", "preset": "tiny", "world_size": 2, "run_id": "run", "sync_dir": str(elsewhere)}
    where = str(ckpt / "trainer.json")
    with pytest.raises(UsageError, match="holds rank 0 of a 2-process run syncing through") as e:
        _resolve_resume(ckpt, saved)                                     # a plain --resume decides nothing
    assert where in str(e.value) and "--rank R" in str(e.value)
    with pytest.raises(UsageError, match="which is not an existing directory") as e:
        _resolve_resume(ckpt, saved, "--rank", 1)
    assert where in str(e.value) and "--sync-dir DIR" in str(e.value)
    with pytest.raises(UsageError, match="not an existing directory"):
        _resolve_resume(ckpt, {**saved, "sync_dir": "relative/sync"}, "--rank", 1)
    assert not (tmp_path / "outside").exists()                          # nothing created where trainer.json said
    for key, value, fragment in (("run_id", "..", "run_id must be 1 to 64"), ("run_id", 7, "run_id must be a string"),
                                 ("world_size", "2", "world_size must be a positive integer"),
                                 ("sync_dir", ["/x"], "sync_dir must be a string"),
                                 ("sync_timeout", "soon", "sync_timeout must be a positive number")):
        with pytest.raises(UsageError) as e:
            _resolve_resume(ckpt, {**saved, key: value}, "--rank", 0)
        assert f"{where}: {fragment}" in str(e.value), str(e.value)

    elsewhere.mkdir(parents=True)
    run = _resolve_resume(ckpt, saved, "--rank", 1)
    assert run.sync_dir == str(elsewhere) and run.rank == 1 and run.world_size == 2 and run.run_id == "run"
    note = [n for n in run.notes if "synced through" in n]
    assert note and str(elsewhere) in note[0] and where in note[0] and "'run'" in note[0], run.notes
    run = _resolve_resume(ckpt, saved, "--rank", 1, "--world-size", 2, "--sync-dir", tmp_path / "s", "--run-id", "r2")
    assert run.sync_dir == str((tmp_path / "s").resolve()) and run.run_id == "r2"
    assert not [n for n in run.notes if "synced through" in n]
    run = _resolve_resume(ckpt, {**saved, "world_size": 1, "sync_dir": None})    # one process: nothing to confirm
    assert run.world_size == 1 and not [n for n in run.notes if "synced through" in n]


def test_a_crafted_checkpoint_with_sync_settings_is_a_one_line_error_in_the_cli(tmp_path, capsys):
    """Whatever trainer.json's own checks say first, a plain --resume of it ends in one line, exit 2."""
    ckpt = tmp_path / "run" / "checkpoints" / "step-000003"
    ckpt.mkdir(parents=True)
    settings = {"source": "scratch", "preset": "tiny", "world_size": 2, "run_id": "..",
                "sync_dir": str(tmp_path / "outside")}
    (ckpt / "trainer.json").write_text(json.dumps({"format": 2, "optimizer_steps": 3,
                                                   "data_position": {"run": settings}}))
    cli_error(capsys, "--resume", ckpt)
    assert not (tmp_path / "outside").exists()
