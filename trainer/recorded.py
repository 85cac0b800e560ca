"""Recorded train-step pieces: run as usual the first time, captured the second, replayed after.

A training step is three replayable pieces, each keyed by everything that shapes its work (input
shape, bucket, which parameter, gradient and optimizer-state buffers): the forward + LM head +
backward pass, the gradient-norm passes, and the optimizer update. Between them the host reads the
loss and the norm back and decides (skip on overflow, clip coefficient), so each piece replays
with only its scalars patched (normalizer and loss scale; lr, bias corrections and gradient scale)
and its inputs written into the tensors it captured. Nothing else runs Python per kernel.

A key is captured on its second occurrence, not its first: the first step creates what later
steps reuse (optimizer state, RoPE tables, pipelines), and a capture must not include that.
Captured passes reserve their activation buffers (runtime/pool.py), so at most ``passes`` of
them are kept, least recently used first out; norm and optimizer pieces hold no activations.
"""
from __future__ import annotations

from collections import OrderedDict


class RecordedSteps:
    def __init__(self, engine, passes: int):
        self.engine = engine
        self.passes = passes
        self._programs: OrderedDict = OrderedDict()    # key -> (program, inputs, kept, holds activations)
        self._seen: set = set()
        self.replays = 0

    def run(self, key, record, *, scalars=None, upload=None, refill=None, activations: bool = False):
        """What ``record(inputs)`` returns, after running it, capturing it, or replaying its capture.

        upload()          makes this step's device inputs (before any capture: host writes cannot be
                          captured); None when the work reads no per-step input.
        refill(inputs)    writes this step's data into the inputs a capture kept.
        scalars           the runtime scalars to set when replaying (by kernel scalar name).
        activations       the piece keeps activation buffers: it counts against ``passes``.
        """
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
        if self.passes == 0 or key not in self._seen:
            self._seen.add(key)
            return record(inputs)
        with self.engine.capture() as program:
            kept = record(inputs)
        self._programs[key] = (program, inputs, kept, activations)
        held = [k for k, entry in self._programs.items() if entry[3]]      # oldest first
        for old in held[:max(0, len(held) - self.passes)]:
            self._programs.pop(old)[0].close()
        return kept

    def held_passes(self) -> int:
        """Recorded forward/backward passes kept now (each holds its activation buffers)."""
        return sum(entry[3] for entry in self._programs.values())

    def clear(self) -> None:
        """Close every program (after something they captured was replaced, e.g. a loaded checkpoint)."""
        for program, *_ in self._programs.values():
            program.close()
        self._programs.clear()
        self._seen.clear()
