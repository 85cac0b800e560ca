"""``python -m trainer grpo``: GRPO (trainer/grpo.py, as TRL's GRPOTrainer) on the train command's
machinery. Its flags are the train command's (trainer/cli/options.py, with GRPO's: --reward,
--num-generations, --max-completion-length, --temperature, --top-p, --epsilon, --epsilon-high,
--num-iterations, --scale-rewards, and --beta / --loss-type with GRPO's defaults 0 and dapo);
``prepare`` reads --prompts (= --data) as prompt records (trainer/cli/splits.py), and ``GrpoTraining``
is the train command's loop with what differs:

- a window (the loop's batch) is --grad-accum prompts per rank, a generation batch: each prompt's
  --num-generations completions are sampled (seeded by --seed, the step and the rank), scored by the
  reward functions and trained on in --num-iterations optimizer steps (``GrpoTrainer.step``), so the
  run's optimizer steps advance by --num-iterations per window; the last window makes only the steps
  left to --steps (the run stops exactly at --steps). metrics.jsonl has one line per window, at its
  last optimizer step: the train command's keys ("loss": the mean GRPO loss of the window's
  micro-batches over its passes; "lr" and "grad_norm": its last step's; "tokens": the prompt and
  completion positions trained, each pass counted; "supervised": the completion tokens, likewise)
  and TRL's reward, reward_std, rewards/<name>/mean and /std, frac_reward_zero_std,
  completions/mean_length (min_, max_, clipped_ratio), clip_ratio/low_mean (high_, region_) and kl
  (with --beta > 0);
- the reference (--beta > 0): a LoRA run's base (the adapters off), a full fine-tuning run's starting
  model (the --model directory, kept in the run's settings for --resume), loaded once more, frozen;
- the held-out evaluation (before, every --eval-every N steps, at the end) is the greedy completion
  of every held-out prompt (up to --max-completion-length tokens) scored by the reward functions:
  the mean reward, each function's mean, and the exact match of the records with an "answer".
"""
from __future__ import annotations

import dataclasses
import sys

import numpy as np

from .held_out import _bar
from .resolve import grpo_config, reward_display_names
from .run_dir import clean
from .state import Session
from .train import Training, run_command

EVAL_BATCH = 32          # held-out prompts generated as one batch
EVAL_SEED_STEP = 2**31   # held-out sampling seeds: past any optimizer step, so never a training batch's draws


def main(argv: list[str]) -> int:
    """The grpo command: the train command's flags (and GRPO's) in ``argv``; the exit status."""
    return run_command(argv, "grpo", GrpoTraining)


def sampling_seed(seed: int, step: int, rank: int) -> int:
    """The seed of the completions sampled after optimizer step ``step`` on ``rank``: fixed by the run's
    --seed, so that a resumed run samples what the uninterrupted one would."""
    return int(np.random.SeedSequence([seed % 2**32, step, rank]).generate_state(1)[0])


def reward_names(rewards: list) -> list:
    """The reward functions (spec, function) under the names their metrics take (rewards/<name>/mean)."""
    return [(name, fn) for name, (_, fn) in zip(reward_display_names([spec for spec, _ in rewards]), rewards)]


