"""Group relative policy optimization on a Trainer, with lfm2jit's own batched sampling, as TRL's
GRPOTrainer defines it (its defaults: 8 generations, dapo loss, epsilon 0.2, beta 0, one iteration).

One step: each prompt's G completions are sampled by ``Lfm2Model.generate``; the reward functions
score them; a completion's advantage is its reward minus its group's mean, divided by the group's
standard deviation (Bessel-corrected) + 1e-4 (``scale_rewards="group"``; "batch": the batch's std;
"none": not divided). Then, for each of ``num_iterations`` passes over the batch (one optimizer
step each), every group is a micro-batch whose per-token loss is

    L_t = -min(r_t A, clip(r_t, 1 - eps_low, 1 + eps_high) A) + beta r_t (exp(q_t - p_t) - (q_t - p_t) - 1)

(the KL term times r_t as TRL's default ``use_bias_correction_kl``; ``kl_bias_correction=False``
drops the factor) with p_t the policy's log-prob of completion token t, r_t = exp(p_t - old_t) (old: the policy's
before the step's first update, so r = 1 on the first pass), q_t the reference's (the model before
training; for LoRA the base, adapters off). The micro-batch loss (times the groups per step, as the
Trainer averages micro-batches):

    grpo      the mean over completions of each one's token mean
    dr_grpo   the sum over tokens / (completions x max_completion_length)
    dapo      the sum over tokens / (the step's completion tokens / groups per step)

With a data-parallel sync of several ranks (each sampling its own prompts' groups), the batch is every
rank's: the ranks gather their rewards, so that the batch std, dapo's completion tokens (and groups) and
the metrics are the whole batch's, and the averaged gradient is the one of a single process that
accumulates every rank's groups.

Reward functions are called as ``f(prompts, completions, **columns) -> list[float]`` (TRL's
signature; ``columns`` holds the prompt records' other keys, each repeated per completion).
Built in: ``exact_match`` (the completion, stripped, equals the ``answer`` column) and
``regex:PATTERN`` (the stripped completion matches PATTERN in full). A function that raises,
returns another length or a non-finite value stops the step before any weight changes.
"""
from __future__ import annotations

import importlib
import importlib.util
import math
import re
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import numpy as np

from .errors import TrainError

LOSS_TYPES = ("grpo", "dr_grpo", "dapo")
SCALES = ("group", "batch", "none")


@dataclass(frozen=True)
class GrpoConfig:
    num_generations: int = 8
    max_completion_length: int = 512
    temperature: float = 1.0
    top_p: float = 1.0
    beta: float = 0.0
    epsilon: float = 0.2
    epsilon_high: float | None = None        # None: epsilon
    loss_type: str = "dapo"
    num_iterations: int = 1
    scale_rewards: str = "group"
    kl_bias_correction: bool = True          # TRL's use_bias_correction_kl: the KL term times the ratio

    def __post_init__(self):
        def integer(name, low):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < low:
                raise ValueError(f"{name} must be an integer >= {low}, got {v!r}")
        integer("num_generations", 2)        # an advantage compares a completion with its group's others
        integer("max_completion_length", 1)
        integer("num_iterations", 1)
        for name, ok, want in (("temperature", lambda v: v > 0, "> 0"), ("top_p", lambda v: 0 < v <= 1, "in (0, 1]"),
                               ("beta", lambda v: v >= 0, ">= 0"), ("epsilon", lambda v: 0 <= v < 1, "in [0, 1)")):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or not ok(v):
                raise ValueError(f"{name} must be a finite number {want}, got {v!r}")
        high = self.epsilon_high
        if high is not None and (isinstance(high, bool) or not isinstance(high, (int, float))
                                 or not math.isfinite(high) or high < 0):
            raise ValueError(f"epsilon_high must be a finite number >= 0 or None, got {high!r}")
        if self.loss_type not in LOSS_TYPES:
            raise ValueError(f"loss_type must be one of {', '.join(LOSS_TYPES)}, got {self.loss_type!r}")
        if not isinstance(self.kl_bias_correction, bool):
            raise ValueError(f"kl_bias_correction must be True or False, got {self.kl_bias_correction!r}")
        if self.scale_rewards not in SCALES:
            raise ValueError(f"scale_rewards must be one of {', '.join(SCALES)}, got {self.scale_rewards!r}")

    @property
    def clip_range(self) -> tuple[float, float]:
        return 1.0 - self.epsilon, 1.0 + (self.epsilon if self.epsilon_high is None else self.epsilon_high)


