"""Stopping a run cleanly on SIGINT/SIGTERM: the current step finishes, then the run checkpoints and
stops; a second signal abandons the step (KeyboardInterrupt). With several ranks a signal may reach
one rank, or reach them at different steps: each step's sums over the ranks carry a stop vote, so
every rank stops after the same step."""
from __future__ import annotations

import signal
import threading


class Interrupted(Exception):
    """A signal arrived: the loop stops at the step boundary."""


class StopSignals:
    """SIGINT/SIGTERM handlers for the duration of the loop (only in the main thread, where Python
    allows them); ``write`` tells the user what happens next."""

    def __init__(self, write):
        self.write = write
        self.received: list[int] = []
        self.agreed = False          # some rank voted to stop in the last step's sums
        self._previous: dict = {}

    def install(self) -> None:
        """Catch SIGINT and SIGTERM from now on (the previous handlers are kept for ``restore``)."""
        if threading.current_thread() is threading.main_thread():
            self._previous = {sig: signal.signal(sig, self._on_signal) for sig in (signal.SIGINT, signal.SIGTERM)}

    def restore(self) -> None:
        """Put the previous handlers back."""
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        self._previous.clear()

    def vote(self) -> float:
        """This rank's stop vote in the step's sums: 1 when it received a signal."""
        return float(bool(self.received))

    def check(self, world_size: int) -> None:
        """Raise ``Interrupted`` before a step when the ranks agreed to stop (or this lone process was told to)."""
        if self.agreed or (self.received and world_size == 1):
            raise Interrupted

    def name(self) -> str:
        """The signal that stopped this rank, for the message."""
        return signal.Signals(self.received[0]).name if self.received else "another rank's signal"

    def _on_signal(self, signum, frame):
        if self.received:
            raise KeyboardInterrupt
        self.received.append(signum)
        self.write(f"\n{signal.Signals(signum).name}: finishing the current step, then saving a checkpoint "
                   "(send it again to stop at once without one)")
