"""Optimizers: AdamW and SGD as torch.optim defines them, run as in-place GPU kernels.

State (moments, momentum buffers) is kept per parameter tensor and saved by parameter name.
The step's scalars (lr, step count, gradient scale) reach the kernels as runtime values, so a
changing learning rate never compiles anything.
"""
from __future__ import annotations

import math

import numpy as np

from lfm2jit.ops import optim as optim_kernels


class Optimizer:
    """Base: ``lr`` is the rate used when no LRScheduler is set."""
    kind = "Optimizer"
    state_names: tuple[str, ...] = ()     # the buffers a step keeps per parameter

    def __init__(self, lr: float):
        if not (isinstance(lr, (int, float)) and math.isfinite(lr) and lr >= 0):
            raise ValueError(f"lr must be a finite number >= 0, got {lr!r}")
        self.lr = float(lr)
        self.state: dict[int, dict] = {}     # id(param) -> buffers

    def step(self, engine, params, lr: float, step: int, gscale: float) -> None:
        raise NotImplementedError

    def kernel_scalars(self, params, lr: float, step: int, gscale: float) -> dict[str, float]:
        """The runtime scalars ``step`` gives its kernels: a recorded optimizer step replays with these."""
        raise NotImplementedError

    def hyperparameters(self) -> dict:
        return {"lr": self.lr}

    def state_key(self, params) -> tuple | None:
        """Which state buffers a step on ``params`` updates; None while a step would still create some."""
        states = [self.state.get(id(p)) for p in params] if self.state_names else []
        if any(st is None for st in states):
            return None
        return tuple((id(t.buffer), t.offset) for st in states for t in st.values())

    def _buffers(self, engine, p, names: tuple[str, ...]) -> dict:
        st = self.state.get(id(p))
        if st is None:
            st = self.state[id(p)] = {n: engine.zero_(engine.empty(p.shape, p.dtype)) for n in names}
        return st

    def state_arrays(self, names: dict[int, str]) -> dict[str, np.ndarray]:
        """Every state buffer as "<param name>::<buffer>" -> array (for checkpoints)."""
        return {f"{names[pid]}::{k}": t.numpy() for pid, st in self.state.items() for k, t in st.items()}

    def load_state_arrays(self, engine, params_by_name: dict, arrays: dict[str, np.ndarray]) -> None:
        self.state.clear()
        for key, arr in arrays.items():
            name, buf = key.split("::")
            p = params_by_name[name]
            self.state.setdefault(id(p), {})[buf] = engine.tensor(arr.astype(np.float32))


class AdamW(Optimizer):
    """torch.optim.AdamW: decoupled decay p -= lr*wd*p, bias-corrected moments, eps outside the sqrt."""
    kind = "AdamW"
    state_names = ("m", "v")

    def __init__(self, lr: float = 1e-3, betas=(0.9, 0.999), eps: float = 1e-8, weight_decay: float = 0.01):
        super().__init__(lr)
        if len(betas) != 2 or not all(0.0 <= b < 1.0 for b in betas):
            raise ValueError(f"betas must be two numbers in [0, 1), got {betas!r}")
        if not eps >= 0 or not weight_decay >= 0:
            raise ValueError(f"eps and weight_decay must be >= 0, got {eps!r}, {weight_decay!r}")
        self.betas, self.eps, self.weight_decay = (float(betas[0]), float(betas[1])), float(eps), float(weight_decay)

    def kernel_scalars(self, params, lr: float, step: int, gscale: float) -> dict[str, float]:
        return optim_kernels.adamw_scalars(lr=lr, betas=self.betas, eps=self.eps, weight_decay=self.weight_decay,
                                           step=step, gscale=gscale)

    def step(self, engine, params, lr: float, step: int, gscale: float) -> None:
        states = [self._buffers(engine, p, self.state_names) for p in params]
        optim_kernels.adamw_step(engine, params, [p.grad for p in params], [s["m"] for s in states],
                                 [s["v"] for s in states], lr=lr, betas=self.betas, eps=self.eps,
                                 weight_decay=self.weight_decay, step=step, gscale=gscale)

    def hyperparameters(self) -> dict:
        return {"lr": self.lr, "betas": list(self.betas), "eps": self.eps, "weight_decay": self.weight_decay}


class SGD(Optimizer):
    """torch.optim.SGD with momentum, dampening, weight decay (added to the gradient) and Nesterov."""
    kind = "SGD"

    def __init__(self, lr: float = 1e-3, momentum: float = 0.0, dampening: float = 0.0, weight_decay: float = 0.0,
                 nesterov: bool = False):
        super().__init__(lr)
        if momentum < 0 or weight_decay < 0:
            raise ValueError(f"momentum and weight_decay must be >= 0, got {momentum!r}, {weight_decay!r}")
        if nesterov and (momentum <= 0 or dampening != 0):
            raise ValueError("Nesterov momentum requires a momentum > 0 and zero dampening")
        self.momentum, self.dampening = float(momentum), float(dampening)
        self.state_names = ("momentum",) if momentum else ()
        self.weight_decay, self.nesterov = float(weight_decay), bool(nesterov)

    def _kernel_step(self, params, step: int) -> int:
        """torch sets a momentum buffer to the gradient on the step that creates it: that is step 1."""
        return 1 if any(id(p) not in self.state for p in params) else max(step, 2)

    def kernel_scalars(self, params, lr: float, step: int, gscale: float) -> dict[str, float]:
        return optim_kernels.sgd_scalars(lr=lr, momentum=self.momentum, dampening=self.dampening,
                                         weight_decay=self.weight_decay, nesterov=self.nesterov,
                                         step=self._kernel_step(params, step), gscale=gscale)

    def step(self, engine, params, lr: float, step: int, gscale: float) -> None:
        kernel_step = self._kernel_step(params, step)
        bufs = [self._buffers(engine, p, self.state_names)["momentum"] for p in params] if self.momentum else None
        optim_kernels.sgd_step(engine, params, [p.grad for p in params], bufs, lr=lr, momentum=self.momentum,
                               dampening=self.dampening, weight_decay=self.weight_decay, nesterov=self.nesterov,
                               step=kernel_step, gscale=gscale)

    def hyperparameters(self) -> dict:
        return {"lr": self.lr, "momentum": self.momentum, "dampening": self.dampening,
                "weight_decay": self.weight_decay, "nesterov": self.nesterov}


def recordable(optimizer: Optimizer) -> bool:
    """Whether a recorded step may stand in for ``optimizer.step``: only the step of the classes here,
    which records kernels and nothing else (a subclass overriding ``step`` runs it every time)."""
    return type(optimizer).step in (AdamW.step, SGD.step)
