"""Learning-rate schedules, indexed by optimizer step k = 1, 2, 3, ...

The trainer advances the schedule once per optimizer step, before reading it, so optimizer step k
uses ``lr_at(k)``. The formulas (``w`` = warmup_steps, ``N`` = total_steps):

=====================  ==========================================================================
``ConstantLR``         ``lr``
``LinearWarmup``       ``lr * min(1, k / w)``                    (``w = 0``: no warmup)
``CosineWithWarmup``   ``k <= w``: warmup as above;
                       ``w < k <= N``: ``min_lr + (lr - min_lr) * (1 + cos(pi * (k - w) / (N - w))) / 2``;
                       ``k > N``: held at ``min_lr``
``LinearDecay``        ``k <= w``: warmup as above;
                       ``w < k <= N``: ``lr + (final_lr - lr) * (k - w) / (N - w)`` (``final_lr`` at ``N``);
                       ``k > N``: held at ``final_lr``
=====================  ==========================================================================

Every schedule is a frozen dataclass: two equal schedules compare equal, and ``to_dict()`` gives a
JSON-serialisable description ``{"type": "CosineWithWarmup", "lr": ..., ...}`` that
``schedule_from_dict`` (or ``LRScheduler.from_dict``) turns back into the same schedule, which is
how checkpoints record the schedule in use. Invalid arguments raise ``ValueError`` / ``TypeError``
naming the schedule, the argument and the value.
"""
from __future__ import annotations

import dataclasses
import math
import numbers
from typing import Any, ClassVar

__all__ = ["LRScheduler", "ConstantLR", "LinearWarmup", "CosineWithWarmup", "LinearDecay", "schedule_from_dict"]

_REGISTRY: dict[str, type["LRScheduler"]] = {}


