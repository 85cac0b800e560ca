"""GradScaler: dynamic loss scaling as torch.amp.GradScaler does it, for the f16 path."""
from __future__ import annotations

from dataclasses import asdict, dataclass

from . import checks

# each attribute's check, applied whenever it is set (construction, update, load_state_dict, by hand)
_CHECKS = {
    "init_scale": lambda what, v: checks.real(what, v, above=0.0),
    "growth_factor": lambda what, v: checks.real(what, v, above=1.0),
    "backoff_factor": lambda what, v: checks.real(what, v, above=0.0, below=1.0),
    "growth_interval": lambda what, v: checks.integer(what, v, minimum=1),
    "enabled": checks.boolean,
    # backing off can take the scale to 0.0 (then every step is skipped, as in torch)
    "scale": lambda what, v: checks.real(what, v, minimum=0.0),
    "growth_tracker": lambda what, v: checks.integer(what, v, minimum=0),
}


@dataclass
class GradScaler:
    """The loss is multiplied by ``scale`` before the backward pass; an overflowing step (inf/NaN
    in the gradients) is skipped and the scale multiplied by ``backoff_factor``; after
    ``growth_interval`` clean steps in a row it is multiplied by ``growth_factor``.

    Every attribute is checked when it is set: a bad value is a TypeError or ValueError naming
    it, and the old value stays."""
    init_scale: float = 2.0 ** 16
    growth_factor: float = 2.0
    backoff_factor: float = 0.5
    growth_interval: int = 2000
    enabled: bool = True

    def __setattr__(self, name, value):
        check = _CHECKS.get(name)
        super().__setattr__(name, check(f"GradScaler: {name}", value) if check is not None else value)

    def __post_init__(self):
        self.scale = self.init_scale
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
        """Take ``scale`` and ``growth_tracker`` from ``state_dict()``'s output; both are checked
        before either changes (ValueError/TypeError naming the key)."""
        if not isinstance(state, dict):
            raise TypeError(f"GradScaler state must be a dict, got {type(state).__name__}")
        missing = [k for k in ("scale", "growth_tracker") if k not in state]
        if missing:
            raise ValueError(f"GradScaler state lacks {', '.join(map(repr, missing))}")
        scale = _CHECKS["scale"]("GradScaler state: scale", state["scale"])
        tracker = _CHECKS["growth_tracker"]("GradScaler state: growth_tracker", state["growth_tracker"])
        self.scale, self.growth_tracker = scale, tracker
