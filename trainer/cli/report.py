"""Experiment logging for ``python -m trainer --report-to tensorboard|wandb|mlflow``.

One small class per backend behind one interface:

    start(settings)        the run's settings (run.json's contents), once, before the first step
    log(step, scalars)     one optimizer step: the keys of metrics.jsonl (``train/<key>``)
    log_eval(step, scalars) a held-out evaluation (``eval/<key>``)
    finish(status)         "finished", "interrupted" or "failed"

Only numbers are logged (bools as 0/1; None, strings and non-finite values are left out). The
libraries are optional: ``missing(name)`` says which pip command installs one, and the CLI refuses a
``--report-to`` whose library is absent before anything is loaded.
"""
from __future__ import annotations

import importlib.util
import json
import math
from pathlib import Path

BACKENDS = ("tensorboard", "wandb", "mlflow")
# The packages each backend imports. MLflow's own store, OUT/mlflow.db, is a SQLite database through
# SQLAlchemy and Alembic (full mlflow brings them; mlflow-skinny does not); with MLFLOW_TRACKING_URI
# set, mlflow alone.
MODULES = {"tensorboard": ("tensorboardX",), "wandb": ("wandb",), "mlflow": ("mlflow", "sqlalchemy", "alembic")}
PIP = {"tensorboard": "pip install tensorboardX  (or: pip install -e .[report])", "wandb": "pip install wandb",
       "mlflow": "pip install mlflow"}


def _importable(module: str) -> bool:
    try:
        return importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):
        return False


def missing(name: str) -> str | None:
    """None when the backend's libraries can be imported, else a one-line reason naming the pip command."""
    import os
    needed = MODULES[name][:1] if name == "mlflow" and os.environ.get("MLFLOW_TRACKING_URI") else MODULES[name]
    absent = [m for m in needed if not _importable(m)]
    if not absent:
        return None
    return f"the {' and '.join(absent)} package{'s are' if len(absent) > 1 else ' is'} not installed ({PIP[name]})"


def numbers(scalars: dict) -> dict[str, float]:
    """The loggable scalars: numbers and bools (as 0/1), finite, not the step itself."""
    out = {}
    for k, v in scalars.items():
        if k == "step" or v is None or isinstance(v, str):
            continue
        if isinstance(v, bool):
            v = int(v)
        if isinstance(v, (int, float)) and math.isfinite(v):
            out[k] = v
    return out


class Reporter:
    """The interface; each method is a no-op here."""
    name = "none"

    def start(self, settings: dict) -> None: ...

    def log(self, step: int, scalars: dict) -> None: ...

    def log_eval(self, step: int, scalars: dict) -> None: ...

    def finish(self, status: str = "finished") -> None: ...


class TensorBoardReporter(Reporter):
    """Event files in OUT/tensorboard (tensorboardX's SummaryWriter), which a stock TensorBoard reads.
    A resumed run starts a new event file with purge_step = the first step of the segment, so TensorBoard
    drops the steps an earlier, later-crashed segment logged past the checkpoint."""
    name = "tensorboard"

    def __init__(self, out: Path, first_step: int = 1):
        from tensorboardX import SummaryWriter
        self.dir = Path(out) / "tensorboard"
        self.writer = SummaryWriter(logdir=str(self.dir), purge_step=first_step if first_step > 1 else None,
                                    flush_secs=10)

    def start(self, settings: dict) -> None:
        self.writer.add_text("settings", "```\n" + json.dumps(settings, indent=2, default=str) + "\n```", 0)

    def log(self, step: int, scalars: dict) -> None:
        for k, v in numbers(scalars).items():
            self.writer.add_scalar(f"train/{k}", v, step)

    def log_eval(self, step: int, scalars: dict) -> None:
        for k, v in numbers(scalars).items():
            self.writer.add_scalar(f"eval/{k}", v, step)

    def finish(self, status: str = "finished") -> None:
        self.writer.add_text("status", status, 0)
        self.writer.close()


class WandbReporter(Reporter):
    """A wandb run (its files under OUT/wandb; WANDB_MODE=offline works without an account)."""
    name = "wandb"

    def __init__(self, out: Path, first_step: int = 1):
        import wandb
        self.wandb = wandb
        self.out = Path(out)
        self.run = None

    def start(self, settings: dict) -> None:
        self.out.mkdir(parents=True, exist_ok=True)
        self.run = self.wandb.init(project="lfm2jit", name=self.out.name, dir=str(self.out), config=settings,
                                   reinit=True)

    def log(self, step: int, scalars: dict) -> None:
        self.run.log({f"train/{k}": v for k, v in numbers(scalars).items()}, step=step)

    def log_eval(self, step: int, scalars: dict) -> None:
        self.run.log({f"eval/{k}": v for k, v in numbers(scalars).items()}, step=step)

    def finish(self, status: str = "finished") -> None:
        if self.run is not None:
            self.run.finish(exit_code=0 if status == "finished" else 1)


class MlflowReporter(Reporter):
    """An MLflow run: to MLFLOW_TRACKING_URI when set, else to the SQLite store OUT/mlflow.db (MLflow's
    default kind of store; its file store is deprecated and refused by MLflow 3)."""
    name = "mlflow"

    def __init__(self, out: Path, first_step: int = 1):
        import os
        import mlflow
        self.mlflow = mlflow
        self.out = Path(out)
        if not os.environ.get("MLFLOW_TRACKING_URI"):
            mlflow.set_tracking_uri(f"sqlite:///{(self.out / 'mlflow.db').resolve()}")

    def start(self, settings: dict) -> None:
        self.mlflow.start_run(run_name=self.out.name)
        self.mlflow.log_params({k: json.dumps(v, default=str)[:500] if not isinstance(v, str) else v[:500]
                                for k, v in settings.items()})

    def log(self, step: int, scalars: dict) -> None:
        self.mlflow.log_metrics({f"train/{k}": v for k, v in numbers(scalars).items()}, step=step)

    def log_eval(self, step: int, scalars: dict) -> None:
        self.mlflow.log_metrics({f"eval/{k}": v for k, v in numbers(scalars).items()}, step=step)

    def finish(self, status: str = "finished") -> None:
        self.mlflow.end_run(status={"finished": "FINISHED", "interrupted": "KILLED"}.get(status, "FAILED"))


CLASSES = {"tensorboard": TensorBoardReporter, "wandb": WandbReporter, "mlflow": MlflowReporter}


class Reporters(Reporter):
    """All the run's reporters as one; a backend that raises is reported once and dropped, so a logging
    failure never stops the training."""

    def __init__(self, names, out: Path, first_step: int = 1, warn=print):
        self.warn = warn
        self.items: list[Reporter] = []
        for name in dict.fromkeys(names or ()):
            self._call(lambda: self.items.append(CLASSES[name](out, first_step)), name)

    def _call(self, fn, name: str) -> None:
        try:
            fn()
        except Exception as e:          # noqa: BLE001 -- logging must not end the run
            self.warn(f"note: --report-to {name}: {type(e).__name__}: {e}; no more logging to {name}")
            self.items = [r for r in self.items if r.name != name]

    def _each(self, method: str, *args) -> None:
        for r in list(self.items):
            self._call(lambda r=r: getattr(r, method)(*args), r.name)

    def start(self, settings: dict) -> None:
        self._each("start", settings)

    def log(self, step: int, scalars: dict) -> None:
        self._each("log", step, scalars)

    def log_eval(self, step: int, scalars: dict) -> None:
        self._each("log_eval", step, scalars)

    def finish(self, status: str = "finished") -> None:
        self._each("finish", status)
        self.items = []
