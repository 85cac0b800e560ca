"""Nothing lost on Ctrl-C: a real SIGINT/SIGTERM to a real `python -m trainer` process finishes the
step, saves a checkpoint, says how to resume and exits 130; --resume continues from it, and the
resumed run's summary.json and loss.png cover the whole run. The default periodic checkpoint interval."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from test_cli_trainer import ROOT, cli, metrics
from trainer.cli.checkpoints import AUTO_CHECKPOINT_SECONDS, auto_checkpoint_every
from trainer.cli.options import build_parser


def _interrupted_run(out: Path, sig: int, lines: int = 3) -> tuple[int, str]:
    env = dict(os.environ, PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    p = subprocess.Popen([sys.executable, "-m", "trainer", "--preset", "tiny", "--steps", "100000", "--out", str(out),
                          "--no-progress", "--eval-max", "4"], cwd=ROOT, env=env, text=True,
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    deadline = time.monotonic() + 240
    try:
        while time.monotonic() < deadline and p.poll() is None:
            f = out / "metrics.jsonl"
            if f.is_file() and len(f.read_text().splitlines()) >= lines:
                break
            time.sleep(0.05)
        assert p.poll() is None, p.communicate()
        p.send_signal(sig)
        _, err = p.communicate(timeout=120)
    finally:
        if p.poll() is None:
            p.kill()
    return p.returncode, err


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM], ids=["SIGINT", "SIGTERM"])
def test_a_signal_saves_a_checkpoint_that_resume_continues(sig, tmp_path):
    out = tmp_path / "run"
    rc, err = _interrupted_run(out, sig)
    assert rc == 130, err
    done = metrics(out)
    k = done[-1]["step"]
    assert [m["step"] for m in done] == list(range(1, k + 1))      # the step under way was finished, not lost
    ckpt = out / "checkpoints" / f"step-{k:06d}"
    assert (ckpt / "trainer.json").is_file() and (ckpt / "model" / "tokenizer.json").is_file()
    assert json.loads((ckpt / "trainer.json").read_text())["optimizer_steps"] == k
    assert f"{signal.Signals(sig).name}: stopped after step {k}; checkpoint {ckpt.resolve()}" in err
    assert f"--resume {out}" in err and "Traceback" not in err
    assert not list((out / "checkpoints").glob("*.tmp*"))
    assert (out / "loss.png").is_file()

    r = cli("--resume", out, "--steps", k + 2, "--no-progress")
    assert r.returncode == 0, r.stderr
    assert f"steps {k + 1}..{k + 2}" in r.stdout
    got = metrics(out)
    assert [m["step"] for m in got] == list(range(1, k + 3))
    assert got[:k] == done
    assert (out / "checkpoints" / f"step-{k + 2:06d}" / "trainer.json").is_file()


def test_a_resumed_runs_summary_and_plot_cover_the_whole_run(tmp_path, monkeypatch):
    """Interrupted at step k, resumed to k + 2 in this process (so the plot's inputs can be seen):
    summary.json's first loss, tokens, steps and held-out loss before training are the whole run's,
    and loss.png is drawn from every step and every evaluation since step 0."""
    out = tmp_path / "run"
    rc, err = _interrupted_run(out, signal.SIGINT)
    assert rc == 130, err
    first_segment = metrics(out)
    k = first_segment[-1]["step"]
    before = json.loads((out / "checkpoints" / f"step-{k:06d}" / "trainer.json").read_text())["data_position"]["evals"]
    assert [e["step"] for e in before] == [0]

    import trainer.cli.plot
    drawn = []
    real = trainer.cli.plot.plot_run

    def spy(path, m, evals, **kw):
        drawn.append(([x["step"] for x in m], [e["step"] for e in evals]))
        return real(path, m, evals, **kw)

    monkeypatch.setattr(trainer.cli.plot, "plot_run", spy)
    from trainer.cli import main
    assert main(["--resume", str(out), "--steps", str(k + 2), "--no-progress"]) == 0
    whole = metrics(out)
    summary = json.loads((out / "summary.json").read_text())
    assert summary["steps"] == k + 2 and summary["steps_this_run"] == 2 and summary["first_step"] == k + 1
    assert summary["first_loss"] == pytest.approx(first_segment[0]["loss"])
    assert summary["last_loss"] == pytest.approx(whole[-1]["loss"])
    assert summary["tokens"] == sum(m["tokens"] for m in whole)
    assert summary["tokens_this_run"] == sum(m["tokens"] for m in whole[k:])
    assert summary["sequences"] == len(whole) * json.loads((out / "run.json").read_text())["grad_accum"]
    assert summary["eval_before"] == pytest.approx(before[0]["loss"])
    assert summary["train_seconds"] >= summary["train_seconds_this_run"]
    assert drawn[-1] == (list(range(1, k + 3)), [0, k, k + 2])
    assert (out / "loss.png").stat().st_size > 10_000


def test_default_checkpoint_interval_is_about_ten_minutes_of_measured_steps():
    assert AUTO_CHECKPOINT_SECONDS == 600
    # the first two steps compile kernels and do not count
    assert auto_checkpoint_every([30.0, 20.0, 0.5, 0.5, 0.6, 0.5]) == 1200
    assert auto_checkpoint_every([5.0, 5.0, 120.0, 110.0, 130.0]) == 5
    assert auto_checkpoint_every([900.0, 900.0, 900.0]) == 1      # slower than the interval: every step
    help_text = " ".join(build_parser().format_help().split())
    assert "checkpoint about every M minutes of training (default 10)" in help_text and "--report-to" in help_text


def test_a_signal_to_one_of_two_ranks_stops_both_after_the_same_step(tmp_path):
    """SIGINT to rank 1 alone: both ranks finish the same step (the step's reduction carries the vote),
    rank 0 saves it, both exit 130, the sync's files are gone, and both ranks resume from it."""
    out, sync = tmp_path / "run", tmp_path / "sync"
    common = ["--preset", "tiny", "--out", out, "--no-progress", "--eval-max", "4", "--sync-dir", sync,
              "--world-size", 2, "--sync-timeout", 60]
    env = dict(os.environ, PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    procs = [subprocess.Popen([sys.executable, "-m", "trainer", *map(str, common), "--steps", "100000", "--rank", str(r)],
                              cwd=ROOT, env=env, text=True, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
             for r in (0, 1)]
    try:
        deadline = time.monotonic() + 240
        f = out / "rank1" / "metrics.jsonl"
        while time.monotonic() < deadline and not (f.is_file() and len(f.read_text().splitlines()) >= 3):
            assert all(p.poll() is None for p in procs), [p.communicate() for p in procs]
            time.sleep(0.05)
        procs[1].send_signal(signal.SIGINT)
        errs = [p.communicate(timeout=120)[1] for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    assert [p.returncode for p in procs] == [130, 130], errs
    k = metrics(out)[-1]["step"]
    assert [m["step"] for m in metrics(out)] == [m["step"] for m in metrics(out / "rank1")] == list(range(1, k + 1))
    ckpt = out / "checkpoints" / f"step-{k:06d}"
    assert json.loads((ckpt / "trainer.json").read_text())["optimizer_steps"] == k
    assert f"another rank's signal: stopped after step {k}; checkpoint {ckpt.resolve()}" in errs[0]
    assert f"--resume {out} --rank R (every rank R of 2)" in errs[0]
    assert f"SIGINT: stopped after step {k} (rank 0 writes the checkpoint)" in errs[1]
    assert not any("Traceback" in e for e in errs)
    assert not list(sync.glob("*.safetensors"))

    resumed = [subprocess.Popen([sys.executable, "-m", "trainer", "--resume", str(out), "--steps", str(k + 2),
                                 "--rank", str(r), "--no-progress"], cwd=ROOT, env=env, text=True,
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE) for r in (0, 1)]
    results = [p.communicate(timeout=240) for p in resumed]
    assert [p.returncode for p in resumed] == [0, 0], results
    assert [m["step"] for m in metrics(out)] == [m["step"] for m in metrics(out / "rank1")] == list(range(1, k + 3))


def test_periodic_checkpoints_by_default_end_to_end(tmp_path):
    """No --checkpoint-every: after 10 measured steps the interval is chosen from the step time, then
    checkpoints appear at its multiples (here --checkpoint-minutes 0.005, i.e. every 0.3 s of training,
    stands in for the 10 minutes of a long run); each one resumable."""
    out = tmp_path / "run"
    r = cli("--preset", "tiny", "--steps", 30, "--checkpoint-minutes", 0.005, "--keep-checkpoints", 0,
            "--eval-fraction", 0, "--no-progress", "--out", out)
    assert r.returncode == 0, r.stderr
    import re
    every = int(re.search(r"checkpointing every (\d+) steps \(about every 0.005 minutes", r.stderr).group(1))
    assert 1 <= every < 20
    steps = sorted(int(p.name.split("-")[1]) for p in (out / "checkpoints").glob("step-*"))
    expected = [k for k in range(10, 30) if k % every == 0] + [30]
    assert steps == sorted(set(expected)), (every, steps)
    for k in steps:
        assert json.loads((out / "checkpoints" / f"step-{k:06d}" / "trainer.json").read_text())["optimizer_steps"] == k
