"""Data-parallel training over MPI (trainer/mpi_sync.py), under a real mpiexec: 2 and 4 ranks equal
one process with the same total batch (within f32 rounding; the ranks bit for bit); a killed, a
hung and a mismatched rank end the job with a non-zero exit (and a clear error where a rank lives
to say it), nothing saved; the CLI under mpiexec equals one process; Ctrl-C to mpiexec checkpoints and
--resume under mpiexec continues."""
from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

HERE = Path(__file__).resolve().parents[1]   # tests/, where mpi_worker.py lives
sys.path.insert(0, str(HERE))
from numerics import rel_err  # noqa: E402
from sync_worker import make_trainer, rank_sequences  # noqa: E402

MPIEXEC = shutil.which("mpiexec", path=str(Path(sys.executable).parent)) or shutil.which("mpiexec")
WINDOWS = 3


def _mpiexec(n: int, tmp_path: Path, *extra: str, timeout: float = 240):
    if MPIEXEC is None:
        pytest.fail("mpiexec is not installed: pip install mpi4py mpich (the test extras include them)")
    return subprocess.run([MPIEXEC, "-n", str(n), sys.executable, str(HERE / "mpi_worker.py"), "--windows",
                           str(WINDOWS), "--accum", "1", "--out", str(tmp_path / "w"), *extra],
                          capture_output=True, text=True, timeout=timeout)


@pytest.mark.parametrize("world,staging", [(2, "backward"), (2, "after"), (4, "backward")])
def test_ranks_equal_one_process_with_the_same_batch(ctx, tmp_path, world, staging):
    """Gradients read back bucket by bucket as the backward finishes them (the default), or after
    the whole pass: the same steps either way."""
    done = _mpiexec(world, tmp_path, *(["--stage-after"] if staging == "after" else []))
    assert done.returncode == 0, done.stderr[-2000:]
    ranks = [np.load(tmp_path / f"w.rank{r}.npz") for r in range(world)]
    from lfm2jit import ComputeEngine
    engine = ComputeEngine(ctx)
    model, tr = make_trainer(ctx, engine, world)
    init = model.state_dict()
    tr.with_packing(0)                                  # one sequence per pass, as each rank runs them
    for i, t, m in rank_sequences(0, 1, WINDOWS, world):
        tr.train_step_masked(i, t, m, model.parameters())
    want = model.state_dict()
    assert int(ranks[0]["optimizer_steps"]) == tr.optimizer_steps() == WINDOWS
    for name, w in want.items():             # one process adds the window's sequences into one buffer, in
        assert rel_err(ranks[0][name], w) < 1e-5, name      # another order: equal within f32 rounding
        for other in ranks[1:]:
            np.testing.assert_array_equal(ranks[0][name], other[name], err_msg=f"ranks disagree on {name}")
        assert not np.array_equal(w, init[name]), f"{name} was not trained"


def test_a_killed_rank_ends_the_job(tmp_path):
    done = _mpiexec(2, tmp_path, "--die-at", "2", "--timeout", "20", timeout=120)
    assert done.returncode != 0
    assert not list(tmp_path.glob("w.rank*.npz"))


@pytest.mark.parametrize("world, collective", [(2, "allreduce"), (3, "reduce-scatter")])
def test_a_hung_rank_is_a_clear_error_within_the_timeout(tmp_path, world, collective):
    done = _mpiexec(world, tmp_path, "--hang-at", "2", "--timeout", "5", timeout=120)
    assert done.returncode != 0
    assert (f"error: rank 0: MPI gradient sync: the gradient exchange ({collective}) at optimizer step 2 did not complete "
            "within 5s" in done.stderr), done.stderr[-2000:]
    assert not list(tmp_path.glob("w.rank*.npz"))


def test_a_rank_of_another_run_is_refused_before_any_step(tmp_path):
    done = _mpiexec(2, tmp_path, "--run-id-of-rank1", "other", "--timeout", "20", timeout=120)
    assert done.returncode != 0
    assert "has run id" in done.stderr and "every rank must run the same job" in done.stderr, done.stderr[-2000:]
    assert not list(tmp_path.glob("w.rank*.npz"))


