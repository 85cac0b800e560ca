"""What a training run tells the user: the banner at its start, each held-out evaluation, and the
summary at its end (printed, and written to summary.json), with the --check-loss-drop verdict."""
from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np

from lfm2jit.safefiles import write_atomic

from .held_out import print_samples
from .resolve import reward_display_names
from .run_dir import RunFiles, clean
from .state import History, Session, lora_base_dtype


def per_second(rate: float | None) -> str:
    """A rate as a person reads it: whole numbers from 10 up, two significant digits below
    (0.31 tokens/s on a CPU is not 0)."""
    if rate is None:
        return "-"
    return f"{rate:.0f}" if rate >= 10 else f"{rate:.2g}"

def fmt_count(n: int) -> str:
    """A parameter count as 950, 163.2k or 1.20M."""
    return f"{n / 1e6:.2f}M" if n >= 1e6 else (f"{n / 1e3:.1f}k" if n >= 1e3 else str(n))


def fell(before: float, after: float) -> bool:
    """Whether the loss fell as the summary shows it (four decimals): 0.2053 -> 0.2045 did,
    0.20531 -> 0.20529 (both shown as 0.2053) did not."""
    return bool(np.isfinite(before) and np.isfinite(after)) and float(f"{after:.4f}") < float(f"{before:.4f}")


def ratio_text(before: float, after: float) -> str:
    """after / before as x0.13; with four decimals where two would read x1.00 although the losses
    shown differ (x0.9961 for 0.2053 -> 0.2045), so the ratio explains the verdict."""
    ratio = after / before if before else float("nan")
    text = f"x{ratio:.2f}"
    if text == "x1.00" and f"{after:.4f}" != f"{before:.4f}":
        text = f"x{ratio:.4f}"
    return text


def print_banner(s: Session, start: int) -> None:
    """What is trained, on what, for which steps, and where the files go."""
    run, data, cfg = s.run, s.data, s.model.cfg
    n_params = sum(int(np.prod(t.shape)) for t in s.model.parameters())
    n_trained = sum(int(np.prod(t.shape)) for t in s.params)
    what = (f"resuming {s.ckpt}" if s.ckpt else f"fine-tuning {run.model}" if run.source == "model"
            else f"training from scratch (preset {run.preset})")
    print(f"lfm2jit trainer: {what} on {s.ctx.name}")
    print(f"  model: {fmt_count(n_params)} parameters, hidden {cfg.hidden_size}, {cfg.num_hidden_layers} layers "
          f"({', '.join(cfg.layer_types)}), vocab {cfg.vocab_size}")
    if n_trained != n_params:
        lora = (f"LoRA r {run.lora_r} alpha {run.lora_alpha:g} on {', '.join(run.lora_targets)}"
                + (f" and {', '.join(run.lora_target_parameters)}" if run.lora_target_parameters else "")
                + (f", {lora_base_dtype(run)} base" if lora_base_dtype(run) != "f32" else "")
                if run.lora_r is not None else "a subset")
        print(f"  training {fmt_count(n_trained)} of them ({100 * n_trained / n_params:.2f}%): {lora}")
    unit = {"dpo": "pair", "grpo": "prompt"}.get(run.objective, "sequence")
    print(f"  data: {run.data}: {len(data.train)} training {unit}s, {data.held} held out"
          + (f" ({len(data.eval)} of them evaluated: --eval-max {run.eval_max})" if len(data.eval) < data.held else "")
          + (f"; rank {run.rank} of {run.world_size}" if run.world_size > 1 else ""))
    print(f"  steps {start + 1}..{run.steps}: {run.grad_accum} {unit}(s) per "
          + ("generation batch" if run.objective == "grpo" else "step")
          + (f" per rank x {run.world_size} ranks" if run.world_size > 1 else "")
          + f", {run.optimizer} lr {run.lr:g} ({run.schedule}), clip {run.clip:g}, bucket {run.bucket}"
          + (", loss scaling" if run.scaler else "") + (", f16 activations" if run.f16 else ""))
    if run.objective == "grpo":
        eps = (f"{run.epsilon:g}" if run.epsilon_high is None else f"{run.epsilon:g}/{run.epsilon_high:g}")
        print(f"  GRPO: {run.num_generations} completions per prompt (up to {run.max_completion_length} tokens, "
              f"temperature {run.temperature:g}, top-p {run.top_p:g}), {run.num_iterations} optimizer step(s) per "
              f"generation batch, {run.loss_type} loss, epsilon {eps}, rewards scaled by {run.scale_rewards}, beta "
              f"{run.beta:g}" + ("" if not run.beta else " (reference: " + ("the base, adapters off)" if run.lora_r
                                                                           else f"{run.reference_model})"))
              + f"; rewards: {', '.join(reward_display_names(run.rewards))}")
    if run.objective == "dpo":
        print(f"  DPO: beta {run.beta:g}, {run.loss_type} loss"
              + (f", label smoothing {run.label_smoothing:g}" if run.label_smoothing else "")
              + "; the reference is the model as loaded")
    print(f"  output: {s.out.resolve()}")
    sys.stdout.flush()


