"""Recorded train-step pieces: run as usual the first time, captured the second, replayed after.

A training step is three replayable pieces, each keyed by everything that shapes its work (input
shape, bucket, which parameter, gradient and optimizer-state buffers): the forward + LM head +
backward pass, the gradient-norm passes, and the optimizer update; in one process also the step
gate, which makes the clip coefficient and the skip decision on the GPU, so all of them run
behind one wait for the loss. With a distributed sync the host reads the norm back between them
and decides. Each piece replays with only its scalars patched (normalizer and loss scale; lr,
bias corrections and gradient scale; the gate's loss scale and clip norm) and its inputs written
into the tensors it captured. Nothing else runs Python per kernel.

A key is captured on its second occurrence, not its first: the first step creates what later
steps reuse (optimizer state, RoPE tables, pipelines), and a capture must not include that.
Captured passes reserve their activation buffers (runtime/pool.py), so at most ``passes`` of
them are kept; norm and optimizer pieces hold no activations. When all pass slots are taken, a
pass is captured only if its key has occurred more often than a kept one's, which is then
dropped (the least recently used of the rarest): with many input shapes, the common ones stay
recorded and rare ones do not churn the slots.
"""
from __future__ import annotations

from collections import Counter, OrderedDict


class RecordedSteps:
    def __init__(self, engine, passes: int):
        self.engine = engine
        self.passes = passes
        self._programs: OrderedDict = OrderedDict()    # key -> (program, inputs, kept, holds activations)
        self._seen: Counter = Counter()                # key -> occurrences
        self.replays = 0

    def run(self, key, record, *, scalars=None, upload=None, refill=None, activations: bool = False):
        """What ``record(inputs)`` returns, after running it, capturing it, or replaying its capture.

        upload()          makes this step's device inputs (before any capture: host writes cannot be
                          captured); None when the work reads no per-step input.
        refill(inputs)    writes this step's data into the inputs a capture kept.
        scalars           the runtime scalars to set when replaying (by kernel scalar name).
        activations       the piece keeps activation buffers: it counts against ``passes``.
        """
        self._seen[key] += 1
        hit = self._programs.get(key)
        if hit is not None:
            self._programs.move_to_end(key)
            program, inputs, kept, _ = hit
            if refill is not None:
                refill(inputs)
            program.replay(scalars)
            self.replays += 1
            return kept
        inputs = upload() if upload is not None else None
        if self.passes == 0 or self._seen[key] < 2:
            return record(inputs)
        victim = self._victim(key) if activations else None
        if victim is False:
            return record(inputs)
        if victim is not None:
            self._programs.pop(victim)[0].close()
        with self.engine.capture() as program:
            kept = record(inputs)
        self._programs[key] = (program, inputs, kept, activations)
        return kept

    def _victim(self, key):
        """The kept pass to drop for capturing ``key``: None when a slot is free, False when every
        kept pass has occurred at least as often as ``key`` (then it is not captured)."""
        held = [k for k, entry in self._programs.items() if entry[3]]      # least recently used first
        if len(held) < self.passes:
            return None
        rarest = min(held, key=lambda k: self._seen[k])                     # the first of the rarest
        return rarest if self._seen[rarest] < self._seen[key] else False

    def held_passes(self) -> int:
        """Recorded forward/backward passes kept now (each holds its activation buffers)."""
        return sum(entry[3] for entry in self._programs.values())

    def clear(self) -> None:
        """Close every program (after something they captured was replaced, e.g. a loaded checkpoint)."""
        for program, *_ in self._programs.values():
            program.close()
        self._programs.clear()
        self._seen.clear()