def test_the_cli_under_mpiexec_equals_one_process(tmp_path):
    """`mpiexec -n 2 python -m trainer ... --distributed mpi` against one process with the two ranks'
    accumulation: the same global losses step by step and the same final weights (f32 rounding)."""
    from safetensors.numpy import load_file
    if MPIEXEC is None:
        pytest.fail("mpiexec is not installed: pip install mpi4py mpich (the test extras include them)")
    common = ["-m", "trainer", "--preset", "tiny", "--steps", "5", "--pack-tokens", "0", "--eval-fraction", "0",
              "--no-progress", "--checkpoint-every", "0"]
    two = subprocess.run([MPIEXEC, "-n", "2", sys.executable, *common, "--grad-accum", "1", "--distributed", "mpi",
                          "--out", str(tmp_path / "two")], capture_output=True, text=True, timeout=400)
    assert two.returncode == 0, two.stderr[-3000:]
    one = subprocess.run([sys.executable, *common, "--grad-accum", "2", "--out", str(tmp_path / "one")],
                         capture_output=True, text=True, timeout=400)
    assert one.returncode == 0, one.stderr[-3000:]
    def losses(d):
        return [json.loads(line)["loss"] for line in (d / "metrics.jsonl").read_text().splitlines()]
    assert losses(tmp_path / "two") == pytest.approx(losses(tmp_path / "one"), rel=1e-5)
    a, b = (load_file(str(d / "model" / "model.safetensors")) for d in (tmp_path / "two", tmp_path / "one"))
    for name in b:
        assert rel_err(a[name], b[name]) < 1e-4, name
    assert "--distributed mpi" not in two.stderr
    bad = subprocess.run([sys.executable, *common, "--distributed", "mpi", "--rank", "1"], capture_output=True,
                         text=True, timeout=120)
    assert bad.returncode == 2 and "--distributed mpi takes the rank and world size from MPI" in bad.stderr


def test_dpo_under_mpiexec_equals_one_process(ctx, tmp_path):
    """`mpiexec -n 2 python -m trainer dpo ... --distributed mpi` against one process accumulating the
    two ranks' pairs: the same DPO losses and reward margins step by step (f32 rounding)."""
    sys.path.insert(0, str(HERE / "cli"))
    from lfm2jit import ComputeEngine
    from test_cli_dpo import write_prefs
    from test_cli_trainer import _hf_dir
    if MPIEXEC is None:
        pytest.fail("mpiexec is not installed: pip install mpi4py mpich (the test extras include them)")
    model, prefs = _hf_dir(tmp_path / "hf", ctx, ComputeEngine(ctx)), write_prefs(tmp_path / "prefs.jsonl")
    common = ["-m", "trainer", "dpo", "--model", str(model), "--data", str(prefs), "--max-len", "64", "--lr", "1e-3",
              "--schedule", "constant", "--steps", "3", "--eval-fraction", "0", "--checkpoint-every", "0",
              "--no-progress"]
    two = subprocess.run([MPIEXEC, "-n", "2", sys.executable, *common, "--grad-accum", "1", "--distributed", "mpi",
                          "--out", str(tmp_path / "two")], capture_output=True, text=True, timeout=400, cwd=HERE.parent)
    assert two.returncode == 0, two.stderr[-3000:]
    one = subprocess.run([sys.executable, *common, "--grad-accum", "2", "--out", str(tmp_path / "one")],
                         capture_output=True, text=True, timeout=400, cwd=HERE.parent)
    assert one.returncode == 0, one.stderr[-3000:]

    def logged(d, key):
        return [json.loads(line)[key] for line in (d / "metrics.jsonl").read_text().splitlines()]
    for key in ("loss", "rewards/margins", "rewards/accuracies"):
        assert logged(tmp_path / "two", key) == pytest.approx(logged(tmp_path / "one", key), rel=1e-4, abs=1e-6), key
    assert len(set(logged(tmp_path / "one", "loss"))) == 3          # it trained: the loss moved


