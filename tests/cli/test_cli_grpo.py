"""`python -m trainer grpo` as a user runs it: GRPO on a tiny Hugging Face checkpoint with prompts made
from the shipped chat data (trainer.post_data's prompt records, with an "answer"), full fine-tuning and
LoRA, exact_match and a reward function of a file; --num-iterations, --beta, --resume; a failing
reward function ends the run (exit 1); bad input refused in one line (exit 2) before anything is written."""
from __future__ import annotations

import json
import math

import pytest

from test_cli_dpo import _records
from test_cli_trainer import _hf_dir, cli, metrics
from trainer.cli import main
from trainer.post_data import prompt_records

RUN = ["--max-len", 64, "--grad-accum", 2, "--num-generations", 2, "--max-completion-length", 4, "--lr", 1e-3,
       "--schedule", "constant", "--no-progress"]
TRL_KEYS = ("reward", "reward_std", "frac_reward_zero_std", "completions/mean_length", "completions/min_length",
            "completions/max_length", "completions/clipped_ratio", "clip_ratio/low_mean", "clip_ratio/high_mean",
            "clip_ratio/region_mean")
TRAIN_KEYS = ("loss", "tokens", "supervised", "tokens_per_s", "lr", "grad_norm", "elapsed")

REWARDS = '''
import math

def const(prompts, completions, **columns):
    return [0.5] * len(completions)

def length(prompts, completions, answer=None, **columns):
    assert len(answer) == len(completions)          # the prompts file's columns, one per completion
    return [float(len(c)) for c in completions]

calls = 0

def _second_batch(completions, bad):
    global calls
    calls += 1
    return [0.0] * len(completions) if calls < 2 else bad(completions)

def raises(prompts, completions, **columns):
    return _second_batch(completions, lambda c: 1 / 0)

def short(prompts, completions, **columns):
    return _second_batch(completions, lambda c: [0.0])

def nan(prompts, completions, **columns):
    return _second_batch(completions, lambda c: [math.nan] * len(c))
'''


def write_prompts(path, n: int = 8):
    """trainer.post_data's GRPO records ({"prompt": [messages], "answer", "task"}) of the shipped chat data."""
    recs = prompt_records([{"messages": m} for m in _records(n)])
    path.write_text("".join(json.dumps(r) + "\n" for r in recs))
    return path


@pytest.fixture(scope="module")
def base(tmp_path_factory, ctx, engine):
    d = tmp_path_factory.mktemp("grpo")
    (d / "rewards.py").write_text(REWARDS)
    return _hf_dir(d / "hf", ctx, engine), write_prompts(d / "prompts.jsonl"), d / "rewards.py"


@pytest.fixture(scope="module")
def full_run(base, tmp_path_factory):
    """Full fine-tuning, beta 0.1 (the reference: the --model directory, loaded again), 2 optimizer steps per
    generation batch: windows end at steps 2 and 3 (the last one stops at --steps); 2 held-out prompts."""
    model, prompts, rewards = base
    out = tmp_path_factory.mktemp("grpo") / "full"
    r = cli("grpo", "--model", model, "--prompts", prompts, "--reward", "exact_match", "--reward",
            f"{rewards}:length", *RUN, "--steps", 3, "--num-iterations", 2, "--beta", 0.1,
            "--checkpoint-every", 2, "--eval-fraction", 0.25, "--eval-every", 2, "--out", out)
    assert r.returncode == 0, r.stderr
    return out, r


def check_metrics(out, steps, beta=True):
    lines = metrics(out)
    assert [m["step"] for m in lines] == steps
    for m in lines:
        for key in (*TRAIN_KEYS, *TRL_KEYS, *(("kl",) if beta else ())):
            assert isinstance(m[key], (int, float)) and math.isfinite(m[key]), (key, m)
        assert 1 <= m["completions/min_length"] <= m["completions/mean_length"] <= m["completions/max_length"] <= 4
        assert 0 < m["supervised"] < m["tokens"]
    return lines


def test_full_fine_tuning_run(full_run):
    out, r = full_run
    lines = check_metrics(out, [2, 3])
    for m in lines:
        # the rewards add up: exact_match (0 or 1 per completion) + the completion's length in characters
        assert m["reward"] == pytest.approx(m["rewards/exact_match/mean"] + m["rewards/length/mean"])
        assert 0 <= m["rewards/exact_match/mean"] <= 1 and m["rewards/length/mean"] > 0
        assert m["kl"] >= 0
    # 2 optimizer steps for the first generation batch, 1 for the last (--steps 3): the supervised tokens
    # count each pass, so the first line's are twice its completions'
    assert lines[0]["supervised"] == 2 * round(lines[0]["completions/mean_length"] * 4)
    assert lines[1]["supervised"] == round(lines[1]["completions/mean_length"] * 4)
    assert "GRPO: 2 completions per prompt" in r.stdout and "2 optimizer step(s) per generation batch" in r.stdout
    assert "before training: held-out reward" in r.stdout and "step 2: held-out reward" in r.stderr
    (ev,) = [json.loads(x) for x in (out / "eval.jsonl").read_text().splitlines()]
    assert ev["step"] == 2 and ev["prompts"] == 2 and ev["answers_scored"] == 2 and ev["loss"] is None
    assert 0 <= ev["exact_match"] <= 1 and ev["reward"] == pytest.approx(ev["rewards/exact_match/mean"]
                                                                          + ev["rewards/length/mean"])
    summary = json.loads((out / "summary.json").read_text())
    assert summary["eval_grpo_after"]["prompts"] == 2 and "reward" in summary["eval_grpo_before"]
    assert isinstance(summary["reward_rose"], bool)
    assert ("the held-out reward rose" in r.stdout) == summary["reward_rose"]
    assert "held-out loss" not in r.stdout
    assert (out / "model" / "model.safetensors").is_file() and (out / "loss.png").is_file()
    assert (out / "checkpoints" / "step-000002").is_dir() and (out / "checkpoints" / "step-000003").is_dir()
    settings = json.loads((out / "run.json").read_text())
    assert settings["objective"] == "grpo" and settings["reference_model"] == str(base_model(out))