def _std(x: np.ndarray, axis=None) -> np.ndarray:
    return np.std(x, axis=axis, ddof=1)


def advantages(rewards, num_generations: int, scale: str = "group") -> np.ndarray:
    """float64 [N]: each completion's reward less its group's mean (groups: consecutive runs of
    ``num_generations``), divided by the group's (or the batch's) std + 1e-4 unless ``scale`` is none."""
    r = np.asarray(rewards, np.float64)
    groups = r.reshape(-1, num_generations)
    centred = (groups - groups.mean(axis=1, keepdims=True)).reshape(-1)
    if scale == "none":
        return centred
    std = np.repeat(_std(groups, axis=1), num_generations) if scale == "group" else np.full(r.size, _std(r))
    return centred / (std + 1e-4)


def token_loss(config: GrpoConfig, logp: np.ndarray, old: np.ndarray, ref: np.ndarray | None, advantage: float):
    """Per-token loss L_t (see the module docstring), its derivative in p_t, whether t was clipped
    (low, high) and its KL term (None without beta)."""
    low, high = config.clip_range
    ratio = np.exp(logp - old)
    clipped = np.clip(ratio, low, high)
    unclipped_wins = ratio * advantage <= clipped * advantage
    loss = -np.minimum(ratio * advantage, clipped * advantage)
    # the clipped term is constant outside the range; inside it equals the ratio itself
    grad = np.where(unclipped_wins | ((ratio >= low) & (ratio <= high)), -advantage * ratio, 0.0)
    kl = None
    if config.beta:
        delta = ref - logp
        kl = np.exp(delta) - delta - 1.0
        d_kl = 1.0 - np.exp(delta)
        if config.kl_bias_correction:      # (r kl)' = r kl + r kl': the ratio's gradient counts even where r = 1
            kl, d_kl = ratio * kl, ratio * kl + ratio * d_kl
        loss = loss + config.beta * kl
        grad = grad + config.beta * d_kl
    return loss, grad, (ratio < low) & (advantage < 0), (ratio > high) & (advantage > 0), kl


def group_objective(config: GrpoConfig, old: list | None, ref: list | None, adv, scale: float,
                    stats: dict) -> Callable:
    """The objective of one group's micro-batch for Trainer.train_token_objective; ``scale`` turns the
    per-token sum into the loss type's normalisation (see ``loss_scale``); ``stats`` collects the
    clip ratios and KL of the pass."""
    def objective(logps):
        total, grads = 0.0, []
        for i, p in enumerate(logps):
            # without old log-probs (one pass) the ratio is the policy's own: 1, as TRL's detached copy
            loss, grad, low, high, kl = token_loss(config, p, p if old is None else old[i],
                                                   ref[i] if ref is not None else None, adv[i])
            n = max(p.size, 1)
            weight = scale / n if config.loss_type == "grpo" else scale
            total += float(loss.sum()) * weight
            grads.append(grad * weight)
            for key, flags in (("low", low), ("high", high)):
                stats.setdefault(key, []).append(float(flags.sum()))
            stats.setdefault("tokens", []).append(float(p.size))
            if kl is not None:
                stats.setdefault("kl", []).append(float(kl.sum()))
        return total, grads
    return objective


def loss_scale(config: GrpoConfig, completion_lengths: list[int], groups: int) -> float:
    """The factor on a micro-batch's per-token sum (per completion for grpo, whose token means are
    taken per completion), so that the Trainer's mean over the step's ``groups`` micro-batches is
    TRL's loss."""
    g = config.num_generations
    if config.loss_type == "grpo":
        return 1.0 / g
    if config.loss_type == "dr_grpo":
        return 1.0 / (g * config.max_completion_length)
    return groups / max(sum(completion_lengths), 1)


# ---- reward functions ----

def exact_match(prompts, completions, answer=None, **columns) -> list[float]:
    """1 where the completion, stripped, equals the ``answer`` column, stripped."""
    if answer is None:
        raise TrainError("exact_match needs an 'answer' column in the prompts file")
    return [float(c.strip() == str(a).strip()) for c, a in zip(completions, answer)]


