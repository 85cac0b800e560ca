"""Generation: an inference state per batch of prompts, and the decoding loop of Lfm2Model.generate.

The prompt is prefilled in one pass (the training forward, causal attention over the whole prompt);
its keys, values and conv inputs then seed the state:

* attention layer: a K and a V cache for the batch, [B, C, G, E] (keys after RoPE), C positions
  per sequence, growing by ``grow``. A decode step writes each sequence's new k and v at its own
  length (``cache_write``) and runs ``attention_decode`` over every sequence at once, rows past a
  sequence's length masked out: kernels specialized per capacity, so they compile once per
  ``grow`` positions.
* conv layer: a window of the last L rows of in_proj's output (B, C and x side by side) per
  sequence, [B, L, 3D] for the batch. A step shifts the window by a row into the other of two
  buffers, writes the new row in and runs the training ``short_conv`` over it (T = L): its last
  row is the new position's output, summed in the same order as the forward's.

Every other kernel works row by row, so a step runs them once over the batch's B new rows (T = B).
A step reads its tokens and positions from device tensors and leaves its logits in one, so it
uploads and reads back nothing: decode.py chooses the tokens on the GPU and replays the steps.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from ..runtime import Tensor
from ..schedule.layout import bucketed
from .layers import Attention, Conv, Rows
from .checkpoint import EMBEDDING, FINAL_NORM
from .decode import READBACK_EVERY, Decoder, TokenChoice, check_every

GROW = 64        # cache rows added at a time (and the decode attention's length bucket)


@dataclass(frozen=True)
class Sampling:
    """How the next token is picked from the logits, as transformers' generate does: greedy
    (``do_sample=False``), or sampled after temperature, top-k and top-p (nucleus) filtering.
    decode.TokenChoice picks on the GPU; ``probabilities`` is the distribution it draws from."""
    do_sample: bool = False
    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0

    def __post_init__(self):
        if not isinstance(self.do_sample, bool):
            raise TypeError(f"do_sample must be True or False, got {self.do_sample!r}")
        if not (isinstance(self.temperature, (int, float)) and math.isfinite(self.temperature) and self.temperature > 0):
            raise ValueError(f"temperature must be a positive finite number, got {self.temperature!r}")
        if not isinstance(self.top_k, int) or isinstance(self.top_k, bool) or self.top_k < 0:
            raise ValueError(f"top_k must be an integer >= 0 (0: no top-k filtering), got {self.top_k!r}")
        if not (isinstance(self.top_p, (int, float)) and 0 < self.top_p <= 1):
            raise ValueError(f"top_p must be in (0, 1] (1: no nucleus filtering), got {self.top_p!r}")

    def probabilities(self, logits: np.ndarray) -> np.ndarray:
        """float64 [V]: softmax(logits / temperature) over the top-k logits (ties at the k-th kept),
        then without the least likely tokens whose mass stays within 1 - top_p, renormalised: what
        transformers' temperature, top-k and top-p warpers leave (ties broken as they are)."""
        x = np.asarray(logits, np.float64) / self.temperature
        if self.top_k and self.top_k < x.size:
            kth = np.partition(x, -self.top_k)[-self.top_k]
            x = np.where(x < kth, -np.inf, x)
        p = np.exp(x - x.max())
        p /= p.sum()
        if self.top_p < 1:       # drop the least likely while their mass stays within 1 - top_p
            order = np.argsort(p, kind="stable")               # ascending; of equal ones, later ids last
            drop = np.cumsum(p[order]) <= 1 - self.top_p
            drop[-1] = False                                   # the most likely always stays
            p[order[drop]] = 0.0
            p /= p.sum()
        return p


