"""GradScaler: dynamic loss scaling as torch.amp.GradScaler does it, for the f16 path."""
from __future__ import annotations

import math
from dataclasses import asdict, dataclass


@dataclass
class GradScaler:
    """The loss is multiplied by ``scale`` before the backward pass; an overflowing step (inf/NaN
    in the gradients) is skipped and the scale multiplied by ``backoff_factor``; after
    ``growth_interval`` clean steps in a row it is multiplied by ``growth_factor``."""
    init_scale: float = 2.0 ** 16
    growth_factor: float = 2.0
    backoff_factor: float = 0.5
    growth_interval: int = 2000
    enabled: bool = True

    def __post_init__(self):
        if not (self.init_scale > 0 and math.isfinite(self.init_scale)):
            raise ValueError(f"init_scale must be a positive finite number, got {self.init_scale!r}")
        if not self.growth_factor > 1.0:
            raise ValueError(f"growth_factor must be > 1, got {self.growth_factor!r}")
        if not 0.0 < self.backoff_factor < 1.0:
            raise ValueError(f"backoff_factor must be in (0, 1), got {self.backoff_factor!r}")
        if not isinstance(self.growth_interval, int) or self.growth_interval < 1:
            raise ValueError(f"growth_interval must be a positive integer, got {self.growth_interval!r}")
        self.scale = float(self.init_scale)
        self.growth_tracker = 0

    @property
    def loss_scale(self) -> float:
        return self.scale if self.enabled else 1.0

    def update(self, found_inf: bool) -> None:
        if not self.enabled:
            return
        if found_inf:
            self.scale *= self.backoff_factor
            self.growth_tracker = 0
        else:
            self.growth_tracker += 1
            if self.growth_tracker == self.growth_interval:
                self.scale *= self.growth_factor
                self.growth_tracker = 0

    def state_dict(self) -> dict:
        return {**asdict(self), "scale": self.scale, "growth_tracker": self.growth_tracker}

    def load_state_dict(self, state: dict) -> None:
        self.scale = float(state["scale"])
        self.growth_tracker = int(state["growth_tracker"])
