"""Generation: an inference state per batch of prompts, and the decoding loop of Lfm2Model.generate.

The prompt is prefilled in one pass (the training forward, causal attention over the whole prompt);
its keys, values and conv inputs then seed the state:

* attention layer: a K and a V cache for the batch, [B, C, G, E] (keys after RoPE), C positions
  per sequence, growing by ``grow``. A decode step appends each sequence's new k and v at its own
  length and runs ``attention_decode`` over every sequence at once, rows past a sequence's
  length masked out: a kernel specialized per capacity, so it compiles once per ``grow`` positions.
* conv layer: a window of the last L rows of in_proj's output (B, C and x side by side) per
  sequence, [B, L, 3D] for the batch. A step shifts the window by a row, writes the new row in
  and runs the training ``short_conv`` over it (T = L): its last row is the new position's output,
  summed in the same order as the forward's.

Every other kernel works row by row, so a step runs them once over the batch's B new rows (T = B).
Rows move between the state and a step's tensors by recorded buffer copies (engine.copy_rows),
which may start at any row. Sampling runs on the host from the step's logits.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from ..runtime import Tensor
from ..schedule.layout import bucketed
from .layers import Attention, Conv, Rows
from .checkpoint import EMBEDDING, FINAL_NORM

GROW = 64        # cache rows added at a time (and the decode attention's length bucket)


@dataclass(frozen=True)
class Sampling:
    """How the next token is picked from the logits, as transformers' generate does: greedy
    (``do_sample=False``), or sampled after temperature, top-k and top-p (nucleus) filtering."""
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

    def pick(self, logits: np.ndarray, rng: np.random.Generator) -> int:
        """The next token from one position's float32 logits [V]."""
        if not self.do_sample:
            return int(np.argmax(logits))               # the first of equal maxima, as torch.argmax
        p = self.probabilities(logits)
        return int(rng.choice(p.size, p=p))

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
    """The caches of a batch of sequences (see the module docstring), their lengths so far, and
    the logits [B, V] of each one's last position."""

    def __init__(self, model, prompts: list[np.ndarray], grow: int = GROW):
        self.model, self.grow = model, grow
        cfg, e = model.cfg, model.engine
        self.batch = len(prompts)
        self.lengths = [len(p) for p in prompts]
        d, taps, dt = cfg.hidden_size, cfg.conv_L_cache, model.activation_dtype
        self.capacity = bucketed(max(self.lengths) + 1, grow)
        self.kv: dict[int, list[Tensor]] = {}                  # layer -> [k, v], each [B * C * G, E]
        self.windows: dict[int, list[Tensor]] = {}             # layer -> [this step's, the next's] [B * L, 3D]
        for i, kind in enumerate(cfg.layer_types):
            if kind == "conv":
                self.windows[i] = [e.zero_(e.empty((self.batch * taps, 3 * d), dt)) for _ in range(2)]
            else:
                self.kv[i] = [self._cache(self.capacity), self._cache(self.capacity)]
        self.logits = np.zeros((self.batch, cfg.vocab_size), np.float32)
        for b, ids in enumerate(prompts):
            self._prefill(b, ids)

    def _cache(self, capacity: int) -> Tensor:
        cfg = self.model.cfg
        rows = self.batch * capacity * cfg.num_key_value_heads
        return self.model.engine.empty((rows, cfg.head_dim), self.model.activation_dtype)

    def _row(self, b: int, position: int) -> int:
        """Where sequence b's ``position`` starts in a layer's cache (rows of E)."""
        return (b * self.capacity + position) * self.model.cfg.num_key_value_heads

    def _prefill(self, b: int, ids: np.ndarray) -> None:
        """Run the prompt through the training forward, keep its keys, values and last conv inputs."""
        model, e = self.model, self.model.engine
        n, taps = len(ids), model.cfg.conv_L_cache
        trace = model.forward(ids, bucket=self.grow)
        for i, (s, *_) in enumerate(trace.layers):
            if i in self.windows:             # the last L - 1 rows of B, C, x; zeros before the prompt
                last = min(n, taps - 1)
                if last:
                    e.copy_rows(s.bcx, self.windows[i][0], last, n - last, b * taps + taps - last)
            else:
                g = model.cfg.num_key_value_heads
                for cache, rows in zip(self.kv[i], (s.kr, s.v)):
                    e.copy_rows(rows.view(n * g, model.cfg.head_dim), cache, n * g, 0, self._row(b, 0))
        last = e.empty((1, model.cfg.hidden_size), model.activation_dtype)
        e.copy_rows(trace.hn, last, 1, n - 1)
        self.logits[b] = model.head_logits(last)[0]

    def step(self, tokens) -> np.ndarray:
        """Feed one new token per sequence (at position lengths[b]); returns and keeps the logits [B, V]."""
        model, k, e = self.model, self.model.kernels, self.model.engine
        ids = model.check_ids(np.asarray(tokens).reshape(1, self.batch), "tokens")[0]
        self._reserve(max(self.lengths) + 1)
        cos, sin = model.rope.angles(self.lengths)
        self._rope = (e.tensor(cos), e.tensor(sin))
        self._seen = e.tensor(np.array(self.lengths, np.float32) + 1)          # positions with this one
        h = k.run("embedding", bucket=1, table=model.p(EMBEDDING), ids=e.tensor(ids))["y"]        # (B, D)
        for i, (mixer, *rest) in enumerate(model.blocks):
            # the mixer against this state's cache, between its norm and out_proj; the rest as in training
            step = self._conv_step if isinstance(mixer, Conv) else self._attention_step
            h = mixer.project(step(i, mixer, mixer.normed(h, 1)[0]), h, 1)
            for layer in rest:
                h = layer.forward(h, Rows(1), train=False)[0]
        hn = k.norm(h, FINAL_NORM, 1)[0]
        self.logits = model.head_logits(hn)
        self.lengths = [n + 1 for n in self.lengths]
        return self.logits

    def _reserve(self, positions: int) -> None:
        """Grow the caches to hold ``positions`` per sequence (by ``grow``; each sequence's rows copied over)."""
        if positions <= self.capacity:
            return
        old_capacity = self.capacity
        self.capacity = bucketed(positions, self.grow)
        g = self.model.cfg.num_key_value_heads
        for caches in self.kv.values():
            for j, old in enumerate(caches):
                new = self._cache(self.capacity)
                for b, n in enumerate(self.lengths):
                    self.model.engine.copy_rows(old, new, n * g, b * old_capacity * g, self._row(b, 0))
                caches[j] = new

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
        model, cfg, e, kernels = self.model, self.model.cfg, self.model.engine, self.model.kernels
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
        for b, n in enumerate(self.lengths):          # this position's k and v, at each sequence's length
            e.copy_rows(kr, kc, g, b * g, self._row(b, n))
            e.copy_rows(v, vc, g, b * g, self._row(b, n))
        cache = (batch, self.capacity, g, dim)
        o = run("attention_decode", bucket=self.grow, q=qr.view(batch, g, h // g, dim), k=kc.view(*cache),
                v=vc.view(*cache), n=self._seen, scale=1.0 / math.sqrt(dim))["o"]                  # (B, G, H/G, E)
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
             on_token=None) -> list[list[int]]:
    """Decode up to ``max_new_tokens`` per prompt (each stops after an end id, which it keeps, as
    transformers does); ``on_token(b, token)`` is called as each token is picked (streaming)."""
    rng = np.random.default_rng(seed)
    state = InferenceState(model, prompts)
    out: list[list[int]] = [[] for _ in prompts]
    done = [max_new_tokens == 0] * len(prompts)
    while not all(done):
        tokens = []
        for b in range(len(prompts)):
            if done[b]:
                tokens.append(prompts[b][-1] if not out[b] else out[b][-1])   # fed, never read
                continue
            t = sampling.pick(state.logits[b], rng)
            out[b].append(t)
            if on_token is not None:
                on_token(b, t)
            done[b] = t in eos_ids or len(out[b]) == max_new_tokens
            tokens.append(t)
        if not all(done):
            state.step(tokens)
    return out
