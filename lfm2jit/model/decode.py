"""Decoding without host waits: the next token chosen on the GPU, decode steps recorded once and
replayed, their tokens read back a batch of steps at a time.

* TokenChoice records the choice of every sequence's next token from a step's logits (the
  kernels of ops/kernels/decode.lk) into the token tensor the next step's embedding reads. Greedy
  is the first of equal maxima (torch.argmax). Sampling draws from what ``Sampling.probabilities``
  describes: the logits over the temperature; top-k keeps the entries at or above the k-th
  largest, top-p then the fewest most likely whose mass reaches top_p (both thresholds found by
  searching the value, ``CUTS`` cuts weighed per pass); the draw is Gumbel-max over the kept ones,
  its uniforms hashed on the GPU from a per-row key (from ``seed``) and the row's position.
  Unlike the host's order by id, top-p keeps or drops logits tied at its threshold together.
* Decoder runs ``every`` steps per batch (choose, then the forward of the chosen tokens), the
  tokens gathered in a [every, B] history that is read back once per batch. The first batch is
  captured into a Program (engine.capture) and later batches replay it; a cache that has to grow
  (a new capacity changes the kernels and buffers) is captured again. Fewer steps than a batch
  (the last of a generation) are recorded directly: the last one needs no forward.
"""
from __future__ import annotations

import numpy as np

READBACK_EVERY = 8       # decode steps per replayed program and per readback of their tokens
RESERVE_AHEAD = 256      # cache positions reserved ahead of a capture, so that it is rarely captured again
CUTS = 15                # thresholds weighed per search step: each narrows the interval 16-fold ...
SEARCH_STEPS = 8         # ... so 8 narrow it 2^32-fold, below an f32 step of the logits it starts from


class TokenChoice:
    """Records the next token of each of ``batch`` sequences from their logits [B, V] (see the
    module docstring); the per-row keys and top-k targets are uploaded once, here."""

    def __init__(self, engine, sampling, batch: int, vocab: int, seed: int):
        self.engine, self.sampling = engine, sampling
        self.key = self.top_k = None
        if sampling.do_sample:
            self.key = engine.tensor(np.random.default_rng(seed).integers(0, 2 ** 32, batch, dtype=np.uint32))
            if 0 < sampling.top_k < vocab:
                self.top_k = engine.tensor(np.full(batch, sampling.top_k, np.float32))

    def choose(self, logits, n, out) -> None:
        """Record the choice from ``logits`` f32 [B, V] into ``out`` i32 [B]; ``n`` f32 [B]: each
        row's position, which with its key seeds its draw."""
        e, s = self.engine, self.sampling
        if not s.do_sample:
            e.run("pick_greedy", z=logits, out={"token": out})
            return
        z = logits if s.temperature == 1 else e.run("scale", x=logits, alpha=1.0 / s.temperature)["y"]
        init = e.run("threshold_init", z=z)
        m, floor, hi = init["m"], init["lo"], init["hi"]            # floor: every entry kept
        if self.top_k is not None:
            floor = self._search(z, m, floor, hi, self.top_k, soft=0.0)
        if s.top_p < 1:
            top = e.run("topp_need", z=z, m=m, floor=floor, top_p=s.top_p)
            floor = self._search(z, m, floor, top["hi"], top["need"], soft=1.0)
        e.run("pick_sample", z=z, floor=floor, key=self.key, n=n, out={"token": out})

    def _search(self, z, m, lo, hi, need, soft: float):
        """The largest threshold whose kept set still weighs ``need`` (threshold_step), to an f32 step."""
        for _ in range(SEARCH_STEPS):
            r = self.engine.run("threshold_step", z=z, m=m, lo=lo, hi=hi, need=need, soft=soft, dims={"Q": CUTS})
            lo, hi = r["lo2"], r["hi2"]
        return lo


class Decoder:
    """Batches of decode steps over an InferenceState (see the module docstring). ``every`` is
    even: a conv layer's windows swap buffers each step, so a replay starts where the capture did."""

    def __init__(self, state, choice: TokenChoice, every: int = READBACK_EVERY):
        self.state, self.choice, self.every = state, choice, check_every(every)
        self.history = state.model.engine.empty((every, state.batch), "i32")     # (every, B) tokens per step
        self.program = None

    def run(self, wanted: int) -> np.ndarray:
        """The next tokens of every sequence, int32 [steps, B]: a batch of ``every``, or when fewer
        are wanted (at least 1), just those, recorded without a capture and without the forward
        of the last one: no step is run that no token needs, unless an end id comes first."""
        state = self.state
        if wanted < self.every:
            self._record(wanted, last_forward=False)
            return self.history.numpy()[:wanted]
        ahead = min(wanted // self.every * self.every, RESERVE_AHEAD)
        if state.reserve(max(state.lengths) + max(self.every, ahead)) or self.program is None:
            self.close()
            with state.model.engine.capture() as program:
                self._record(self.every, last_forward=True)
            self.program = program
        else:
            self.program.replay()
            state.replayed(self.every)
        return self.history.numpy()

    def _record(self, steps: int, last_forward: bool) -> None:
        state, e = self.state, self.state.model.engine
        for j in range(steps):
            self.choice.choose(state.logits, state.seen, out=state.tokens)
            e.copy_rows(state.tokens.view(1, state.batch), self.history, 1, 0, j)
            if last_forward or j < steps - 1:
                state.step()

    def close(self) -> None:
        """Give the program's buffers back to the pool."""
        if self.program is not None:
            self.program.close()
            self.program = None


def check_every(every) -> int:
    """Decode steps per readback, checked (before any GPU work): an even number >= 2."""
    if not isinstance(every, int) or isinstance(every, bool) or every < 2 or every % 2:
        raise ValueError(f"decode steps per readback must be an even number >= 2, got {every!r}")
    return every
