"""The training run's progress: a bar redrawn in place on a terminal, plain lines in a log.

On a terminal (``file.isatty()``) one line is redrawn at most every ``redraw_s`` seconds:
``train  12/250 [####......]  0:03 elapsed, 0:41 remaining  loss=...``. Anywhere else (a file, a
pipe, CI) nothing is redrawn: a line ``train: step 25/250 (10%), 0:03 elapsed, 0:41 remaining,
loss=...`` is printed every ``every`` steps (default: a tenth of the run, at least 1) and at the
last step.

The estimate of the time remaining starts after the first ``warmup`` steps of this run: those
compile and specialize the kernels, the steps after them are the run's pace. Until then it reads
"time left estimated from step N". Other long work (the held-out evaluation) counts its own
``unit`` (sequences, answers) the same way.
"""
from __future__ import annotations

import sys
import time

BAR_WIDTH = 24
WARMUP_STEPS = 2


def _clock(seconds: float) -> str:
    s = int(round(seconds))
    h, m = divmod(s // 60, 60)
    return f"{h}:{m:02d}:{s % 60:02d}" if h else f"{m}:{s % 60:02d}"


class Progress:
    """``update(n)``, ``set_postfix_str(text)``, ``write(line)`` and ``close()``, as the CLI uses a bar."""

    def __init__(self, total: int, initial: int = 0, enabled: bool = True, file=None, desc: str = "train",
                 every: int | None = None, warmup: int = WARMUP_STEPS, redraw_s: float = 0.1, unit: str = "step"):
        self.file = sys.stderr if file is None else file
        self.total, self.n, self.initial = int(total), int(initial), int(initial)
        self.enabled, self.desc, self.warmup, self.redraw_s = enabled, desc, max(0, int(warmup)), redraw_s
        self.unit = unit
        try:
            self.tty = bool(self.file.isatty())
        except (AttributeError, ValueError):
            self.tty = False
        todo = max(1, self.total - self.initial)
        self.every = max(1, int(every) if every else round(todo / 10))
        self.postfix = ""
        self.t0 = time.perf_counter()
        self.t_warm = self.t0 if self.warmup == 0 else None     # when the pace starts counting
        self.n_warm = self.initial
        self._drawn = 0.0
        self._width = 0

    # ---- what the CLI calls ----
    def set_postfix_str(self, text: str, refresh: bool = False) -> None:
        self.postfix = text
        if refresh:
            self._draw(force=True)

    def update(self, n: int = 1) -> None:
        self.n += n
        if self.t_warm is None and self.n - self.initial >= self.warmup:
            self.t_warm, self.n_warm = time.perf_counter(), self.n
        if not self.enabled:
            return
        if self.tty:
            self._draw(force=self.n >= self.total)
        elif (self.n - self.initial) // self.every > (self.n - n - self.initial) // self.every or self.n >= self.total:
            print(self.line(), file=self.file, flush=True)          # crossed a multiple of every (n may be > 1)

    def write(self, text: str, file=None) -> None:
        """Print a line between the redraws (on a terminal, above the bar)."""
        out = self.file if file is None else file
        if self.enabled and self.tty and out is self.file and self._width:
            out.write("\r" + " " * self._width + "\r")
            self._width = 0
        print(text, file=out, flush=True)
        if self.enabled and self.tty and out is self.file:
            self._draw(force=True)

    def close(self) -> None:
        if self.enabled and self.tty and self._width:
            self.file.write("\n")
            self.file.flush()
            self._width = 0

    # ---- the text ----
    def remaining(self) -> str:
        if self.n >= self.total:
            return "done"
        if self.t_warm is None or self.n <= self.n_warm:
            return f"time left estimated from {self.unit} {self.initial + self.warmup + 1}"
        pace = (time.perf_counter() - self.t_warm) / (self.n - self.n_warm)
        return f"{_clock(pace * (self.total - self.n))} remaining"

    def line(self) -> str:
        pct = 100 * self.n / self.total if self.total else 100.0
        return (f"{self.desc}: {self.unit} {self.n}/{self.total} ({pct:.0f}%), {_clock(time.perf_counter() - self.t0)} "
                f"elapsed, {self.remaining()}" + (f", {self.postfix}" if self.postfix else ""))

    def _draw(self, force: bool = False) -> None:
        if not (self.enabled and self.tty):
            return
        now = time.perf_counter()
        if not force and now - self._drawn < self.redraw_s:
            return
        self._drawn = now
        filled = int(BAR_WIDTH * self.n / self.total) if self.total else BAR_WIDTH
        text = (f"{self.desc} {self.n:>{len(str(self.total))}}/{self.total} [{'#' * filled}{'.' * (BAR_WIDTH - filled)}] "
                f"{_clock(now - self.t0)} elapsed, {self.remaining()}" + (f"  {self.postfix}" if self.postfix else ""))
        pad = max(0, self._width - len(text))
        self.file.write("\r" + text + " " * pad)
        self.file.flush()
        self._width = len(text)
