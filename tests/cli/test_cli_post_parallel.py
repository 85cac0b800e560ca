"""DPO and GRPO with data parallelism and --f16 (issue 48: "data parallel as for SFT"): two ranks syncing
through a directory (``--sync-dir --world-size 2 --rank R``) against one process accumulating both
ranks' micro-batches, as tests/trainer/test_sync.py holds the train command to; GRPO's teacher-forced
steps on two ranks against one process (the same advantages, dapo normalisation, metrics and weights);
and GRPO with --f16 against the f32 run.

Run as a script (``python test_cli_post_parallel.py SYNC_DIR RANK OUT``) this file is rank 1 of the
teacher-forced GRPO test."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
if __name__ == "__main__":                       # rank 1 of the teacher-forced test, in its own process
    sys.path[:0] = [str(ROOT), str(HERE.parent), str(HERE)]

from numerics import rel_err  # noqa: E402
from test_cli_dpo import write_prefs  # noqa: E402
from test_cli_grpo import write_prompts  # noqa: E402
from test_cli_trainer import _hf_dir, cli, metrics  # noqa: E402
from trainer.dpo import METRICS as DPO_METRICS  # noqa: E402

# a reward function that also writes what it scored to $POST_PARALLEL_LOG (one JSON line a call)
REWARDS = '''
import json, os

def chars(prompts, completions, **columns):
    rewards = [float(len(c)) for c in completions]
    with open(os.environ["POST_PARALLEL_LOG"], "a") as f:
        f.write(json.dumps({"completions": completions, "rewards": rewards}) + "\\n")
    return rewards
'''
VOLATILE = ("tokens_per_s", "elapsed")      # wall-clock numbers, the only ones ranks may log differently


def env_with(**extra) -> dict:
    return dict(os.environ, PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""), **extra)


def two_ranks(args: list, out: Path, sync: Path, logs: tuple = (None, None)) -> None:
    """``python -m trainer ARGS`` as ranks 0 and 1 of a file-synced run writing to ``out``, at once."""
    procs = []
    for r in (0, 1):
        env = env_with(**({"POST_PARALLEL_LOG": str(logs[r])} if logs[r] else {}))
        procs.append(subprocess.Popen([sys.executable, "-m", "trainer", *map(str, args), "--sync-dir", sync,
                                       "--world-size", "2", "--rank", str(r), "--sync-timeout", "120", "--out", out],
                                      cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
    results = [p.communicate(timeout=300) for p in procs]
    assert [p.returncode for p in procs] == [0, 0], [err[-3000:] for _, err in results]
    assert sorted(os.listdir(sync)) == []                    # a run that ended well leaves no sync file


def same_lines(a: list[dict], b: list[dict]) -> None:
    assert [{k: v for k, v in m.items() if k not in VOLATILE} for m in a] == \
           [{k: v for k, v in m.items() if k not in VOLATILE} for m in b]


def weights(d: Path) -> dict:
    from safetensors.numpy import load_file
    return load_file(str(d / "model.safetensors" if (d / "model.safetensors").is_file()
                         else d / "model" / "model.safetensors"))


@pytest.fixture(scope="module")
def base(tmp_path_factory, ctx, engine):
    d = tmp_path_factory.mktemp("post_parallel")
    (d / "rewards.py").write_text(REWARDS)
    return (_hf_dir(d / "hf", ctx, engine), write_prefs(d / "prefs.jsonl"), write_prompts(d / "prompts.jsonl"),
            d / "rewards.py")


def test_dpo_two_ranks_equal_one_process_accumulating_both(base, tmp_path):
    """Rank r takes pairs r, r + 2, ... of each window of 4 (--grad-accum 2 each), so the two ranks take
    one process's --grad-accum 4 steps: both log that run's loss, TRL's metrics, gradient norm (clipped
    at 0.5) and tokens; the held-out pairs (3, split 2 + 1) give its evaluation; the weights are its own."""
    model, prefs, _, _ = base
    # SGD: its update is proportional to the gradient, so a sum instead of a mean over the ranks would show
    # (AdamW is nearly scale-invariant, and it amplifies f32 rounding where a gradient is near its eps)
    common = ["dpo", "--model", model, "--data", prefs, "--max-len", 64, "--optimizer", "sgd", "--lr", 0.5,
              "--schedule", "constant", "--steps", 2, "--clip", 0.5, "--eval-fraction", 0.25, "--checkpoint-every", 0, "--no-progress"]
    one = cli(*common, "--grad-accum", 4, "--out", tmp_path / "one")
    assert one.returncode == 0, one.stderr
    two_ranks([*common, "--grad-accum", 2], tmp_path / "two", tmp_path / "sync")
    want, got = metrics(tmp_path / "one"), metrics(tmp_path / "two")
    same_lines(got, metrics(tmp_path / "two" / "rank1"))
    assert [m["step"] for m in got] == [m["step"] for m in want] == [1, 2]
    for g, w in zip(got, want):
        for key in ("loss", "grad_norm", *DPO_METRICS):
            assert g[key] == pytest.approx(w[key], rel=1e-5, abs=1e-7), (key, g, w)
        assert (g["tokens"], g["supervised"], g["lr"]) == (w["tokens"], w["supervised"], w["lr"])
    assert want[1]["loss"] != want[0]["loss"] and want[0]["grad_norm"] > 0.5      # it trained, clipped
    s1, s2 = (json.loads((d / "summary.json").read_text()) for d in (tmp_path / "one", tmp_path / "two"))
    assert s2["eval_sequences"] == s1["eval_sequences"] == 3
    for key in ("loss", *DPO_METRICS):
        assert s2["eval_dpo_after"][key] == pytest.approx(s1["eval_dpo_after"][key], rel=1e-5, abs=1e-7), key
    a, b, init = weights(tmp_path / "two"), weights(tmp_path / "one"), weights(model)
    for name in b:            # the weights, and the updates themselves (to the weights' f32 rounding: ulps)
        assert rel_err(a[name], b[name]) < 1e-5, name
        assert rel_err(a[name] - init[name], b[name] - init[name]) < 1e-3, name
        assert not np.array_equal(b[name], init[name]), f"{name} was not trained"


def test_grpo_two_ranks_log_the_whole_batchs_metrics(base, tmp_path):
    """Each rank samples its own prompts' completions (seeded by the rank): both ranks log the same line,
    whose reward metrics are those of every rank's completions together (what the reward function saw on
    each rank), its supervised tokens all of their completion tokens."""
    model, _, prompts, rewards = base
    common = ["grpo", "--model", model, "--prompts", prompts, "--reward", f"{rewards}:chars", "--max-len", 64,
              "--grad-accum", 2, "--num-generations", 2, "--max-completion-length", 4, "--lr", 1e-3,
              "--schedule", "constant", "--steps", 2, "--eval-fraction", 0, "--checkpoint-every", 0, "--no-progress"]
    logs = (tmp_path / "scored0.jsonl", tmp_path / "scored1.jsonl")
    two_ranks(common, tmp_path / "two", tmp_path / "sync", logs)
    got = metrics(tmp_path / "two")
    same_lines(got, metrics(tmp_path / "two" / "rank1"))
    scored = [[json.loads(x) for x in p.read_text().splitlines()] for p in logs]
    assert [len(s) for s in scored] == [2, 2]                        # one call per window on each rank
    assert scored[0][0]["completions"] != scored[1][0]["completions"]   # each its own prompts and draws
    assert [m["step"] for m in got] == [1, 2]
    for m, r0, r1 in zip(got, *scored):
        rewards = np.array(r0["rewards"] + r1["rewards"])          # 2 prompts x 2 completions a rank
        groups = rewards.reshape(-1, 2)
        assert m["reward"] == pytest.approx(rewards.mean(), rel=1e-12)
        assert m["rewards/chars/mean"] == pytest.approx(rewards.mean(), rel=1e-12)
        assert m["rewards/chars/std"] == pytest.approx(np.std(rewards, ddof=1), rel=1e-12, abs=1e-12)
        assert m["reward_std"] == pytest.approx(np.std(groups, axis=1, ddof=1).mean(), rel=1e-12, abs=1e-12)
        assert m["frac_reward_zero_std"] == pytest.approx(np.mean(groups[:, 0] == groups[:, 1]))
        assert m["supervised"] == pytest.approx(m["completions/mean_length"] * 8)      # one pass, 8 completions
        assert m["completions/min_length"] <= m["completions/mean_length"] <= m["completions/max_length"] <= 4
        assert float(m["completions/min_length"]).is_integer() and float(m["completions/max_length"]).is_integer()
        assert m["grad_norm"] > 0


# ---- GRPO's teacher-forced steps on two ranks (this file as rank 1's process) against one process ----

G, STEPS = 2, 2


def chars(prompts, completions, **columns):
    return [float(len(c)) for c in completions]


def forced_batches():
    """STEPS batches of 4 prompts with G fixed completions each, of lengths 1..6 (so the ranks' completion
    tokens differ, as dapo's normalisation must see)."""
    from trainer.grpo import PromptRecord
    rng = np.random.default_rng(5)
    out = []
    for _ in range(STEPS):
        records = [PromptRecord(rng.integers(3, 100, int(rng.integers(2, 6))).astype(np.int32), f"p{i}", {})
                   for i in range(4)]
        completions = [rng.integers(3, 100, int(rng.integers(1, 7))).tolist() for _ in range(4 * G)]
        out.append((records, completions))
    return out


def forced_run(ctx, engine, records_of, accum: int, sync=None):
    """STEPS teacher-forced GRPO steps (batch-std advantages, dapo, 2 iterations, SGD with momentum) on
    the records and completions ``records_of(batch)`` picks; (each step's metrics, the final weights)."""
    from lfm2jit.model import Lfm2Config, Lfm2Model
    from trainer import SGD, Trainer
    from trainer.data import default_tokenizer, load_tokenizer
    from trainer.grpo import GrpoConfig, GrpoTrainer
    model = Lfm2Model(Lfm2Config.preset("tiny"), ctx, engine, seed=0)
    tr = (Trainer(model, SGD(lr=0.5, momentum=0.9), ctx, engine).with_length_bucket(16)
          .with_grad_accum_steps(accum).with_file_grad_sync(sync))
    grpo = GrpoTrainer(tr, GrpoConfig(num_generations=G, max_completion_length=6, num_iterations=2, epsilon=0.05,
                                      scale_rewards="batch"), [("chars", chars)], load_tokenizer(default_tokenizer()))
    logged = []
    for k, batch in enumerate(forced_batches()):
        records, completions = records_of(batch)
        _, m = grpo.step(records, model.parameters(), seed=k, completions=completions)
        logged.append(m)
    return logged, model.state_dict()


def rank_share(rank: int, world: int = 2):
    """Rank r's prompts of a batch: r, r + world, ... (as the CLI deals them), with their completions."""
    def pick(batch):
        records, completions = batch
        mine = list(range(rank, len(records), world))
        return [records[i] for i in mine], [c for i in mine for c in completions[i * G:(i + 1) * G]]
    return pick


def test_grpo_teacher_forced_two_ranks_equal_one_process(ctx, engine, tmp_path):
    """With the same completions, two ranks of two prompts each take one process's four-prompt steps:
    the batch's reward std (scale_rewards="batch") and dapo's token count are every rank's, and so are
    the metrics; the weights match that process's and each other's bit for bit."""
    from trainer import FileGradSyncConfig
    sync = tmp_path / "sync"
    peer = subprocess.Popen([sys.executable, str(Path(__file__).resolve()), str(sync), "1", str(tmp_path / "rank1")],
                            cwd=ROOT, env=env_with(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        mine, ours = forced_run(ctx, engine, rank_share(0), 2, FileGradSyncConfig(sync, 0, 2, timeout_s=120))
    finally:
        log, _ = peer.communicate(timeout=300)
    assert peer.returncode == 0, log[-3000:]
    theirs = json.loads((tmp_path / "rank1.json").read_text())
    their_weights = np.load(tmp_path / "rank1.npz")
    want, final = forced_run(ctx, engine, lambda batch: batch, 4)
    assert mine == theirs                                          # every rank logs the whole batch's metrics
    for got, w in zip(mine, want):
        assert got.keys() == w.keys()
        for key in w:
            assert got[key] == pytest.approx(w[key], rel=1e-5, abs=1e-7), key
    assert want[0]["clip_ratio/region_mean"] > 0                    # the second iteration clipped some tokens
    for name, w in final.items():
        assert np.array_equal(ours[name], their_weights[name]), f"ranks disagree on {name}"
        assert rel_err(ours[name], w) < 1e-5, name


def test_grpo_f16_tracks_the_f32_run(base, tmp_path, ctx):
    """--f16 (f16 activations, a loss scaler): the same sampled completions' reward, and the first
    window's loss (its second iteration's ratios) and gradient norm within f16 rounding of the f32 run's."""
    if not ctx.has_f16:
        pytest.skip("adapter has no shader-f16")
    model, _, prompts, rewards = base
    common = ["grpo", "--model", model, "--prompts", prompts, "--reward", f"{rewards}:chars", "--max-len", 64,
              "--grad-accum", 2, "--num-generations", 2, "--max-completion-length", 4, "--lr", 1e-4,
              "--schedule", "constant", "--steps", 2, "--num-iterations", 2, "--eval-fraction", 0,
              "--checkpoint-every", 0, "--no-progress"]
    env = {"POST_PARALLEL_LOG": str(tmp_path / "scored.jsonl")}
    runs = {}
    for name, extra in (("f32", []), ("f16", ["--f16"])):
        r = subprocess.run([sys.executable, "-m", "trainer", *map(str, common + extra), "--out", str(tmp_path / name)],
                           cwd=ROOT, env=env_with(**env), capture_output=True, text=True, timeout=300)
        assert r.returncode == 0, r.stderr[-3000:]
        (runs[name],) = metrics(tmp_path / name)
    f16, f32 = runs["f16"], runs["f32"]
    assert f16["loss_scale"] > 1 and f32["loss_scale"] == 1.0
    for key in ("reward", "completions/mean_length", "frac_reward_zero_std"):
        assert f16[key] == f32[key], key
    assert f16["grad_norm"] == pytest.approx(f32["grad_norm"], rel=1e-2)
    assert f16["loss"] == pytest.approx(f32["loss"], rel=1e-2, abs=1e-4)
    assert f32["grad_norm"] > 0


if __name__ == "__main__":
    from lfm2jit import ComputeEngine, WgpuContext
    from trainer import FileGradSyncConfig
    sync_dir, rank, out = sys.argv[1], int(sys.argv[2]), sys.argv[3]
    ctx = WgpuContext.create()
    logged, final = forced_run(ctx, ComputeEngine(ctx), rank_share(rank), 2,
                               FileGradSyncConfig(sync_dir, rank, 2, timeout_s=120))
    Path(out + ".json").write_text(json.dumps(logged))
    np.savez(out + ".npz", **final)
