"""Masked cross-entropy fused with the LM head, in O(T * chunk) temporary memory.

``lm_head_cross_entropy`` computes, for hidden states ``h[T, D]`` and the output embedding
``E[V, D]`` (logits = h @ E^T),

    loss = sum_t mask[t] * (logsumexp_v(logits[t, v]) - logits[t, target[t]]) / normalizer

together with its gradients for ``h`` and ``E`` (times ``loss_scale``), without ever storing the
[T, V] logits: the vocabulary is walked in chunks of ``chunk`` rows of E, twice.

* Pass 1, per chunk: logits_c = h @ E_c^T ([T, chunk], one buffer reused by every chunk), folded
  into a running max m, sum s and target logit tl per position (two small ping-pong sets, since a
  kernel may not read and write one buffer); then lse = m + log(s) and the loss sum.
* Pass 2, per chunk, last first (its logits are still in the buffer): logits_c again, turned in
  place into dlogits_c = scale * mask * (softmax - onehot(target)); dh (+)= dlogits_c @ E_c and
  dE[c0:c1] (+)= dlogits_c^T @ h.

Where memory allows (``keep_logits`` bytes), pass 1 writes the chunks before the last into buffers
of their own, kept for pass 2, which then computes only the other chunks' logits again: the same
kernels on the same inputs, so the results are bitwise those of the one-buffer walk.

The kernels are in ``kernels/xent.lk``; every dispatch binds at most one chunk of E (real LFM2's
65536 x 2048 f32 embedding is larger than many adapters' storage binding limit). Work is recorded,
not run: the returned tensors are read (``.numpy()``) when wanted. Positions with mask 0 and padded
positions (past the real T in a length bucket) contribute exactly zero to the loss and to every
gradient; their rows of dh are exact zeros (or left as they were, when accumulating).
"""
from __future__ import annotations

import math
import numbers
from typing import NamedTuple

import numpy as np

from . import precision
from ..runtime.tensor import ITEMSIZE, Tensor
from ..schedule.layout import bucketed

ROW_MULTIPLE = 64          # chunk sizes are multiples of this, so chunk offsets meet any binding alignment
MAX_EXACT_VOCAB = 1 << 24  # chunk offsets travel as f32 scalars: exact integers below 2^24
DEFAULT_CHUNK = 4096       # vocabulary rows a chunk at the longest sequences (and the fewest chunk_for takes)
MAX_CHUNK = 16384          # ... and at most; 16384 ran the f16 LM head 1.1-1.7x faster than 4096 at T = 512-4096 (H100)
MAX_CHUNK_LOGITS = 1 << 26  # [T, chunk] f32 elements (256 MiB) chunk_for doubles a chunk up to


class LMHeadResult(NamedTuple):
    """What ``lm_head_cross_entropy`` returns; unpacks as ``loss, dh, dE``."""
    loss: Tensor   # f32[segments]: sum_t mask[t] * CE[t] / normalizer over each segment's positions
                   # (per_position: f32[T], each position's mask[t] * CE[t])
                   # (not multiplied by loss_scale)
    dh: Tensor     # f32[T, D]: d(loss * loss_scale)/dh, or added to the given dh
    dE: Tensor     # f32[V, D]: d(loss * loss_scale)/dE, or added to the given dE

    def loss_value(self) -> float:
        """The loss (summed over segments) as a Python float (reads it back, running the recorded work)."""
        return float(self.loss.numpy().astype(np.float64).sum())


def xent_scalars(normalizer: float, loss_scale: float) -> dict[str, float]:
    """The runtime scalars of the loss and dlogits kernels, by name: how a recorded step
    (runtime/program.py) replays with another normalizer or loss scale."""
    return {"inv_norm": 1.0 / normalizer, "scale": loss_scale / normalizer}