def regex_reward(pattern: str) -> Callable:
    """1 where the stripped completion matches ``pattern`` in full (a format check)."""
    try:
        compiled = re.compile(pattern, re.DOTALL)
    except re.error as e:
        raise ValueError(f"regex:{pattern}: not a regular expression ({e})") from None

    def regex(prompts, completions, **columns) -> list[float]:
        return [float(compiled.fullmatch(c.strip()) is not None) for c in completions]
    regex.__name__ = f"regex:{pattern}"
    return regex


def load_reward(spec: str) -> tuple[str, Callable]:
    """A reward function by name: ``exact_match``, ``regex:PATTERN``, ``module:function`` or
    ``path/to/file.py:function``; ValueError naming what is wrong."""
    if spec == "exact_match":
        return spec, exact_match
    if spec.startswith("regex:"):
        return spec, regex_reward(spec[len("regex:"):])
    where, sep, name = spec.rpartition(":")
    if not sep or not where or not name:
        raise ValueError(f"reward {spec!r}: expected exact_match, regex:PATTERN, module:function or file.py:function")
    try:
        if where.endswith(".py"):
            path = Path(where)
            if not path.is_file():
                raise ValueError(f"reward {spec!r}: no such file {path}")
            module_spec = importlib.util.spec_from_file_location(f"lfm2jit_reward_{path.stem}", path)
            module = importlib.util.module_from_spec(module_spec)
            module_spec.loader.exec_module(module)
        else:
            module = importlib.import_module(where)
    except ValueError:
        raise
    except Exception as e:     # noqa: BLE001 - whatever importing the user's module raised
        raise ValueError(f"reward {spec!r}: importing {where} failed: {type(e).__name__}: {e}") from None
    fn = getattr(module, name, None)
    if not callable(fn):
        raise ValueError(f"reward {spec!r}: {where} has no function {name!r}")
    return spec, fn


def score(rewards: list[tuple[str, Callable]], prompts: list, completions: list[str], columns: dict) -> np.ndarray:
    """float64 [functions, completions]: each reward function's scores, checked (a TrainError naming
    the function for an exception, a wrong length, a non-number or a non-finite value)."""
    out = np.zeros((len(rewards), len(completions)))
    for k, (name, fn) in enumerate(rewards):
        try:
            values = fn(prompts, completions, **columns)
        except TrainError:
            raise
        except Exception as e:     # noqa: BLE001 - the user's code
            raise TrainError(f"reward function {name} raised {type(e).__name__}: {e}") from None
        try:
            values = [float(v) for v in values]
        except (TypeError, ValueError):
            raise TrainError(f"reward function {name} must return a list of numbers, got {values!r:.80}") from None
        if len(values) != len(completions):
            raise TrainError(f"reward function {name} returned {len(values)} rewards for {len(completions)} completions")
        bad = [i for i, v in enumerate(values) if not math.isfinite(v)]
        if bad:
            raise TrainError(f"reward function {name} returned {values[bad[0]]} for completion {bad[0]} "
                             f"({completions[bad[0]]!r:.60}); rewards must be finite numbers")
        out[k] = values
    return out


# ---- prompts ----

@dataclass(frozen=True)
class PromptRecord:
    """A prompts-file record: its token ids (ending with the generation prompt for a conversation),
    the prompt as given (what reward functions see) and its other keys."""
    ids: np.ndarray
    prompt: object
    columns: dict
    origin: str = ""


def read_prompts(path, tokenizer, *, chat_template=None) -> list[PromptRecord]:
    """``{"prompt": "text" | [messages], ...other columns}`` records, one a line; DataError naming
    the file and line for a missing or empty prompt."""
    from .data import BOS_TOKEN, DataError, _chat_template, encode_chat, jsonl_records
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"no such prompts file: {path}")
    template = _chat_template(chat_template, tokenizer)
    bos = tokenizer.token_to_id(BOS_TOKEN)
    out = []
    for lineno, record in jsonl_records(path):
        prompt = record.get("prompt")
        if isinstance(prompt, str) and prompt:
            ids = np.array(([bos] if bos is not None else []) + tokenizer.encode(prompt, add_special_tokens=False).ids,
                           np.int32)
        elif isinstance(prompt, list) and prompt:
            try:
                ids = encode_chat(prompt, tokenizer, add_generation_prompt=True, chat_template=template)[0]
            except ValueError as e:
                raise DataError(str(e), path, lineno) from None
        else:
            raise DataError("a prompts record needs a non-empty 'prompt' (text or a list of messages), got "
                            f"{prompt!r:.60}", path, lineno)
        out.append(PromptRecord(ids, prompt, {k: v for k, v in record.items() if k != "prompt"}, f"{path}:{lineno}"))
    if not out:
        raise DataError("no records (the file is empty)", path)
    return out


