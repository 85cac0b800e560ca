"""``python -m trainer``: train a tiny LFM2 from scratch on the shipped data (no arguments), or fine-tune
a Hugging Face LFM2 checkpoint on a chat or text JSONL file (``--model DIR --data FILE``).

``prepare`` (trainer/cli/prepare.py) builds the run's ``Session``; ``Training.train`` below is the
loop: for each optimizer step, next_batch -> step -> log -> (checkpoint) -> (evaluate), then finish.

Each optimizer step takes the next ``world_size * grad_accum`` sequences of the epoch's shuffled
order; rank r trains on sequences r, r + world_size, ... of that window (one micro-batch per
sequence, as ``Trainer`` runs them), so N ranks with accumulation A see exactly the sequences that
one process with accumulation N*A would. A run directory holds::

    metrics.jsonl            one JSON line per optimizer step (see METRICS_KEYS; an MoE model's also has
                             expert_tokens: per sparse layer, the tokens routed to each expert)
    eval.jsonl               the held-out loss every --eval-every N steps: {"step", "loss", "answer_loss"}
    loss.png                 the loss curve (and the held-out loss before and after)
    summary.json             the numbers the summary prints
    run.json                 the resolved settings of the run
    checkpoints/step-NNNNNN  Trainer.save_checkpoint: model/ (a Hugging Face LFM2 directory, with the
                             tokenizer copied in), optimizer.safetensors, trainer.json

``--resume`` restores weights, optimizer state, loss scaler, step count, schedule and data position
from a checkpoint, plus the run's settings (kept in the checkpoint's data position as "run"), so
the resumed run continues exactly as if it had not stopped. Flags given with ``--resume`` override
the saved settings (a note lists what changed).

Exit status: 0 done; 1 training failed (a TrainError such as a sync timeout or a non-finite loss,
or the no-argument run's loss did not fall); 2 bad usage or input (missing files, malformed JSONL,
a tokenizer larger than the model's vocabulary), reported in one line without a traceback.
"""
from __future__ import annotations

import json
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from lfm2jit.safefiles import write_atomic

from . import held_out
from .checkpoints import Cadence, save
from .options import build_parser
from .plot import write_plot
from .prepare import prepare
from .progress import Progress
from .report import Reporters
from .resume import saved_evals
from .run_dir import RunFiles, clean, write_final_model
from .signals import Interrupted, StopSignals
from .splits import Cursor
from .state import History, Session
from .summary import conclude, per_second, print_banner, print_eval_before, print_eval_during
from .usage import UsageError, report

MAX_SKIPPED_IN_A_ROW = 50
METRICS_KEYS = ("step", "loss", "tokens", "supervised", "tokens_per_s", "lr", "grad_norm", "loss_scale",
                "skipped", "elapsed", "epoch")


def main(argv: list[str]) -> int:
    """The train command: its flags in ``argv``; the exit status."""
    return run_command(argv, "sft", Training)


def run_command(argv: list[str], objective: str, loop: type["Training"]) -> int:
    """A training command (``objective`` "sft": python -m trainer, "dpo": python -m trainer dpo, whose
    loop is a subclass of Training): its flags in ``argv``; the exit status."""
    from ..errors import TrainError
    args = build_parser(objective).parse_args(argv)
    args.objective = objective
    try:
        session = prepare(args, argv_empty=not argv)
        training = loop(session)
    except UsageError as e:
        return report(e)
    except TrainError as e:           # the sync handshake: another rank disagrees, or none answered
        print(f"error: {e}", file=sys.stderr)
        return 1
    try:
        return training.train()
    except OSError as e:              # a full disk or a file-size limit while writing a checkpoint or a run file
        print(f"error: {e}", file=sys.stderr)
        return 1


@dataclass
class StepResult:
    """One optimizer step as the loop sees it."""
    stats: object            # the StepStats of the window's last sequence: whether the optimizer stepped
    record: dict             # the step's metrics.jsonl line, over all ranks
    seconds: float