def base_model(out):
    return json.loads((out / "run.json").read_text())["model"]


def test_lora_run_with_a_constant_reward_and_beta(base, tmp_path):
    model, prompts, rewards = base
    out = tmp_path / "lora"
    r = cli("grpo", "--model", model, "--prompts", prompts, "--reward", f"{rewards}:const", *RUN, "--steps", 2,
            "--lora-r", 4, "--beta", 0.1, "--eval-fraction", 0.25, "--eval-every", 1, "--eval-generations", 3,
            "--out", out)
    assert r.returncode == 0, r.stderr
    assert "reference: the base, adapters off" in r.stdout
    for m in check_metrics(out, [1, 2]):
        assert m["reward"] == 0.5 and m["rewards/const/mean"] == 0.5 and m["rewards/const/std"] == 0
        assert m["reward_std"] == 0 and m["frac_reward_zero_std"] == 1
    (ev,) = [json.loads(x) for x in (out / "eval.jsonl").read_text().splitlines()]
    # exact match is the records' "answer" against the greedy completion, whatever the reward functions
    assert ev["step"] == 1 and ev["reward"] == 0.5 and 0 <= ev["exact_match"] <= 1 and ev["answers_scored"] == 2
    # --eval-generations 3: 3 completions sampled per held-out prompt, each scored (6 in all)
    assert ev["sampled/reward"] == 0.5 and (ev["sampled/exact_match"] * 6) == pytest.approx(round(ev["sampled/exact_match"] * 6))
    assert "sampled: reward 0.50 -> 0.50, exact match" in r.stdout
    assert (out / "adapter" / "adapter_model.safetensors").is_file() and not (out / "model").exists()


def test_resume_continues_the_run(full_run, tmp_path):
    out, _ = full_run
    new = tmp_path / "resumed"
    r = cli("grpo", "--resume", out / "checkpoints" / "step-000002", "--no-progress", "--out", new)
    assert r.returncode == 0, r.stderr
    (got,) = check_metrics(new, [3])
    want = metrics(out)[1]
    for key in ("loss", "grad_norm", "reward", "kl", "completions/mean_length"):
        assert got[key] == pytest.approx(want[key], rel=1e-5, abs=1e-6), key
    # the summary's "before" is the run's start (kept in the checkpoint), not the resumed segment's
    before = json.loads((new / "summary.json").read_text())["eval_grpo_before"]
    assert before["reward"] == json.loads((out / "summary.json").read_text())["eval_grpo_before"]["reward"]
    r = cli("--resume", out, "--steps", 4, "--no-progress")           # the train command names grpo
    assert r.returncode == 2 and "continue it with python -m trainer grpo --resume" in r.stderr


@pytest.mark.parametrize("name, message", [
    ("raises", "reward function raises raised ZeroDivisionError"),
    ("short", "reward function short returned 1 rewards for 4 completions"),
    ("nan", "reward function nan returned nan for completion 0"),
])
def test_a_failing_reward_function_ends_the_run(name, message, base, tmp_path):
    model, prompts, rewards = base
    out = tmp_path / name
    r = cli("grpo", "--model", model, "--prompts", prompts, "--reward", f"{rewards}:{name}", *RUN, "--steps", 3,
            "--checkpoint-every", 1, "--eval-fraction", 0, "--out", out)
    assert r.returncode == 1, r.stderr
    err = [x for x in r.stderr.splitlines() if x.startswith("error:")]
    assert len(err) == 1 and message in err[0] and "training failed at step 2" in err[0], r.stderr
    assert "Traceback" not in r.stderr
    assert f"the newest checkpoint is {out.resolve() / 'checkpoints' / 'step-000001'}" in r.stderr
    assert [m["step"] for m in metrics(out)] == [1]                 # the failed batch changed nothing
    assert sorted(p.name for p in (out / "checkpoints").iterdir()) == ["step-000001"]


