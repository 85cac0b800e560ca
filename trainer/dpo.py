"""Direct preference optimization on a Trainer: each preference pair is one micro-batch whose loss is
a function of the summed completion log-probs of its chosen and rejected answers (DPO's, as TRL's
DPOTrainer defines it), trained through ``Trainer.train_token_objective``.

With z = (pi_c - pi_r) - (ref_c - ref_r), pi and ref the policy's and the reference's summed
completion log-probs:

    sigmoid   -(1 - eps) log sigmoid(beta z) - eps log sigmoid(-beta z)     (eps: label smoothing,
              the conservative DPO of Mitchell 2023; eps = 0 is TRL's "sigmoid")
    ipo       (z' - 1 / (2 beta))^2 with z' = (pi_c - ref_c) / n_c - (pi_r - ref_r) / n_r, each
              answer's log-ratio averaged over its n completion tokens (TRL's "ipo")

The reference is the model as it was before training (for LoRA: the base with new, zero-B
adapters), its log-probs computed once before the first step (``reference_logps``) and kept with
the run, so no second copy of the model is held. Metrics per pair, under TRL's names:
rewards/chosen = beta (pi_c - ref_c), rewards/rejected, rewards/accuracies (chosen > rejected),
rewards/margins, logps/chosen = pi_c, logps/rejected.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from .errors import TrainError
from .preferences import PreferencePair

LOSS_TYPES = ("sigmoid", "ipo")
METRICS = ("rewards/chosen", "rewards/rejected", "rewards/accuracies", "rewards/margins", "logps/chosen",
           "logps/rejected")


@dataclass(frozen=True)
class DpoConfig:
    beta: float = 0.1               # TRL's default
    loss_type: str = "sigmoid"
    label_smoothing: float = 0.0

    def __post_init__(self):
        if isinstance(self.beta, bool) or not isinstance(self.beta, (int, float)) or not (
                math.isfinite(self.beta) and self.beta > 0):
            raise ValueError(f"beta must be a finite number > 0, got {self.beta!r}")
        if self.loss_type not in LOSS_TYPES:
            raise ValueError(f"loss_type must be one of {', '.join(LOSS_TYPES)}, got {self.loss_type!r}")
        eps = self.label_smoothing
        if isinstance(eps, bool) or not isinstance(eps, (int, float)) or not 0.0 <= eps < 0.5:
            raise ValueError(f"label_smoothing must be in [0, 0.5), got {eps!r}")
        if eps and self.loss_type != "sigmoid":
            raise ValueError(f"label_smoothing={eps!r} applies to the sigmoid loss only, not {self.loss_type!r}")


def _log_sigmoid(x: float) -> float:
    return -math.log1p(math.exp(-x)) if x >= 0 else x - math.log1p(math.exp(x))


def _sigmoid(x: float) -> float:
    return 1.0 / (1.0 + math.exp(-x)) if x >= 0 else math.exp(x) / (1.0 + math.exp(x))


def dpo_loss(config: DpoConfig, policy: tuple[float, float], reference: tuple[float, float],
             lengths: tuple[int, int]) -> tuple[float, tuple[float, float]]:
    """One pair's loss and its gradient in (pi_c, pi_r); ``lengths``: the answers' completion tokens."""
    (pc, pr), (rc, rr), beta = policy, reference, config.beta
    if config.loss_type == "ipo":
        nc, nr = lengths
        gap = (pc - rc) / nc - (pr - rr) / nr - 1.0 / (2.0 * beta)
        return gap * gap, (2.0 * gap / nc, -2.0 * gap / nr)
    eps, z = config.label_smoothing, beta * ((pc - pr) - (rc - rr))
    loss = -(1.0 - eps) * _log_sigmoid(z) - eps * _log_sigmoid(-z)
    d_z = beta * (-(1.0 - eps) * _sigmoid(-z) + eps * _sigmoid(z))
    return loss, (d_z, -d_z)


def dpo_metrics(config: DpoConfig, policy: tuple[float, float], reference: tuple[float, float]) -> dict[str, float]:
    (pc, pr), (rc, rr) = policy, reference
    chosen, rejected = config.beta * (pc - rc), config.beta * (pr - rr)
    return {"rewards/chosen": chosen, "rewards/rejected": rejected, "rewards/accuracies": float(chosen > rejected),
            "rewards/margins": chosen - rejected, "logps/chosen": pc, "logps/rejected": pr}


class DpoTrainer:
    """DPO over a Trainer (its model, optimizer, schedule, accumulation, clipping, loss scaling and
    sync): one pair per micro-batch, so ``grad_accum_steps`` pairs make an optimizer step and the
    update follows the mean loss over them, as TRL's batch mean does."""

    def __init__(self, trainer, config: DpoConfig = DpoConfig()):
        if not isinstance(config, DpoConfig):
            raise TypeError(f"config must be a DpoConfig, got {type(config).__name__}")
        self.trainer, self.config = trainer, config

    def reference_logps(self, pairs: list[PreferencePair], progress=None, chunk: int = 64) -> np.ndarray:
        """float64 [N, 2]: each pair's summed completion log-probs of chosen and rejected by the model
        as it is now (the reference), ``chunk`` pairs at a time (packed into passes as training packs
        sequences); ``progress(done, total)`` is called as pairs are scored."""
        out = np.zeros((len(pairs), 2))
        for start in range(0, len(pairs), chunk):
            part = pairs[start:start + chunk]
            sums = self.trainer.sequence_logps([seq for pair in part for seq in pair.sequences()])
            out[start:start + len(part)] = sums.reshape(len(part), 2)
            if progress is not None:
                progress(start + len(part), len(pairs))
        return out

    def train_pair(self, pair: PreferencePair, reference, params):
        """One pair's micro-batch: (StepStats, metrics); ``reference``: its (ref_c, ref_r)."""
        ref = np.asarray(reference, np.float64)
        if ref.shape != (2,) or not np.isfinite(ref).all():
            raise TrainError(f"{pair.origin or 'pair'}: reference log-probs must be 2 finite numbers, got {reference!r}")
        ref_pair, seen = (float(ref[0]), float(ref[1])), {}

        def objective(logps):
            policy = (float(logps[0].sum()), float(logps[1].sum()))
            loss, (d_c, d_r) = dpo_loss(self.config, policy, ref_pair, pair.lengths)
            seen.update(dpo_metrics(self.config, policy, ref_pair))
            return loss, [np.full(logps[0].shape, d_c), np.full(logps[1].shape, d_r)]
        stats = self.trainer.train_token_objective(pair.sequences(), params, objective)
        return stats, seen
