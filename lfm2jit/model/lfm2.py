"""Lfm2Model: LFM2 (short-conv + grouped-query-attention decoder) running on generated kernels.

The forward pass is the embedding, then each decoder layer's list of layers (layers/: its conv or
attention, then its MLP), then the final norm; the backward pass is the same list reversed. Each
layer's forward returns the activations its backward reads, typed (layers/*Saved). All work is
recorded into the engine and submitted together.

Parameters, their gradients and per-row statistics are always f32. Activations (and their
gradients) are f32, or f16 with ``activation_dtype="f16"``: mixed precision, where every kernel
still computes in f32 and only storage narrows (see lfm2jit/ops/precision.py).

On an adapter without the shader-f16 feature, f16 activations and an f16 LoRA base
(``add_lora(base_dtype="f16")``) are refused with one line before any GPU work, rather than run
in f32: both were asked for to halve memory, and an f32 fallback would quietly double it. An f16
(or bf16) checkpoint loads anywhere: its tensors are widened to f32 as they are read.

Shapes: T positions (padded to the length bucket inside kernels), D hidden, F MLP width,
H query heads, G kv heads, E head dim (E = 2R for RoPE), V vocabulary.

Several sequences of one length run packed: B sequences of S positions are T = B*S rows, one
after another. Every kernel but two works row by row, so it runs once over all rows (bigger
matmuls, B times fewer dispatches). The causal conv and attention mix positions: both run once
over a [B, S, ...] view (their kernels' optional batch axis; each sequence is its own length
bucket there). RoPE reads position tables repeated per sequence.

Activation checkpointing (``checkpoint_layers``): a training pass keeps only the input of each
checkpointed decoder layer, and the backward runs that layer's forward again right before its
backward: the same kernels on the same inputs (and LoRA dropout keys), so the activations, and every
gradient, are bit-identical; the rerun adds nothing to an MoE router's statistics.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from ..ops import precision
from ..runtime import Tensor, arena
from ..runtime.tensor import DTYPES
from . import device_init, lora_attach, staging
from .adapters import LoraAdapters
from .checkpoint import (EMBEDDING, FINAL_NORM, check_tensors, load_checkpoint, read_generation_eos,
                         save_checkpoint)
from .config import Lfm2Config
from .generate import Sampling, check_request, eos_ids, generate
from .ids import DeviceIds, Segments, check_ids, check_segments
from .layers import Kernels, ResidualSaved, Rope, Rows, decoder_block
from .quantized_base import QuantizedWeight
from .lora import AdapterError, LoraConfig, check_weights, init_weights, read_adapter, write_adapter
from .moe_checkpoint import moe_model_tensors, save_moe_pretrained
from .moe_config import Lfm2MoeConfig, read_model_config




@dataclass
class Checkpointed:
    """A checkpointed decoder layer's part of a trace: its input only."""
    h: Tensor                                     # (T, D) the decoder layer's input


@dataclass
class Trace:
    """What the forward pass saved for the backward pass."""
    ids: DeviceIds                                # every row's token id
    rows: Rows                                    # the bucket, and how sequences are packed in the rows
    h_in: Tensor                                  # (T, D) embeddings
    # per decoder layer, what each of its layers saved (in Lfm2Model.blocks' order); None below keep_from;
    # a checkpointed layer's input only (Checkpointed), its forward run again by the backward
    layers: list[list[ResidualSaved] | Checkpointed | None] = field(default_factory=list)
    train: bool = False                           # a training pass (forward's train): a rerun is one too
    h_out: Tensor | None = None                   # (T, D) last layer's output
    hn: Tensor | None = None                      # (T, D) after the final norm
    inv: Tensor | None = None                     # (T,) final norm's 1/rms


