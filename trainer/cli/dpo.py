"""``python -m trainer dpo``: preference tuning with DPO (trainer/dpo.py) on the train command's
machinery. Its flags are the train command's (trainer/cli/options.py, with --beta, --loss-type and
--label-smoothing); ``prepare`` reads --data as preference pairs (trainer/cli/splits.py), and
``PreferenceTraining`` is the train command's loop with what differs:

- before the first step, the reference log-probs of every training and held-out pair by the model as
  loaded, written to the run directory as ``reference_logps.npz`` (arrays ``train`` and ``eval``,
  float64 [N, 2]: each pair's summed completion log-probs of chosen and rejected; ``pairs_sha1``, a
  digest of the pairs' tokens; ``data_sha1``, of --data). ``--resume`` reads them back from there (the
  resumed checkpoint's run directory): the reference is the run's starting model, which a checkpoint
  no longer holds, so a missing file or one of other pairs is a usage error;
- a step trains each pair of its window as one micro-batch (``DpoTrainer.train_pair``); metrics.jsonl
  has the train command's keys ("loss": the mean DPO loss of the window's pairs; "tokens": the input
  positions of both sequences of each pair; "supervised": their completion tokens) and TRL's
  rewards/chosen, rewards/rejected, rewards/accuracies, rewards/margins, logps/chosen, logps/rejected
  (means over the window's pairs);
- the held-out evaluation (before, every --eval-every N steps, at the end) is the mean DPO loss and
  the same metrics over the held-out pairs, the policy's log-probs by ``Trainer.sequence_logps``.
"""
from __future__ import annotations

import hashlib
import sys
import time
from pathlib import Path

import numpy as np

from lfm2jit.safefiles import write_atomic

from .held_out import _bar
from .state import Session
from .train import Training, run_command
from .usage import UsageError

REFERENCE_FILE = "reference_logps.npz"


def main(argv: list[str]) -> int:
    """The dpo command: the train command's flags (and DPO's) in ``argv``; the exit status."""
    return run_command(argv, "dpo", PreferenceTraining)


def pairs_sha1(pairs) -> str:
    """A digest of the pairs' token ids (prompt, chosen, rejected, each with its length)."""
    h = hashlib.sha1()
    for p in pairs:
        for ids in (p.prompt, p.chosen, p.rejected):
            a = np.ascontiguousarray(ids, np.int64)
            h.update(np.int64(a.size).tobytes())
            h.update(a.tobytes())
    return h.hexdigest()


