"""`python -m trainer` in subprocesses, as a user runs it: flags, files written, resume, fine-tuning,
multi-process sync and clear errors."""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from lfm2jit.model import Lfm2Config, Lfm2Model
from lfm2jit.model.config import PRESETS
from trainer.cli.options import build_parser
from trainer.cli.train import METRICS_KEYS
from trainer.data import default_dataset, default_text_dataset, default_tokenizer

ROOT = Path(__file__).resolve().parents[2]
VOCAB = 102           # the shipped tokenizer's size
# a short run: the tiny preset, one sequence per step, a schedule that changes the rate every step
# but does not depend on the total (so a 3-step run resumed to 6 equals a 6-step run)
SHORT = ["--preset", "tiny", "--grad-accum", "1", "--schedule", "warmup", "--warmup-steps", "4", "--lr", "3e-3",
         "--eval-max", "4", "--no-progress"]


def cli(*args: str, cwd: Path = ROOT, timeout: float = 300) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    return subprocess.run([sys.executable, "-m", "trainer", *map(str, args)], cwd=cwd, capture_output=True,
                          text=True, timeout=timeout, env=env)


def metrics(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def assert_same_steps(got: list[dict], want: list[dict]) -> None:
    assert [m["step"] for m in got] == [m["step"] for m in want]
    for g, w in zip(got, want):
        for key in ("loss", "grad_norm", "lr"):
            assert g[key] == pytest.approx(w[key], rel=1e-6, abs=1e-7), (key, g, w)
        assert g["tokens"] == w["tokens"] and g["supervised"] == w["supervised"]


@pytest.fixture(scope="module")
def short_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("cli") / "short"
    r = cli(*SHORT, "--steps", 3, "--out", out)
    return out, r


@pytest.fixture(scope="module")
def long_run(tmp_path_factory):
    """The uninterrupted 6-step run, with a checkpoint at step 3."""
    out = tmp_path_factory.mktemp("cli") / "long"
    r = cli(*SHORT, "--steps", 6, "--checkpoint-every", 3, "--out", out)
    assert r.returncode == 0, r.stderr
    return out


def check_plot(path, curves: dict[str, str]) -> None:
    """The PNG opens, names each panel's box (trainer/cli/plot.py), and each box holds its curve's colour."""
    from PIL import Image
    img = Image.open(path)
    assert img.format == "PNG" and 300 < img.width < 4000 and 300 < img.height < 4000
    boxes = {k[len("panel:"):]: tuple(map(int, v.split())) for k, v in img.text.items() if k.startswith("panel:")}
    assert set(curves) <= set(boxes), boxes
    rgb = np.asarray(img.convert("RGB")).astype(int)
    for name, color in curves.items():
        x0, y0, x1, y1 = boxes[name]
        want = np.array([int(color[i:i + 2], 16) for i in (1, 3, 5)])
        near = (np.abs(rgb[y0:y1, x0:x1] - want).sum(-1) < 40).sum()
        assert near > 20, (name, near)


def test_help_lists_every_flag():
    r = cli("--help")
    assert r.returncode == 0, r.stderr
    flags = {s for a in build_parser()._actions for s in a.option_strings if s.startswith("--")}
    wanted = {"--model", "--data", "--lr", "--schedule", "--warmup-steps", "--min-lr", "--grad-accum", "--clip",
              "--bucket", "--scaler", "--f16", "--pack-tokens", "--steps", "--epochs", "--max-len", "--checkpoint-every",
              "--resume",
              "--out", "--seed", "--sync-dir", "--rank", "--world-size", "--run-id", "--sync-timeout", "--adapter",
              "--optimizer", "--weight-decay", "--momentum", "--preset", "--replay", "--recompute-mlp",
              "--checkpoint-layers"}
    assert wanted <= flags
    for flag in flags:
        assert flag in r.stdout, flag
    for choice in ("constant", "warmup", "cosine", "linear", "adamw", "sgd"):
        assert choice in r.stdout


def test_short_run_writes_metrics_png_checkpoint_and_summary(short_run, ctx, engine):
    out, r = short_run
    assert r.returncode == 0, r.stderr
    assert "Traceback" not in r.stderr
    # metrics: one line per optimizer step, with every documented key
    lines = metrics(out)
    assert [m["step"] for m in lines] == [1, 2, 3]
    for m in lines:
        assert set(METRICS_KEYS) <= set(m)
        assert np.isfinite(m["loss"]) and m["tokens"] > 0 and m["tokens_per_s"] > 0 and m["grad_norm"] > 0
        assert m["skipped"] is False and m["loss_scale"] == 1.0
    assert [m["lr"] for m in lines] == pytest.approx([3e-3 * k / 4 for k in (1, 2, 3)])
    # the plot: a PNG with its loss, learning-rate and gradient-norm panels, each with its curve drawn
    check_plot(out / "loss.png", {"loss": "#9bbbe8", "learning rate": "#7f3fbf", "gradient norm": "#ff7f0e"})
    # the checkpoint: a Hugging Face directory the model loads, plus trainer state
    ckpt = out / "checkpoints" / "step-000003"
    assert {"model", "optimizer.safetensors", "trainer.json"} <= {p.name for p in ckpt.iterdir()}
    assert (ckpt / "model" / "tokenizer.json").is_file()
    model = Lfm2Model.from_pretrained(ckpt / "model", ctx, engine)
    assert model.cfg.vocab_size == VOCAB and model.cfg.hidden_size == PRESETS["tiny"]["hidden_size"]
    meta = json.loads((ckpt / "trainer.json").read_text())
    assert meta["optimizer_steps"] == 3 and meta["data_position"]["next"] == 3
    # the summary
    summary = json.loads((out / "summary.json").read_text())
    assert summary["steps"] == 3 and np.isfinite(summary["eval_before"]) and np.isfinite(summary["eval_after"])
    assert summary["first_loss"] == pytest.approx(lines[0]["loss"]) and summary["last_loss"] == pytest.approx(
        lines[-1]["loss"])
    for text in ("held-out loss", "train loss: step 1", "metrics:", "loss curve:", "checkpoint:", str(out.resolve())):
        assert text in r.stdout, text


def test_resume_continues_at_step_4_exactly_as_an_uninterrupted_run(short_run, long_run, tmp_path):
    out, r = short_run
    assert r.returncode == 0, r.stderr
    resumed = tmp_path / "resumed"
    shutil.copytree(out, resumed)
    r = cli("--resume", resumed, "--steps", 6)
    assert r.returncode == 0, r.stderr
    got = metrics(resumed)
    assert [m["step"] for m in got] == [1, 2, 3, 4, 5, 6]         # continued in the run's own directory
    assert_same_steps(got, metrics(long_run))
    assert "steps 4..6" in r.stdout
    assert (resumed / "checkpoints" / "step-000006" / "trainer.json").is_file()


def test_resume_from_a_mid_run_checkpoint_into_a_new_directory(long_run, tmp_path):
    ckpt = long_run / "checkpoints" / "step-000003"
    assert ckpt.is_dir()
    r = cli("--resume", ckpt, "--out", tmp_path / "again")
    assert r.returncode == 0, r.stderr
    got = metrics(tmp_path / "again")
    assert [m["step"] for m in got] == [4, 5, 6]
    assert_same_steps(got, metrics(long_run)[3:])


def _hf_dir(path: Path, ctx, engine, vocab: int = VOCAB) -> Path:
    cfg = Lfm2Config(**{**PRESETS["tiny"], "vocab_size": vocab})
    Lfm2Model(cfg, ctx, engine, seed=7).save_pretrained(path)
    shutil.copyfile(default_tokenizer(), path / "tokenizer.json")
    return path


def test_fine_tune_a_hugging_face_checkpoint_on_chat_data(tmp_path, ctx, engine):
    src = _hf_dir(tmp_path / "hf", ctx, engine)
    before = Lfm2Model.from_pretrained(src, ctx, engine).state_dict()
    out = tmp_path / "ft"
    r = cli("--model", src, "--data", default_dataset(), "--steps", 2, "--grad-accum", 1, "--lr", 1e-3,
            "--eval-max", 4, "--no-progress", "--out", out)
    assert r.returncode == 0, r.stderr
    assert "fine-tuning" in r.stdout and "assistant tokens" in r.stdout
    lines = metrics(out)
    assert [m["step"] for m in lines] == [1, 2]
    assert all(m["supervised"] < m["tokens"] for m in lines)        # only the answers are supervised
    after = Lfm2Model.from_pretrained(out / "checkpoints" / "step-000002" / "model", ctx, engine).state_dict()
    assert before.keys() == after.keys()
    assert any(not np.array_equal(before[k], after[k]) for k in before)


def test_text_jsonl_with_sgd_and_loss_scaling(tmp_path, ctx, engine):
    src = _hf_dir(tmp_path / "hf", ctx, engine)
    out = tmp_path / "txt"
    r = cli("--model", src, "--data", default_text_dataset(), "--steps", 1, "--grad-accum", 2, "--optimizer", "sgd",
            "--scaler", "--eval-fraction", 0, "--no-progress", "--out", out)
    assert r.returncode == 0, r.stderr
    (m,) = metrics(out)
    assert m["supervised"] == m["tokens"] and m["loss_scale"] == 2.0 ** 16 and m["skipped"] is False


def test_f16_run_tracks_the_f32_run_and_resumes_in_f16(short_run, tmp_path, ctx):
    """--f16 turns on loss scaling and f16 activations; losses follow the f32 run's (within 1e-3,
    see tests/ops/test_mixed_precision.py), and a resumed run stays f16."""
    if not ctx.has_f16:
        pytest.skip("adapter has no shader-f16")
    out32, r32 = short_run
    assert r32.returncode == 0, r32.stderr
    out = tmp_path / "f16"
    r = cli(*SHORT, "--steps", 2, "--checkpoint-every", 2, "--f16", "--out", out)
    assert r.returncode == 0, r.stderr
    assert "loss scaling, f16 activations" in r.stdout
    r = cli("--resume", out, "--steps", 3, "--no-progress")
    assert r.returncode == 0, r.stderr
    assert "loss scaling, f16 activations" in r.stdout
    got, want = metrics(out), metrics(out32)
    assert [m["step"] for m in got] == [1, 2, 3]
    assert all(m["loss_scale"] == 2.0 ** 16 and m["skipped"] is False for m in got)
    assert [m["loss"] for m in got] == pytest.approx([m["loss"] for m in want], rel=1e-3)
    meta = json.loads((out / "checkpoints" / "step-000003" / "trainer.json").read_text())
    assert '"f16": true' in json.dumps(meta)


def test_replay_and_recompute_change_nothing_but_speed_and_memory(tmp_path):
    """--replay 0 (every step's Python runs), --recompute-mlp (backward recomputes the MLP's
    up-projections) and --checkpoint-layers (backward reruns checkpointed layers' forwards) run the
    same kernels on the same inputs: bit-identical metrics and weights."""
    common = ["--preset", "tiny", "--steps", 4, "--eval-fraction", 0, "--no-progress", "--max-len", 64]
    runs = {"default": [], "recompute": ["--recompute-mlp"], "checkpoint": ["--checkpoint-layers", "all"],
            "first": ["--checkpoint-layers", 1, "--replay", 0]}
    for name, flags in runs.items():
        r = cli(*common, *flags, "--out", tmp_path / name)
        assert r.returncode == 0, r.stderr
    from safetensors.numpy import load_file
    base = metrics(tmp_path / "default")
    w0 = load_file(str(tmp_path / "default" / "checkpoints" / "step-000004" / "model" / "model.safetensors"))
    for name in ("recompute", "checkpoint", "first"):
        got = metrics(tmp_path / name)
        assert [(m["loss"], m["grad_norm"]) for m in got] == [(m["loss"], m["grad_norm"]) for m in base], name
        w = load_file(str(tmp_path / name / "checkpoints" / "step-000004" / "model" / "model.safetensors"))
        assert all(np.array_equal(w[k], w0[k]) for k in w0), name


def test_packing_concat_trains_as_pad_does(tmp_path):
    """--packing concat (a step's sequences concatenated in one row) against the default pad: the same
    losses and gradient norms to f32 rounding (the packed passes' sums run in other orders)."""
    common = ["--preset", "tiny", "--steps", 3, "--grad-accum", 4, "--schedule", "constant", "--eval-fraction", 0,
              "--no-progress", "--optimizer", "sgd"]
    for mode in ("pad", "concat"):
        r = cli(*common, "--packing", mode, "--out", tmp_path / mode)
        assert r.returncode == 0, r.stderr
    pad, concat = metrics(tmp_path / "pad"), metrics(tmp_path / "concat")
    assert [m["step"] for m in pad] == [m["step"] for m in concat] == [1, 2, 3]
    for a, b in zip(concat, pad):
        assert a["tokens"] == b["tokens"] and a["supervised"] == b["supervised"]
        assert a["loss"] == pytest.approx(b["loss"], rel=1e-4) and a["grad_norm"] == pytest.approx(b["grad_norm"], rel=1e-3)
    meta = json.loads((tmp_path / "concat" / "checkpoints" / "step-000003" / "trainer.json").read_text())
    assert '"packing": "concat"' in json.dumps(meta)


def test_two_ranks_with_file_sync_equal_one_process_accumulating_both(tmp_path):
    common = ["--preset", "tiny", "--steps", 2, "--schedule", "constant", "--eval-fraction", 0, "--no-progress"]
    # one sequence per pass, as each rank runs it (packing would change f32 rounding, which AdamW
    # turns into visible differences for weights whose gradient is near its eps)
    one = cli(*common, "--grad-accum", 2, "--pack-tokens", 0, "--out", tmp_path / "one")
    assert one.returncode == 0, one.stderr
    sync = ["--sync-dir", tmp_path / "sync", "--world-size", 2, "--grad-accum", 1, "--out", tmp_path / "two",
            "--sync-timeout", 120]
    env = dict(os.environ, PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    procs = [subprocess.Popen([sys.executable, "-m", "trainer", *map(str, common + sync), "--rank", str(r)],
                              cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for r in (0, 1)]
    results = [p.communicate(timeout=300) for p in procs]
    assert [p.returncode for p in procs] == [0, 0], results
    single = metrics(tmp_path / "one")
    rank0, rank1 = metrics(tmp_path / "two"), metrics(tmp_path / "two" / "rank1")
    for s, a, b in zip(single, rank0, rank1):
        assert s["loss"] == pytest.approx((a["loss"] + b["loss"]) / 2, rel=1e-5)
        assert s["grad_norm"] == pytest.approx(a["grad_norm"], rel=1e-4) == b["grad_norm"]
    from safetensors.numpy import load_file
    w1 = load_file(str(tmp_path / "one" / "checkpoints" / "step-000002" / "model" / "model.safetensors"))
    w2 = load_file(str(tmp_path / "two" / "checkpoints" / "step-000002" / "model" / "model.safetensors"))
    for k in w1:
        np.testing.assert_allclose(w2[k], w1[k], rtol=1e-4, atol=1e-6, err_msg=k)


def test_stale_sync_files_stop_the_run_instead_of_being_averaged_in(tmp_path):
    sync = tmp_path / "sync"
    sync.mkdir()
    (sync / "run.round00000002.rank1.safetensors").write_bytes(b"left by an earlier run")
    r = cli("--preset", "tiny", "--steps", 1, "--eval-fraction", 0, "--no-progress", "--out", tmp_path / "o",
            "--sync-dir", sync, "--world-size", 2, "--rank", 0, "--sync-timeout", 5)
    assert r.returncode == 2, (r.stdout, r.stderr)
    assert "gradient files of an earlier run named 'run'" in r.stderr and "Traceback" not in r.stderr


@pytest.fixture(scope="module")
def small_vocab_model(tmp_path_factory, ctx, engine):
    return _hf_dir(tmp_path_factory.mktemp("cli") / "v64", ctx, engine, vocab=64)


@pytest.fixture(scope="module")
def bad_jsonl(tmp_path_factory):
    p = tmp_path_factory.mktemp("cli") / "bad.jsonl"
    p.write_text('{"text": "fine"}\n{"messages": [{"role": "user", "content": "hi"}\n')
    return p


@pytest.mark.parametrize("args, message", [
    (["--model", "/no/such/dir"], "--model /no/such/dir: no such directory"),
    (["--data", "/no/such/file.jsonl"], "--data /no/such/file.jsonl: no such file"),
    (["--data", "BAD"], "bad.jsonl:2: malformed JSON"),
    (["--model", "SMALL"], "has 102 ids but the model's vocab_size is 64"),
    (["--world-size", "2"], "--world-size > 1 needs --sync-dir"),
    (["--world-size", "2", "--rank", "2", "--sync-dir", "/tmp/x"], "--rank must be in 0..1"),
    (["--resume", "/no/such/run"], "--resume /no/such/run: no such directory"),
    (["--preset", "huge"], "unknown --preset 'huge'"),
    (["--steps", "0"], "--steps must be > 0"),
    (["--packing", "tight"], "--packing must be pad, concat or auto, got 'tight'"),
    (["--steps", "many"], "invalid int value"),
    (["--steps", "3", "--epochs", "1"], "not allowed with argument"),
    (["--checkpoint-layers", "0"], "--checkpoint-layers must be all or a number of decoder layers >= 1, got '0'"),
    (["--checkpoint-layers", "-1"], "--checkpoint-layers must be all or a number of decoder layers >= 1, got '-1'"),
    (["--checkpoint-layers", "abc"], "--checkpoint-layers must be all or a number of decoder layers >= 1, got 'abc'"),
    (["--checkpoint-layers", "5", "--preset", "tiny"], "--checkpoint-layers 5: the model has 4 decoder layers"),
    (["--checkpoint-layers", "3"], "--checkpoint-layers 3: the model has 2 decoder layers"),
])
def test_bad_input_exits_2_with_a_message(args, message, bad_jsonl, small_vocab_model):
    args = [str(bad_jsonl) if a == "BAD" else str(small_vocab_model) if a == "SMALL" else a for a in args]
    r = cli(*args, "--no-progress")
    assert r.returncode == 2, (r.stdout, r.stderr)
    assert message in r.stderr
    assert "Traceback" not in r.stderr
