"""`python -m trainer dpo` as a user runs it (issue 48): DPO on a tiny Hugging Face checkpoint with
preference pairs made from the shipped chat data, full and LoRA; --resume with the run's reference
log-probs; bad input refused in one line (exit 2) before anything is written."""
from __future__ import annotations

import json
import math
import shutil

import numpy as np
import pytest

from test_cli_trainer import _hf_dir, cli, metrics
from trainer.cli import main
from trainer.data import default_dataset
from trainer.dpo import METRICS

RUN = ["--max-len", 64, "--grad-accum", 2, "--lr", 1e-3, "--schedule", "constant", "--no-progress"]


def _records(n: int) -> list[list[dict]]:
    return [json.loads(line)["messages"] for line in default_dataset().read_text().splitlines()[:n]]


def write_prefs(path, n: int = 12, kind: str = "conversational"):
    """Preference records from the shipped chat data: chosen = the record's answer, rejected = the next one's."""
    recs = _records(n)
    with open(path, "w") as f:
        for i, m in enumerate(recs):
            other = recs[(i + 1) % n][-1]
            if kind == "standard":
                rec = {"prompt": m[0]["content"], "chosen": m[-1]["content"], "rejected": other["content"]}
            elif kind == "implicit":
                rec = {"chosen": m, "rejected": m[:-1] + [other]}
            else:
                rec = {"prompt": m[:-1], "chosen": [m[-1]], "rejected": [other]}
            f.write(json.dumps(rec) + "\n")
    return path


@pytest.fixture(scope="module")
def base(tmp_path_factory, ctx, engine):
    d = tmp_path_factory.mktemp("dpo")
    return _hf_dir(d / "hf", ctx, engine), write_prefs(d / "prefs.jsonl")


@pytest.fixture(scope="module")
def full_run(base, tmp_path_factory):
    """3 steps of 2 pairs, a checkpoint at step 2, an evaluation at step 2 and at the end."""
    model, prefs = base
    out = tmp_path_factory.mktemp("dpo") / "full"
    r = cli("dpo", "--model", model, "--data", prefs, *RUN, "--steps", 3, "--checkpoint-every", 2,
            "--eval-fraction", 0.25, "--eval-every", 2, "--out", out)
    assert r.returncode == 0, r.stderr
    return out, r


def check_metrics(out, steps):
    lines = metrics(out)
    assert [m["step"] for m in lines] == steps
    for m in lines:
        for key in ("loss", "tokens", "supervised", "lr", "grad_norm", *METRICS):
            assert math.isfinite(m[key]), (key, m)
        assert 0.0 <= m["rewards/accuracies"] <= 1.0
        assert m["supervised"] < m["tokens"]          # completion tokens of prompt + completion
    return lines


def test_dpo_run_writes_trl_metrics_evaluations_and_the_model(full_run):
    out, r = full_run
    lines = check_metrics(out, [1, 2, 3])
    # the policy equals the reference at the start: sigmoid DPO's loss is log 2
    assert lines[0]["loss"] == pytest.approx(math.log(2), abs=1e-4)
    assert abs(lines[0]["rewards/margins"]) < 1e-3
    assert "reference log-probs of 12 pairs by the starting model" in r.stdout
    assert "held-out before training: DPO loss 0.6931" in r.stdout
    assert "step 2: held-out: loss 0.6931 -> " in r.stderr and "rewards/accuracies" in r.stderr
    (ev,) = [json.loads(x) for x in (out / "eval.jsonl").read_text().splitlines()]
    assert ev["step"] == 2 and ev["pairs"] == 3 and math.isfinite(ev["loss"])
    assert all(math.isfinite(ev[k]) for k in METRICS) and 0 <= ev["rewards/accuracies"] <= 1
    summary = json.loads((out / "summary.json").read_text())
    assert summary["eval_before"] == pytest.approx(math.log(2), abs=1e-6)
    assert set(METRICS) <= set(summary["eval_dpo_after"]) and summary["eval_exact_match"] is None
    assert (out / "model" / "model.safetensors").is_file() and (out / "loss.png").is_file()
    with np.load(out / "reference_logps.npz") as z:
        assert z["train"].shape == (9, 2) and z["eval"].shape == (3, 2) and (z["train"] < 0).all()
    assert json.loads((out / "run.json").read_text())["objective"] == "dpo"


def test_dpo_with_lora_and_implicit_prompt_eval_data(base, tmp_path):
    model, prefs = base
    held = write_prefs(tmp_path / "held.jsonl", n=4, kind="implicit")
    out = tmp_path / "lora"
    r = cli("dpo", "--model", model, "--data", prefs, "--eval-data", held, *RUN, "--steps", 2, "--lora-r", 4,
            "--loss-type", "ipo", "--beta", 0.5, "--out", out)
    assert r.returncode == 0, r.stderr
    assert "LoRA r 4" in r.stdout and "DPO: beta 0.5, ipo loss" in r.stdout
    lines = check_metrics(out, [1, 2])
    assert lines[0]["loss"] == pytest.approx(1.0, abs=1e-3)     # IPO at the start: (0 - 1/(2 beta))^2
    assert (out / "adapter" / "adapter_model.safetensors").is_file() and not (out / "model").exists()
    summary = json.loads((out / "summary.json").read_text())
    assert summary["eval_sequences"] == 4 and set(METRICS) <= set(summary["eval_dpo_after"])