@pytest.mark.parametrize("args, message", [
    (["--num-generations", "1"], "--num-generations must be an integer >= 2, got 1"),
    (["--loss-type", "sigmoid"], "--loss-type must be grpo, dr_grpo or dapo, got 'sigmoid'"),
    (["--beta", "-1"], "--beta must be a finite number >= 0, got -1.0"),
    (["--epsilon", "1"], "--epsilon must be a finite number in [0, 1), got 1.0"),
    (["--top-p", "0"], "--top-p must be a finite number in (0, 1], got 0.0"),
    (["--max-completion-length", "0"], "--max-completion-length must be an integer >= 1, got 0"),
    (["--reward", "nosuch.py:f"], "--reward reward 'nosuch.py:f': no such file nosuch.py"),
    (["--reward", "accuracy"], "--reward reward 'accuracy': expected exact_match, regex:PATTERN"),
    (["--reward", "regex:("], "--reward regex:(: not a regular expression"),
    (["--reward", "REWARDS:missing"], "has no function 'missing'"),
    (["--label-smoothing", "0.1"], "--label-smoothing does not apply to python -m trainer grpo"),
    (["--loss-on", "all"], "--loss-on does not apply to python -m trainer grpo"),
    (["--check-loss-drop", "0.5"], "--check-loss-drop does not apply to python -m trainer grpo"),
    (["--prompts", "BAD"], "bad.jsonl:2: a prompts record needs a non-empty 'prompt'"),
    (["--prompts", "NOANSWER"], "--reward exact_match compares each completion with its record's 'answer': "),
])
def test_bad_grpo_input_exits_2_in_one_line_writing_nothing(args, message, base, tmp_path, capsys):
    model, prompts, rewards = base
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"prompt": "hi", "answer": "x"}\n{"answer": "y"}\n')
    (tmp_path / "noanswer.jsonl").write_text('{"prompt": "hi", "answer": "x"}\n{"prompt": "ho"}\n')
    args = [a.replace("REWARDS", str(rewards)).replace("BAD", str(bad))
            .replace("NOANSWER", str(tmp_path / "noanswer.jsonl")) for a in args]
    out = tmp_path / "out"
    assert main(["grpo", "--model", str(model), "--prompts", str(prompts), *args, "--no-progress",
                 "--out", str(out)]) == 2
    err = capsys.readouterr().err
    assert message in err and err.count("\n") == 1, err
    assert not out.exists()


@pytest.mark.parametrize("command, args, message", [
    (["grpo", "--preset", "tiny", "--prompts", "PROMPTS"], ["--beta", "0.1"],
     "--beta 0.1 needs a reference model"),
    (["grpo", "--model", "MODEL"], [], "python -m trainer grpo needs --prompts FILE.jsonl"),
    (["--model", "MODEL"], ["--num-generations", "4"],
     "--num-generations is a GRPO flag: use python -m trainer grpo ... --num-generations 4"),
    (["dpo", "--model", "MODEL", "--data", "PROMPTS"], ["--reward", "exact_match"],
     "--reward is a GRPO flag: use python -m trainer grpo"),
])
def test_grpo_flags_belong_to_the_grpo_command(command, args, message, base, tmp_path, capsys):
    model, prompts, _ = base
    argv = [a.replace("MODEL", str(model)).replace("PROMPTS", str(prompts)) for a in command + args]
    out = tmp_path / "out"
    assert main([*argv, "--no-progress", "--out", str(out)]) == 2
    err = capsys.readouterr().err
    assert message in err and err.count("\n") == 1, err
    assert not out.exists()


def test_batches_whose_groups_all_score_alike_do_not_fail_the_run(base, tmp_path, monkeypatch, capsys):
    """A constant reward gives no advantage: a zero gradient by right, which the train command's check
    (MAX_SKIPPED_IN_A_ROW windows without a nonzero step fail the run; here 1) does not count."""
    model, prompts, rewards = base
    monkeypatch.setattr("trainer.cli.train.MAX_SKIPPED_IN_A_ROW", 1)
    out = tmp_path / "flat"
    assert main(["grpo", "--model", str(model), "--prompts", str(prompts), "--reward", f"{rewards}:const",
                 *map(str, RUN), "--steps", "2", "--eval-fraction", "0", "--out", str(out)]) == 0, capsys.readouterr().err
    assert [(m["grad_norm"], m["frac_reward_zero_std"]) for m in metrics(out)] == [(0.0, 1.0), (0.0, 1.0)]


def test_epochs_count_generation_batches_times_iterations(base, tmp_path):
    """--epochs 1 over 6 training prompts (8, a quarter held out), 2 per batch, 2 optimizer steps each: 6 steps."""
    from trainer.cli.options import build_parser
    from trainer.cli.prepare import prepare
    model, prompts, _ = base
    args = build_parser("grpo").parse_args(["--model", str(model), "--prompts", str(prompts), "--epochs", "1",
                                            "--num-iterations", "2", "--grad-accum", "2", "--eval-fraction", "0.25",
                                            "--no-progress", "--out", str(tmp_path / "out")])
    args.objective = "grpo"
    session = prepare(args, argv_empty=False)
    assert (len(session.data.train), len(session.data.eval), session.run.steps) == (6, 2, 6)
