"""Optimizers: AdamW and SGD as torch.optim defines them, run as in-place GPU kernels.

State is kept per parameter tensor, as torch keeps it, and saved by parameter name: each
parameter's own step count (torch's ``state[p]["step"]``: AdamW's bias corrections count from it,
not from the trainer's step, which only the LR schedule follows) and its buffers (moments,
momentum), made on its first update. The step's scalars (lr, bias corrections, gradient scale)
reach the kernels as runtime values, so a changing learning rate never compiles anything.
Parameters whose counts differ need different scalars: a step runs the kernels once per group of
parameters with the same scalars (usually one group, all of them).
"""
from __future__ import annotations

import numpy as np

from lfm2jit.ops import optim as optim_kernels
from lfm2jit.runtime import arena

from . import checks


class Optimizer:
    """Base: ``lr`` is the rate used when no LRScheduler is set.

    ``state[id(p)]`` is ``{"step": updates applied to p, <buffer name>: Tensor, ...}``, present
    once p has been updated (or loaded from a checkpoint). The Trainer drops a parameter's state
    when a window starts without it (see ``keep_only``), so a parameter trained again later starts
    afresh, as it would with a new torch optimizer."""
    kind = "Optimizer"
    state_names: tuple[str, ...] = ()     # the buffers a step keeps per parameter

    def __init__(self, lr: float):
        self.lr = lr
        self.state: dict[int, dict] = {}     # id(param) -> {"step": int, buffer name: Tensor}

    # Hyperparameters are checked whenever they are set (at construction or later): a bad value is
    # a TypeError or ValueError naming it (e.g. "SGD: momentum must be a finite number >= 0, got nan")
    # and the old value stays.
    lr = checks.Checked(checks.real, "{kind}: {name}", minimum=0.0)

    def step(self, engine, params, lr: float, gscale: float) -> None:
        """One torch step on ``params`` (gradients read as ``.grad * gscale``): each parameter's
        count advances by one. The Trainer records ``group_step`` pieces the same way."""
        for group, _ in self.groups(params, lr, gscale):
            self.group_step(engine, group, lr, gscale)
        self.advance(params)

    def next_step(self, p) -> int:
        """The count p's next update runs as (1 for a parameter without state)."""
        st = self.state.get(id(p))
        return st["step"] + 1 if st is not None else 1

    def groups(self, params, lr: float, gscale: float) -> list[tuple[list, dict[str, float]]]:
        """``params`` split into groups whose next update takes the same kernel scalars, each with
        those scalars (the ones a recorded ``group_step`` replays with); in the order of params."""
        at_step: dict[int, dict[str, float]] = {}
        by_scalars: dict[tuple, tuple[list, dict[str, float]]] = {}
        for p in params:
            n = self.next_step(p)
            if n not in at_step:
                at_step[n] = self.kernel_scalars(lr, n, gscale)
            by_scalars.setdefault(tuple(at_step[n].items()), ([], at_step[n]))[0].append(p)
        return list(by_scalars.values())

    def kernel_scalars(self, lr: float, step: int, gscale: float) -> dict[str, float]:
        """The runtime scalars of a parameter's update number ``step``."""
        raise NotImplementedError

    def group_step(self, engine, group, lr: float, gscale: float, gate=None) -> None:
        """Record one update of ``group``, one group of ``groups`` (its first parameter's count
        stands for all), making the buffers of parameters that have none; ``gate``, a step_gate
        tensor, scales the gradients on the device and skips the update where it says so. Counts
        stay as they are: ``advance`` moves them, outside what a recorded piece replays."""
        raise NotImplementedError

    def advance(self, params) -> None:
        """Count one update of every parameter in ``params``."""
        for p in params:
            self.state.setdefault(id(p), {"step": 0})["step"] += 1

    def drop_unstepped(self, params) -> bool:
        """Drop the state of parameters in ``params`` never updated yet (made for a step the GPU
        then skipped), as if it had not been made; whether any was dropped."""
        fresh = [id(p) for p in params if self.state.get(id(p), {}).get("step") == 0]
        for pid in fresh:
            del self.state[pid]
        return bool(fresh)

    def keep_only(self, params) -> bool:
        """Drop the state of every parameter not in ``params``; whether any was dropped."""
        keep = {id(p) for p in params}
        dropped = [pid for pid in self.state if pid not in keep]
        for pid in dropped:
            del self.state[pid]
        return bool(dropped)

    def hyperparameters(self) -> dict:
        return {"lr": self.lr}

    def state_key(self, params) -> tuple | None:
        """Which state buffers a step on ``params`` updates; None while a step would still create some."""
        if not self.state_names:
            return ()
        states = [self.state.get(id(p)) for p in params]
        if any(st is None for st in states):
            return None
        return tuple((id(st[n].buffer), st[n].offset) for st in states for n in self.state_names)

    def _states(self, engine, group) -> list[dict]:
        """The state of each parameter of ``group``, made (zeroed) for those without: each buffer
        name's new tensors carved side by side in the group's order (runtime/arena.py), as the
        parameters and gradients are, so a step covers a run of them in one dispatch."""
        fresh = list({id(p): p for p in group if id(p) not in self.state}.values())
        made = {id(p): {"step": 0} for p in fresh}
        for n in self.state_names:
            for p, t in zip(fresh, arena.carve_like(engine, fresh)):
                made[id(p)][n] = t
        self.state.update(made)                 # only once every buffer exists
        return [self.state[id(p)] for p in group]

    def state_arrays(self, names: dict[int, str]) -> dict[str, np.ndarray]:
        """All state as "<param name>::step" -> int64 scalar and "<param name>::<buffer>" -> array
        (for checkpoints)."""
        return {f"{names[pid]}::{k}": np.array(v, np.int64) if k == "step" else v.numpy()
                for pid, st in self.state.items() for k, v in st.items()}

    def check_state_arrays(self, params_by_name: dict, arrays: dict[str, np.ndarray]) -> dict[str, dict]:
        """``state_arrays``' output grouped by parameter, every entry checked (a ValueError naming
        it): known parameters, this optimizer's buffers, a step count >= 1, float buffers of the
        parameter's shape."""
        entries = ("step", *self.state_names)
        by_name: dict[str, dict] = {}
        for key, arr in arrays.items():
            name, _, buf = key.rpartition("::")
            if name not in params_by_name:
                raise ValueError(f"optimizer state {key!r} names no parameter of this model")
            if buf not in entries:
                raise ValueError(f"optimizer state {key!r}: {self.kind} keeps {', '.join(entries)} per parameter")
            by_name.setdefault(name, {})[buf] = arr
        for name, st in by_name.items():
            missing = [e for e in entries if e not in st]
            if missing:
                raise ValueError(f"optimizer state of {name} lacks {', '.join(missing)}")
            step = st["step"]
            if step.shape != () or not np.issubdtype(step.dtype, np.integer) or step < 1:
                raise ValueError(f"optimizer state {name}::step must be one integer >= 1, got {step!r}")
            shape = tuple(params_by_name[name].shape)
            for buf in self.state_names:
                if not np.issubdtype(st[buf].dtype, np.floating):
                    raise ValueError(f"optimizer state {name}::{buf} is {st[buf].dtype}; expected floats")
                if tuple(st[buf].shape) != shape:
                    raise ValueError(f"optimizer state {name}::{buf} has shape {list(st[buf].shape)} "
                                     f"but the parameter has {list(shape)}")
        return by_name

    def load_state_arrays(self, engine, params_by_name: dict, arrays: dict[str, np.ndarray]) -> None:
        """Replace all state by ``state_arrays``' output; every entry is checked before anything changes."""
        by_name = self.check_state_arrays(params_by_name, arrays)
        names = [n for n in params_by_name if n in by_name]      # carved in the parameters' order
        made = {n: {"step": int(by_name[n]["step"])} for n in names}
        for b in self.state_names:
            for n, t in zip(names, arena.carve(engine, [tuple(params_by_name[n].shape) for n in names])):
                t.write(by_name[n][b].astype(np.float32))
                made[n][b] = t
        self.state.clear()
        self.state.update({id(params_by_name[n]): st for n, st in made.items()})