# ---- the step ----

class GrpoTrainer:
    """GRPO over a Trainer: ``step(records)`` samples, scores and trains on one batch of prompts
    (``num_iterations`` optimizer steps; the Trainer's ``grad_accum_steps`` must be the batch's
    prompt count, one group per micro-batch). ``reference(sequences, temperature) -> token log-probs``
    is the reference model's, needed when beta > 0 (``adapters_off`` gives it for a LoRA run)."""

    def __init__(self, trainer, config: GrpoConfig, rewards: list[tuple[str, Callable]], tokenizer,
                 reference: Callable | None = None):
        if not isinstance(config, GrpoConfig):
            raise TypeError(f"config must be a GrpoConfig, got {type(config).__name__}")
        if not rewards:
            raise ValueError("GRPO needs at least one reward function")
        if config.beta and reference is None:
            raise ValueError(f"beta={config.beta!r} needs the reference model's log-probs (reference=...)")
        self.trainer, self.config, self.rewards, self.tok, self.reference = trainer, config, rewards, tokenizer, reference

    def sample(self, records: list[PromptRecord], seed: int) -> list[list[int]]:
        """G completions per record, prompts repeated G times in one batch (sampling, seeded)."""
        c, model = self.config, self.trainer.model
        prompts = [r.ids.tolist() for r in records for _ in range(c.num_generations)]
        return model.generate(prompts, max_new_tokens=c.max_completion_length, do_sample=True,
                              temperature=c.temperature, top_p=c.top_p, seed=seed)

    def step(self, records: list[PromptRecord], params, seed: int, completions: list[list[int]] | None = None):
        """One batch: (the passes' StepStats, TRL's metrics). ``completions`` (token ids, G per
        record, in order) replaces sampling (teacher forcing, for tests and replays)."""
        c, tr = self.config, self.trainer
        g = c.num_generations
        if tr.grad_accum_steps != len(records):
            raise TrainError(f"GRPO trains one group per micro-batch: the Trainer's grad_accum_steps "
                             f"({tr.grad_accum_steps}) must equal the batch's {len(records)} prompts")
        ids = self.sample(records, seed) if completions is None else [list(x) for x in completions]
        if len(ids) != g * len(records) or any(len(x) == 0 for x in ids):
            raise TrainError(f"{len(ids)} completions for {len(records)} prompts x {g} generations, each non-empty")
        texts = [self.tok.decode(x, skip_special_tokens=True) for x in ids]
        columns = {k: [r.columns.get(k) for r in records for _ in range(g)]
                   for k in dict.fromkeys(k for r in records for k in r.columns)}
        per_function = score(self.rewards, [r.prompt for r in records for _ in range(g)], texts, columns)
        lengths = [len(x) for x in ids]
        eos = set(tr.model.generation_eos)
        clipped = [float(x[-1] not in eos) for x in ids]
        # with several ranks, every rank's completions: the batch's std, dapo's token count and the metrics
        # are the whole batch's, as one process accumulating every rank's groups has them
        batch, mine = self._whole_batch(params, per_function, lengths, clipped)
        adv = advantages(batch["per_function"].sum(axis=0), g, c.scale_rewards)[mine]
        seqs = []
        for r, x in zip((r for r in records for _ in range(g)), ids):
            full = np.concatenate([r.ids, np.asarray(x, np.int32)])
            mask = np.zeros(full.size - 1, np.float32)
            mask[r.ids.size - 1:] = 1.0
            seqs.append((full[:-1], full[1:], mask))
        completion = [slice(r.ids.size - 1, None) for r in records for _ in range(g)]
        # every log-prob at the sampling temperature, as TRL scores them (its logits divided by it)
        old = [x[s] for x, s in zip(tr.token_logps(seqs, c.temperature), completion)] if c.num_iterations > 1 else None
        ref = [x[s] for x, s in zip(self.reference(seqs, c.temperature), completion)] if c.beta else None
        factor = loss_scale(c, batch["lengths"], len(records) * batch["ranks"])
        stats, passes = {}, []
        for _ in range(c.num_iterations):
            for k in range(len(records)):
                part = slice(k * g, (k + 1) * g)
                objective = group_objective(c, None if old is None else old[part], None if ref is None else ref[part],
                                            adv[part], factor, stats)
                passes.append(tr.train_token_objective(seqs[part], params, _on_completions(objective, completion[part]),
                                                       c.temperature))
        sums = [sum(p.loss for p in passes), len(passes), *(sum(stats.get(k, [])) for k in ("low", "high", "kl", "tokens"))]
        if batch["ranks"] > 1:
            sums = self.trainer.distributed_grad_sync.allreduce_sum(sums, "the GRPO batch's losses and clip ratios")
        return passes, self._metrics(batch, dict(zip(("loss", "passes", "low", "high", "kl", "tokens"), sums)))

    def _whole_batch(self, params, per_function: np.ndarray, lengths: list[int], clipped: list[float]):
        """The batch's rewards per function [functions, completions], completion lengths and clipped flags
        over every rank (in rank order) with the trainer's data-parallel sync, and the slice of them that is
        this rank's; alone, this rank's own."""
        sync, n = self.trainer.distributed_grad_sync, len(lengths)
        if sync is None or sync.world_size == 1:
            return {"per_function": per_function, "lengths": list(lengths), "clipped": list(clipped), "ranks": 1}, slice(None)
        self.trainer.sync_handshake(params)          # the CLI has done it; a first step from Python has not
        rows = sync.gather([*per_function.ravel(), *lengths, *clipped], "the GRPO batch's rewards")
        f = per_function.shape[0]
        return ({"per_function": np.concatenate([np.reshape(row[:f * n], (f, n)) for row in rows], axis=1),
                 "lengths": [int(v) for row in rows for v in row[f * n:f * n + n]],
                 "clipped": [v for row in rows for v in row[f * n + n:]], "ranks": len(rows)},
                slice(sync.rank * n, (sync.rank + 1) * n))

    def _metrics(self, batch: dict, sums: dict) -> dict[str, float]:
        """TRL's metrics of the whole batch (every rank's completions) and of its passes."""
        g, per_function, lengths = self.config.num_generations, batch["per_function"], batch["lengths"]
        rewards = per_function.sum(axis=0)
        tokens = max(sums["tokens"], 1.0)
        out = {"loss": sums["loss"] / sums["passes"], "reward": float(rewards.mean()),
               "reward_std": float(_std(rewards.reshape(-1, g), axis=1).mean()),
               "frac_reward_zero_std": float(np.mean(np.isclose(_std(rewards.reshape(-1, g), axis=1), 0.0))),
               "completions/mean_length": float(np.mean(lengths)), "completions/min_length": float(min(lengths)),
               "completions/max_length": float(max(lengths)),
               "completions/clipped_ratio": float(np.mean(batch["clipped"])),
               "clip_ratio/low_mean": sums["low"] / tokens, "clip_ratio/high_mean": sums["high"] / tokens,
               "clip_ratio/region_mean": (sums["low"] + sums["high"]) / tokens}
        for (name, _), values in zip(self.rewards, per_function):
            out[f"rewards/{name}/mean"], out[f"rewards/{name}/std"] = float(values.mean()), float(_std(values))
        if self.config.beta:
            out["kl"] = sums["kl"] / tokens
        return out


def _on_completions(objective, parts: list[slice]):
    """The group objective on each sequence's completion positions (the prompt's get no gradient)."""
    def wrapped(logps):
        loss, grads = objective([x[s] for x, s in zip(logps, parts)])
        full = []
        for x, s, gr in zip(logps, parts, grads):
            d = np.zeros_like(x)
            d[s] = gr
            full.append(d)
        return loss, full
    return wrapped


@contextmanager
def adapters_off(model):
    """The model without its LoRA adapters while the block runs: a LoRA run's reference (its base)."""
    lora, model.lora = model.lora, None
    try:
        yield model
    finally:
        model.lora = lora