def _check_rate(owner: str, name: str, value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(f"{owner}: {name} must be a real number, got {type(value).__name__} {value!r}")
    value = float(value)
    if not math.isfinite(value):
        raise ValueError(f"{owner}: {name} must be finite, got {value}")
    if value < 0:
        raise ValueError(f"{owner}: {name} must be >= 0, got {value}")
    return value


def _check_steps(owner: str, name: str, value: Any, minimum: int) -> int:
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise TypeError(f"{owner}: {name} must be an integer, got {type(value).__name__} {value!r}")
    value = int(value)
    if value < minimum:
        raise ValueError(f"{owner}: {name} must be >= {minimum}, got {value}")
    return value


class LRScheduler:
    """Base class: ``lr_at(k)`` is the learning rate of optimizer step ``k`` (k = 1, 2, ...).

    Subclasses are frozen dataclasses whose fields fully describe them; they implement ``_lr(k)``
    (``k`` already validated) and validate their fields in ``__post_init__``. Defining a subclass
    registers it for ``schedule_from_dict`` under its class name.
    """

    type_name: ClassVar[str]

    def __init_subclass__(cls, **kwargs):
        super().__init_subclass__(**kwargs)
        cls.type_name = cls.__name__
        _REGISTRY[cls.__name__] = cls

    def lr_at(self, k: int) -> float:
        """The learning rate for optimizer step ``k`` (an integer >= 1)."""
        if isinstance(k, bool) or not isinstance(k, numbers.Integral):
            raise TypeError(f"{type(self).__name__}.lr_at: the step must be an integer >= 1, "
                            f"got {type(k).__name__} {k!r}")
        if k < 1:
            raise ValueError(f"{type(self).__name__}.lr_at: optimizer steps are numbered from 1, got k = {int(k)}")
        return float(self._lr(int(k)))

    __call__ = lr_at

    def _lr(self, k: int) -> float:
        raise NotImplementedError

    # ---- serialisation ----
    def to_dict(self) -> dict:
        """A JSON-serialisable description: ``{"type": <class name>, <field>: <value>, ...}``."""
        if not dataclasses.is_dataclass(self):
            raise NotImplementedError(f"{type(self).__name__} is not a dataclass; override to_dict/from_dict")
        return {"type": type(self).__name__, **{f.name: getattr(self, f.name) for f in dataclasses.fields(self)}}

    state_dict = to_dict

    @staticmethod
    def from_dict(d: dict) -> "LRScheduler":
        return schedule_from_dict(d)

    from_state_dict = from_dict


def _warmup(lr: float, warmup_steps: int, k: int) -> float:
    return lr if warmup_steps == 0 else lr * min(1.0, k / warmup_steps)


@dataclasses.dataclass(frozen=True)
class ConstantLR(LRScheduler):
    """The same rate at every step."""

    lr: float

    def __post_init__(self):
        object.__setattr__(self, "lr", _check_rate("ConstantLR", "lr", self.lr))

    def _lr(self, k: int) -> float:
        return self.lr


@dataclasses.dataclass(frozen=True)
class LinearWarmup(LRScheduler):
    """``lr * min(1, k / warmup_steps)``: linear warmup from lr/warmup_steps, then constant."""

    lr: float
    warmup_steps: int

    def __post_init__(self):
        object.__setattr__(self, "lr", _check_rate("LinearWarmup", "lr", self.lr))
        object.__setattr__(self, "warmup_steps", _check_steps("LinearWarmup", "warmup_steps", self.warmup_steps, 0))

    def _lr(self, k: int) -> float:
        return _warmup(self.lr, self.warmup_steps, k)


def _check_window(owner: str, warmup_steps, total_steps) -> tuple[int, int]:
    total = _check_steps(owner, "total_steps", total_steps, 1)
    warmup = _check_steps(owner, "warmup_steps", warmup_steps, 0)
    if warmup > total:
        raise ValueError(f"{owner}: warmup_steps ({warmup}) must not exceed total_steps ({total})")
    return warmup, total


@dataclasses.dataclass(frozen=True)
class CosineWithWarmup(LRScheduler):
    """Linear warmup to ``lr``, half a cosine down to ``min_lr`` at ``total_steps``, then ``min_lr``."""

    lr: float
    warmup_steps: int
    total_steps: int
    min_lr: float = 0.0

    def __post_init__(self):
        lr = _check_rate("CosineWithWarmup", "lr", self.lr)
        min_lr = _check_rate("CosineWithWarmup", "min_lr", self.min_lr)
        if min_lr > lr:
            raise ValueError(f"CosineWithWarmup: min_lr ({min_lr}) must not exceed lr ({lr})")
        warmup, total = _check_window("CosineWithWarmup", self.warmup_steps, self.total_steps)
        for name, value in (("lr", lr), ("min_lr", min_lr), ("warmup_steps", warmup), ("total_steps", total)):
            object.__setattr__(self, name, value)

    def _lr(self, k: int) -> float:
        w, n = self.warmup_steps, self.total_steps
        if k <= w:
            return _warmup(self.lr, w, k)
        if k > n:
            return self.min_lr
        return self.min_lr + (self.lr - self.min_lr) * (1.0 + math.cos(math.pi * (k - w) / (n - w))) / 2.0


@dataclasses.dataclass(frozen=True)
class LinearDecay(LRScheduler):
    """Linear warmup to ``lr``, then a straight line down to ``final_lr`` at ``total_steps``, then held."""

    lr: float
    warmup_steps: int
    total_steps: int
    final_lr: float = 0.0

    def __post_init__(self):
        lr = _check_rate("LinearDecay", "lr", self.lr)
        final_lr = _check_rate("LinearDecay", "final_lr", self.final_lr)
        if final_lr > lr:
            raise ValueError(f"LinearDecay: final_lr ({final_lr}) must not exceed lr ({lr})")
        warmup, total = _check_window("LinearDecay", self.warmup_steps, self.total_steps)
        for name, value in (("lr", lr), ("final_lr", final_lr), ("warmup_steps", warmup), ("total_steps", total)):
            object.__setattr__(self, name, value)

    def _lr(self, k: int) -> float:
        w, n = self.warmup_steps, self.total_steps
        if k <= w:
            return _warmup(self.lr, w, k)
        if k >= n:
            return self.final_lr
        return self.lr + (self.final_lr - self.lr) * (k - w) / (n - w)


def schedule_from_dict(d: dict) -> LRScheduler:
    """Rebuild a schedule from ``to_dict()``'s description (e.g. read back from a checkpoint's JSON)."""
    if not isinstance(d, dict):
        raise TypeError(f"a schedule description must be a dict, got {type(d).__name__}")
    if "type" not in d:
        raise ValueError(f"schedule description {d!r} has no 'type' key")
    kind = d["type"]
    cls = _REGISTRY.get(kind) if isinstance(kind, str) else None
    if cls is None:
        raise ValueError(f"unknown schedule type {kind!r}; known: {', '.join(sorted(_REGISTRY))}")
    args = {k: v for k, v in d.items() if k != "type"}
    if dataclasses.is_dataclass(cls):
        fields = {f.name: f for f in dataclasses.fields(cls)}
        unknown = sorted(set(args) - set(fields))
        if unknown:
            raise ValueError(f"{kind}: unknown key(s) {unknown} in schedule description; expected {sorted(fields)}")
        missing = [n for n, f in fields.items() if n not in args
                   and f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING]
        if missing:
            raise ValueError(f"{kind}: schedule description lacks {missing}")
    return cls(**args)
