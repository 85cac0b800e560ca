"""--report-to: a real short run logs to TensorBoard event files (read back record by record with the
event protos tensorboardX ships) the same scalars as metrics.jsonl, step by step, plus the evaluations
and the run's settings; wandb (offline) and mlflow (SQLite store) too; a clear usage error where a library is missing."""
from __future__ import annotations

import json
import struct
from pathlib import Path

import numpy as np
import pytest

from test_cli_trainer import SHORT, cli, metrics
from trainer.cli.report import numbers
from trainer.cli.train import METRICS_KEYS

tbx = pytest.importorskip("tensorboardX", reason="tensorboardX is not installed (pip install -e .[report])")


def _masked_crc(data: bytes) -> int:
    from tensorboardX.crc32c import crc32c
    crc = crc32c(data)
    return (((crc >> 15) | (crc << 17)) + 0xA282EAD8) & 0xFFFFFFFF


def read_events(logdir: Path) -> list:
    """Every Event of the TFRecord event files in ``logdir``, CRCs checked, files in name order."""
    from tensorboardX.proto import event_pb2
    events = []
    files = sorted(logdir.glob("events.out.tfevents.*"))
    assert files, f"no event files in {logdir}"
    for f in files:
        buf, i = f.read_bytes(), 0
        while i < len(buf):
            (n,) = struct.unpack("<Q", buf[i:i + 8])
            assert struct.unpack("<I", buf[i + 8:i + 12])[0] == _masked_crc(buf[i:i + 8])
            data = buf[i + 12:i + 12 + n]
            assert struct.unpack("<I", buf[i + 12 + n:i + 16 + n])[0] == _masked_crc(data)
            ev = event_pb2.Event()
            ev.ParseFromString(data)
            events.append(ev)
            i += 16 + n
    return events


def scalars(events) -> dict[str, list[tuple[int, float]]]:
    out: dict[str, list] = {}
    for ev in events:
        for v in ev.summary.value:
            if v.HasField("simple_value"):
                out.setdefault(v.tag, []).append((ev.step, v.simple_value))
    return out


def texts(events) -> dict[str, str]:
    out = {}
    for ev in events:
        for v in ev.summary.value:
            if v.HasField("tensor") and v.tensor.string_val:
                out[v.tag.split("/")[0]] = v.tensor.string_val[0].decode()
    return out


def test_tensorboard_event_files_hold_the_metrics_jsonl_scalars_step_by_step(tmp_path):
    out = tmp_path / "tb"
    r = cli(*SHORT, "--steps", 4, "--out", out, "--report-to", "tensorboard")
    assert r.returncode == 0, r.stderr
    events = read_events(out / "tensorboard")
    got = scalars(events)
    lines = metrics(out)
    assert [m["step"] for m in lines] == [1, 2, 3, 4]
    logged_keys = {k for m in lines for k in numbers(m)}
    assert {"loss", "lr", "grad_norm", "tokens", "tokens_per_s", "elapsed"} <= logged_keys <= set(METRICS_KEYS)
    for key in logged_keys:
        want = [(m["step"], np.float32(numbers(m)[key])) for m in lines if key in numbers(m)]
        assert [(s, np.float32(v)) for s, v in got[f"train/{key}"]] == want, key
    summary = json.loads((out / "summary.json").read_text())
    assert dict(got["eval/loss"]) == pytest.approx({0: summary["eval_before"], 4: summary["eval_after"]}, rel=1e-6)
    assert dict(got["eval/answer_loss"])[4] == pytest.approx(summary["eval_answer_after"], rel=1e-6)
    settings = texts(events)["settings"]
    assert json.loads(settings.strip("`\n"))["lr"] == pytest.approx(3e-3)


def test_a_resumed_run_appends_to_the_event_files_from_its_first_step(tmp_path):
    out = tmp_path / "tb"
    assert cli(*SHORT, "--steps", 2, "--out", out, "--report-to", "tensorboard").returncode == 0
    r = cli("--resume", out, "--steps", 4, "--no-progress", "--report-to", "tensorboard")
    assert r.returncode == 0, r.stderr
    events = read_events(out / "tensorboard")
    assert len(list((out / "tensorboard").glob("events.out.tfevents.*"))) == 2
    # the second file starts with a purge at step 3, so TensorBoard keeps the first segment's steps 1..2
    assert any(ev.HasField("session_log") and ev.step == 3 for ev in events)
    got = scalars(events)
    assert [(s, np.float32(v)) for s, v in got["train/loss"]] == [(m["step"], np.float32(m["loss"]))
                                                                  for m in metrics(out)]


@pytest.mark.parametrize("backend, absent, reason", [
    ("wandb", {"wandb"}, "the wandb package is not installed (pip install wandb)"),
    ("mlflow", {"mlflow", "sqlalchemy", "alembic"},
     "the mlflow and sqlalchemy and alembic packages are not installed (pip install mlflow)"),
    ("mlflow", {"alembic"}, "the alembic package is not installed (pip install mlflow)"),      # mlflow-skinny
])
def test_report_to_a_missing_library_is_a_one_line_usage_error(tmp_path, monkeypatch, capsys, backend, absent, reason):
    """Refused before anything is loaded or written (the packages' absence faked: CI has them all)."""
    import trainer.cli.report
    from trainer.cli import main
    real = trainer.cli.report._importable
    monkeypatch.setattr(trainer.cli.report, "_importable", lambda m: m not in absent and real(m))
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    assert main([*map(str, SHORT), "--steps", "1", "--out", str(tmp_path / "x"), "--report-to", "tensorboard",
                 backend]) == 2
    assert capsys.readouterr().err.strip() == f"error: --report-to {backend}: {reason}"
    assert not (tmp_path / "x").exists()
    # a tracking server of the user's own needs the mlflow client alone
    monkeypatch.setenv("MLFLOW_TRACKING_URI", "http://localhost:5000")
    assert trainer.cli.report.missing("mlflow") == (None if "mlflow" not in absent else
                                                "the mlflow package is not installed (pip install mlflow)")


def test_wandb_offline_run(tmp_path, monkeypatch):
    monkeypatch.setenv("WANDB_MODE", "offline")
    out = tmp_path / "wb"
    r = cli(*SHORT, "--steps", 2, "--out", out, "--report-to", "wandb")
    assert r.returncode == 0, r.stderr
    assert "note: --report-to" not in r.stderr
    assert list((out / "wandb").glob("offline-run-*"))


def test_mlflow_sqlite_store_holds_the_losses_and_settings(tmp_path, monkeypatch):
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    out = tmp_path / "ml"
    r = cli(*SHORT, "--steps", 2, "--out", out, "--report-to", "mlflow")
    assert r.returncode == 0, r.stderr
    assert "note: --report-to" not in r.stderr
    import mlflow
    client = mlflow.tracking.MlflowClient(f"sqlite:///{(out / 'mlflow.db').resolve()}")
    (run,) = client.search_runs([e.experiment_id for e in client.search_experiments()])
    assert run.info.status == "FINISHED" and run.info.run_name == out.name
    hist = client.get_metric_history(run.info.run_id, "train/loss")
    assert [h.step for h in hist] == [m["step"] for m in metrics(out)]
    assert [h.value for h in hist] == pytest.approx([m["loss"] for m in metrics(out)])
    assert run.data.params["steps"] == "2"
    assert [h.step for h in client.get_metric_history(run.info.run_id, "eval/loss")] == [0, 2]