class AdamW(Optimizer):
    """torch.optim.AdamW: decoupled decay p -= lr*wd*p, bias-corrected moments, eps outside the sqrt."""
    kind = "AdamW"
    state_names = ("m", "v")

    def __init__(self, lr: float = 1e-3, betas=(0.9, 0.999), eps: float = 1e-8, weight_decay: float = 0.01):
        checks.real("AdamW: lr", lr, minimum=0.0)          # every argument is checked before any is set
        betas = self._check_betas(betas)
        eps = checks.real("AdamW: eps", eps, minimum=0.0)
        weight_decay = checks.real("AdamW: weight_decay", weight_decay, minimum=0.0)
        super().__init__(lr)
        self.betas, self.eps, self.weight_decay = betas, eps, weight_decay

    @staticmethod
    def _check_betas(betas) -> tuple[float, float]:
        if isinstance(betas, (str, bytes)) or not hasattr(betas, "__len__"):
            raise TypeError(f"AdamW: betas must be two finite numbers in [0, 1), got {type(betas).__name__} {betas!r}")
        if len(betas) != 2:
            raise ValueError(f"AdamW: betas must be two finite numbers in [0, 1), got {len(betas)}: {betas!r}")
        return tuple(checks.real(f"AdamW: betas[{i}]", b, minimum=0.0, below=1.0) for i, b in enumerate(betas))

    @property
    def betas(self) -> tuple[float, float]:
        return self._betas

    @betas.setter
    def betas(self, betas) -> None:
        self._betas = self._check_betas(betas)

    eps = checks.Checked(checks.real, "{kind}: {name}", minimum=0.0)
    weight_decay = checks.Checked(checks.real, "{kind}: {name}", minimum=0.0)

    def kernel_scalars(self, lr: float, step: int, gscale: float) -> dict[str, float]:
        return optim_kernels.adamw_scalars(lr=lr, betas=self.betas, eps=self.eps, weight_decay=self.weight_decay,
                                           step=step, gscale=gscale)

    def group_step(self, engine, group, lr: float, gscale: float, gate=None) -> None:
        step = self.next_step(group[0])
        states = self._states(engine, group)
        optim_kernels.adamw_step(engine, group, [p.grad for p in group], [s["m"] for s in states],
                                 [s["v"] for s in states], lr=lr, betas=self.betas, eps=self.eps,
                                 weight_decay=self.weight_decay, step=step, gscale=gscale, gate=gate)

    def hyperparameters(self) -> dict:
        return {"lr": self.lr, "betas": list(self.betas), "eps": self.eps, "weight_decay": self.weight_decay}