def lm_head_cross_entropy(engine, h: Tensor, E: Tensor, targets, mask=None, *, normalizer: float = 1.0,
                          loss_scale: float = 1.0, chunk: int | None = None, bucket: int = 1,
                          dh: Tensor | None = None, dE: Tensor | None = None,
                          accumulate_dh: bool = False, accumulate_dE: bool = False,
                          check_targets: bool = True, grads: bool = True, grad_E: bool = True,
                          segments: int = 1, keep_logits: int = 0, per_position: bool = False) -> LMHeadResult:
    """Masked cross-entropy of ``h @ E^T`` against ``targets``, with gradients for h and E, in one call.

    Arguments:
      engine      the ComputeEngine to record into.
      h           f32 or f16 Tensor [T, D]: final hidden states (after the last norm), T >= 1 real
                  positions. With f16 h (mixed precision) dh is f16 too; everything else stays f32.
      E           f32 Tensor [V, D]: the LM head / output embedding (logits = h @ E^T).
      targets     [T] target ids: an i32 Tensor, or integers (a list or numpy array, uploaded here).
                  Positions whose mask is nonzero need 0 <= target < V; masked ones may hold
                  anything (e.g. -100).
      mask        [T] per-position weights: None (all 1), an f32 Tensor, or numbers. 1 = include,
                  0 = ignore (contributes exactly zero); other finite values weight the position.
      normalizer  the loss sum is divided by this (e.g. the number of supervised tokens).
      loss_scale  multiplies the gradients only (dynamic loss scaling); the returned loss is unscaled.
      chunk       vocabulary rows per step, a positive multiple of 64: temporaries are one
                  [T, chunk] f32 buffer plus a few [T] vectors. V need not be a multiple of it.
                  None: ``chunk_for`` the bucketed T (longer chunks for short sequences).
      bucket      the length bucket T is specialized to (kernels are cached per bucketed T).
      dh, dE      output tensors to write ([T, D] in h's dtype / f32 [V, D]); allocated from the pool
                  when None.
      accumulate_dh, accumulate_dE
                  add to the given dh / dE instead of overwriting them (e.g. a tied embedding
                  whose dE already holds the input-embedding gradient).
      grads       False for the loss alone (evaluation): pass 2 is skipped and dh, dE are None.
      grad_E      False when E is frozen (LoRA, a frozen tied embedding): dE is neither computed
                  nor allocated, and is None.
      segments    the loss per segment: T splits into this many equal runs of positions (packed
                  sequences), and ``loss`` holds one sum per run.
      per_position
                  ``loss`` is f32[T] instead: each position's mask * cross-entropy, not divided by
                  the normalizer (an objective of per-token log-probs reads it); not with segments.
      keep_logits bytes of extra [T, chunk] f32 buffers pass 1 may fill for pass 2 (0: the one
                  reused buffer): each keeps one more chunk's logits, so pass 2 skips computing
                  them again. ``kept_chunks`` says how many a budget keeps.
      check_targets
                  validate target ids and mask values; when either is a Tensor this reads it back
                  (a flush). Host arrays are always checked. With False, an out-of-range target
                  at an unmasked position silently gives that position a zero target logit.

    Returns ``LMHeadResult(loss, dh, dE)``; nothing has run yet (reading a tensor runs it). Every
    bad argument raises ValueError/TypeError before any GPU work is recorded.
    """
    T, D, V = _check_operands(h, E)
    if not grads and (dh is not None or dE is not None or accumulate_dh or accumulate_dE):
        raise ValueError("grads=False computes the loss only; do not pass dh/dE or accumulate flags")
    if not grad_E and (dE is not None or accumulate_dE):
        raise ValueError("grad_E=False computes no dE; do not pass dE or accumulate_dE")
    normalizer = _finite("normalizer", normalizer)
    if normalizer == 0.0:
        raise ValueError("normalizer must be nonzero (the loss sum is divided by it)")
    loss_scale = _finite("loss_scale", loss_scale)
    if chunk is None and isinstance(bucket, int) and bucket >= 1:
        chunk = chunk_for(bucketed(T, bucket), D, engine.ctx.limits.get("max-storage-buffer-binding-size", 128 << 20))
    if not isinstance(chunk, int) or isinstance(chunk, bool) or chunk < ROW_MULTIPLE or chunk % ROW_MULTIPLE:
        raise ValueError(f"chunk must be a positive multiple of {ROW_MULTIPLE} vocabulary rows "
                         f"(so every chunk's rows of E start at an aligned byte offset), got {chunk!r}")
    if not isinstance(bucket, int) or isinstance(bucket, bool) or bucket < 1:
        raise ValueError(f"bucket must be a positive integer, got {bucket!r}")
    if not isinstance(segments, int) or isinstance(segments, bool) or segments < 1 or T % segments:
        raise ValueError(f"segments must be a positive integer dividing T={T}, got {segments!r}")
    if per_position is not False and (per_position is not True or segments != 1):
        raise ValueError(f"per_position must be True or False, and True only with segments=1, got {per_position!r}")
    if not isinstance(keep_logits, numbers.Integral) or isinstance(keep_logits, bool) or keep_logits < 0:
        raise ValueError(f"keep_logits must be a whole number of bytes >= 0, got {keep_logits!r}")
    if V >= MAX_EXACT_VOCAB:
        raise ValueError(f"vocabulary size {V} is too large: chunk offsets are passed as exact f32 "
                         f"integers, so V must be below {MAX_EXACT_VOCAB}")
    dh = _check_out("dh", dh, h.dtype, (T, D), accumulate_dh)
    dE = _check_out("dE", dE, "f32", (V, D), accumulate_dE)
    chunks = [(c0, min(c0 + chunk, V)) for c0 in range(0, V, chunk)]
    _check_bindings(engine, E, dE, T, D, chunks, bucket)
    _check_distinct(h=h, E=E, dh=dh, dE=dE, targets=targets, mask=mask)
    targets, mask = _prepare_targets_mask(engine, targets, mask, T, V, check_targets)

    scalars = xent_scalars(normalizer, loss_scale)

    # ---- nothing above records GPU work; from here on it is all recorded ----
    width = chunks[0][1] - chunks[0][0]          # the widest chunk (the first one)
    tp = bucketed(T, bucket)
    logits_store = engine.empty((tp * width,), "f32")
    kept = kept_chunks(V, T, chunk=chunk, bucket=bucket, keep_logits=keep_logits) if grads else 0
    # the chunks just before the last, which pass 2 reaches right after it, keep their logits
    stores = {i: engine.empty((tp * width,), "f32") for i in range(len(chunks) - 1 - kept, len(chunks) - 1)}

    def logits_buffer(i: int) -> Tensor:      # chunk i's [T, cols] logits: its own buffer or the reused one
        cols = chunks[i][1] - chunks[i][0]
        return stores.get(i, logits_store).rows(0, T * cols).view(T, cols)

    if grads:
        dh = dh if dh is not None else engine.empty((T, D), h.dtype, capacity=tp * D)
        dE = dE if dE is not None or not grad_E else engine.empty((V, D), "f32")
    state = [{n: engine.empty((T,), "f32", capacity=tp) for n in ("m", "s", "tl")} for _ in range(2)]
    lse = engine.empty((T,), "f32", capacity=tp)

    def run(name: str, **kw):       # with f16 h (mixed precision), the variants reading or writing h / dh
        return precision.run(engine, name, h.dtype, **kw)

    # pass 1: running log-sum-exp and target logit over the chunks
    for i, (c0, c1) in enumerate(chunks):
        x = logits_buffer(i)
        E_c = E.rows(c0, c1)
        run("xent_logits", bucket=bucket, out={"x": x}, h=h, E=E_c)
        new, old = state[i % 2], state[(i + 1) % 2]
        out = {"m2": new["m"], "s2": new["s"], "tl2": new["tl"]}
        if i == 0:
            run("xent_lse_first", bucket=bucket, out=out, x=x, tgt=targets)
        else:
            run("xent_lse_next", bucket=bucket, out=out, x=x, tgt=targets,
                m=old["m"], s=old["s"], tl=old["tl"], c0=float(c0))
    final = state[(len(chunks) - 1) % 2]
    run("xent_lse_final", bucket=bucket, out={"lse": lse}, m=final["m"], s=final["s"])
    tl = final["tl"]
    loss = engine.empty((T,) if per_position else (segments,), "f32")      # f32 whatever the activations' dtype
    if per_position:
        run("xent_position_loss", bucket=bucket, out={"loss": loss}, lse=lse, tl=tl, mask=mask)
    elif segments == 1:
        run("xent_loss", bucket=bucket, out={"loss": loss}, lse=lse, tl=tl, mask=mask, inv_norm=scalars["inv_norm"])
    else:               # every position of a packed segment is real: each fills its own bucket
        seg = T // segments
        run("xent_loss", bucket=seg, out={"loss": loss}, lse=lse.view(segments, seg), tl=tl.view(segments, seg),
            mask=mask.view(segments, seg), inv_norm=scalars["inv_norm"])

    if not grads:
        return LMHeadResult(loss, None, None)
    # pass 2: dlogits per chunk, then dh and the chunk's rows of dE. It walks the chunks backwards,
    # so the first one it needs (the last of pass 1) still has its logits in the buffer, and the
    # kept ones follow.
    for i, (c0, c1) in enumerate(reversed(chunks)):
        index = len(chunks) - 1 - i
        x = logits_buffer(index)
        E_c = E.rows(c0, c1)
        if i and index not in stores:
            run("xent_logits", bucket=bucket, out={"x": x}, h=h, E=E_c)
        run("xent_dlogits", bucket=bucket, x=x, lse=lse, tgt=targets, mask=mask, c0=float(c0), scale=scalars["scale"])
        run("xent_dh", bucket=bucket, out={"dh": dh}, accumulate=("dh",) if (i or accumulate_dh) else (),
            g=x, E=E_c)
        if grad_E:
            run("xent_dE", bucket=bucket, out={"dE": dE.rows(c0, c1)}, accumulate=("dE",) if accumulate_dE else (),
                g=x, h=h)
    return LMHeadResult(loss, dh, dE)