class Lfm2Model:
    """An LFM2 decoder: its parameters, adapters and checkpoints, and its forward and backward as
    lists of layers (``blocks``: per decoder layer, the layers/ classes its forward runs)."""

    def __init__(self, cfg: Lfm2Config | Lfm2MoeConfig, ctx, engine, seed: int = 0, tensors: dict[str, np.ndarray] | None = None,
                 activation_dtype: str = "f32", recompute_mlp: bool = False, base_dtype: str = "f32",
                 checkpoint_layers: int | str = 0):
        """Without ``tensors``, a new model initialised from ``seed`` on the GPU (model/device_init.py).
        ``base_dtype="f16"`` (or "nf4", "int8") keeps the decoder's linear weights (and an MoE
        model's expert tensors) as frozen f16 (or quantized) from the start, each as it is drawn or
        read, for LoRA on a base too large to hold in f32 even for a moment (add_lora(base_dtype=...)
        narrows an f32 base after the fact).
        ``checkpoint_layers``: activation checkpointing of the first N decoder layers, or "all" (the
        ``checkpoint_layers`` property)."""
        self.cfg = cfg
        self.ctx = ctx
        self.engine = engine
        self.activation_dtype = precision.check_activation_dtype(activation_dtype, ctx)
        if not isinstance(recompute_mlp, bool):
            raise TypeError(f"recompute_mlp must be True or False, got {recompute_mlp!r}")
        self.recompute_mlp = recompute_mlp     # backward recomputes the MLP's a and b too (layers/mlp.py)
        self._checkpoint_layers = _check_checkpoint_layers(checkpoint_layers, len(cfg.layer_types))
        lora_attach.check_base_dtype(base_dtype, ctx)
        # carved side by side (runtime/arena.py): the optimizer steps a run of them in one dispatch;
        # _buffers: tensors the checkpoint holds that are never trained (an MoE router's expert_bias)
        if tensors is None:         # drawn on the GPU
            self._params, self._buffers = device_init.initial_parameters(ctx, engine, cfg, seed, base_dtype)
        else:
            tensors, buffers = _model_tensors(cfg, tensors)
            self._params = lora_attach.upload_parameters(
                ctx, tensors, set(lora_attach.base_linears(cfg)) if base_dtype != "f32" else set(), base_dtype)
            self._buffers = {n: Tensor.from_numpy(ctx, a.astype(np.float32)) for n, a in buffers.items()}
        self.lora: LoraAdapters | None = None
        # per sparse layer, the tokens its training passes routed to each expert since take_routed_tokens
        self.routed_tokens: dict[int, Tensor] = {
            i: Tensor.from_numpy(ctx, np.zeros(cfg.num_experts, np.float32)) for i in getattr(cfg, "moe_layers", ())}
        # an MoE router's load-balancing loss: its weight (0: off, as fine-tuning recipes leave it), the
        # value its training passes added up (per expert, summed over the sparse layers), and the scale
        # the running backward gives the loss's gradient (backward's aux_scale)
        self._router_aux_loss_coef = 0.0
        self.router_balance = Tensor.from_numpy(ctx, np.zeros(getattr(cfg, "num_experts", 1), np.float32))
        self.aux_grad_scale = 1.0
        self.kernels = Kernels(self)
        self.rope = Rope(cfg, ctx)
        self.blocks = [decoder_block(self.kernels, cfg, i, self.rope, keep_ab=not recompute_mlp)
                       for i in range(len(cfg.layer_types))]
        # the ids generate stops at: generation_config.json's eos_token_id where from_pretrained
        # found one (LFM2's end of turn, <|im_end|>, with <|endoftext|>), else config.json's
        eos = cfg.eos_token_id
        self.generation_eos: tuple[int, ...] = tuple(eos if isinstance(eos, list) else [] if eos is None else [eos])
        self.source_dir: Path | None = None      # the directory from_pretrained read (its tokenizer: save_gguf)

    @property
    def checkpoint_layers(self) -> int | str:
        """Activation checkpointing: 0 (the default: off), the first N decoder layers (Megatron's
        "block" recompute method), or "all" (every layer, as transformers' gradient checkpointing).
        A training pass (``forward(train=True)``) keeps only each checkpointed layer's input (T, D);
        the backward runs the layer's forward again right before its backward, for about one more
        forward of those layers per step. Evaluation and generation passes keep what they did."""
        return self._checkpoint_layers

    @checkpoint_layers.setter
    def checkpoint_layers(self, value: int | str) -> None:
        self._checkpoint_layers = _check_checkpoint_layers(value, len(self.blocks))

    def checkpointed(self, index: int) -> bool:
        """Whether a training pass checkpoints decoder layer ``index`` (``checkpoint_layers``)."""
        return self._checkpoint_layers == "all" or index < self._checkpoint_layers

    # ---- parameters ----
    def named_parameters(self) -> dict[str, Tensor]:
        """Parameters by transformers name (e.g. "model.layers.0.conv.in_proj.weight"), then the LoRA
        adapters' by PEFT name ("base_model.model.model.layers.0.conv.in_proj.lora_A.weight")."""
        return {**self._params, **(self.lora.named if self.lora else {})}

    def parameters(self) -> list[Tensor]:
        return list(self.named_parameters().values())

    def p(self, name: str) -> Tensor:
        return self._params[name]

    @property
    def lm_head(self) -> Tensor:
        return self._params[EMBEDDING if self.cfg.tie_word_embeddings else "lm_head.weight"]

    def take_routed_tokens(self) -> dict[int, np.ndarray]:
        """Per sparse layer of an MoE model, how many tokens its training passes routed to each expert
        since the last call (rows of the padding token left out: packing adds them), as int64
        [num_experts]; the counts start again from zero. Empty for a dense model."""
        counts = {i: np.rint(t.numpy()).astype(np.int64) for i, t in self.routed_tokens.items()}
        for t in self.routed_tokens.values():
            self.engine.zero_(t)
        return counts

    @property
    def router_aux_loss_coef(self) -> float:
        """The weight of an MoE router's load-balancing loss in training (0, the default: none): per
        pass and sparse layer, sum over experts of (E / K) * their share of the pass's picks * their
        mean normalised score (1 when the load is even), added to the loss's gradient."""
        return self._router_aux_loss_coef

    @router_aux_loss_coef.setter
    def router_aux_loss_coef(self, value: float) -> None:
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not np.isfinite(value) or value < 0:
            raise ValueError(f"router_aux_loss_coef must be a finite number >= 0, got {value!r}")
        if value and not isinstance(self.cfg, Lfm2MoeConfig):
            raise ValueError(f"router_aux_loss_coef={value!r}: a dense LFM2 model has no router to balance")
        self._router_aux_loss_coef = float(value)

    def take_router_balance(self) -> float:
        """The routers' load-balancing loss added up over the training passes since the last call (each
        pass's weighted by its sequences; without the coefficient), and start again from zero."""
        value = float(self.router_balance.numpy().astype(np.float64).sum())
        self.engine.zero_(self.router_balance)
        return value

    # ---- LoRA ----
    def add_lora(self, config: LoraConfig = LoraConfig(), seed: int = 0, base_dtype: str | None = None) -> list[Tensor]:
        """New LoRA adapters (B = 0: the model's outputs are unchanged) on the layers ``config``
        targets; returns their tensors, the ones to train (``lora_parameters``). ``base_dtype="f16"``
        keeps the decoder's linear weights (and an MoE model's expert tensors) as f16, halving their
        memory; they are then frozen. None keeps the base as the model was built (``base_dtype``).
        ``seed`` draws A and, with ``config.dropout``, the training passes' dropout masks."""
        if not isinstance(config, LoraConfig):
            raise TypeError(f"add_lora takes a LoraConfig, got {type(config).__name__}")
        base_dtype = self._lora_base(base_dtype)     # before A is drawn: an f16 base needs shader-f16
        modules, parameters = config.modules(self.cfg), config.parameters(self.cfg)
        self._attach(config, modules, init_weights(config, modules, seed, parameters), base_dtype, seed, parameters)
        return self.lora_parameters()

    def load_adapter(self, directory, base_dtype: str | None = None, seed: int = 0) -> list[Tensor]:
        """A PEFT adapter directory (adapter_config.json + adapter_model.safetensors), checked in
        full against this model before anything changes. ``seed``: of the dropout masks (add_lora's:
        a resumed run passes the seed it started with, so it draws the masks the run would have)."""
        base_dtype = self._lora_base(base_dtype)     # before the files are read
        config, tensors = read_adapter(Path(directory))
        modules, parameters = config.modules(self.cfg), config.parameters(self.cfg)
        self._attach(config, modules, check_weights(config, modules, tensors, str(directory), parameters), base_dtype,
                     seed, parameters)
        return self.lora_parameters()

    def _attach(self, config: LoraConfig, modules, weights: dict, base_dtype: str, seed: int, parameters) -> None:
        if self.lora is not None:
            raise AdapterError("this model already has LoRA adapters: merge_lora() folds them in first")
        self.lora = lora_attach.upload_adapters(self.ctx, config, modules, weights, seed, parameters)
        if base_dtype != self.base_dtype:
            self._params = lora_attach.reupload(self.ctx, self._params, set(lora_attach.base_linears(self.cfg)), base_dtype)

    @property
    def base_dtype(self) -> str:
        """"f16" where the decoder's linear weights are held as frozen f16, else "f32"."""
        return self._params[lora_attach.base_linears(self.cfg)[0]].dtype

    def _lora_base(self, base_dtype: str | None) -> str:
        """The base dtype an adapter asks for, checked before any work: None keeps the model's."""
        if base_dtype is None:
            return self.base_dtype
        lora_attach.check_base_dtype(base_dtype, self.ctx)
        if base_dtype != self.base_dtype and self.base_dtype != "f32":
            raise ValueError(f"base_dtype={base_dtype!r}: this model's base is {self.base_dtype} (built with "
                             f"base_dtype={self.base_dtype!r}) and cannot be changed again; pass "
                             f"base_dtype={self.base_dtype!r} or None")
        return base_dtype

    def lora_parameters(self) -> list[Tensor]:
        return list(self.lora.named.values()) if self.lora else []

    def save_adapter(self, directory, base_model: str | None = None) -> None:
        """adapter_config.json + adapter_model.safetensors, as PeftModel.save_pretrained writes them."""
        if self.lora is None:
            raise AdapterError("this model has no LoRA adapters to save (add_lora or load_adapter first)")
        write_adapter(Path(directory), self.lora.config, self.lora.peft_arrays(), base_model)

    def merge_lora(self) -> None:
        """Fold the adapters into the base weights (lora_attach.merge) and drop them, so
        ``save_pretrained`` writes a plain model."""
        if self.lora is None:
            raise AdapterError("this model has no LoRA adapters to merge")
        lora_attach.merge(self._params, self.lora)
        self.lora = None

    # ---- checkpoints ----
    @classmethod
    def from_pretrained(cls, directory, ctx, engine, activation_dtype: str = "f32",
                        recompute_mlp: bool = False, base_dtype: str = "f32",
                        checkpoint_layers: int | str = 0) -> "Lfm2Model":
        directory = Path(directory)
        precision.check_activation_dtype(activation_dtype, ctx)    # before the checkpoint is read
        lora_attach.check_base_dtype(base_dtype, ctx)
        cfg = read_model_config(directory / "config.json")          # lfm2 or lfm2_moe
        _check_checkpoint_layers(checkpoint_layers, len(cfg.layer_types))
        narrow = lora_attach.held_as(base_dtype)         # never the whole base in f32
        model = cls(cfg, ctx, engine, tensors=load_checkpoint(directory, narrow), activation_dtype=activation_dtype,
                    recompute_mlp=recompute_mlp, base_dtype=base_dtype, checkpoint_layers=checkpoint_layers)
        model.source_dir = directory
        eos = read_generation_eos(directory)
        if eos:
            model.generation_eos = tuple(sorted(eos_ids(eos, cfg.vocab_size)))
        return model

    def state_dict(self) -> dict[str, np.ndarray]:
        """The base model's tensors, as f32, by transformers' in-memory names (an MoE model's experts
        fused), buffers included as torch's state_dict has them (without adapters: ``save_adapter``
        writes those)."""
        return {n: t.numpy().astype(np.float32) for n, t in {**self._params, **self._buffers}.items()}

    def save_pretrained(self, directory, dtype: str = "f32", max_shard_size=None) -> None:
        """config.json + model.safetensors that transformers' Lfm2ForCausalLM.from_pretrained loads,
        stored as ``dtype`` ("f32", "bf16" or "f16": rounded to nearest even); with ``max_shard_size``
        (bytes, or "5GB"), shards of at most that size and model.safetensors.index.json."""
        tensors = self.state_dict()
        if isinstance(self.cfg, Lfm2MoeConfig):         # per expert, as transformers saves them
            save_moe_pretrained(Path(directory), self.cfg, tensors, dtype, max_shard_size)
            return
        if self.cfg.tie_word_embeddings:
            tensors["lm_head.weight"] = tensors[EMBEDDING]   # transformers expects it
        save_checkpoint(Path(directory), self.cfg, tensors, dtype, max_shard_size)

    def save_gguf(self, path, outtype: str = "f16", tokenizer=None, name: str | None = None) -> Path:
        """One GGUF file for llama.cpp (arch lfm2 / lfm2moe; gguf_export.py): ``outtype`` "f32",
        "f16", "bf16" or "q8_0"; ``tokenizer`` a tokenizer.json or its directory, by default the
        directory from_pretrained read."""
        from .gguf_export import GgufError, write_model
        if self.lora is not None:
            raise GgufError("this model has LoRA adapters: merge_lora() first (python -m trainer export-gguf "
                            "--adapter DIR writes them as a LoRA GGUF)")
        if tokenizer is None and self.source_dir is None:
            raise GgufError("save_gguf needs tokenizer= (a tokenizer.json or its directory): llama.cpp reads the "
                            "vocabulary from the GGUF file")
        return write_model(path, self.cfg, self.state_dict(), tokenizer or self.source_dir, outtype, name)

    def load_state(self, tensors: dict[str, np.ndarray]) -> None:
        params, buffers = _model_tensors(self.cfg, tensors)            # all checked before any is written
        for name, arr in {**params, **buffers}.items():
            t = self._params[name] if name in self._params else self._buffers[name]
            t.write(arr.astype(DTYPES.get(t.dtype, np.float32)))     # a quantized weight quantizes it

    # ---- input ----
    def check_ids(self, ids, what: str = "input_ids") -> np.ndarray:
        """The ids as int32 [B, T] (a 1-D sequence is B = 1)."""
        return check_ids(ids, self.cfg.vocab_size, what)

    def pack_multiple(self) -> int:
        """Packed sequences must be a multiple of this many positions long: each sequence's rows of
        every per-sequence tensor (conv input and output, q, k, v, o, lse and their gradients) then
        start at an offset the adapter can bind."""
        align = self.ctx.limits.get("min-storage-buffer-offset-alignment", 256)
        size = 2 if self.activation_dtype == "f16" else 4
        cfg = self.cfg
        rows = [size * cfg.hidden_size, size * cfg.num_key_value_heads * cfg.head_dim, 4 * cfg.num_attention_heads]
        m = 1
        while any(m * r % align for r in rows):
            m *= 2
        return m

    def upload_ids(self, input_ids, segments=None) -> DeviceIds:
        """Check ids ([S] or [B, S], as ``forward`` takes them) and upload them with their slots; with
        ``segments`` (forward's), the layout of the sequences concatenated in the one row too."""
        host = self.check_ids(input_ids)
        ids = DeviceIds.upload(self.engine, host, self.cfg.pad_token_id)
        if segments is not None:
            if host.shape[0] != 1:
                raise ValueError(f"input_ids: segments are the sequences concatenated in one row, got a batch of "
                                 f"{host.shape[0]} rows")
            ids.segments = Segments.upload(self.engine, check_segments(segments, host.shape[1]), self.rope)
        return ids

    def write_ids(self, ids: DeviceIds, input_ids, segments=None) -> None:
        """New ids (and, for a concatenated row, a new layout of it) into uploaded ones of the same shape."""
        host = self.check_ids(input_ids)
        if (segments is None) != (ids.segments is None):
            raise ValueError("write_ids: segments must be given exactly when the uploaded ids have them")
        ids.write(host)
        if segments is not None:
            ids.segments.write(check_segments(segments, host.shape[1]), self.rope)

    # ---- forward ----
    def forward(self, input_ids, bucket: int = 1, keep_from: int = 0, train: bool = False, segments=None) -> Trace:
        """Record the forward pass up to the final norm; the trace holds what backward needs.
        ``input_ids`` is one sequence [S] or a batch [B, S] of equally long ones (packed; S a
        multiple of ``pack_multiple()`` when B > 1), or those ids already uploaded (``upload_ids``).
        Layers below ``keep_from`` keep nothing: a backward that starts higher (``backward_start``)
        never reads them, so their activations go back to the pool as the forward moves on.
        ``train``: a training pass, which applies LoRA dropout (masks from the keys of the last
        ``lora.draw_dropout``); evaluation and generation leave it out, as PEFT's eval mode does.
        A training pass keeps only the input of each checkpointed layer (``checkpoint_layers``).
        ``segments``: the lengths of sequences concatenated in one row ([S] ids, summing to S): packing
        without padding. Each runs as it would alone: attention and the short conv stay within it and
        RoPE positions restart at its start. Uploaded ids carry their own (``upload_ids(ids, segments)``)."""
        uploaded = isinstance(input_ids, DeviceIds)
        if uploaded and segments is not None:
            raise ValueError("forward: uploaded ids carry their segments (upload_ids(ids, segments)); pass none here")
        ids = input_ids if uploaded else self.upload_ids(input_ids, segments)
        batch, seq = ids.host.shape
        if batch > 1 and seq % self.pack_multiple():
            raise ValueError(f"input_ids: a batch of {batch} sequences of {seq} positions; packed sequences must be "
                             f"a multiple of {self.pack_multiple()} positions long (pad them)")
        k, rows = self.kernels, Rows(bucket, batch, seq, ids.ids, ids.segments)
        h = k.run("embedding", bucket=bucket, table=self.p(EMBEDDING), ids=ids.ids)["y"]              # (T, D)
        trace = Trace(ids, rows, h, train=train)
        for i in range(len(self.blocks)):
            h_in = h
            h, saved = self._block_forward(i, h, rows, train)                                         # (T, D)
            if i < keep_from:
                saved = None
            elif train and self.checkpointed(i):   # the rest goes back to the pool as the forward moves on
                saved = Checkpointed(h_in)
            trace.layers.append(saved)
        trace.h_out = h
        trace.hn, trace.inv = k.norm(h, FINAL_NORM, bucket)                                           # (T, D), (T,)
        return trace

    def _block_forward(self, index: int, h: Tensor, rows: Rows, train: bool) -> tuple[Tensor, list[ResidualSaved]]:
        """Decoder layer ``index``'s forward: its output (T, D) and what each of its layers saved."""
        saved = []
        for layer in self.blocks[index]:
            h, s = layer.forward(h, rows, train)                                                      # (T, D)
            saved.append(s)
        return h, saved

    def _rerun(self, index: int, trace: Trace) -> list[ResidualSaved]:
        """A checkpointed layer's forward again, from its kept input, as the training pass ran it (the
        same kernels, inputs and dropout keys: bit-identical). ``kernels.replaying`` has the layers keep
        everything their backward reads and leave the MoE routing statistics alone (counted once)."""
        k = self.kernels
        k.replaying = True
        try:
            return self._block_forward(index, trace.layers[index].h, trace.rows, trace.train)[1]
        finally:
            k.replaying = False

    def logits(self, input_ids, bucket: int = 1) -> np.ndarray:
        """float32 [T, vocab] logits of a sequence (materialised: for checks, not for training)."""
        trace = self.forward(input_ids, bucket)
        return self.head_logits(trace.hn, bucket)

    def head_logits(self, hn: Tensor, bucket: int = 1) -> np.ndarray:
        """float32 [rows, vocab] logits of final-normed hidden states [rows, D], read back."""
        return self.head(hn, bucket).numpy()

    def head(self, hn: Tensor, bucket: int = 1, out: Tensor | None = None) -> Tensor:
        """Record the float32 logits [rows, vocab] of final-normed hidden states [rows, D] (into ``out``)."""
        y = self.engine.empty((hn.shape[0], self.cfg.vocab_size), "f32") if out is None else out
        return self.kernels.run("linear", bucket=bucket, x=hn, w=self.lm_head, out={"y": y})["y"]

    # ---- generation ----
    def generate(self, prompt_ids, max_new_tokens: int = 32, do_sample: bool = False, temperature: float = 1.0,
                 top_k: int = 0, top_p: float = 1.0, eos_token_id=None, seed: int = 0, on_token=None):
        """The new tokens after a prompt (a list of ids), or a list of such lists for a list of
        prompts (of any lengths; decoded as one batch). Greedy unless ``do_sample``; sampling is
        reproducible per ``seed``. Each sequence stops after ``max_new_tokens`` or an end id
        (kept, as transformers keeps it): ``eos_token_id`` (an id or a list), by default the
        model's (``generation_eos``). ``on_token(index, token)`` sees each token as it is picked.
        Everything is checked before any GPU work."""
        prompts, single = check_request(self, prompt_ids, max_new_tokens, seed)
        sampling = Sampling(do_sample, temperature, top_k, top_p)
        eos = eos_ids(self.generation_eos if eos_token_id is None else eos_token_id, self.cfg.vocab_size)
        out = generate(self, prompts, max_new_tokens, sampling, eos, seed, on_token)
        return out[0] if single else out

    # ---- backward ----
    def zero_grad(self, params: list[Tensor] | None = None) -> None:
        """Give each parameter (default: all) a zeroed .grad. Missing gradients are carved side by
        side out of arenas (runtime/arena.py), in the order given, so passes over every gradient
        (its zeroing here, the gradient norm) take a dispatch per arena run, not per tensor."""
        params = [t for t in (params if params is not None else self.parameters())
                  if not isinstance(t, QuantizedWeight)]        # a quantized base has no gradient to hold
        missing = list({id(t): t for t in params if t.grad is None}.values())
        for t, g in zip(missing, arena.carve_like(self.engine, missing)):
            t.grad = g
        for run in arena.runs([t.grad for t in params]):
            self.engine.zero_(run.span)

    def check_trainable(self, params) -> None:
        """Refuse, before any GPU work, what backward cannot train: frozen f16 base weights."""
        ids = {id(t) for t in params}
        named = self.named_parameters()
        halves = [n for n, t in named.items() if id(t) in ids and t.dtype != "f32"]
        if halves:
            raise ValueError(f"{halves[0]} is a frozen {named[halves[0]].dtype} base weight (add_lora(base_dtype="
                             f"'{named[halves[0]].dtype}')); it cannot be "
                             "trained: train the adapters (lora_parameters()), or keep the base in f32")

    def backward_start(self, params) -> int:
        """The first decoder layer a backward for ``params`` reaches (the number of layers when it
        reaches none): what ``forward(keep_from=...)`` may drop below."""
        ids = {id(t) for t in params}
        lowest = staging.lowest_trained_layer(self.named_parameters(), len(self.blocks), lambda t: id(t) in ids)
        return len(self.blocks) if lowest is None else lowest

    def gradient_order(self, params) -> list[Tensor]:
        """``params`` in the order backward finishes their gradients: the final norm's, then each
        layer's from the last down, then the rest (the embedding, an untied LM head). A
        data-parallel sync stages them in this order while the backward still runs."""
        stages = staging.gradient_stages(self.named_parameters(), params, len(self.blocks))
        return [p for stage in stages for p in stage]

    def backward(self, trace: Trace, d_hn: Tensor, params: list[Tensor], on_ready=None,
                 aux_scale: float = 1.0) -> None:
        """Add the gradients of every parameter in ``params`` (which must have .grad) given the
        gradient of the final normed hidden state d_hn (T, D). The reverse of ``forward``, pruned
        to what the trained parameters need: nothing below the lowest layer that holds one.
        ``on_ready(tensors)``, when given, is called as soon as the recorded work has finished the
        gradients of these parameters (the final norm's, then each layer's; not the rest, which
        are finished when backward returns), so their readback can be recorded right behind it.
        ``aux_scale``: what d_hn carries beyond the loss's own gradient (the trainer's loss scale over
        the accumulation), given to an MoE router's balance loss gradient too (router_aux_loss_coef)."""
        named, n_layers = self.named_parameters(), len(self.blocks)
        stages = staging.gradient_stages(named, params, n_layers) if on_ready is not None else None

        def ready(stage: int) -> None:
            if stages is not None and stages[stage]:
                on_ready(stages[stage])
        self.check_trainable(params)
        ids = {id(t) for t in params}
        missing = [n for n, t in named.items() if id(t) in ids and t.grad is None]
        if missing:
            raise ValueError(f"parameters without .grad (call zero_grad first): {missing[:3]}")
        k, rows = self.kernels, trace.rows
        k.trained_ids = ids
        self.aux_grad_scale = float(aux_scale)
        lowest = staging.lowest_trained_layer(named, n_layers, k.is_trained)
        if lowest is None:
            return
        dropped = [i for i in range(lowest, n_layers) if trace.layers[i] is None]
        if dropped:
            raise ValueError(f"this trace kept no activations for layers {', '.join(map(str, dropped))} "
                             f"(forward(keep_from=...)), which a backward for these parameters needs (it starts at "
                             f"layer {lowest})")
        # hn = rmsnorm(h_out)
        dh = k.norm_backward(trace.h_out, trace.inv, FINAL_NORM, d_hn, rows.bucket)                   # (T, D)
        ready(0)
        for i in reversed(range(lowest, n_layers)):
            block, saved = self.blocks[i], trace.layers[i]
            if isinstance(saved, Checkpointed):
                saved = self._rerun(i, trace)
            # what the block's forwards did not keep, in their order; then their backwards, reversed
            for layer, s in zip(block, saved):
                layer.recompute(s, rows)
            for layer, s in reversed(list(zip(block, saved))):
                layer.backward(s, dh, rows)            # dh becomes the gradient in the layer's input
            ready(staging.layer_stage(i, n_layers))
        # h_in = embed(ids)
        emb = self.p(EMBEDDING)
        if k.is_trained(emb):
            ids = trace.ids                      # slots skip the padding token: torch's padding_idx
            k.run("embedding_backward", bucket=rows.bucket, dims={"V": self.cfg.vocab_size}, g=dh,
                  order=ids.order, bounds=ids.bounds, rows=ids.rows, out={"d_table": emb.grad}, accumulate={"d_table"})


def _model_tensors(cfg, tensors) -> tuple[dict[str, np.ndarray], dict[str, np.ndarray]]:
    """(parameters, buffers) of a model of ``cfg`` from ``tensors``: checked, and an MoE
    checkpoint's experts fused."""
    if isinstance(cfg, Lfm2MoeConfig):
        return moe_model_tensors(cfg, tensors)
    return check_tensors(cfg, tensors), {}


def _check_checkpoint_layers(value, n_layers: int) -> int | str:
    """``checkpoint_layers`` checked: "all", or an int from 0 to the model's ``n_layers``."""
    if value == "all":
        return value
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or not 0 <= value <= n_layers:
        raise ValueError(f"checkpoint_layers must be 'all' or a number of layers from 0 to {n_layers} (this "
                         f"model's decoder layers), got {value!r}")
    return int(value)