def _dpo_text(ev: dict, before: dict | None = None) -> str:
    """A DPO evaluation's reward accuracy and margin (after ``before``'s, when given); "" for others."""
    if "rewards/accuracies" not in ev:
        return ""
    if before and "rewards/accuracies" in before:
        return (f", rewards/accuracies {before['rewards/accuracies']:.2f} -> {ev['rewards/accuracies']:.2f}, "
                f"rewards/margins {before['rewards/margins']:.4f} -> {ev['rewards/margins']:.4f}")
    return f", rewards/accuracies {ev['rewards/accuracies']:.2f}, rewards/margins {ev['rewards/margins']:.4f}"


def _grpo_text(ev: dict, before: dict | None = None) -> str:
    """A GRPO evaluation's held-out reward and exact match (after ``before``'s, when given)."""
    def value(key, fmt):
        now = ev.get(key)
        was = (before or {}).get(key)
        text = "-" if now is None else format(now, fmt)
        return text if was is None or not before else f"{format(was, fmt)} -> {text}"
    return (f"held-out reward {value('reward', '.2f')}"
            + (f", exact match {value('exact_match', '.0%')} of {ev['answers_scored']}"
               if ev.get("exact_match") is not None else "") + " (greedy)"
            + (f"; sampled: reward {value('sampled/reward', '.2f')}"
               + (f", exact match {value('sampled/exact_match', '.0%')}" if ev.get("sampled/exact_match") is not None
                  else "") if "sampled/reward" in ev else ""))


def _grpo_samples(samples: list[dict], k: int, write) -> None:
    for x in samples[:k]:
        mark = {True: "ok ", False: "BAD", None: "   "}[x["correct"]]
        prompt = x["prompt"] if isinstance(x["prompt"], str) else (x["prompt"][-1] or {}).get("content", "")
        write(f"    {mark} {x['reward']:.2f} {prompt!r:.60} -> {x['completion']!r:.60}"
              + (f" (expected {x['expected']!r})" if x["correct"] is False else ""))


def print_eval_before(s: Session, before: dict, seconds: float) -> None:
    """The held-out loss before the first step, which took ``seconds``."""
    if s.run.objective == "grpo":
        print(f"  before training: {_grpo_text(before)}; {before['prompts']} prompts, {seconds:.1f}s")
        sys.stdout.flush()
        return
    if "rewards/accuracies" in before:
        print(f"  held-out before training: DPO loss {before['loss']:.4f}{_dpo_text(before)}; {len(s.data.eval)} "
              f"pairs, {seconds:.1f}s")
        sys.stdout.flush()
        return
    print(f"  held-out loss before training: {before['loss']:.4f}"
          + (f" (answer tokens only: {before['answer_loss']:.4f})" if s.data.has_answers else "")
          + f"; {len(s.data.eval)} sequences, {seconds:.1f}s")
    sys.stdout.flush()


def print_eval_during(s: Session, step: int, ev: dict, write, before: dict | None = None) -> None:
    """An evaluation during training, with its first --samples answers, through ``write``; a DPO run's
    beside ``before``, the evaluation before this segment's first step."""
    if s.run.objective == "grpo":
        write(f"  step {step}: {_grpo_text(ev, before)}")
        _grpo_samples(ev.get("samples", []), s.run.samples, write)
        return
    if "rewards/accuracies" in ev:
        write(f"  step {step}: held-out: loss " + (f"{before['loss']:.4f} -> " if before else "")
              + f"{ev['loss']:.4f}{_dpo_text(ev, before)}")
        return
    write(f"  step {step}: held-out loss {ev['loss']:.4f}"
          + (f" (answers {ev['answer_loss']:.4f})" if s.data.has_answers else "")
          + (f", exact match {ev['exact_match']:.0%} of {ev['answers_scored']}"
             if ev["exact_match"] is not None else ""))
    if ev["exact_match"] is not None:
        print_samples(ev["samples"], s.run.samples, write)


