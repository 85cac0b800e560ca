"""Trainer: masked-loss training steps with accumulation, sync, loss scaling, clipping and an optimizer.

One call of ``train_step_masked`` runs a sequence forward and backward, adding its gradients
(its loss divided by ``grad_accum_steps``). Every ``grad_accum_steps`` calls the window is
finished: gradients are synced across processes (if configured), unscaled and checked for
overflow, clipped on their global L2 norm, applied by the optimizer, and cleared. In one process,
the unscaling, overflow check and clip coefficient are made on the GPU (ops.optim.step_gate) and the update is recorded behind them, so a step waits for the GPU
once; the host then reads whether the step was taken. Input is checked before any GPU work; an
error leaves weights, gradients and counters as they were.

``params`` may change from one window to the next (unfreezing layers, say). The optimizer keeps a
step count per parameter, as torch does, so a parameter's bias corrections count its own updates.
Unlike torch, which keeps the state of a parameter it no longer updates, a window that starts
without a parameter releases its ``.grad`` and optimizer state: trained again later, it starts
afresh (step count 1), as with a new torch optimizer.

``train_sequences`` and ``train_batch`` give the same results as calling ``train_step_masked`` on
each sequence in turn, but run consecutive sequences of one window packed: padded (with the pad
token, unsupervised) to one length and stacked into one forward and backward pass, up to
``pack_tokens`` rows. Padded positions come after every real one and carry no loss, so their
gradients are exact zeros; each sequence's loss keeps its own normalizer through per-position
weights (mask / supervised tokens). With ``packing_mode = "concat"`` they are concatenated into one
row instead (packing.concat; Lfm2Model.forward's segments), up to ``pack_tokens`` positions: no
sequence is padded to another's length.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from math import lcm

import numpy as np

from lfm2jit.ops.lmhead import ROW_MULTIPLE, lm_head_cross_entropy, xent_scalars
from lfm2jit.ops.optim import F32_MAX, grad_sumsq, norm_of, step_gate, step_gate_scalars

from . import checks
from .errors import TrainError
from .optim import Optimizer, recordable
from .packing import concat, concatenable, concatenating_saves_rows, default_mode, pack, packable, pad_token, resolve_mode
from .recorded import RecordedSteps
from .scaler import GradScaler
from .schedules import LRScheduler
from .sync import FileGradSync, FileGradSyncConfig


@dataclass
class StepStats:
    loss: float            # this sequence's mean cross-entropy over its supervised tokens
    tokens: int            # supervised tokens in this sequence
    stepped: bool          # the optimizer ran after this sequence
    skipped: bool          # the window overflowed (inf/NaN gradients) and its step was skipped
    grad_norm: float | None  # global L2 norm before clipping, when the window ended
    lr: float              # the learning rate of the (current or next) optimizer step
    loss_scale: float      # the loss scale used for this sequence's gradients


DEFAULT_PACK_TOKENS = 4096      # rows of one packed pass: activations grow with it
DEFAULT_REPLAY_PASSES = 2       # recorded forward/backward passes kept (each holds its activations)
DEFAULT_LM_HEAD_KEEP = 256 << 20  # bytes of LM-head logits kept from the loss pass for the gradient pass


def _where(*tensor_lists) -> tuple:
    """Which memory these tensors are: part of a recorded piece's key."""
    return tuple((id(t.buffer), t.offset) for ts in tensor_lists for t in ts)