class GrpoTraining(Training):
    """The train command's loop over GRPO's generation batches (see the module docstring)."""
    COMMAND = "trainer grpo"

    def __init__(self, s: Session):
        from ..grpo import load_reward
        super().__init__(s)
        run = s.run
        self.config = grpo_config(run)
        self.rewards = reward_names([load_reward(spec) for spec in run.rewards])   # checked when resolved
        self.reference = self.reference_fn() if run.beta else None
        self.grpo = self.trainer_of(self.config)

    def trainer_of(self, config):
        from ..grpo import GrpoTrainer
        return GrpoTrainer(self.tr, config, self.rewards, self.s.tok, reference=self.reference)

    def reference_fn(self):
        """The reference's token log-probs: a LoRA run's base (adapters off), else the starting model's,
        loaded from the run's --model directory into a frozen copy."""
        from ..grpo import adapters_off
        run, tr = self.run, self.tr
        if run.lora_r is not None:
            def base(sequences, temperature=1.0):
                with adapters_off(tr.model):
                    return tr.token_logps(sequences, temperature)
            return base
        from lfm2jit.model import CheckpointError, ConfigError, Lfm2Model
        from ..optim import SGD
        from ..trainer import Trainer
        from .usage import UsageError
        try:
            model = Lfm2Model.from_pretrained(run.reference_model, self.s.ctx, self.s.engine,
                                              "f16" if run.f16 else "f32")
        except (CheckpointError, ConfigError, OSError) as e:
            raise UsageError(f"--beta {run.beta:g}: the reference model {run.reference_model}: {e}") from None
        frozen = (Trainer(model, SGD(lr=0.0), self.s.ctx, self.s.engine).with_length_bucket(run.bucket)
                  .with_packing(run.pack_tokens, run.packing))
        return frozen.token_logps

    def train(self) -> int:
        """The train command's loop; a reward function that fails in the evaluation before the first step
        (or after the last) ends the run as one that fails during it does (exit 1)."""
        from ..errors import TrainError
        try:
            return super().train()
        except TrainError as e:
            if hasattr(self, "bar"):
                return self.failed(e)
            if hasattr(self, "reporters"):
                self.reporters.finish("failed")
            print(f"error: {e}\n  no step was trained", file=sys.stderr)
            return 1

    # ---- training ----
    def train_window(self, window: np.ndarray) -> tuple[list, int, dict]:
        """This rank's prompts of the window as one generation batch: --num-iterations optimizer steps (only
        those left to --steps); the passes' StepStats, the positions trained and TRL's metrics times the
        passes (Training.step divides the sums over the ranks by them: the metrics are the whole batch's,
        the same on every rank, so this gives them back)."""
        run, tr = self.run, self.tr
        records = [self.s.data.train[i] for i in window]
        left = run.steps - tr.optimizer_steps()
        grpo = self.grpo
        if 0 < left < self.config.num_iterations:     # the last window stops exactly at --steps
            grpo = self.trainer_of(dataclasses.replace(self.config, num_iterations=left))
        passes, metrics = grpo.step(records, self.s.params, seed=sampling_seed(run.seed, tr.optimizer_steps(),
                                                                                run.rank))
        self.flat = metrics["frac_reward_zero_std"] == 1.0 and not metrics.get("kl")
        g = self.config.num_generations
        iterations = len(passes) // max(len(records), 1)
        # this rank's positions (the metrics are the whole batch's, over every rank): its prompts' and the
        # completion tokens its passes trained on (each pass counted)
        positions = iterations * sum(g * (r.ids.size - 1) for r in records) + sum(p.tokens for p in passes)
        n = len(passes)
        return passes, positions, {k: v * n for k, v in metrics.items() if k != "loss"}

    def check_stepping(self, last) -> None:
        """As the train command, except that a batch whose every group scored its completions alike (no
        advantage, no KL) has a zero gradient by right: it neither fails the run nor counts towards failing."""
        if getattr(self, "flat", False) and not last.skipped:
            return
        super().check_stepping(last)

    # ---- the held-out evaluation ----
    def held_out(self, answers: bool) -> dict:
        """The greedy completions of this rank's held-out prompts scored by the reward functions (sums added
        over the ranks): the mean reward, each function's, and the exact match of the records with an answer;
        with --eval-generations N also N sampled completions per prompt, as "sampled/reward" and
        "sampled/exact_match". There is no loss ("loss" is nan); with ``answers`` the greedy completions are
        kept as "samples"."""
        run, items = self.run, self.my_eval
        texts, lengths = self._complete(items, 1)
        sums, per = self._sums(items, texts, lengths)
        n = sums["completions"]
        mean = (lambda x: x / n) if n else (lambda x: float("nan"))
        out = {"loss": float("nan"), "reward": mean(sums["reward"]),
               **{f"rewards/{name}/mean": mean(v) for name, v in sums["by_function"].items()},
               "completions/mean_length": mean(sums["tokens"]), "prompts": int(n),
               "exact_match": sums["exact_match"], "answers_scored": int(sums["answers"]), "answer_loss": None}
        if run.eval_generations:
            g = run.eval_generations
            sampled, _ = self._sums([r for r in items for _ in range(g)], *self._complete(items, g))
            out["sampled/reward"] = sampled["reward"] / sampled["completions"] if sampled["completions"] else float("nan")
            out["sampled/exact_match"] = sampled["exact_match"]
        if answers:
            total = per.sum(axis=0)
            expected = {i: str(r.columns["answer"]) for i, r in enumerate(items) if "answer" in r.columns}
            out["samples"] = [{"prompt": r.prompt, "completion": t, "reward": float(total[i]),
                               "expected": expected.get(i), "correct": (t.strip() == expected[i].strip())
                               if i in expected else None} for i, (r, t) in enumerate(zip(items, texts))]
        return out

    def _complete(self, items, g: int) -> tuple[list[str], list[int]]:
        """Each prompt's greedy completion (g = 1), or g completions sampled at the run's temperature and top-p,
        each batch seeded by --seed, the rank and its place alone, so every evaluation draws alike."""
        run, model, tok = self.run, self.s.model, self.s.tok
        texts: list[str] = []
        lengths: list[int] = []
        desc = "held-out completions" if g == 1 else f"held-out samples (x{g})"
        with _bar(run, len(items), desc, "prompt") as bar:
            for i in range(0, len(items), EVAL_BATCH):
                part = items[i:i + EVAL_BATCH]
                prompts = [r.ids.tolist() for r in part for _ in range(g)]
                sampling = {} if g == 1 else dict(do_sample=True, temperature=self.config.temperature,
                                                  top_p=self.config.top_p,
                                                  seed=sampling_seed(run.seed, EVAL_SEED_STEP + i, run.rank))
                out = model.generate(prompts, max_new_tokens=self.config.max_completion_length, **sampling)
                texts += [tok.decode(x, skip_special_tokens=True) for x in out]
                lengths += [len(x) for x in out]
                bar.update(len(part))
        return texts, lengths

    def _sums(self, items, texts: list[str], lengths: list[int]) -> tuple[dict, np.ndarray]:
        """The completions, their reward, each function's ("by_function"), those with an answer, the share of
        those exactly right ("exact_match", None without any) and their tokens, summed over the ranks; and
        this rank's rewards per function and completion."""
        from ..grpo import score
        names = [name for name, _ in self.rewards]
        if items:
            columns = {k: [r.columns.get(k) for r in items] for k in dict.fromkeys(k for r in items for k in r.columns)}
            per = score(self.rewards, [r.prompt for r in items], texts, columns)
        else:
            per = np.zeros((len(names), 0))
        with_answer = [i for i, r in enumerate(items) if "answer" in r.columns]
        right = [texts[i].strip() == str(items[i].columns["answer"]).strip() for i in with_answer]
        values = [float(len(items)), float(per.sum()), *(float(x.sum()) for x in per), float(len(with_answer)),
                  float(sum(right)), float(sum(lengths))]
        if self.run.world_size > 1:
            values = self.s.sum_over_ranks(values, "the held-out sums")
        n, reward, *rest = values
        by_function, (answers, exact, tokens) = rest[:len(names)], rest[len(names):]
        return {"completions": n, "reward": reward, "by_function": dict(zip(names, by_function)), "answers": answers,
                "exact_match": exact / answers if answers else None, "tokens": tokens}, per

    def kept(self, ev: dict) -> dict:
        """The held-out reward and exact match, kept in checkpoints for a resumed run's summary."""
        return {"reward": clean(ev.get("reward")), "exact_match": clean(ev.get("exact_match")),
                "answers_scored": ev.get("answers_scored", 0),
                **{k: clean(ev[k]) for k in ("sampled/reward", "sampled/exact_match") if k in ev}}
