"""The run's plot, loss.png, drawn with matplotlib (Agg: no display needed).

Panels, sharing the step axis: the training loss per step with its trailing mean (which starts at
the first step: the mean of the steps so far, then of the last ``window``), and the held-out loss
of every evaluation as points joined by a line; the exact match of the held-out answers where
evaluations scored them; the learning rate; the gradient norm before clipping (log scale). The
loss axis turns logarithmic when the loss spans more than a factor of 20. Each panel's box in the
image is written into the PNG's text chunks (``panel:<name>`` = "x0 y0 x1 y1" in pixels from the
top left), so a reader can check what was drawn where.
"""
from __future__ import annotations

import math
import sys
from pathlib import Path

import numpy as np

__all__ = ["plot_run", "trailing_mean", "write_plot"]

COLORS = {"loss": "#9bbbe8", "mean": "#1f4fa8", "eval": "#d62728", "match": "#2ca02c", "lr": "#7f3fbf",
          "grad_norm": "#ff7f0e"}


def trailing_mean(values, window: int) -> np.ndarray:
    """Mean of the last ``window`` values at each point (of all so far, for the first ones)."""
    v = np.asarray(values, np.float64)
    c = np.cumsum(np.insert(v, 0, 0.0))
    idx = np.arange(1, v.size + 1)
    lo = np.maximum(0, idx - window)
    return (c[idx] - c[lo]) / (idx - lo)


def _finite(points):
    return [(x, y) for x, y in points if x is not None and y is not None and math.isfinite(x) and math.isfinite(y)]


def plot_run(path, metrics: list[dict], evals: list[dict] | None = None, title: str = "training") -> Path:
    """Draw ``metrics`` (metrics.jsonl's records) and ``evals`` (eval records: "step", "loss", and
    optionally "exact_match") into ``path`` as a PNG."""
    import matplotlib
    matplotlib.use("Agg", force=True)
    import matplotlib.pyplot as plt

    steps = [m for m in metrics if not m.get("skipped")]
    loss = _finite((m.get("step"), m.get("loss")) for m in steps)
    lr = _finite((m.get("step"), m.get("lr")) for m in steps)
    norm = [(x, y) for x, y in _finite((m.get("step"), m.get("grad_norm")) for m in steps) if y > 0]
    held = _finite((e.get("step"), e.get("loss")) for e in evals or [])
    match = _finite((e.get("step"), e.get("exact_match")) for e in evals or [])
    panels = ["loss"] + (["exact match"] if match else []) + ["learning rate", "gradient norm"]
    ratios = [3] + [1] * (len(panels) - 1)
    fig, axes = plt.subplots(len(panels), 1, sharex=True, figsize=(8, 2.2 + 1.5 * len(panels)),
                             gridspec_kw={"height_ratios": ratios}, dpi=100, squeeze=False)
    axes = dict(zip(panels, axes[:, 0]))
    ax = axes["loss"]
    ax.set_title(title)
    if loss:
        x, y = map(np.array, zip(*loss))
        ax.plot(x, y, color=COLORS["loss"], lw=1, label="loss per step", marker="." if len(x) <= 60 else None)
        window = max(2, len(x) // 25)
        ax.plot(x, trailing_mean(y, window), color=COLORS["mean"], lw=2, label=f"mean of the last {window} steps")
    if held:
        hx, hy = zip(*held)
        ax.plot(hx, hy, color=COLORS["eval"], marker="s", ms=5, lw=1.2, label="held-out loss")
    values = [y for _, y in loss + held]
    if values and min(values) > 0 and max(values) / min(values) > 20:
        ax.set_yscale("log")
    ax.set_ylabel("loss")
    if not values:
        ax.text(0.5, 0.5, "no finite losses to plot", transform=ax.transAxes, ha="center")
    else:
        ax.legend(loc="upper right", fontsize=8)
    if match:
        mx, my = zip(*match)
        axes["exact match"].plot(mx, [100 * v for v in my], color=COLORS["match"], marker="o", lw=1.2)
        axes["exact match"].set_ylim(-5, 105)
        axes["exact match"].set_ylabel("answers\nright (%)")
    if lr:
        axes["learning rate"].plot(*zip(*lr), color=COLORS["lr"], lw=1.5)
    axes["learning rate"].set_ylabel("learning\nrate")
    axes["learning rate"].ticklabel_format(axis="y", style="sci", scilimits=(-2, 3))
    if norm:
        axes["gradient norm"].plot(*zip(*norm), color=COLORS["grad_norm"], lw=1)
        axes["gradient norm"].set_yscale("log")
    axes["gradient norm"].set_ylabel("gradient\nnorm")
    axes["gradient norm"].set_xlabel("optimizer step")
    for a in axes.values():
        a.grid(True, alpha=0.3)
    fig.tight_layout()
    fig.canvas.draw()
    height = fig.bbox.height
    boxes = {f"panel:{name}": " ".join(str(round(v)) for v in (a.bbox.x0, height - a.bbox.y1, a.bbox.x1, height - a.bbox.y0))
             for name, a in axes.items()}
    path = Path(path)
    fig.savefig(path, format="png", metadata=boxes)
    plt.close(fig)
    return path


def write_plot(path: Path, metrics: list[dict], evals: list[dict]) -> None:
    """The run's loss.png; a file that cannot be written is a note, not a failed run."""
    try:
        plot_run(path, metrics, evals, title=f"training: {path.parent.name}")
    except OSError as e:
        print(f"note: could not write {path}: {e}", file=sys.stderr)