class Trainer:
    """Public attributes (``clip_grad_norm``, ``grad_accum_steps``, ``step_in_accum``, ``scaler``,
    ``distributed_grad_sync``, ``lr_scheduler``, ``length_bucket``, ``optimizer``, ``lm_head_chunk``,
    ``lm_head_keep_bytes``, ``pack_tokens``) are checked whenever they are set, by a builder or directly:
    a bad value is a TypeError or ValueError naming the attribute, the value and what was expected, and leaves the
    attribute as it was (see trainer/checks.py)."""

    def __init__(self, model, optimizer: Optimizer, ctx, engine):
        for what, value in (("model", model), ("ctx", ctx), ("engine", engine)):
            if value is None:
                raise TypeError(f"Trainer: {what} must not be None")
        self._step_in_accum = 0
        self._grad_accum_steps = 1
        self._scaler: GradScaler | None = None
        self._gate = None                    # step_gate's f32[3], made by the first gated step
        self.optimizer = optimizer
        self.model = model
        self.ctx = ctx
        self.engine = engine
        self.clip_grad_norm = None
        self.distributed_grad_sync = None
        self.lr_scheduler = None
        self.length_bucket = 64
        self.lm_head_chunk = None           # ops/lmhead.chunk_for each length bucket
        self.lm_head_keep_bytes = DEFAULT_LM_HEAD_KEEP
        self.pack_tokens = DEFAULT_PACK_TOKENS
        self._packing_mode = default_mode(ctx)
        self._steps = 0
        self._window: list[object] | None = None     # the params of the open accumulation window
        self.recorded = RecordedSteps(engine, DEFAULT_REPLAY_PASSES)

    # ---- checked attributes ----
    @property
    def optimizer(self) -> Optimizer:
        return self._optimizer

    @optimizer.setter
    def optimizer(self, optimizer: Optimizer) -> None:
        if not isinstance(optimizer, Optimizer):
            raise TypeError(f"optimizer must be an Optimizer (AdamW, SGD), got {type(optimizer).__name__} {optimizer!r}")
        self._refuse_mid_window("optimizer", getattr(self, "_optimizer", None) is not optimizer)
        self._optimizer = optimizer

    @property
    def clip_grad_norm(self) -> float | None:
        return self._clip_grad_norm

    @clip_grad_norm.setter
    def clip_grad_norm(self, max_norm: float | None) -> None:
        """The largest global gradient norm (torch.nn.utils.clip_grad_norm_'s max_norm), or None."""
        if max_norm is not None:
            try:
                max_norm = checks.real("clip_grad_norm", max_norm, above=0.0)
            except (TypeError, ValueError) as e:
                raise type(e)(f"{e} (or None for no clipping)") from None
        self._clip_grad_norm = max_norm

    @property
    def grad_accum_steps(self) -> int:
        return self._grad_accum_steps

    @grad_accum_steps.setter
    def grad_accum_steps(self, steps: int) -> None:
        steps = checks.integer("grad_accum_steps", steps, minimum=1)
        self._refuse_mid_window("grad_accum_steps", steps != self._grad_accum_steps)
        self._grad_accum_steps = steps

    @property
    def step_in_accum(self) -> int:
        """Sequences done in the open accumulation window (0 when none is open)."""
        return self._step_in_accum

    @step_in_accum.setter
    def step_in_accum(self, n: int) -> None:
        self._step_in_accum = checks.integer(
            "step_in_accum", n, minimum=0, maximum=self._grad_accum_steps - 1,
            extra=f"(sequences done in a window of grad_accum_steps={self._grad_accum_steps})")

    @property
    def scaler(self) -> GradScaler | None:
        return self._scaler

    @scaler.setter
    def scaler(self, scaler: GradScaler | None) -> None:
        checks.instance("scaler", scaler, GradScaler, "a GradScaler")
        # the window's gradients so far carry the old scale: unscaling them by another is wrong
        self._refuse_mid_window("scaler", scaler is not self._scaler)
        self._scaler = scaler

    lr_scheduler = checks.Checked(checks.instance, cls=LRScheduler,
                                  expected="an LRScheduler (ConstantLR, LinearWarmup, CosineWithWarmup, LinearDecay)")

    @property
    def distributed_grad_sync(self):
        return self._distributed_grad_sync

    @distributed_grad_sync.setter
    def distributed_grad_sync(self, sync) -> None:
        if sync is not None and not callable(getattr(sync, "average", None)):
            raise TypeError(f"distributed_grad_sync must be a gradient sync (with an average(engine, names, "
                            f"params, step) method, e.g. FileGradSync) or None, got {type(sync).__name__} {sync!r}")
        self._distributed_grad_sync = sync

    length_bucket = checks.Checked(checks.integer, minimum=1)

    @property
    def lm_head_chunk(self) -> int | None:
        """Vocabulary rows per LM-head chunk; None (the default): chosen for each length bucket."""
        return self._lm_head_chunk

    @lm_head_chunk.setter
    def lm_head_chunk(self, chunk: int | None) -> None:
        if chunk is None:
            self._lm_head_chunk = None
            return
        chunk = checks.integer("lm_head_chunk", chunk, minimum=ROW_MULTIPLE, extra=f"and a multiple of {ROW_MULTIPLE}")
        if chunk % ROW_MULTIPLE:
            raise ValueError(f"lm_head_chunk must be an integer >= {ROW_MULTIPLE} and a multiple of "
                             f"{ROW_MULTIPLE}, got {chunk}")
        self._lm_head_chunk = chunk

    # Logits chunks the LM head keeps from its loss pass so its gradient pass need not compute them
    # again (ops/lmhead.py keep_logits): speed for memory, up to one [T, chunk] f32 buffer per chunk.
    lm_head_keep_bytes = checks.Checked(checks.integer, minimum=0, extra="(bytes; 0: compute every chunk twice)")
    pack_tokens = checks.Checked(checks.integer, minimum=0, extra="(0: no packing)")

    def _refuse_mid_window(self, what: str, changes: bool) -> None:
        if changes and self._step_in_accum:
            raise ValueError(f"cannot change {what} in the middle of an accumulation window "
                             f"({self._step_in_accum} of {self._grad_accum_steps} sequences done)")

    # ---- builders (each sets its attribute, checked as above) ----
    def with_length_bucket(self, bucket: int) -> "Trainer":
        self.length_bucket = bucket
        return self

    def with_clip_grad_norm(self, max_norm: float | None) -> "Trainer":
        self.clip_grad_norm = max_norm
        return self

    def with_grad_accum_steps(self, steps: int) -> "Trainer":
        self.grad_accum_steps = steps
        return self

    def with_grad_scaler(self, scaler: GradScaler | None) -> "Trainer":
        self.scaler = scaler
        return self

    def with_lr_scheduler(self, scheduler: LRScheduler | None) -> "Trainer":
        self.lr_scheduler = scheduler
        return self

    @property
    def packing_mode(self) -> str:
        """How train_sequences / train_batch pack a window's sequences: "pad" (padded to the longest
        and stacked) or "concat" (concatenated into one row; see packing.py). Set to "auto", or by
        default: concat on a GPU, pad on a CPU adapter (packing.default_mode)."""
        return self._packing_mode

    @packing_mode.setter
    def packing_mode(self, mode: str) -> None:
        self._packing_mode = resolve_mode(mode, self.ctx)

    def with_packing(self, max_tokens: int | None, mode: str | None = None) -> "Trainer":
        """Pack up to ``max_tokens`` rows (padded positions included) of consecutive sequences of a
        window into one pass in train_sequences / train_batch; None or 0 runs them one by one.
        ``mode``: "pad", "concat" or "auto" (``packing_mode``); None keeps the current one."""
        if mode is not None:
            self.packing_mode = mode
        self.pack_tokens = 0 if max_tokens is None else max_tokens
        return self

    def with_replay(self, passes: int) -> "Trainer":
        """Keep up to ``passes`` recorded forward/backward passes (one per input shape) and replay
        them, with the norm and optimizer steps, instead of running Python per kernel (see
        trainer/recorded.py); 0 runs every step as usual. Each kept pass holds its activations."""
        if not isinstance(passes, int) or isinstance(passes, bool) or passes < 0:
            raise ValueError(f"replay passes must be an integer >= 0, got {passes!r}")
        self.recorded.clear()
        self.recorded.passes = passes
        return self

    def with_file_grad_sync(self, config: FileGradSyncConfig | None) -> "Trainer":
        checks.instance("with_file_grad_sync: config", config, FileGradSyncConfig, "a FileGradSyncConfig")
        self.distributed_grad_sync = FileGradSync(config) if config is not None else None
        return self

    def with_mpi_grad_sync(self, comm=None, timeout_s: float = 600.0, run_id: str = "run",
                           stage_in_backward: bool = True) -> "Trainer":
        """Average gradients over MPI ranks (mpi4py; ``comm`` defaults to COMM_WORLD): see
        trainer/mpi_sync.py. Each rank trains its own share of a window, as with the file sync;
        ``stage_in_backward``: each bucket is read back and exchanged as soon as the backward has
        finished it (False: after the whole pass)."""
        from .mpi_sync import MpiGradSync
        self.distributed_grad_sync = MpiGradSync(comm, timeout_s, run_id, stage_in_backward)
        return self

    def sync_handshake(self, params) -> None:
        """With a file gradient sync: announce this rank and wait until every rank has announced
        the same run (world size, distinct ranks, the parameters' names, shapes and dtypes); a
        mismatch, a duplicate rank or a timeout is a TrainError on every rank, before any step.
        The first window does it when it was not called; later calls return at once."""
        sync = self.distributed_grad_sync
        if sync is not None and not sync.ready:
            params = self._params(params)
            sync.handshake(self._names(params), params)

    # ---- counters ----
    def optimizer_steps(self) -> int:
        return self._steps

    def set_optimizer_steps(self, n: int) -> None:
        """Resume at optimizer step n: the next step is n + 1, and the LR schedule follows. Bias
        corrections follow each parameter's own count in the optimizer state, which this leaves alone."""
        if not isinstance(n, int) or n < 0:
            raise ValueError(f"optimizer steps must be an integer >= 0, got {n!r}")
        self._steps = n

    def lr_at(self, k: int) -> float:
        return self.lr_scheduler.lr_at(k) if self.lr_scheduler is not None else self.optimizer.lr

    @property
    def loss_scale(self) -> float:
        return self.scaler.loss_scale if self.scaler is not None else 1.0

    # ---- checkpoints ----
    def save_checkpoint(self, directory, data_position: dict | None = None, fill=None):
        """Write a checkpoint (atomically); see trainer/checkpoint.py for what it holds. ``fill``:
        called with the temporary directory before it is renamed into place, to add files (the
        tokenizer, say) that must be in the checkpoint when it appears."""
        from .checkpoint import save_checkpoint
        return save_checkpoint(self, directory, data_position, fill)

    def load_checkpoint(self, directory) -> dict:
        """Restore a checkpoint written by save_checkpoint; returns the saved data position. Every
        file is checked before anything changes: a bad one raises TrainError naming it, and the
        weights, optimizer state and counters stay as they were."""
        from .checkpoint import load_checkpoint
        return load_checkpoint(self, directory)

    # ---- steps ----
    def train_step(self, input_ids, target_ids, params) -> StepStats:
        """One sequence with every target supervised."""
        n = len(np.asarray(target_ids).reshape(-1))
        return self.train_step_masked(input_ids, target_ids, np.ones(n, np.float32), params)

    def train_step_masked(self, input_ids, target_ids, loss_mask, params) -> StepStats:
        """One sequence; ``loss_mask`` is aligned with ``target_ids`` (1 = include, 0 = ignore).
        ``params`` (here and below) is any iterable of the model's tensors, read once per call."""
        params = self._params(params)
        return self._train_group([self._check(input_ids, target_ids, loss_mask, params)])[0]

    def train_sequences(self, sequences, params) -> list[StepStats]:
        """``(input_ids, target_ids, loss_mask)`` triples in order, each a micro-batch as in
        train_step_masked; consecutive ones of a window run packed (see ``with_packing``). All
        are checked before any GPU work."""
        params = self._params(params)
        checked = [self._check(i, t, m, params) for i, t, m in sequences]
        stats: list[StepStats] = []
        while len(stats) < len(checked):
            rest = checked[len(stats):len(stats) + self.grad_accum_steps - self.step_in_accum]
            stats += self._train_group(rest[:self._packable(rest)])
        return stats

    def train_batch(self, batch, params) -> list[StepStats]:
        """One micro-batch per sequence of ``batch``, padding stripped, empty sequences skipped
        (consecutive ones of a window run packed)."""
        return self.train_sequences(batch.sequences(), params)

    def sequence_logps(self, sequences) -> np.ndarray:
        """float64 [N]: each (input_ids, target_ids, loss_mask) sequence's summed log p(target) over
        its masked positions, by the model as it is (no gradients): a preference run's reference."""
        return np.array([x.sum() for x in self.token_logps(sequences)], np.float64)

    def token_logps(self, sequences, temperature: float = 1.0) -> list[np.ndarray]:
        """Per sequence, float64 log p(target) at each position (0 where the mask is 0), by the model
        as it is (no gradients; packed as training packs them): GRPO's old and reference log-probs.
        ``temperature``: of the softmax (the logits divided by it, as sampling at it does)."""
        checked = [self._check(i, t, m, None) for i, t, m in sequences]
        out: list[np.ndarray] = []
        while len(out) < len(checked):
            rest = checked[len(out):]
            group = rest[:self._packable(rest)]
            ids, targets, (mask,), segments = self._pack(group, [g[2] for g in group])
            trace = self.model.forward(self.model.upload_ids(ids, segments), self.length_bucket)
            out += self._position_logps(self._tempered(trace.hn, temperature), targets, mask, group, segments)
        return out

    def _pack(self, group, masks):
        """Checked sequences as one pass, as ``packing_mode`` packs them: (ids, targets, (mask,),
        segments); ``masks`` one per sequence. Padded and stacked (segments None), or concatenated
        into one row (segments: its lengths) when the mode is concat and that saves rows."""
        ids, targets, pad = [g[0] for g in group], [g[1] for g in group], pad_token(self.model.cfg)
        if (self.packing_mode == "concat" and len(group) > 1
                and concatenating_saves_rows([len(i) for i in ids], self._pack_unit(), self.length_bucket)):
            return concat(ids, targets, [masks], self.length_bucket, pad)
        return (*pack(ids, targets, [masks], self._pack_unit(), pad), None)

    def _tempered(self, h, temperature: float):
        """h / temperature: the final hidden states whose logits are the model's divided by it."""
        if temperature == 1.0:
            return h
        return self.model.kernels.run("scale", bucket=self.length_bucket, x=h, alpha=1.0 / temperature)["y"]

    def _position_logps(self, hn, targets, mask, group, segments) -> list[np.ndarray]:
        """The LM head's loss pass, per position: -cross-entropy = log p, per sequence of ``group``
        (rows of equal length, or with ``segments`` one concatenated row)."""
        ce = lm_head_cross_entropy(self.engine, hn, self.model.lm_head, targets, mask, chunk=self.lm_head_chunk,
                                   bucket=self.length_bucket, grads=False, per_position=True,
                                   check_targets=False).loss.numpy().astype(np.float64)
        lengths = [len(g[0]) for g in group]
        starts = np.cumsum([0, *segments[:-1]]) if segments else np.arange(len(group)) * (len(ce) // len(group))
        return [-ce[s:s + n] * (g[2] != 0) for s, n, g in zip(starts, lengths, group)]

    def train_token_objective(self, sequences, params, objective, temperature: float = 1.0) -> StepStats:
        """One micro-batch whose loss is a function of its sequences' per-token log-probabilities
        (DPO's pair, GRPO's group). ``sequences``: (input_ids, target_ids, loss_mask) triples, run
        packed in one pass. ``objective(logps)`` gets, per sequence, float64 log p(target) at each
        position (0 where the mask is 0) and returns ``(loss, d_logps)``: the micro-batch's loss and
        its gradient in each of those log-probs (arrays of the same shapes). The gradient reaches
        the parameters through the LM head's gradient pass, d_logps as per-position weights, so no
        [T, V] logits are held. Accumulation, clipping, loss scaling and sync as in train_sequences;
        an objective that raises or returns a bad value changes nothing. ``temperature``: the log-probs
        are of the logits divided by it (GRPO's, as TRL scores completions sampled at it)."""
        if not (isinstance(temperature, (int, float)) and math.isfinite(temperature) and temperature > 0):
            raise TrainError(f"temperature must be a finite number > 0, got {temperature!r}")
        params = self._params(params)
        group = [self._check(i, t, m, params) for i, t, m in sequences]
        if not group:
            raise TrainError("train_token_objective needs at least one sequence")
        if not callable(objective):
            raise TrainError(f"objective must be callable (logps -> (loss, d_logps)), got {type(objective).__name__}")
        model, engine = self.model, self.engine
        if self.step_in_accum == 0:
            self.sync_handshake(params)
            self._start_window(params)
        ids, targets, (mask,), segments = self._pack(group, [g[2] for g in group])
        head = model.lm_head
        head_trained = any(p is head for p in params)
        bucket, loss_scale = self.length_bucket, self.loss_scale / self.grad_accum_steps
        if model.lora is not None:
            model.lora.draw_dropout(self._steps, self._micro_index())
        tgt = engine.tensor(targets, "i32")
        trace = model.forward(model.upload_ids(ids, segments), bucket, keep_from=model.backward_start(params),
                              train=True)
        hn = self._tempered(trace.hn, temperature)
        logps = self._position_logps(hn, tgt, mask, group, segments)     # pass 1, read back for the objective
        try:
            loss, d_logps = _objective_value(objective, logps)
        except BaseException:
            self._abandon_window(params)
            raise
        # pass 2: the gradient of sum_t w_t CE_t with w = -d_logps is the objective's
        weights = self._pack(group, [-d * g[2] for d, g in zip(d_logps, group)])[2][0]
        result = lm_head_cross_entropy(engine, hn, head, tgt, engine.tensor(weights, "f32"), normalizer=1.0,
                                       loss_scale=loss_scale, chunk=self.lm_head_chunk, bucket=bucket,
                                       dE=head.grad if head_trained else None, accumulate_dE=head_trained,
                                       grad_E=head_trained, keep_logits=self.lm_head_keep_bytes,
                                       check_targets=False)     # checked in _check
        model.backward(trace, self._tempered(result.dh, temperature), params, aux_scale=loss_scale)
        self._step_in_accum += 1      # reaches grad_accum_steps: _finish_window resets it
        stats = StepStats(loss=loss, tokens=int(sum(g[2].sum() for g in group)), stepped=False, skipped=False,
                          grad_norm=None, lr=self.lr_at(self._steps + 1), loss_scale=self.loss_scale)
        if self.step_in_accum == self.grad_accum_steps:
            self._finish_window(params, stats)
        return stats

    def _packable(self, group) -> int:
        """How many of the leading sequences of ``group`` to pack into one pass, up to pack_tokens
        rows (see packing.packable)."""
        lengths = [len(ids) for ids, *_ in group]
        if self.packing_mode == "concat" and self.pack_tokens:
            return concatenable(lengths, self.pack_tokens)
        return packable(lengths, self._pack_unit(), self.pack_tokens)

    def _pack_unit(self) -> int:
        """Packed sequences are padded to a multiple of this: the model's binding multiple and the
        length bucket (so kernels specialized for one packed length serve the whole bucket)."""
        return lcm(self.model.pack_multiple(), self.length_bucket)

    def _train_group(self, group) -> list[StepStats]:
        """Forward and backward for checked sequences (packed when several), then the window's end."""
        model, engine = self.model, self.engine
        params = group[0][3]
        if self.step_in_accum == 0:
            self.sync_handshake(params)     # a no-op after the first window (and without a sync)
            self._start_window(params)
        tokens = [int(mask.sum()) for _, _, mask, _ in group]
        segments = None                       # the concatenated row's sequence lengths
        if len(group) == 1:
            ids, targets, mask, _ = group[0]
            normalizer = float(tokens[0])
        elif self.packing_mode == "concat":   # one row; per-position weights as below
            ids, targets, (mask,), segments = concat([g[0] for g in group], [g[1] for g in group],
                                                     [[g[2] / n for g, n in zip(group, tokens)]], self.length_bucket,
                                                     pad_token(model.cfg))
            normalizer = 1.0
        else:                    # packed: per-position weights mask / tokens keep each sequence's mean
            ids, targets, (mask,) = pack([g[0] for g in group], [g[1] for g in group],
                                         [[g[2] / n for g, n in zip(group, tokens)]], self._pack_unit(),
                                         pad_token(model.cfg))
            normalizer = 1.0
        head = model.lm_head
        head_trained = any(p is head for p in params)
        bucket, loss_scale = self.length_bucket, self.loss_scale / self.grad_accum_steps

        if model.lora is not None:   # this pass's LoRA dropout keys: from where the pass is in training
            model.lora.draw_dropout(self._steps, self._micro_index())
        # The window's last pass of a sync that can stage gradients in the backward copies each
        # bucket as soon as the backward has finished it, so it is averaged while the GPU runs on.
        ends_window = self.step_in_accum + len(group) == self.grad_accum_steps
        sync = self.distributed_grad_sync
        staging = getattr(sync, "staged_in_backward", None) if ends_window else None
        staged = staging(engine, model.gradient_order(params)) if staging is not None else None

        def upload():
            return model.upload_ids(ids, segments), engine.tensor(targets, "i32"), engine.tensor(mask, "f32")

        def refill(inputs):
            dev_ids, tgt, msk = inputs
            if segments is not None:
                model.write_ids(dev_ids, ids, segments)
            else:
                dev_ids.write(np.asarray(ids).reshape(dev_ids.host.shape))
            tgt.write(targets)
            msk.write(mask)

        def record(inputs):
            dev_ids, tgt, msk = inputs
            trace = model.forward(dev_ids, bucket, keep_from=model.backward_start(params), train=True)
            # The loss divides by the supervised tokens; gradients are further scaled by the loss
            # scale and divided by grad_accum_steps, so a window's update is the mean over it.
            result = lm_head_cross_entropy(
                engine, trace.hn, head, tgt, msk, normalizer=normalizer, loss_scale=loss_scale,
                chunk=self.lm_head_chunk, bucket=bucket, dE=head.grad if head_trained else None,
                accumulate_dE=head_trained, grad_E=head_trained, segments=1 if segments else len(group),
                per_position=segments is not None,      # a concatenated row's losses are summed per sequence below
                keep_logits=self.lm_head_keep_bytes, check_targets=False)   # checked in _check
            if staged is not None:
                staged.start()
            model.backward(trace, result.dh, params, on_ready=staged.ready if staged is not None else None,
                           aux_scale=loss_scale)
            if staged is not None:
                staged.finish()
            return result.loss

        key = ("pass", np.shape(ids), segments is not None, bucket, self.lm_head_chunk, self.lm_head_keep_bytes,
               head_trained, _where(params, [p.grad for p in params]), id(staged) if staged is not None else None)
        scalars = xent_scalars(normalizer, loss_scale)
        if segments is not None:       # per-position losses: no kernel divides by the normalizer (1 here)
            del scalars["inv_norm"]
        if getattr(model, "router_aux_loss_coef", 0.0):      # an MoE router's balance loss follows the loss scale
            scalars["aux_scale"] = model.router_aux_loss_coef * loss_scale
        loss = self.recorded.run(key, record, scalars=scalars, upload=upload,
                                 refill=refill, activations=True)
        if staged is not None:
            sync.average(engine, self._names(params), params, self._steps + 1, staged=staged)
        # A pass that ends the window records the gradient-norm passes (and, where the GPU decides,
        # the step gate and the optimizer update) before the loss is read, so the GPU runs them all
        # behind one wait (with a distributed sync, the norm follows the averaging on the host).
        tot = self._record_norm(params) if ends_window and sync is None else None
        gate = self._record_gated_step(params, tot, loss) if tot is not None else None
        losses = loss.numpy().astype(np.float64)   # one small read-back; also runs the recorded work
        if segments is not None:                   # per position: each sequence's sum
            ends = np.cumsum(segments[:len(group)])
            losses = np.array([losses[e - len(g[0]):e].sum() for e, g in zip(ends, group)])
        if not np.isfinite(losses).all() and self.scaler is None:
            self._abandon_window(params)
            raise TrainError(f"the loss is {losses[~np.isfinite(losses)][0]} (non-finite); the accumulation window "
                             "was discarded, no weight changed")
        stats = []
        for loss, n in zip(losses, tokens):
            self._step_in_accum += 1      # reaches grad_accum_steps: _finish_window resets it
            stats.append(StepStats(loss=float(loss), tokens=n, stepped=False, skipped=False, grad_norm=None,
                                   lr=self.lr_at(self._steps + 1), loss_scale=self.loss_scale))
        if self.step_in_accum == self.grad_accum_steps:
            self._finish_window(params, stats[-1], tot, gate, averaged=staged is not None)
        return stats

    def _micro_index(self) -> int:
        """The window's next micro-batch across every rank (rank r takes records r, r + world, ...),
        so data-parallel ranks draw what one process accumulating their windows would."""
        sync = self.distributed_grad_sync
        world, rank = (sync.world_size, sync.rank) if sync is not None else (1, 0)
        return self.step_in_accum * world + rank

    def _start_window(self, params) -> None:
        """Zero the window's gradients, releasing the gradients and optimizer state of parameters
        it no longer trains (recorded pieces bind them, so those are dropped too)."""
        kept = {id(p) for p in params}
        dropped = [p for p in self._window or () if id(p) not in kept]
        for p in dropped:
            p.grad = None
        if self.optimizer.keep_only(params) or dropped:
            self.recorded.clear()
        self.model.zero_grad(params)
        self._window = params

    # ---- the end of an accumulation window ----
    def _record_norm(self, params):
        """Record the passes summing every gradient's squares (f32[2] on the device, or None)."""
        grads = [p.grad for p in params]
        return self.recorded.run(("norm", _where(grads)), lambda _: grad_sumsq(self.engine, grads))

    def _record_gated_step(self, params, tot, loss):
        """Record the window's clip, skip decision and optimizer step behind its norm, all on the
        GPU (ops.optim.step_gate), so they run behind the one wait for the loss; the gate tensor,
        or None where the host decides after reading the norm: an optimizer of other kernels, a
        loss scale whose inverse is no f32."""
        opt, scale = self.optimizer, self.loss_scale
        if not recordable(opt) or not (scale > 0 and 1.0 / scale <= F32_MAX):
            return None
        clip = self.clip_grad_norm
        if self._gate is None:           # one buffer for every step, so the pieces that read it stay recorded
            self._gate = self.engine.empty((3,))
        gate = self.recorded.run(("gate", _where([tot, loss])),
                                 lambda _: step_gate(self.engine, tot, loss, loss_scale=scale, max_norm=clip,
                                                     out=self._gate),
                                 scalars=step_gate_scalars(loss_scale=scale, max_norm=clip))
        self._optimizer_step(params, self.lr_at(self._steps + 1), 1.0, gate)
        return gate

    def _finish_window(self, params, stats: StepStats, tot=None, gate=None, averaged: bool = False) -> None:
        """Clip and step (or skip, or raise) from the window's gradient norm; ``tot`` is its
        recorded sum of squares when the caller already recorded it; with ``gate`` the GPU has
        already stepped or skipped, and the host counts what it did; ``averaged``: the distributed
        sync has already averaged the gradients (staged in the backward)."""
        engine = self.engine
        self.step_in_accum = 0
        if gate is not None:
            _, go, grad_norm = (float(x) for x in gate.numpy())
            if not go:                   # state this step made for its first update was never used
                if self.optimizer.drop_unstepped(params):
                    self.recorded.clear()
                self._skip(params, stats)
                return
            self._count_step(params, stats, grad_norm, advance=True)
            return
        if tot is None:
            if self.distributed_grad_sync is not None and not averaged:
                self.distributed_grad_sync.average(engine, self._names(params), params, self._steps + 1)
            tot = self._record_norm(params)
        norm, finite = norm_of(tot.numpy() if tot is not None else None)
        scale = self.loss_scale
        # As torch unscales (by an f32 1/scale) before it checks: a scale so small that 1/scale or the
        # unscaled norm is no f32 (a scale backed off to 0, say) makes the gradients inf/NaN: skipped
        if finite and not (scale > 0 and 1.0 / scale <= F32_MAX and norm / scale <= F32_MAX):
            finite = False
        if not finite:
            self._skip(params, stats)
            return
        grad_norm = norm / scale
        coef = 1.0
        if self.clip_grad_norm is not None:
            coef = min(1.0, self.clip_grad_norm / (grad_norm + 1e-6))    # torch.nn.utils.clip_grad_norm_
        self._optimizer_step(params, self.lr_at(self._steps + 1), coef / scale)
        self._count_step(params, stats, grad_norm, advance=False)

    def _skip(self, params, stats: StepStats) -> None:
        """A window whose gradients (or norm, or loss) are inf or NaN: skipped with a GradScaler,
        else discarded with an error; no weight changed either way."""
        if self.scaler is None:
            self._abandon_window(params)
            raise TrainError("the gradients hold inf or NaN (no GradScaler to skip the step); "
                             "the window was discarded, no weight changed")
        self.scaler.update(found_inf=True)
        stats.skipped = True
        stats.loss_scale = self.loss_scale

    def _count_step(self, params, stats: StepStats, grad_norm: float, advance: bool) -> None:
        """Count the optimizer step just taken (``advance``: the parameters' counts too, which a
        gated step leaves to here)."""
        k = self._steps + 1
        if advance:
            self.optimizer.advance(params)
        self._steps = k
        if self.scaler is not None:
            self.scaler.update(found_inf=False)
        stats.stepped, stats.grad_norm, stats.lr = True, grad_norm, self.lr_at(k)

    def _optimizer_step(self, params, lr: float, gscale: float, gate=None) -> None:
        """``optimizer.step``, recorded as one piece per group of parameters whose counts give the
        same scalars (a group whose update creates optimizer state is never captured); the counts
        advance outside the pieces, which replay with the group's scalars of this step (with a
        step_gate ``gate``, only once the host has read whether the GPU took the step)."""
        opt, engine = self.optimizer, self.engine
        if not recordable(opt):
            opt.step(engine, params, lr=lr, gscale=gscale)
            return
        for group, scalars in opt.groups(params, lr, gscale):
            state = opt.state_key(group)
            if state is None:
                opt.group_step(engine, group, lr=lr, gscale=gscale, gate=gate)
                continue
            key = ("optimizer", id(opt), _where(group, [p.grad for p in group]), state,
                   None if gate is None else _where([gate]))
            self.recorded.run(key, lambda _, group=group: opt.group_step(engine, group, lr=lr, gscale=gscale,
                                                                         gate=gate),
                              scalars=scalars)
        if gate is None:
            opt.advance(params)

    def _abandon_window(self, params) -> None:
        self.step_in_accum = 0
        self.model.zero_grad(params)

    def _names(self, params) -> list[str]:
        by_id = {id(t): n for n, t in self.model.named_parameters().items()}
        return [by_id[id(p)] for p in params]

    # ---- input checks (before any GPU work) ----
    def _check(self, input_ids, target_ids, loss_mask, params):
        vocab = self.model.cfg.vocab_size
        ids = self._ids(input_ids, "input_ids", vocab)
        targets = self._ids(target_ids, "target_ids", vocab)
        if ids.shape != targets.shape:
            raise TrainError(f"input_ids has {ids.size} tokens but target_ids has {targets.size}; "
                             "they must be aligned one to one")
        mask = np.asarray(loss_mask)
        if mask.ndim != 1 or mask.size != ids.size:
            raise TrainError(f"loss_mask has shape {list(mask.shape)}; expected [{ids.size}] like target_ids")
        if mask.dtype == bool:
            mask = mask.astype(np.float32)
        if not np.issubdtype(mask.dtype, np.number) or not np.all((mask == 0) | (mask == 1)):
            bad = mask if not np.issubdtype(mask.dtype, np.number) else mask[(mask != 0) & (mask != 1)]
            raise TrainError(f"loss_mask must hold only 0 and 1; found {np.unique(bad)[:5].tolist()}")
        mask = mask.astype(np.float32)
        if mask.sum() == 0:
            raise TrainError("loss_mask selects no target: a sequence needs at least one supervised token")
        return ids, targets, mask, params

    @staticmethod
    def _ids(values, what: str, vocab: int) -> np.ndarray:
        arr = np.asarray(values)
        if arr.ndim != 1:
            raise TrainError(f"{what} must be a 1-D sequence of token ids, got shape {list(arr.shape)}")
        if arr.size == 0:
            raise TrainError(f"{what} is empty: a sequence needs at least one token")
        if not np.issubdtype(arr.dtype, np.integer):
            raise TrainError(f"{what} must hold integers, got {arr.dtype}")
        bad = np.flatnonzero((arr < 0) | (arr >= vocab))
        if bad.size:
            raise TrainError(f"{what}[{bad[0]}] = {int(arr[bad[0]])} is outside the vocabulary 0..{vocab - 1}")
        return arr.astype(np.int32)

    def _params(self, params) -> list:
        """``params`` as a list (a generator is read once here), checked."""
        if params is None:
            raise TrainError("params is None: pass the list of tensors to train (e.g. model.parameters())")
        try:
            params = list(params)
        except TypeError:
            raise TrainError(f"params must be an iterable of the model's tensors, "
                             f"got {type(params).__name__}") from None
        if not params:
            raise TrainError("params is empty: nothing to train")
        known = {id(t) for t in self.model.parameters()}
        foreign = [i for i, p in enumerate(params) if id(p) not in known]
        if foreign:
            raise TrainError(f"params[{foreign[0]}] is not a parameter of this model")
        if len({id(p) for p in params}) != len(params):
            raise TrainError("params lists a tensor twice")
        if self._window is not None and self.step_in_accum and [id(p) for p in params] != [id(p) for p in self._window]:
            raise TrainError("params changed in the middle of an accumulation window; pass the same list "
                             f"for all {self.grad_accum_steps} sequences of a window")
        try:
            self.model.check_trainable(params)      # frozen f16 weights, LoRA dropout: refused before GPU work
        except ValueError as e:
            raise TrainError(str(e)) from None
        return params


def _objective_value(objective, logps: list[np.ndarray]) -> tuple[float, list[np.ndarray]]:
    """``objective(logps)`` checked: a finite loss and one finite array per sequence, of its shape."""
    out = objective([x.copy() for x in logps])
    if not (isinstance(out, tuple) and len(out) == 2):
        raise TrainError(f"the objective must return (loss, d_logps), got {type(out).__name__}")
    loss, grads = out
    try:
        loss = float(loss)
    except (TypeError, ValueError):
        raise TrainError(f"the objective's loss must be a number, got {type(loss).__name__}") from None
    if not math.isfinite(loss):
        raise TrainError(f"the objective's loss is {loss} (non-finite); the window was discarded, no weight changed")
    if len(grads) != len(logps):
        raise TrainError(f"the objective returned {len(grads)} gradients for {len(logps)} sequences")
    checked = []
    for i, (g, x) in enumerate(zip(grads, logps)):
        g = np.asarray(g, np.float64)
        if g.shape != x.shape:
            raise TrainError(f"the objective's gradient {i} has shape {list(g.shape)}; its sequence has {list(x.shape)}")
        if not np.isfinite(g).all():
            raise TrainError(f"the objective's gradient {i} holds inf or NaN; the window was discarded, "
                             "no weight changed")
        checked.append(g)
    return loss, checked
