"""A run directory is never silently reused, a skipped checkpoint is always said, and the final model
directory is always complete (issue 45): `python -m trainer` in subprocesses, the smallest runs."""
from __future__ import annotations

import json
import shutil

import pytest

from test_cli_trainer import SHORT, cli, metrics

RESUME = [a for a in SHORT if a not in ("--preset", "tiny")]     # the model comes from the checkpoint
MODEL_DIR_FILES = ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json",
                   "generation_config.json")


def _one_error_line(r) -> str:
    lines = [ln for ln in r.stderr.splitlines() if ln.startswith("error:")]
    assert len(lines) == 1, r.stderr
    return lines[0]


def test_a_fresh_run_into_a_used_out_refuses_and_overwrite_clears_it(tmp_path):
    out = tmp_path / "short"
    r = cli(*SHORT, "--steps", 2, "--checkpoint-every", 1, "--keep-checkpoints", 0, "--out", out)
    assert r.returncode == 0, r.stderr
    before = (out / "metrics.jsonl").read_text()
    r = cli(*SHORT, "--steps", 1, "--out", out)
    assert r.returncode == 2, r.stderr
    line = _one_error_line(r)
    assert str(out) in line and "--resume" in line and "--overwrite" in line and "--out" in line, line
    assert (out / "metrics.jsonl").read_text() == before
    assert sorted(p.name for p in (out / "checkpoints").iterdir()) == ["step-000001", "step-000002"]

    r = cli(*SHORT, "--steps", 1, "--out", out, "--overwrite")
    assert r.returncode == 0, r.stderr
    assert [m["step"] for m in metrics(out)] == [1]
    assert sorted(p.name for p in (out / "checkpoints").iterdir()) == ["step-000001"]
    r = cli(*RESUME, "--resume", out, "--steps", 2)
    assert r.returncode == 0, r.stderr
    assert [m["step"] for m in metrics(out)] == [1, 2]


def test_overwrite_refuses_a_directory_holding_other_files(tmp_path):
    out = tmp_path / "mixed"
    out.mkdir()
    (out / "run.json").write_text("{}")
    (out / "metrics.jsonl").write_text("")
    (out / "my-notes.txt").write_text("keep me")
    r = cli(*SHORT, "--steps", 1, "--out", out, "--overwrite")
    assert r.returncode == 2, r.stderr
    line = _one_error_line(r)
    assert str(out) in line and "my-notes.txt" in line, line
    assert (out / "my-notes.txt").read_text() == "keep me" and (out / "run.json").is_file()


@pytest.fixture(scope="module")
def damaged_run(tmp_path_factory):
    """A 2-step run checkpointed at steps 1 and 2 whose newest checkpoint lost optimizer.safetensors."""
    out = tmp_path_factory.mktemp("cli") / "damaged"
    r = cli(*SHORT, "--steps", 2, "--checkpoint-every", 1, "--keep-checkpoints", 0, "--out", out)
    assert r.returncode == 0, r.stderr
    (out / "checkpoints" / "step-000002" / "optimizer.safetensors").unlink()
    return out


def test_overwrite_cannot_clear_the_run_being_resumed(damaged_run, tmp_path):
    out = tmp_path / "r"
    shutil.copytree(damaged_run, out)
    r = cli(*RESUME, "--resume", out, "--overwrite", "--steps", 3)
    assert r.returncode == 2, r.stderr
    assert "--overwrite" in _one_error_line(r)
    assert (out / "checkpoints" / "step-000001" / "trainer.json").is_file() and (out / "metrics.jsonl").is_file()


def test_resuming_a_damaged_checkpoint_by_name_is_an_error(damaged_run):
    ckpt = damaged_run / "checkpoints" / "step-000002"
    r = cli(*RESUME, "--resume", ckpt, "--steps", 3)
    assert r.returncode == 2, r.stderr
    line = _one_error_line(r)
    assert "optimizer.safetensors" in line and str(ckpt) in line, line


def test_resuming_a_run_says_which_checkpoint_it_skipped_and_completes_the_model(damaged_run, tmp_path):
    out = tmp_path / "b"
    shutil.copytree(damaged_run, out)
    # keep 1: the checkpoint resumed from (step 1) is pruned before the final model is written
    r = cli(*RESUME, "--resume", out, "--steps", 3, "--keep-checkpoints", 1)
    assert r.returncode == 0, r.stderr
    skipped = [ln for ln in r.stderr.splitlines() if "step-000002" in ln and "optimizer.safetensors" in ln]
    assert len(skipped) == 1, r.stderr
    assert [m["step"] for m in metrics(out)] == [1, 2, 3]
    assert "could not complete" not in r.stderr, r.stderr
    assert not (out / "checkpoints" / "step-000001").exists()
    for name in MODEL_DIR_FILES:
        assert (out / "model" / name).is_file(), name
    assert json.loads((out / "model" / "generation_config.json").read_text())
    assert not [p for p in out.iterdir() if ".tmp-" in p.name or ".old-" in p.name]


def test_a_damaged_checkpoint_is_not_counted_by_retention(damaged_run, tmp_path):
    out = tmp_path / "c"
    shutil.copytree(damaged_run, out)
    # the damaged step 2 stays until a save replaces it; retention keeps the newest valid ones
    from trainer.cli.checkpoints import prune_checkpoints
    prune_checkpoints(out / "checkpoints", 1)
    assert sorted(p.name for p in (out / "checkpoints").iterdir()) == ["step-000001", "step-000002"]


def test_every_rank_decides_alike_and_clears_only_its_own_files(tmp_path):
    """Ranks share --out: each looks before the sync handshake (no rank writes before it), so all refuse
    alike; with --overwrite rank 0 clears the top level (and ranks this run lacks), rank r its rank<r>/."""
    from trainer.cli.run_dir import check_out, clear_out
    from trainer.cli.usage import UsageError

    class R:
        def __init__(self, rank, overwrite):
            self.rank, self.world_size, self.overwrite = rank, 2, overwrite

    out = tmp_path / "x"
    for d in ("checkpoints/step-000003", "rank1", "rank3", "model"):
        (out / d).mkdir(parents=True)
    for f in ("run.json", "metrics.jsonl", "rank1/metrics.jsonl", "rank3/run.json"):
        (out / f).write_text("{}")
    for rank in (0, 1):
        with pytest.raises(UsageError, match="--overwrite"):
            check_out(out, R(rank, False), None)
        check_out(out, R(rank, True), None)
    assert clear_out(out, R(1, True), None) == ["rank1"]
    assert sorted(p.name for p in out.iterdir()) == ["checkpoints", "metrics.jsonl", "model", "rank3", "run.json"]
    (out / "rank1").mkdir()             # rank 1 has started writing: rank 0 leaves it alone
    assert clear_out(out, R(0, True), None) == ["checkpoints", "metrics.jsonl", "model", "rank3", "run.json"]
    assert [p.name for p in out.iterdir()] == ["rank1"]
    (out / "checkpoints").mkdir()
    (out / "checkpoints" / "notes.txt").write_text("mine")
    with pytest.raises(UsageError, match="checkpoints/notes.txt"):
        check_out(out, R(0, True), None)