class InferenceState:
    """The caches of a batch of sequences (see the module docstring) and, on the device, what a
    step reads and writes: ``tokens`` i32 [B] (the next token of each sequence), ``seen`` f32 [B]
    (its length so far) and ``logits`` f32 [B, V] (of its last position). ``lengths`` mirrors
    ``seen`` on the host."""

    def __init__(self, model, prompts: list[np.ndarray], grow: int = GROW):
        self.model, self.grow = model, grow
        cfg, e = model.cfg, model.engine
        self.batch = len(prompts)
        self.lengths = [len(p) for p in prompts]
        d, taps, dt = cfg.hidden_size, cfg.conv_L_cache, model.activation_dtype
        self.capacity = 0
        self.kv: dict[int, list[Tensor]] = {}                  # layer -> [k, v], each [B * C * G, E] (reserve makes them)
        self.windows: dict[int, list[Tensor]] = {}             # layer -> [this step's, the next's] [B * L, 3D]
        for i, kind in enumerate(cfg.layer_types):
            if kind == "conv":
                self.windows[i] = [e.zero_(e.empty((self.batch * taps, 3 * d), dt)) for _ in range(2)]
            else:
                self.kv[i] = [None, None]
        self.reserve(max(self.lengths) + 1)
        self.tokens = e.empty((self.batch,), "i32")
        self.seen = e.tensor(np.array(self.lengths, np.float32))
        self.logits = e.empty((self.batch, cfg.vocab_size), "f32")
        last = e.empty((self.batch, d), dt)                     # (B, D) each prompt's last final-normed row
        first: dict[bytes, int] = {}                            # prompt -> the sequence that prefilled it
        for b, ids in enumerate(prompts):
            same = first.setdefault(ids.tobytes(), b)
            if same == b:
                self._prefill(b, ids, last)
            else:                             # a repeated prompt (GRPO's G samples of one): its rows copied
                self._copy_sequence(same, b, len(ids), last)
        model.head(last, out=self.logits)

    def _cache(self, capacity: int) -> Tensor:
        cfg = self.model.cfg
        rows = self.batch * capacity * cfg.num_key_value_heads
        return self.model.engine.empty((rows, cfg.head_dim), self.model.activation_dtype)

    def _row(self, b: int, position: int) -> int:
        """Where sequence b's ``position`` starts in a layer's cache (rows of E)."""
        return (b * self.capacity + position) * self.model.cfg.num_key_value_heads

    def _prefill(self, b: int, ids: np.ndarray, last: Tensor) -> None:
        """Run the prompt through the training forward, keep its keys, values and last conv inputs,
        and its last final-normed row as row b of ``last``."""
        model, e = self.model, self.model.engine
        n, taps = len(ids), model.cfg.conv_L_cache
        trace = model.forward(ids, bucket=self.grow)
        for i, (s, *_) in enumerate(trace.layers):
            if i in self.windows:             # the last L - 1 rows of B, C, x; zeros before the prompt
                last_rows = min(n, taps - 1)
                if last_rows:
                    e.copy_rows(s.bcx, self.windows[i][0], last_rows, n - last_rows, b * taps + taps - last_rows)
            else:
                g = model.cfg.num_key_value_heads
                for cache, rows in zip(self.kv[i], (s.kr, s.v)):
                    e.copy_rows(rows.view(n * g, model.cfg.head_dim), cache, n * g, 0, self._row(b, 0))
        e.copy_rows(trace.hn, last, 1, n - 1, b)

    def _copy_sequence(self, src: int, dst: int, n: int, last: Tensor) -> None:
        """Sequence ``src``'s prefilled state (``n`` positions) as sequence ``dst``'s."""
        taps, g = self.model.cfg.conv_L_cache, self.model.cfg.num_key_value_heads
        for now, _ in self.windows.values():
            self._copy_within(now, taps, src * taps, dst * taps)
        for caches in self.kv.values():
            for cache in caches:
                self._copy_within(cache, n * g, self._row(src, 0), self._row(dst, 0))
        self._copy_within(last, 1, src, dst)

    def _copy_within(self, t: Tensor, n: int, src: int, dst: int) -> None:
        """Rows src..src+n-1 of ``t`` to row dst on: through a temporary, as WebGPU copies only
        between two buffers."""
        e = self.model.engine
        tmp = e.empty((n,) + t.shape[1:], t.dtype)
        e.copy_rows(t, tmp, n, src, 0)
        e.copy_rows(tmp, t, n, 0, dst)

    def step(self, tokens=None) -> None:
        """Record one decode step: each sequence's token (``tokens``, written to the device first,
        or the ``tokens`` tensor as the GPU chose it) at its position; the logits go to ``logits``.
        Without ``tokens`` it neither uploads nor reads back, so engine.capture can replay it."""
        model, k, e = self.model, self.model.kernels, self.model.engine
        if tokens is not None:
            self.tokens.write(model.check_ids(np.asarray(tokens).reshape(1, self.batch), "tokens")[0])
        self.reserve(max(self.lengths) + 1)
        self._pos = e.run("decode_advance", n=self.seen)["pos"]                                  # (B,) i32
        # RoPE's rows of each position, gathered from the tables (the embedding kernel's gather)
        self._rope = [e.run("embedding", table=t, ids=self._pos)["y"] for t in self._tables]     # (B, R) cos, sin
        h = k.run("embedding", bucket=1, table=model.p(EMBEDDING), ids=self.tokens)["y"]          # (B, D)
        for i, (mixer, *rest) in enumerate(model.blocks):
            # the mixer against this state's cache, between its norm and out_proj; the rest as in training
            step = self._conv_step if isinstance(mixer, Conv) else self._attention_step
            h = mixer.project(step(i, mixer, mixer.normed(h, 1)[0]), h, 1)
            for layer in rest:
                h = layer.forward(h, Rows(1), train=False)[0]
        hn = k.norm(h, FINAL_NORM, 1)[0]
        model.head(hn, out=self.logits)
        self.replayed(1)

    def replayed(self, steps: int) -> None:
        """The host's mirror of ``seen`` after ``steps`` steps ran (recorded, or replayed)."""
        self.lengths = [n + steps for n in self.lengths]

    def reserve(self, positions: int) -> bool:
        """Grow the caches to hold ``positions`` per sequence (by ``grow``; each sequence's rows
        copied over); whether they grew. Never inside a capture, which would replay the copies."""
        if positions <= self.capacity:
            return False
        if self.model.engine.capturing is not None:
            raise RuntimeError(f"the inference cache must grow to {positions} positions inside engine.capture(); "
                               "reserve them before capturing")
        old_capacity = self.capacity
        self.capacity = bucketed(positions, self.grow)
        self._tables = self.model.rope.tables(self.capacity)      # cos, sin (C, R) of every position
        g = self.model.cfg.num_key_value_heads
        for caches in self.kv.values():
            for j, old in enumerate(caches):
                new = self._cache(self.capacity)
                if old is not None:
                    for b, n in enumerate(self.lengths):
                        self.model.engine.copy_rows(old, new, n * g, b * old_capacity * g, self._row(b, 0))
                caches[j] = new
        return True

    def _conv_step(self, i: int, conv: Conv, xn: Tensor) -> Tensor:
        model, cfg, e = self.model, self.model.cfg, self.model.engine
        d, taps, batch = cfg.hidden_size, cfg.conv_L_cache, self.batch
        bcx = model.kernels.linear(xn, conv.pre + "conv.in_proj", 1)                              # (B, 3D)
        now, nxt = self.windows[i]
        if taps > 1:                          # every row up one (each window's first row drops out) ...
            e.copy_rows(now, nxt, batch * taps - 1, 1, 0)
        for b in range(batch):                # ... and the new row last in each window
            e.copy_rows(bcx, nxt, 1, b, b * taps + taps - 1)
        self.windows[i] = [nxt, now]
        y = model.kernels.run("short_conv", bucket=1, bcx=nxt.view(batch, taps, 3, d),
                              **conv.weights())["y"].view(batch * taps, d)                         # (B * L, D)
        c = e.empty((batch, d), model.activation_dtype)
        for b in range(batch):
            e.copy_rows(y, c, 1, b * taps + taps - 1, b)
        return c                                                                                   # (B, D) out_proj's input

    def _attention_step(self, i: int, attention: Attention, xn: Tensor) -> Tensor:
        cfg, kernels = self.model.cfg, self.model.kernels
        batch, h, g, dim = self.batch, cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
        a, run = attention.attn, kernels.run
        q = kernels.linear(xn, a + "q_proj", 1).view(batch, h, dim)                                # (B, H, E)
        k = kernels.linear(xn, a + "k_proj", 1).view(batch, g, dim)                                # (B, G, E)
        v = kernels.linear(xn, a + "v_proj", 1).view(batch * g, dim)                               # (B * G, E)
        qn = kernels.norm(q, a + "q_layernorm.weight", 1, "head_rmsnorm")[0]
        kn = kernels.norm(k, a + "k_layernorm.weight", 1, "head_rmsnorm")[0]
        cos, sin = self._rope
        qr = run("rope", bucket=1, x=qn.view(batch, h, 2, dim // 2), cos=cos, sin=sin)["y"].view(batch, h * dim)
        kr = run("rope", bucket=1, x=kn.view(batch, g, 2, dim // 2), cos=cos, sin=sin)["y"].view(batch * g, dim)
        kc, vc = self.kv[i]
        cache = (batch, self.capacity, g, dim)
        for c, row in ((kc, kr), (vc, v)):        # this position's k and v, at each sequence's length
            run("cache_write", bucket=self.grow, cache=c.view(*cache), row=row.view(batch, g, dim), pos=self._pos)
        o = run("attention_decode", bucket=self.grow, q=qr.view(batch, g, h // g, dim), k=kc.view(*cache),
                v=vc.view(*cache), n=self.seen, scale=1.0 / math.sqrt(dim))["o"]                  # (B, G, H/G, E)
        return o.view(batch, h * dim)                                                              # (B, H * E) out_proj's input


def check_request(model, prompt_ids, max_new_tokens, seed) -> tuple[list[np.ndarray], bool]:
    """Lfm2Model.generate's prompts, each as int32 ids [T], and whether it was given one prompt (not
    a list); the prompts, ``max_new_tokens`` and ``seed`` checked."""
    single = len(prompt_ids) > 0 and np.ndim(prompt_ids[0]) == 0 if isinstance(prompt_ids, (list, tuple)) \
        else np.ndim(prompt_ids) == 1
    prompts = [model.check_ids(p, "prompt_ids" if single else f"prompt_ids[{i}]")
               for i, p in enumerate([prompt_ids] if single else list(prompt_ids))]
    if not prompts:
        raise ValueError("prompt_ids is an empty list of prompts")
    if any(p.shape[0] != 1 for p in prompts):
        raise ValueError("prompt_ids: each prompt must be one sequence of ids (a list of prompts, not a 2-D batch "
                         "per prompt)")
    if not isinstance(max_new_tokens, int) or isinstance(max_new_tokens, bool) or max_new_tokens < 0:
        raise ValueError(f"max_new_tokens must be an integer >= 0, got {max_new_tokens!r}")
    if not isinstance(seed, int) or isinstance(seed, bool):
        raise ValueError(f"seed must be an integer, got {seed!r}")
    return [p[0] for p in prompts], single


def eos_ids(eos_token_id, vocab_size: int) -> frozenset[int]:
    """The end ids of ``eos_token_id`` (an id or a list of them), each checked against the vocabulary."""
    ids = [eos_token_id] if np.ndim(eos_token_id) == 0 else list(eos_token_id)
    for i in ids:
        if not isinstance(i, (int, np.integer)) or isinstance(i, bool) or not 0 <= i < vocab_size:
            raise ValueError(f"eos_token_id {i!r} is not a token id of the vocabulary 0..{vocab_size - 1}")
    return frozenset(int(i) for i in ids)


def generate(model, prompts, max_new_tokens: int, sampling: Sampling, eos_ids: frozenset[int], seed: int,
             on_token=None, every: int = READBACK_EVERY) -> list[list[int]]:
    """Decode up to ``max_new_tokens`` per prompt (each stops after an end id, which it keeps, as
    transformers does). Tokens are chosen on the GPU and read back ``every`` steps at a time
    (decode.Decoder); ``on_token(b, token)`` is called for each kept token, in order, as each
    batch is read back (streaming)."""
    out: list[list[int]] = [[] for _ in prompts]
    check_every(every)
    if max_new_tokens == 0:
        return out
    state = InferenceState(model, prompts)
    decoder = Decoder(state, TokenChoice(model.engine, sampling, len(prompts), model.cfg.vocab_size, seed), every)
    done, made = [False] * len(prompts), 0
    try:
        while not all(done):
            for row in decoder.run(max_new_tokens - made):
                made += 1
                for b, t in enumerate(row.tolist()):
                    if done[b]:                  # finished: what its row decodes since is dropped
                        continue
                    out[b].append(t)
                    if on_token is not None:
                        on_token(b, t)
                    done[b] = t in eos_ids or made == max_new_tokens
                if all(done):
                    break
    finally:
        decoder.close()
    return out