class Training:
    """A run's loop over optimizer steps: batch -> step -> log -> (checkpoint) -> (evaluate), then finish."""
    COMMAND = "trainer"          # python -m COMMAND --resume continues the run

    def __init__(self, s: Session):
        self.s, self.run, self.tr = s, s.run, s.trainer
        self.files = RunFiles(s.out, s.run.rank)
        self.my_eval = s.data.eval[s.run.rank::s.run.world_size]
        self.lost_in_a_row = self.zero_in_a_row = 0    # windows without a finite, nonzero step; of them, zero norm
        self.last_ckpt: Path | None = None

    def train(self) -> int:
        """Train from the checkpoint's step (or the first) to --steps; the exit status."""
        from .. import TrainError
        self.begin()
        try:
            with open(self.files.metrics, "a") as self.metrics_file:
                while self.tr.optimizer_steps() < self.run.steps:
                    self.stop.check(self.run.world_size)
                    before = self.tr.optimizer_steps()
                    result = self.step(self.next_batch())
                    self.log(result, before)
                    if result.stats.skipped:
                        continue
                    k = self.tr.optimizer_steps()       # before + 1 (a GRPO window: + --num-iterations)
                    if self.cadence.due(k, result.seconds):
                        self.checkpoint(k)
                    if self.evaluation_due(k, before):
                        self.evaluate(k)
        except Interrupted:
            return self.stopped()
        except (TrainError, KeyboardInterrupt) as e:
            return self.failed(e)
        except BaseException:
            self.stop.restore()
            self.reporters.finish("failed")
            raise
        return self.finish()

    def begin(self) -> None:
        """Before the first step: run.json, the earlier segments' history, the banner, the held-out loss."""
        s, run, start = self.s, self.run, self.tr.optimizer_steps()
        self.files.dir.mkdir(parents=True, exist_ok=True)
        settings = json.dumps({k: v for k, v in vars(run).items() if k not in ("notes", "derived")}, indent=2)
        write_atomic(self.files.settings, settings)
        metrics_before, evals_during = self.files.rewind(start)
        pos = s.position
        self.h = History(start, float(pos.get("elapsed", 0.0)), metrics_before, evals_during, saved_evals(pos, start))
        self.cursor = Cursor(len(s.data.train), run.seed, int(pos.get("epoch", 0)), int(pos.get("next", 0)),
                             int(pos.get("tokens", 0)))
        print_banner(s, start)
        self.reporters = Reporters(run.report_to if run.rank == 0 else [], s.out, first_step=start + 1,
                                   warn=lambda line: print(line, file=sys.stderr))
        self.reporters.start(json.loads(settings))
        self.evaluate_before()
        self.t0 = time.perf_counter()
        self.bar = Progress(total=run.steps, initial=start, enabled=run.progress, file=sys.stderr, desc="train")
        self.cadence = Cadence(run, start, self.warn)
        self.stop = StopSignals(self.warn)
        self.stop.install()

    def next_batch(self) -> np.ndarray:
        """This rank's share of the next window of sequences: rank r takes r, r + world_size, ..."""
        return self.cursor.take(self.run.world_size * self.run.grad_accum)[self.run.rank::self.run.world_size]

    def step(self, window: np.ndarray) -> StepResult:
        """One optimizer step on ``window``; its metrics over all ranks: the mean loss of the window's
        sequences, its tokens (and each rank's stop vote)."""
        tr = self.tr
        t_step = time.perf_counter()
        stats, window_tokens, extra = self.train_window(window)
        last = stats[-1]
        seconds = time.perf_counter() - t_step
        model = self.s.model
        routed = model.take_routed_tokens()           # an MoE model's tokens per expert, per layer
        coef = model.router_aux_loss_coef             # and its routers' balance loss, when on
        names = list(extra)
        loss_sum, n_seq, toks, supervised, votes, balance, *rest = self.s.sum_over_ranks(
            [sum(float(x.loss) for x in stats), len(stats), window_tokens,
             sum(x.tokens for x in stats), self.stop.vote(), model.take_router_balance() if coef else 0.0,
             *(float(extra[k]) for k in names), *(float(v) for n in routed.values() for v in n)],
            "the step's loss and tokens")
        sums, per_expert = rest[:len(names)], rest[len(names):]
        self.stop.agreed = votes > 0
        toks = int(toks)
        self.cursor.tokens += toks
        rec = {"step": tr.optimizer_steps() if last.stepped else tr.optimizer_steps() + 1, "loss": loss_sum / n_seq,
               "tokens": toks, "supervised": int(supervised), "tokens_per_s": toks / seconds if seconds > 0 else None,
               "lr": last.lr, "grad_norm": last.grad_norm, "loss_scale": last.loss_scale,
               "skipped": bool(last.skipped), "elapsed": round(self.elapsed(), 3), "epoch": self.cursor.epoch}
        rec.update({k: v / n_seq for k, v in zip(names, sums)})   # the objective's own metrics: means too
        rec = {k: clean(v) for k, v in rec.items()}
        if coef:                           # the balance loss's mean over the step's sequences, with its weight
            rec["router_aux_loss"] = clean(coef * balance / n_seq)
        if routed:
            width = len(per_expert) // len(routed)
            rec["expert_tokens"] = {str(i): [round(v) for v in per_expert[j * width:(j + 1) * width]]
                                    for j, i in enumerate(routed)}
        return StepResult(last, rec, seconds)

    def train_window(self, window: np.ndarray) -> tuple[list, int, dict]:
        """Train this rank's share of a window: each micro-batch's StepStats, the window's input tokens, and
        the sums over its micro-batches of the objective's own metrics (none for SFT), by name."""
        data = self.s.data
        stats = self.tr.train_sequences([data.train[i] for i in window], self.s.params)
        return stats, sum(len(data.train[i][0]) for i in window), {}

    def held_out(self, answers: bool) -> dict:
        """The held-out metrics of this rank's share (over all ranks); with ``answers`` greedy answers too."""
        return held_out.evaluate(self.s, self.my_eval, answers=answers)

    def kept(self, ev: dict) -> dict:
        """What of an evaluation at a segment's start or end the checkpoints keep beside the loss (a GRPO
        run's held-out reward and exact match); none for SFT."""
        return {}

    def log(self, result: StepResult, before: int | None = None) -> None:
        """The step into metrics.jsonl and the reporters; a run that no longer steps fails; the bar moves (by
        the optimizer steps since ``before``: a GRPO window makes --num-iterations)."""
        rec, last = result.record, result.stats
        self.metrics_file.write(json.dumps(rec) + "\n")
        self.metrics_file.flush()
        self.h.metrics.append(rec)
        self.reporters.log(rec["step"], rec)
        self.check_stepping(last)
        if not last.skipped:
            self.bar.set_postfix_str(f"loss={rec['loss'] if rec['loss'] is None else round(rec['loss'], 3)} "
                                     f"tok/s={per_second(rec['tokens_per_s'])} lr={last.lr:.2e}", refresh=False)
            self.bar.update(1 if before is None else max(1, self.tr.optimizer_steps() - before))

    def check_stepping(self, last) -> None:
        """Fail after MAX_SKIPPED_IN_A_ROW windows in a row without a finite, nonzero step: skipped ones
        (overflow) and steps whose gradient norm is 0 (under a loss scale, gradients that underflowed)."""
        from .. import TrainError
        lost = last.skipped or not (last.grad_norm and np.isfinite(last.grad_norm))
        self.lost_in_a_row, self.zero_in_a_row = ((self.lost_in_a_row + 1, self.zero_in_a_row + (not last.skipped))
                                                  if lost else (0, 0))
        if self.lost_in_a_row >= MAX_SKIPPED_IN_A_ROW:
            raise TrainError(
                f"{self.lost_in_a_row} windows in a row took no finite, nonzero step: "
                f"{self.lost_in_a_row - self.zero_in_a_row} overflowed (inf/NaN gradients) and were skipped, "
                f"{self.zero_in_a_row} had a gradient norm of 0 (all-zero gradients"
                + (", the loss scale underflowed" if self.tr.scaler is not None else "")
                + f"); the loss scale is down to {last.loss_scale:g}")

    def checkpoint(self, step: int) -> Path:
        """Save the trainer and the run's position at ``step``; the checkpoint's directory."""
        c = self.cursor
        position = {"epoch": c.epoch, "next": c.next, "elapsed": self.elapsed(), "tokens": c.tokens,
                    "data_sha1": self.s.data.sha1, "n_train": c.n, "run": self.run.saved(),
                    "evals": self.h.evals_at_ends}
        self.last_ckpt = save(self.tr, self.run, self.files.checkpoints, step, position, self.s.model_files)
        return self.last_ckpt

    def evaluate_before(self) -> None:
        """The held-out loss before this segment's first step (no answers: few would be right yet)."""
        s, h = self.s, self.h
        if not s.data.eval:
            return
        t_eval = time.perf_counter()
        h.eval_before = self.held_out(answers=False)
        print_eval_before(s, h.eval_before, time.perf_counter() - t_eval)
        self.reporters.log_eval(h.start, h.eval_before)
        if not any(e["step"] == h.start for e in h.evals_at_ends):
            h.evals_at_ends.append({"step": h.start, "loss": clean(h.eval_before["loss"]),
                                    "answer_loss": clean(h.eval_before["answer_loss"]), **self.kept(h.eval_before)})

    def evaluation_due(self, step: int, before: int | None = None) -> bool:
        """--eval-every N: after every N-th step but the last (the end of the run evaluates), unless stopping;
        a window of several optimizer steps (from ``before``) is due when it passed a multiple of N."""
        run = self.run
        before = step - 1 if before is None else before
        return bool(run.eval_every and self.s.data.eval and step // run.eval_every > before // run.eval_every
                    and step < run.steps and not self.stop.agreed)

    def evaluate(self, step: int) -> None:
        """Score the held-out split, record it in eval.jsonl (and samples.jsonl) and print it."""
        ev = held_out.record(step, self.held_out(answers=True), self.files.evals,
                             self.files.samples, self.run.samples)
        self.h.evals_during.append(ev)
        self.reporters.log_eval(step, ev)
        print_eval_during(self.s, step, ev, self.warn, self.h.eval_before)
        del ev["samples"]

    def finish(self) -> int:
        """After the last step: the final evaluation, checkpoint and model, the plot and the summary."""
        s, run, h = self.s, self.run, self.h
        self.bar.close()
        self.stop.restore()
        train_seconds = time.perf_counter() - self.t0
        t_eval = time.perf_counter()
        final_eval = self.held_out(answers=True) if s.data.eval else {}
        eval_seconds = time.perf_counter() - t_eval
        k = self.tr.optimizer_steps()
        if s.data.eval:               # into the final checkpoint, so that a resumed run's summary and plot show it
            self.reporters.log_eval(k, final_eval)
            h.evals_at_ends = [e for e in h.evals_at_ends if e["step"] != k] + [
                {"step": k, "loss": clean(final_eval["loss"]), "answer_loss": clean(final_eval["answer_loss"]),
                 "exact_match": clean(final_eval.get("exact_match")), **self.kept(final_eval)}]
        if run.rank == 0 and (h.metrics or self.last_ckpt is None):
            self.last_ckpt = self.checkpoint(k) if (h.metrics or not s.ckpt) else s.ckpt
        final_samples = final_eval.pop("samples", [])
        if final_samples:             # every scored answer of the last evaluation
            with open(self.files.samples, "a") as f:
                f.writelines(json.dumps({"step": k, **x}) + "\n" for x in final_samples)
        final_model = write_final_model(run, s.model, s.out, s.model_files) if run.rank == 0 else None
        write_plot(self.files.plot, h.whole, h.evals() if s.data.eval else [])
        s.finish_sync()
        return conclude(s, h, final_eval, final_samples, train_seconds, eval_seconds, self.files, self.last_ckpt,
                        final_model, self.reporters)

    def stopped(self) -> int:
        """A signal stopped the run after a step: checkpoint it (rank 0), say how to continue; status 130."""
        run, h = self.run, self.h
        self.bar.close()
        k = self.tr.optimizer_steps()
        if run.rank == 0 and k > h.start and (self.last_ckpt is None or self.last_ckpt.name != f"step-{k:06d}"):
            self.checkpoint(k)
        ckpt = self.last_ckpt or self.s.ckpt
        self.stop.restore()
        write_plot(self.files.plot, h.whole, h.evals())
        self.reporters.finish("interrupted")
        self.s.finish_sync()            # every rank stopped after the same step: the run can resume or rerun
        if run.rank == 0 and ckpt:
            print(f"\n{self.stop.name()}: stopped after step {k}; checkpoint {ckpt.resolve()}\n"
                  f"  continue with: {self.resume_command()}", file=sys.stderr)
        else:
            print(f"\n{self.stop.name()}: stopped after step {k}"
                  + ("" if run.rank == 0 else " (rank 0 writes the checkpoint)"), file=sys.stderr)
        return 130

    def failed(self, e: BaseException) -> int:
        """A TrainError or a second signal ended the run mid-step: say where its newest checkpoint is."""
        interrupted = isinstance(e, KeyboardInterrupt)
        self.bar.close()
        self.stop.restore()
        write_plot(self.files.plot, self.h.whole, self.h.evals_during)
        self.reporters.finish("interrupted" if interrupted else "failed")
        where = (f"the newest checkpoint is {self.last_ckpt.resolve()} (continue with python -m {self.COMMAND} "
                 f"--resume {self.s.out})"
                 if self.last_ckpt else "no checkpoint was written (--checkpoint-every N writes them during the run)")
        if interrupted:
            print(f"\ninterrupted at step {self.tr.optimizer_steps() + 1}; {where}", file=sys.stderr)
            return 130
        print(f"error: training failed at step {self.tr.optimizer_steps() + 1}: {e}\n  {where}", file=sys.stderr)
        return 1

    def resume_command(self) -> str:
        """How this run continues: under mpiexec as it was launched, with the file sync every rank with its --rank."""
        run = self.run
        cmd = f"{sys.executable} -m {self.COMMAND} --resume {self.s.out}"
        if run.world_size > 1 and run.distributed == "mpi":
            return f"mpiexec -n {run.world_size} {cmd}"
        return f"{cmd} --rank R (every rank R of {run.world_size})" if run.world_size > 1 else cmd

    def elapsed(self) -> float:
        """Training seconds of the whole run so far, the earlier segments' included."""
        return self.h.elapsed_before + time.perf_counter() - self.t0

    def warn(self, line: str) -> None:
        """A line on stderr that leaves the progress bar intact."""
        self.bar.write(line, file=sys.stderr)