def conclude(s: Session, h: History, final_eval: dict, final_samples: list[dict], train_seconds: float,
             eval_seconds: float, files: RunFiles, checkpoint: Path | None, final_model: str | None, reporters) -> int:
    """Write summary.json for the whole run (the earlier segments of a resumed run too), print it; the
    exit status (1 when --check-loss-drop is not met)."""
    run, data, nan = s.run, s.data, float("nan")
    steps = s.trainer.optimizer_steps()
    eval_before, answer_before = h.eval_before.get("loss", nan), h.eval_before.get("answer_loss", nan)
    eval_after, answer_after = final_eval.get("loss", nan), final_eval.get("answer_loss", nan)
    first_eval = h.evals_at_ends[0] if h.evals_at_ends else None
    if first_eval is not None and first_eval["step"] < h.start:       # the held-out loss at the run's start
        eval_before = first_eval["loss"] if first_eval["loss"] is not None else nan
        answer_before = nan if first_eval.get("answer_loss") is None else first_eval["answer_loss"]
    whole, new = h.whole, h.metrics
    losses = [m["loss"] for m in whole if not m["skipped"] and m["loss"] is not None]
    loss_steps = [m["step"] for m in whole if not m["skipped"] and m["loss"] is not None]
    k = max(1, len(losses) // 10)
    first, last = (losses[0], losses[-1]) if losses else (nan, nan)
    first_avg = float(np.mean(losses[:k])) if losses else nan
    last_avg = float(np.mean(losses[-k:])) if losses else nan
    toks = sum(m["tokens"] for m in new)
    tps = toks / train_seconds if train_seconds > 0 else nan
    run_toks, run_seconds = sum(m["tokens"] for m in whole), h.elapsed_before + train_seconds
    before, after = (eval_before, eval_after) if data.eval else (first_avg, last_avg)
    ratio = after / before if (data.eval or losses) and before else nan
    grpo_before, rose = _grpo_before(h), None
    if run.objective == "grpo":                # the held-out reward's change, else the training reward's
        kk = max(1, len(whole) // 10)
        rewards = [m["reward"] for m in whole if m.get("reward") is not None]
        r0, r1 = ((grpo_before.get("reward"), final_eval.get("reward")) if data.eval else
                  (float(np.mean(rewards[:kk])), float(np.mean(rewards[-kk:]))) if rewards else (None, None))
        rose = bool(r0 is not None and r1 is not None and r1 > r0)
    summary = {
        "steps": steps, "steps_this_run": len(new), "first_step": h.start + 1,
        "sequences": run.grad_accum * run.world_size * len(whole), "tokens": run_toks,
        "train_seconds": round(run_seconds, 2),
        "tokens_per_s": round(run_toks / run_seconds, 1) if run_seconds > 0 else None,
        "tokens_this_run": toks, "train_seconds_this_run": round(train_seconds, 2),
        "tokens_per_s_this_run": round(tps, 1), "first_loss": first, "last_loss": last,
        f"first_{k}_steps_mean_loss": first_avg, f"last_{k}_steps_mean_loss": last_avg,
        "eval_sequences": len(data.eval), "eval_before": eval_before, "eval_after": eval_after,
        "eval_answer_before": answer_before, "eval_answer_after": answer_after,
        "eval_perplexity_after": final_eval.get("perplexity"), "eval_answer_perplexity_after": final_eval.get(
            "answer_perplexity"), "eval_exact_match": final_eval.get("exact_match"),
        "eval_answers_scored": final_eval.get("answers_scored", 0),
        "eval_seconds": round(eval_seconds, 2), "loss_fell": fell(before, after), "loss_ratio": ratio,
        "evals_during": h.evals_during,
        **({"eval_dpo_before": {k: clean(v) for k, v in h.eval_before.items()},
            "eval_dpo_after": {k: clean(v) for k, v in final_eval.items()}} if run.objective == "dpo" else {}),
        **({"eval_grpo_before": {k: clean(v) for k, v in grpo_before.items() if k != "samples"},
            "eval_grpo_after": {k: clean(v) for k, v in final_eval.items() if k != "samples"},
            "reward_rose": rose} if run.objective == "grpo" else {}),
        "metrics": str(files.metrics.resolve()), "plot": str(files.plot.resolve()),
        "checkpoint": str(Path(checkpoint).resolve()) if checkpoint else None,
    }
    summary = {key: clean(v) for key, v in summary.items()}
    write_atomic(files.summary, json.dumps(summary, indent=2) + "\n")   # whole or not at all, on a full disk too
    reporters.finish("finished")
    print()
    print(f"done: {len(new)} optimizer steps (to step {steps}) on {toks} tokens in "
          f"{train_seconds:.1f}s: {per_second(tps)} tokens/s")
    if losses:
        print(f"  train loss: step {loss_steps[0]} {first:.4f} -> step {loss_steps[-1]} {last:.4f}"
              + (f"  (mean of the first {k} steps {first_avg:.4f} -> of the last {k} {last_avg:.4f})" if k > 1 else ""))
    if run.objective == "grpo":
        return _conclude_grpo(s, h, final_eval, final_samples, grpo_before, rose, r0, r1, kk, files, checkpoint,
                              final_model)
    if data.eval:
        print(f"  held-out loss ({data.label}): {eval_before:.4f} before -> {eval_after:.4f} after  "
              f"({ratio_text(eval_before, eval_after)}, {len(data.eval)} "
              f"{'pairs' if run.objective == 'dpo' else 'sequences'})")
        if "rewards/accuracies" in final_eval:
            print(f"  held-out{_dpo_text(final_eval, h.eval_before)[1:]}"
                  + (f" (from step {h.start})" if h.start else ""))
        if data.has_answers:
            print(f"  held-out loss on the answers only: {answer_before:.4f} before -> {answer_after:.4f} after  "
                  f"({ratio_text(answer_before, answer_after)})")
        if final_eval.get("exact_match") is not None:
            print(f"  held-out answers exactly right: {final_eval['exact_match']:.0%} of "
                  f"{final_eval['answers_scored']} (greedy; all in {files.samples.resolve()}), for example:")
            print_samples(final_samples, run.samples, print)
    print(f"  the {'held-out' if data.eval else 'training'} loss {'fell' if fell(before, after) else 'DID NOT FALL'} "
          f"({ratio_text(before, after)})")
    _print_files(run, files, checkpoint, final_model)
    if run.check_loss_drop is not None and len(new) and not (ratio <= run.check_loss_drop):
        print(f"error: the {'held-out' if data.eval else 'training'} loss went from "
              f"{before:.4f} to {after:.4f} ({ratio_text(before, after)}); --check-loss-drop wants at most x{run.check_loss_drop:g}", file=sys.stderr)
        return 1
    return 0


def _print_files(run, files: RunFiles, checkpoint, final_model) -> None:
    """Where the run's files are: metrics, the loss curve, the checkpoint, the final model, the summary."""
    print(f"  metrics: {files.metrics.resolve()}")
    print(f"  loss curve: {files.plot.resolve()}")
    if checkpoint:
        print(f"  checkpoint: {Path(checkpoint).resolve()}  (Hugging Face model in its model/ directory"
              + (", the LoRA adapter in adapter/)" if run.lora_r is not None else ")"))
    if final_model is not None:
        print(f"  {final_model}")
    print(f"  summary: {files.summary.resolve()}")


def _grpo_before(h: History) -> dict:
    """A GRPO run's held-out evaluation at its start (an earlier segment's, after --resume)."""
    first = h.evals_at_ends[0] if h.evals_at_ends else None
    if first is not None and first["step"] < h.start and "reward" in first:
        return {k: v for k, v in first.items() if k != "step"}
    return h.eval_before


def _conclude_grpo(s: Session, h: History, final_eval: dict, final_samples: list[dict], before: dict, rose: bool,
                   r0, r1, k: int, files: RunFiles, checkpoint, final_model) -> int:
    """The rest of a GRPO run's summary: the held-out reward and exact match instead of a loss verdict."""
    run, data = s.run, s.data
    if data.eval:
        print(f"  {_grpo_text(final_eval, before)}, {final_eval['prompts']} prompts"
              + (f" (from step {h.start})" if h.start and before is h.eval_before else ""))
        if final_samples:
            print(f"  held-out completions (all in {files.samples.resolve()}), for example:")
            _grpo_samples(final_samples, run.samples, print)
        print(f"  the held-out reward {'rose' if rose else 'DID NOT RISE'}"
              + (f" ({r0:.4f} -> {r1:.4f})" if r0 is not None and r1 is not None else ""))
    elif r0 is not None:
        print(f"  the training reward {'rose' if rose else 'DID NOT RISE'} (mean of the first {k} batches "
              f"{r0:.4f} -> of the last {k} {r1:.4f}; no held-out prompts)")
    _print_files(run, files, checkpoint, final_model)
    return 0