def test_each_rank_of_a_host_takes_its_own_gpu_index(tmp_path):
    """--distributed mpi sets LFM2JIT_ADAPTER_INDEX to the local rank: on a two-GPU host rank 0 and
    rank 1 open different adapters (choose_adapter shares equal ones out by index). Each rank writes its
    own file: two ranks printing at once may interleave on mpiexec's shared stdout."""
    code = ("import sys; from mpi4py import MPI; from trainer.mpi_sync import local_rank; "
            "open(f'{sys.argv[1]}/rank{MPI.COMM_WORLD.Get_rank()}', 'w').write(str(local_rank()))")
    done = subprocess.run([MPIEXEC, "-n", "2", sys.executable, "-c", code, str(tmp_path)], capture_output=True,
                          text=True, timeout=120, cwd=HERE.parent)
    assert done.returncode == 0, done.stderr
    assert sorted((tmp_path / f"rank{r}").read_text() for r in range(2)) == ["0", "1"]


def test_ctrl_c_to_mpiexec_saves_a_checkpoint_that_mpiexec_resume_continues(tmp_path):
    """mpiexec forwards Ctrl-C (SIGINT) to every rank; the ranks stop after the same step, rank 0
    saves it and says how to continue; the same mpiexec command with --resume continues from it."""
    if MPIEXEC is None:
        pytest.fail("mpiexec is not installed: pip install mpi4py mpich (the test extras include them)")
    out = tmp_path / "run"
    common = ["-m", "trainer", "--preset", "tiny", "--distributed", "mpi", "--out", str(out), "--no-progress",
              "--eval-max", "4"]
    p = subprocess.Popen([MPIEXEC, "-n", "2", sys.executable, *common, "--steps", "100000"], cwd=HERE.parent,
                         text=True, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    try:
        deadline = time.monotonic() + 240
        f = out / "metrics.jsonl"
        while time.monotonic() < deadline and not (f.is_file() and len(f.read_text().splitlines()) >= 3):
            assert p.poll() is None, p.communicate()
            time.sleep(0.05)
        p.send_signal(signal.SIGINT)
        _, err = p.communicate(timeout=120)
    finally:
        if p.poll() is None:
            p.kill()
    assert p.returncode == 130, err[-3000:]
    k = json.loads(f.read_text().splitlines()[-1])["step"]
    assert (out / "checkpoints" / f"step-{k:06d}" / "trainer.json").is_file()
    assert f"continue with: mpiexec -n 2 {sys.executable} -m trainer --resume {out}" in err
    assert f"SIGINT: stopped after step {k} (rank 0 writes the checkpoint)" in err
    resumed = subprocess.run([MPIEXEC, "-n", "2", sys.executable, "-m", "trainer", "--resume", str(out), "--steps",
                              str(k + 2), "--no-progress"], cwd=HERE.parent, capture_output=True, text=True,
                             timeout=240)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert [json.loads(line)["step"] for line in f.read_text().splitlines()] == list(range(1, k + 3))


def test_distributed_mpi_without_an_mpi_library_is_a_usage_error(tmp_path):
    """mpi4py that cannot load its library: one line naming what to install, exit 2, nothing written."""
    fake = tmp_path / "fake" / "mpi4py"
    fake.mkdir(parents=True)
    (fake / "__init__.py").write_text('raise ImportError("libmpi.so.12: cannot open shared object file")\n')
    env = {**os.environ, "PYTHONPATH": str(fake.parent)}
    r = subprocess.run([sys.executable, "-m", "trainer", "--preset", "tiny", "--steps", "1", "--distributed", "mpi",
                        "--out", str(tmp_path / "run")], cwd=HERE.parent, env=env, capture_output=True, text=True,
                       timeout=120)
    assert r.returncode == 2, r.stderr
    assert ("--distributed mpi needs mpi4py and an MPI library (libmpi.so.12: cannot open shared object file): "
            "pip install mpi4py mpich") in r.stderr
    assert not (tmp_path / "run").exists()