def chunk_for(T: int, D: int, binding_bytes: int) -> int:
    """Vocabulary rows a chunk for T (bucketed) positions: DEFAULT_CHUNK doubled up to MAX_CHUNK while
    the [T, chunk] f32 logits stay within MAX_CHUNK_LOGITS and both they and the chunk of f32 E
    within one storage binding. Longer chunks give each chunk's GEMMs more tiles and the LM head
    fewer dispatches (benches/results/h100_xent_chunks.json); T from 16384 keeps DEFAULT_CHUNK."""
    rows = DEFAULT_CHUNK
    while (rows < MAX_CHUNK and T * 2 * rows <= MAX_CHUNK_LOGITS
           and 2 * rows * max(T, D) * ITEMSIZE["f32"] <= binding_bytes):
        rows *= 2
    return rows


def kept_chunks(V: int, T: int, *, chunk: int = DEFAULT_CHUNK, bucket: int = 1, keep_logits: int = 0) -> int:
    """How many chunks' logits a ``keep_logits`` budget keeps from pass 1 for pass 2 (each costs one
    [bucketed T, chunk] f32 buffer; the last chunk's logits are kept anyway, in the reused buffer)."""
    width = min(chunk, V)
    return min(-(-V // chunk) - 1, keep_logits // (bucketed(T, bucket) * width * ITEMSIZE["f32"]))


# ---- argument checks (all before any GPU work) ----

def _check_operands(h, E) -> tuple[int, int, int]:
    for name, t, dtypes in (("h", h, ("f32", "f16")), ("E", E, ("f32",))):
        if not isinstance(t, Tensor):
            raise TypeError(f"{name} must be a Tensor, got {type(t).__name__}")
        if t.dtype not in dtypes:
            raise ValueError(f"{name} must be {' or '.join(dtypes)}, got {t.dtype}")
        if len(t.shape) != 2:
            raise ValueError(f"{name} must be 2-D ({'[T, D]' if name == 'h' else '[V, D]'}), got shape {list(t.shape)}")
    (T, D), (V, DE) = h.shape, E.shape
    if D != DE:
        raise ValueError(f"h is [T={T}, D={D}] but E is [V={V}, D={DE}]: the hidden sizes differ")
    if T < 1 or D < 1 or V < 1:
        raise ValueError(f"empty operand: h is {list(h.shape)}, E is {list(E.shape)}")
    return T, D, V


def _finite(name: str, value) -> float:
    if not isinstance(value, numbers.Real) or isinstance(value, bool) or not math.isfinite(float(value)):
        raise ValueError(f"{name} must be a finite number, got {value!r}")
    return float(value)


def _check_out(name: str, t, dtype: str, shape, accumulate: bool):
    if t is None:
        if accumulate:
            raise ValueError(f"accumulate_{name}=True needs a {name} tensor to add to")
        return None
    if not isinstance(t, Tensor):
        raise TypeError(f"{name} must be a Tensor or None, got {type(t).__name__}")
    if t.dtype != dtype or t.shape != tuple(shape):
        raise ValueError(f"{name} is {t.dtype}{list(t.shape)}, expected {dtype}{list(shape)}")
    return t


def _check_bindings(engine, E: Tensor, dE: Tensor | None, T: int, D: int, chunks, bucket: int) -> None:
    """Every chunk view must start at an aligned offset and every binding fit the adapter's limit."""
    limits = engine.ctx.limits
    align = limits.get("min-storage-buffer-offset-alignment", 256)
    row = D * ITEMSIZE["f32"]
    for name, t in (("E", E), ("dE", dE)):
        if t is None:
            continue
        for c0, _ in chunks:
            if (t.offset + c0 * row) % align:
                raise ValueError(f"{name}'s rows from {c0} start at byte {t.offset + c0 * row}, not a multiple of the "
                                 f"adapter's {align}-byte binding alignment ({name} itself starts at byte {t.offset})")
    biggest = max(bucketed(T, bucket) * (chunks[0][1] - chunks[0][0]), (chunks[0][1] - chunks[0][0]) * D,
                  bucketed(T, bucket) * D) * ITEMSIZE["f32"]
    limit = limits.get("max-storage-buffer-binding-size")
    if limit is not None and biggest > limit:
        raise ValueError(f"a binding of {biggest} bytes (the [T, chunk] logits or a [chunk, D] slice) exceeds the "
                         f"adapter's max-storage-buffer-binding-size {limit}: use a smaller chunk")


def _check_distinct(**tensors) -> None:
    """dh and dE are written while h, E, targets and mask are read: they must not share buffers."""
    seen: dict[int, str] = {}
    for name in ("h", "E", "targets", "mask", "dh", "dE"):
        t = tensors[name]
        if not isinstance(t, Tensor):
            continue
        other = seen.get(id(t.buffer))
        if other is not None and (name in ("dh", "dE") or other in ("dh", "dE")):
            raise ValueError(f"{name} shares a buffer with {other}; outputs must not alias inputs or each other")
        seen.setdefault(id(t.buffer), name)


def _prepare_targets_mask(engine, targets, mask, T: int, V: int, check: bool) -> tuple[Tensor, Tensor]:
    """Targets as an i32 Tensor [T] and the mask as an f32 Tensor [T], validated."""
    tgt_host = mask_host = None
    if isinstance(targets, Tensor):
        if targets.dtype != "i32" or targets.shape != (T,):
            raise ValueError(f"targets is {targets.dtype}{list(targets.shape)}, expected i32[{T}]")
        if check:
            tgt_host = targets.numpy()
    else:
        arr = np.asarray(targets)
        if arr.shape != (T,):
            raise ValueError(f"targets has shape {list(arr.shape)}, expected [{T}] (one per position of h)")
        if arr.dtype.kind not in "iu":
            raise TypeError(f"targets must be integers, got dtype {arr.dtype}")
        if arr.size and (arr.min() < -2**31 or arr.max() >= 2**31):
            raise ValueError("targets do not fit in i32")
        tgt_host = arr.astype(np.int64)
    if mask is None:
        mask_host = np.ones(T, np.float32)
    elif isinstance(mask, Tensor):
        if mask.dtype != "f32" or mask.shape != (T,):
            raise ValueError(f"mask is {mask.dtype}{list(mask.shape)}, expected f32[{T}]")
        if check:
            mask_host = mask.numpy()
    else:
        arr = np.asarray(mask)
        if arr.shape != (T,):
            raise ValueError(f"mask has shape {list(arr.shape)}, expected [{T}] (one per position of h)")
        if arr.dtype.kind not in "biuf":
            raise TypeError(f"mask must be numbers, got dtype {arr.dtype}")
        mask_host = arr.astype(np.float32)
    if mask_host is not None and not np.isfinite(mask_host).all():
        bad = int(np.flatnonzero(~np.isfinite(mask_host))[0])
        raise ValueError(f"mask[{bad}] = {mask_host[bad]} is not finite")
    if tgt_host is not None and mask_host is not None:
        live = mask_host != 0
        out = live & ((tgt_host < 0) | (tgt_host >= V))
        if out.any():
            bad = int(np.flatnonzero(out)[0])
            raise ValueError(f"targets[{bad}] = {int(tgt_host[bad])} is out of range for a vocabulary of {V} "
                             f"(position {bad} is not masked out)")
    if not isinstance(targets, Tensor):
        targets = engine.tensor(np.asarray(targets).astype(np.int32), "i32")
    if not isinstance(mask, Tensor):
        mask = engine.tensor(mask_host, "f32")
    return targets, mask