class PreferenceTraining(Training):
    """The train command's loop over DPO's pairs (see the module docstring)."""
    COMMAND = "trainer dpo"

    def __init__(self, s: Session):
        from ..dpo import DpoConfig, DpoTrainer
        super().__init__(s)
        run = s.run
        self.config = DpoConfig(beta=run.beta, loss_type=run.loss_type, label_smoothing=run.label_smoothing)
        self.dpo = DpoTrainer(self.tr, self.config)
        self.reference_path = self.files.dir / REFERENCE_FILE
        self.fingerprint = pairs_sha1(list(s.data.train) + list(s.data.eval))
        # on --resume: read (and checked) before any file of the run is written
        self.reference = self.saved_reference() if s.ckpt is not None else None

    # ---- the reference log-probs ----
    def saved_reference(self) -> dict:
        """The reference log-probs a resumed run computed before its first step: from this run directory, else
        from the resumed checkpoint's; a UsageError when there are none or they are of other pairs."""
        run, ckpt, data = self.run, self.s.ckpt, self.s.data
        places = [self.reference_path]
        if ckpt.parent.name == "checkpoints":
            top = ckpt.parent.parent
            places.append((top if run.rank == 0 else top / f"rank{run.rank}") / REFERENCE_FILE)
        found = next((p for p in places if p.is_file()), None)
        if found is None:
            raise UsageError(f"--resume {ckpt}: no {REFERENCE_FILE} in {places[-1].parent}: a DPO run's reference "
                             "log-probs are its starting model's, computed before its first step, which a checkpoint "
                             "cannot give again; start a new run")
        try:
            with np.load(found, allow_pickle=False) as z:
                train, held, digest = np.asarray(z["train"]), np.asarray(z["eval"]), str(z["pairs_sha1"])
        except Exception as e:             # a damaged zip, a missing array: whatever np.load raises
            raise UsageError(f"--resume {ckpt}: {found} does not read as reference log-probs: {e}") from None
        if (digest != self.fingerprint or train.shape != (len(data.train), 2) or held.shape != (len(data.eval), 2)
                or not (np.isfinite(train).all() and np.isfinite(held).all())):
            raise UsageError(f"--resume {ckpt}: {found} holds the reference log-probs of other preference pairs than "
                             "this run's (--data, --eval-data, --eval-fraction, --eval-max, --seed, --max-len or the "
                             "tokenizer changed): the reference must be the run's starting model; start a new run")
        return {"train": train.astype(np.float64), "eval": held.astype(np.float64), "from": found}

    def scored(self, pairs, desc: str) -> np.ndarray:
        """[N, 2] summed completion log-probs of ``pairs`` by the model as it is, chunks of pairs a call,
        with a progress bar."""
        with _bar(self.run, len(pairs), desc, "pair") as bar:
            done_before = [0]

            def advance(done: int, total: int) -> None:
                bar.update(done - done_before[0])
                done_before[0] = done
            return self.dpo.reference_logps(pairs, progress=advance)

    def compute_reference(self) -> dict:
        """The log-probs of every training and held-out pair by the model as loaded (the reference), written
        to the run directory."""
        data = self.s.data
        pairs = list(data.train) + list(data.eval)
        t0 = time.perf_counter()
        logps = self.scored(pairs, "reference log-probs")
        ref = {"train": logps[:len(data.train)], "eval": logps[len(data.train):]}
        self.write_reference(ref)
        print(f"  reference log-probs of {len(pairs)} pairs by the starting model: {time.perf_counter() - t0:.1f}s, "
              f"in {self.reference_path.resolve()}")
        sys.stdout.flush()
        return {**ref, "from": self.reference_path}

    def write_reference(self, ref: dict) -> None:
        import io
        buf = io.BytesIO()
        np.savez(buf, train=ref["train"], eval=ref["eval"], pairs_sha1=np.array(self.fingerprint),
                 data_sha1=np.array(self.s.data.sha1))
        write_atomic(self.reference_path, buf.getvalue())

    def evaluate_before(self) -> None:
        """The reference log-probs (computed, or read back on --resume and kept in this run directory too),
        then the held-out DPO metrics before this segment's first step."""
        if self.reference is None:
            self.reference = self.compute_reference()
        elif self.reference["from"] != self.reference_path:
            self.write_reference(self.reference)
        super().evaluate_before()

    # ---- training and evaluation ----
    def train_window(self, window: np.ndarray) -> tuple[list, int, dict]:
        """Each pair of this rank's share of the window as one micro-batch; the sums of TRL's metrics."""
        from ..dpo import METRICS
        data, ref = self.s.data, self.reference["train"]
        stats, sums, tokens = [], dict.fromkeys(METRICS, 0.0), 0
        for i in window:
            pair = data.train[i]
            st, metrics = self.dpo.train_pair(pair, ref[i], self.s.params)
            stats.append(st)
            for k in METRICS:
                sums[k] += metrics[k]
            tokens += sum(len(seq[0]) for seq in pair.sequences())
        return stats, tokens, sums

    def held_out(self, answers: bool) -> dict:
        """The mean DPO loss and TRL's metrics over the held-out pairs (this rank's share, added over the
        ranks); no answers are generated. Keys the train command's summary reads are there, as None."""
        from ..dpo import METRICS, dpo_loss, dpo_metrics
        run, items = self.run, self.my_eval
        ref = self.reference["eval"][run.rank::run.world_size]
        sums = dict.fromkeys(("loss", *METRICS), 0.0)
        for pair, p, r in zip(items, self.scored(items, "held-out DPO"), ref):
            policy, reference = (float(p[0]), float(p[1])), (float(r[0]), float(r[1]))
            sums["loss"] += dpo_loss(self.config, policy, reference, pair.lengths)[0]
            for k, v in dpo_metrics(self.config, policy, reference).items():
                sums[k] += v
        n, values = float(len(items)), list(sums.values())
        if run.world_size > 1:
            n, *values = self.s.sum_over_ranks([n, *values], "the held-out sums")
        means = {k: v / n if n else float("nan") for k, v in zip(sums, values)}
        return {**means, "pairs": int(n), "answer_loss": None, "exact_match": None, "answers_scored": 0}