def test_f16_activations_give_the_f32_runs_steps_within_f16_rounding(base, full_run, tmp_path):
    """--f16 (f16 activations, a loss scaler): the same three steps' DPO loss and margins as the f32
    run's, within f16 rounding (a wrong scaling or a dropped term would be far off)."""
    model, prefs = base
    out = tmp_path / "f16"
    r = cli("dpo", "--model", model, "--data", prefs, *RUN, "--steps", 3, "--f16", "--eval-fraction", 0.25,
            "--eval-every", 0, "--checkpoint-every", 0, "--out", out)
    assert r.returncode == 0, r.stderr
    for key in ("loss", "rewards/margins", "logps/chosen"):
        got, want = [m[key] for m in metrics(out)], [m[key] for m in metrics(full_run[0])]
        assert got == pytest.approx(want, rel=1e-2, abs=1e-3), key


def test_resume_continues_with_the_saved_reference(full_run, tmp_path):
    out, _ = full_run
    new = tmp_path / "resumed"
    r = cli("dpo", "--resume", out / "checkpoints" / "step-000002", "--no-progress", "--out", new)
    assert r.returncode == 0, r.stderr
    assert "reference log-probs of" not in r.stdout          # read back, not computed again
    (got,) = check_metrics(new, [3])
    want = metrics(out)[2]
    for key in ("loss", "grad_norm", *METRICS):
        assert got[key] == pytest.approx(want[key], rel=1e-6, abs=1e-7), key
    assert (new / "reference_logps.npz").read_bytes() == (out / "reference_logps.npz").read_bytes()


def test_resume_without_the_reference_or_with_other_pairs_is_refused(full_run, tmp_path):
    out, _ = full_run
    copy = tmp_path / "copy"
    shutil.copytree(out, copy)
    before = (copy / "metrics.jsonl").read_text()
    r = cli("dpo", "--resume", copy, "--steps", 4, "--seed", 1, "--no-progress")     # another split
    assert r.returncode == 2, r.stderr
    assert "reference_logps.npz holds the reference log-probs of other preference pairs" in r.stderr
    (copy / "reference_logps.npz").unlink()
    r = cli("dpo", "--resume", copy, "--steps", 4, "--no-progress")
    assert r.returncode == 2, r.stderr
    assert f"no reference_logps.npz in {copy}" in r.stderr and "Traceback" not in r.stderr
    assert (copy / "metrics.jsonl").read_text() == before and not (copy / "reference_logps.npz").exists()
    r = cli("--resume", out, "--steps", 4, "--no-progress")           # the train command: names dpo
    assert r.returncode == 2 and "continue it with python -m trainer dpo --resume" in r.stderr


@pytest.fixture(scope="module")
def bad_prefs(tmp_path_factory):
    d = tmp_path_factory.mktemp("bad")
    (d / "no_rejected.jsonl").write_text('{"prompt": "hi", "chosen": "a"}\n')
    (d / "empty.jsonl").write_text('{"prompt": "hi", "chosen": "a", "rejected": "b"}\n'
                                   '{"prompt": "hi", "chosen": "a", "rejected": ""}\n')
    return d


@pytest.mark.parametrize("args, message", [
    (["--data", "BAD/no_rejected.jsonl"], "no_rejected.jsonl:1: no 'rejected' answer"),
    (["--data", "BAD/empty.jsonl"], "empty.jsonl:2: 'rejected' is empty"),
    (["--beta", "0"], "--beta must be a finite number > 0, got 0.0"),
    (["--beta", "-1"], "--beta must be a finite number > 0, got -1.0"),
    (["--beta", "nan"], "--beta must be a finite number > 0, got nan"),
    (["--loss-type", "hinge"], "--loss-type must be sigmoid or ipo, got 'hinge'"),
    (["--label-smoothing", "0.5"], "--label-smoothing must be in [0, 0.5), got 0.5"),
    (["--label-smoothing", "0.1", "--loss-type", "ipo"], "--label-smoothing 0.1 applies to the sigmoid loss only"),
    (["--loss-on", "all"], "--loss-on does not apply to python -m trainer dpo"),
])
def test_bad_dpo_input_exits_2_in_one_line_writing_nothing(args, message, base, bad_prefs, tmp_path, capsys):
    model, prefs = base
    args = [a.replace("BAD", str(bad_prefs)) for a in args]
    out = tmp_path / "out"
    assert main(["dpo", "--model", str(model), "--data", str(prefs), *args, "--no-progress", "--out", str(out)]) == 2
    err = capsys.readouterr().err
    assert message in err and err.count("\n") == 1, err
    assert not out.exists()


@pytest.mark.parametrize("args, message", [
    (["--beta", "0.2"], "--beta is a preference-tuning (DPO) flag: use python -m trainer dpo"),
    (["--data", "PREFS"], "prefs.jsonl:1: record has neither 'text' nor 'messages'"),
])
def test_the_train_command_points_at_dpo(args, message, base, tmp_path, capsys):
    model, prefs = base
    args = [a.replace("PREFS", str(prefs)) for a in args]
    out = tmp_path / "out"
    assert main(["--model", str(model), *args, "--no-progress", "--out", str(out)]) == 2
    err = capsys.readouterr().err
    assert message in err and "use python -m trainer dpo" in err and err.count("\n") == 1, err
    assert not out.exists()