class SGD(Optimizer):
    """torch.optim.SGD with momentum, dampening, weight decay (added to the gradient) and Nesterov.
    A parameter's momentum buffer is set to its gradient on its own first update, as torch does
    (torch keeps no step count for SGD; the count here is what tells that first update)."""
    kind = "SGD"

    def __init__(self, lr: float = 1e-3, momentum: float = 0.0, dampening: float = 0.0, weight_decay: float = 0.0,
                 nesterov: bool = False):
        checks.real("SGD: lr", lr, minimum=0.0)            # every argument is checked before any is set
        momentum = checks.real("SGD: momentum", momentum, minimum=0.0)
        dampening = checks.real("SGD: dampening", dampening)
        weight_decay = checks.real("SGD: weight_decay", weight_decay, minimum=0.0)
        nesterov = checks.boolean("SGD: nesterov", nesterov)
        self._check_nesterov(momentum, dampening, nesterov)
        super().__init__(lr)
        self._momentum, self._dampening, self._nesterov = momentum, dampening, nesterov
        self.weight_decay = weight_decay

    @property
    def state_names(self) -> tuple[str, ...]:
        return ("momentum",) if self._momentum else ()

    @staticmethod
    def _check_nesterov(momentum: float, dampening: float, nesterov: bool) -> None:
        if nesterov and (momentum <= 0 or dampening != 0):
            raise ValueError(f"SGD: Nesterov momentum requires a momentum > 0 and zero dampening, "
                             f"got momentum={momentum!r}, dampening={dampening!r}")

    @property
    def momentum(self) -> float:
        return self._momentum

    @momentum.setter
    def momentum(self, momentum: float) -> None:
        momentum = checks.real("SGD: momentum", momentum, minimum=0.0)
        self._check_nesterov(momentum, self._dampening, self._nesterov)
        if self.state and bool(momentum) != bool(self._momentum):
            raise ValueError(f"SGD: momentum cannot change from {self._momentum!r} to {momentum!r} once "
                             "parameters have state (momentum buffers exist only with a momentum > 0)")
        self._momentum = momentum

    @property
    def dampening(self) -> float:
        return self._dampening

    @dampening.setter
    def dampening(self, dampening: float) -> None:
        dampening = checks.real("SGD: dampening", dampening)
        self._check_nesterov(self._momentum, dampening, self._nesterov)
        self._dampening = dampening

    @property
    def nesterov(self) -> bool:
        return self._nesterov

    @nesterov.setter
    def nesterov(self, nesterov: bool) -> None:
        nesterov = checks.boolean("SGD: nesterov", nesterov)
        self._check_nesterov(self._momentum, self._dampening, nesterov)
        self._nesterov = nesterov

    weight_decay = checks.Checked(checks.real, "{kind}: {name}", minimum=0.0)

    def kernel_scalars(self, lr: float, step: int, gscale: float) -> dict[str, float]:
        return optim_kernels.sgd_scalars(lr=lr, momentum=self.momentum, dampening=self.dampening,
                                         weight_decay=self.weight_decay, nesterov=self.nesterov,
                                         step=step, gscale=gscale)

    def group_step(self, engine, group, lr: float, gscale: float, gate=None) -> None:
        step = self.next_step(group[0])
        bufs = [st["momentum"] for st in self._states(engine, group)] if self.momentum else None
        optim_kernels.sgd_step(engine, group, [p.grad for p in group], bufs, lr=lr, momentum=self.momentum,
                               dampening=self.dampening, weight_decay=self.weight_decay, nesterov=self.nesterov,
                               step=step, gscale=gscale, gate=gate)

    def hyperparameters(self) -> dict:
        return {"lr": self.lr, "momentum": self.momentum, "dampening": self.dampening,
                "weight_decay": self.weight_decay, "nesterov": self.nesterov}


def recordable(optimizer: Optimizer) -> bool:
    """Whether recorded ``group_step`` pieces may stand in for ``optimizer.step``: only for the
    classes here, whose steps record kernels and nothing else (a subclass overriding ``step`` or
    ``group_step`` runs it every time)."""
    cls = type(optimizer)
    return cls.step is Optimizer.step and cls.group_step in (AdamW.group_step, SGD.group_step)
