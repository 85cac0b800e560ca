"""Lfm2Model: LFM2 (short-conv + grouped-query-attention decoder) running on generated kernels.

The forward pass is a straight list of kernel calls per layer; the backward pass is the same list
reversed, each line quoting the forward line it differentiates. Every activation is commented
with its shape. All work is recorded into the engine and submitted together.

Parameters, their gradients and per-row statistics are always f32. Activations (and their
gradients) are f32, or f16 with ``activation_dtype="f16"``: mixed precision, where every kernel
still computes in f32 and only storage narrows (see lfm2jit/precision.py).

Shapes: T positions (padded to the length bucket inside kernels), D hidden, F MLP width,
H query heads, G kv heads, E head dim (E = 2R for RoPE), V vocabulary.

Several sequences of one length run packed: B sequences of S positions are T = B*S rows, one
after another. Every kernel but two works row by row, so it runs once over all rows (bigger
matmuls, B times fewer dispatches). The causal conv and attention mix positions: both run once
over a [B, S, ...] view (their kernels' optional batch axis; each sequence is its own length
bucket there). RoPE reads position tables repeated per sequence.
"""
from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from .. import grad
from ..ops import library, precision
from ..ops.embedding import slots
from ..runtime import Tensor, arena
from ..schedule.spec import bucketed
from .adapters import LoraAdapters
from .checkpoint import check_tensors, load_checkpoint, parameter_shapes, read_generation_eos, save_checkpoint
from .config import Lfm2Config
from .generate import Sampling, generate
from .lora import AdapterError, LoraConfig, check_weights, init_weights, read_adapter, write_adapter


# The projection after each mixer: block() runs it, adding the residual in its epilogue.
OUT_PROJ = {"conv": "conv.out_proj", "full_attention": "self_attn.out_proj"}


def _k(name: str):
    return library.get(name)


@dataclass
class DeviceIds:
    """A [B, S] batch of token ids on the device, with the embedding gradient's slots (see
    intrinsics/embedding.slots), all uploaded before the forward records anything. A recorded
    train step (runtime/program.py) reads these tensors, so it replays with new ids written in."""
    host: np.ndarray                              # (B, S) int32
    ids: Tensor                                   # (T,) i32
    order: Tensor                                 # (T,) i32
    bounds: Tensor                                # (T, 2) i32
    rows: Tensor                                  # (T,) i32
    skip: int | None                              # the padding token, whose row gets no gradient

    def write(self, ids: np.ndarray) -> None:
        """New ids of the same shape (checked by the caller, as Lfm2Model.check_ids does)."""
        if ids.shape != self.host.shape:
            raise ValueError(f"ids of shape {list(ids.shape)} do not fit uploaded ids of shape {list(self.host.shape)}")
        self.host = ids.astype(np.int32)
        flat = self.host.reshape(-1)
        self.ids.write(flat)
        for t, arr in zip((self.order, self.bounds, self.rows), slots(flat, skip=self.skip)):
            t.write(arr)


@dataclass
class Trace:
    """What the forward pass saved for the backward pass."""
    ids: DeviceIds                                # every row's token id
    bucket: int
    h_in: Tensor                                  # (T, D) embeddings
    batch: int = 1                                # sequences packed in the rows,
    seq: int = 0                                  # each of this many rows
    layers: list[dict] = field(default_factory=list)
    h_out: Tensor | None = None                   # (T, D) last layer's output
    hn: Tensor | None = None                      # (T, D) after the final norm
    inv: Tensor | None = None                     # (T,) final norm's 1/rms

    @property
    def seq_bucket(self) -> int:
        """The bucket of the kernels that mix positions: packed sequences are S rows apart, so
        each is a whole bucket of S."""
        return self.bucket if self.batch == 1 else self.seq

    def by_sequence(self, x: Tensor) -> Tensor:
        """x (T, ...) as the conv and attention kernels take it: (B, S, ...) when sequences are packed."""
        return x if self.batch == 1 else x.view(self.batch, self.seq, *x.shape[1:])


class Lfm2Model:
    def __init__(self, cfg: Lfm2Config, ctx, engine, seed: int = 0, tensors: dict[str, np.ndarray] | None = None,
                 activation_dtype: str = "f32", recompute_mlp: bool = False):
        self.cfg = cfg
        self.ctx = ctx
        self.engine = engine
        self.activation_dtype = precision.check_activation_dtype(activation_dtype, ctx)
        if not isinstance(recompute_mlp, bool):
            raise TypeError(f"recompute_mlp must be True or False, got {recompute_mlp!r}")
        self.recompute_mlp = recompute_mlp     # backward recomputes the MLP's a and b too (see _recompute)
        if tensors is None:
            tensors = self._init_tensors(seed)
        tensors = check_tensors(cfg, tensors)
        # carved side by side (runtime/arena.py): the optimizer steps a run of them in one dispatch
        self._params: dict[str, Tensor] = dict(zip(tensors, arena.upload(ctx, [a.astype(np.float32) for a in tensors.values()])))
        self._rope: dict[int, tuple[Tensor, Tensor]] = {}
        self._train_ids: set[int] = set()
        self.lora: LoraAdapters | None = None
        # the ids generate stops at: generation_config.json's eos_token_id where from_pretrained
        # found one (LFM2's end of turn, <|im_end|>, with <|endoftext|>), else config.json's
        eos = cfg.eos_token_id
        self.generation_eos: tuple[int, ...] = tuple(eos if isinstance(eos, list) else [] if eos is None else [eos])

    # ---- parameters ----
    def _init_tensors(self, seed: int) -> dict[str, np.ndarray]:
        """As transformers initialises LFM2: normal(0, initializer_range) for linear, conv and embedding
        weights, zeros for biases and the padding token's embedding row, ones for norm weights."""
        rng = np.random.default_rng(seed)
        out = {}
        for name, shape in parameter_shapes(self.cfg).items():
            if "norm" in name:
                out[name] = np.ones(shape, np.float32)
            elif name.endswith(".bias"):
                out[name] = np.zeros(shape, np.float32)
            else:
                out[name] = (rng.standard_normal(shape) * self.cfg.initializer_range).astype(np.float32)
        pad = self.cfg.pad_token_id
        if pad is not None and 0 <= pad < self.cfg.vocab_size:      # nn.Embedding(padding_idx) starts at zero
            out["model.embed_tokens.weight"][pad] = 0.0
        return out

    def named_parameters(self) -> dict[str, Tensor]:
        """Parameters by transformers name (e.g. "model.layers.0.conv.in_proj.weight"), then the LoRA
        adapters' by PEFT name ("base_model.model.model.layers.0.conv.in_proj.lora_A.weight")."""
        return {**self._params, **(self.lora.named if self.lora else {})}

    def parameters(self) -> list[Tensor]:
        return list(self.named_parameters().values())

    # ---- LoRA ----
    def add_lora(self, config: LoraConfig = LoraConfig(), seed: int = 0, base_dtype: str = "f32") -> list[Tensor]:
        """New LoRA adapters (B = 0: the model's outputs are unchanged) on the layers ``config``
        targets; returns their tensors, the ones to train (``lora_parameters``). ``base_dtype="f16"``
        keeps the decoder's linear weights as f16, halving their memory; they are then frozen.
        ``seed`` draws A and, with ``config.dropout``, the training passes' dropout masks."""
        if not isinstance(config, LoraConfig):
            raise TypeError(f"add_lora takes a LoraConfig, got {type(config).__name__}")
        modules = config.modules(self.cfg)
        self._attach(config, modules, init_weights(config, modules, seed), base_dtype, seed)
        return self.lora_parameters()

    def load_adapter(self, directory, base_dtype: str = "f32", seed: int = 0) -> list[Tensor]:
        """A PEFT adapter directory (adapter_config.json + adapter_model.safetensors), checked in
        full against this model before anything changes. ``seed``: of the dropout masks (add_lora's:
        a resumed run passes the seed it started with, so it draws the masks the run would have)."""
        config, tensors = read_adapter(Path(directory))
        modules = config.modules(self.cfg)
        self._attach(config, modules, check_weights(config, modules, tensors, str(directory)), base_dtype, seed)
        return self.lora_parameters()

    def _attach(self, config: LoraConfig, modules, weights: dict, base_dtype: str, seed: int = 0) -> None:
        if self.lora is not None:
            raise AdapterError("this model already has LoRA adapters: merge_lora() folds them in first")
        if base_dtype not in ("f32", "f16"):
            raise ValueError(f"base_dtype must be 'f32' or 'f16', got {base_dtype!r}")
        if base_dtype == "f16" and not self.ctx.has_f16:
            raise ValueError(f"base_dtype='f16' needs the shader-f16 feature, which adapter {self.ctx.name!r} lacks")
        self.lora = LoraAdapters(config, dict(zip(weights, arena.upload(self.ctx, list(weights.values())))), modules,
                                 seed)
        if base_dtype == "f16":
            self._reupload(set(self._base_linears()))

    def _reupload(self, to_f16: set[str]) -> None:
        """The parameters named in ``to_f16`` as f16 in an arena of their own, the others
        re-uploaded as f32 into a fresh one (new tensors, same values, the model's order), so the
        old arena, and with it the f32 copies, is freed: an arena lives while any view of it does."""
        arrays = {n: t.numpy() for n, t in self._params.items()}
        new: dict[str, Tensor] = {}
        for dtype, names in (("f32", [n for n in arrays if n not in to_f16]), ("f16", [n for n in arrays if n in to_f16])):
            new.update(zip(names, arena.upload(self.ctx, [arrays[n] for n in names], dtype)))
        self._params = {n: new[n] for n in arrays}

    def _base_linears(self) -> list[str]:
        return [n for n, shape in parameter_shapes(self.cfg).items()
                if n.startswith("model.layers.") and n.endswith(".weight") and len(shape) == 2]

    def lora_parameters(self) -> list[Tensor]:
        return list(self.lora.named.values()) if self.lora else []

    def save_adapter(self, directory, base_model: str | None = None) -> None:
        """adapter_config.json + adapter_model.safetensors, as PeftModel.save_pretrained writes them."""
        if self.lora is None:
            raise AdapterError("this model has no LoRA adapters to save (add_lora or load_adapter first)")
        write_adapter(Path(directory), self.lora.config, {n: t.numpy() for n, t in self.lora.named.items()}, base_model)

    def merge_lora(self) -> None:
        """Fold the adapters into the base weights (W += s * B A, in float64, stored as the weight's
        dtype: an f16 base is rounded to f16, as merging into a half-precision base in PEFT is) and
        drop them, so ``save_pretrained`` writes a plain model."""
        if self.lora is None:
            raise AdapterError("this model has no LoRA adapters to merge")
        s = self.lora.config.scaling
        for module, ad in self.lora.by_module.items():
            w = self._params[module + ".weight"]
            merged = w.numpy().astype(np.float64) + s * (ad.b.numpy().astype(np.float64) @ ad.a.numpy().astype(np.float64))
            w.write(merged.astype(_NUMPY[w.dtype]))
        self.lora = None

    def p(self, name: str) -> Tensor:
        return self._params[name]

    @property
    def lm_head(self) -> Tensor:
        return self._params["model.embed_tokens.weight" if self.cfg.tie_word_embeddings else "lm_head.weight"]

    # ---- checkpoints ----
    @classmethod
    def from_pretrained(cls, directory, ctx, engine, activation_dtype: str = "f32",
                        recompute_mlp: bool = False) -> "Lfm2Model":
        directory = Path(directory)
        cfg = Lfm2Config.from_json(directory / "config.json")
        model = cls(cfg, ctx, engine, tensors=load_checkpoint(directory), activation_dtype=activation_dtype,
                    recompute_mlp=recompute_mlp)
        eos = read_generation_eos(directory)
        if eos:
            model.generation_eos = tuple(sorted(model._eos_ids(eos)))
        return model

    def state_dict(self) -> dict[str, np.ndarray]:
        """The base model's tensors, as f32 (without adapters: ``save_adapter`` writes those)."""
        return {n: t.numpy().astype(np.float32) for n, t in self._params.items()}

    def save_pretrained(self, directory, dtype: str = "f32") -> None:
        """config.json + model.safetensors that transformers' Lfm2ForCausalLM.from_pretrained loads,
        stored as ``dtype`` ("f32", "bf16" or "f16": rounded to nearest even)."""
        tensors = self.state_dict()
        if self.cfg.tie_word_embeddings:
            tensors["lm_head.weight"] = tensors["model.embed_tokens.weight"]   # transformers expects it
        save_checkpoint(Path(directory), self.cfg, tensors, dtype)

    def load_state(self, tensors: dict[str, np.ndarray]) -> None:
        for name, arr in check_tensors(self.cfg, tensors).items():
            self._params[name].write(arr.astype(_NUMPY[self._params[name].dtype]))

    # ---- input checks ----
    def check_ids(self, ids, what: str = "input_ids") -> np.ndarray:
        """The ids as int32 [B, T] (a 1-D sequence is B = 1)."""
        arr = np.asarray(ids)
        if arr.ndim == 1:
            arr = arr[None]
        if arr.ndim != 2 or arr.size == 0:
            raise ValueError(f"{what} must be a non-empty [T] sequence or [B, T] batch of token ids, "
                             f"got shape {list(np.shape(ids))}")
        if not np.issubdtype(arr.dtype, np.integer):
            raise ValueError(f"{what} must be integers, got {arr.dtype}")
        bad = np.argwhere((arr < 0) | (arr >= self.cfg.vocab_size))
        if bad.size:
            at = tuple(bad[0]) if np.ndim(ids) == 2 else (bad[0][1],)
            raise ValueError(f"{what}[{', '.join(map(str, at))}] = {arr[tuple(bad[0])]} is outside the vocabulary "
                             f"0..{self.cfg.vocab_size - 1}")
        return arr.astype(np.int32)

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

    def upload_ids(self, input_ids) -> DeviceIds:
        """Check ids ([S] or [B, S], as ``forward`` takes them) and upload them with their slots."""
        return self._upload(self.check_ids(input_ids))

    def _upload(self, ids: np.ndarray) -> DeviceIds:
        flat = ids.reshape(-1)
        order, bounds, rows = slots(flat, skip=self.cfg.pad_token_id)
        e = self.engine
        return DeviceIds(ids, e.tensor(flat), e.tensor(order), e.tensor(bounds), e.tensor(rows), self.cfg.pad_token_id)

    def rope_tables(self, t_pad: int, seq: int | None = None) -> tuple[Tensor, Tensor]:
        """cos and sin (T_pad, R) for positions 0..T_pad-1 (or, packed, 0..seq-1 repeated), computed
        once per bucket on the host in float32 as transformers does (angle = position * inv_freq)."""
        key = (t_pad, seq)
        if key not in self._rope:
            cos, sin = self.rope_angles(np.arange(t_pad) if seq is None else np.arange(t_pad) % seq)
            self._rope[key] = (Tensor.from_numpy(self.ctx, cos), Tensor.from_numpy(self.ctx, sin))
        return self._rope[key]

    def rope_angles(self, positions) -> tuple[np.ndarray, np.ndarray]:
        """float32 cos and sin [len(positions), R] as transformers computes them (angle = position * inv_freq)."""
        e = self.cfg.head_dim
        inv_freq = (1.0 / (self.cfg.rope_theta ** (np.arange(0, e, 2, dtype=np.int64).astype(np.float32) / e)))
        ang = np.asarray(positions).astype(np.float32)[:, None] * inv_freq.astype(np.float32)[None]
        return np.cos(ang), np.sin(ang)

    def _run(self, kernel, **args) -> dict[str, Tensor]:
        """engine.run with the kernel's variant for this model's activation dtype."""
        return precision.run(self.engine, kernel, self.activation_dtype, **args)

    # ---- forward ----
    def forward(self, input_ids, bucket: int = 1, keep_from: int = 0, train: bool = False) -> Trace:
        """Record the forward pass up to the final norm; the trace holds what backward needs.
        ``input_ids`` is one sequence [S] or a batch [B, S] of equally long ones (packed; S a
        multiple of ``pack_multiple()`` when B > 1), or those ids already uploaded (``upload_ids``).
        Layers below ``keep_from`` keep nothing: a backward that starts higher (``backward_start``)
        never reads them, so their activations go back to the pool as the forward moves on.
        ``train``: a training pass, which applies LoRA dropout (masks from the keys of the last
        ``lora.draw_dropout``); evaluation and generation leave it out, as PEFT's eval mode does."""
        uploaded = isinstance(input_ids, DeviceIds)
        host = input_ids.host if uploaded else self.check_ids(input_ids)
        batch, seq = host.shape
        if batch > 1 and seq % self.pack_multiple():
            raise ValueError(f"input_ids: a batch of {batch} sequences of {seq} positions; packed sequences must be "
                             f"a multiple of {self.pack_multiple()} positions long (pad them)")
        ids = input_ids if uploaded else self._upload(host)
        run, cfg = self._run, self.cfg
        h = run(_k("embedding"), bucket=bucket, table=self.p("model.embed_tokens.weight"), ids=ids.ids)["y"]  # (T, D)
        trace = Trace(ids, bucket, h, batch, seq)
        for i, kind in enumerate(cfg.layer_types):
            mix = self._conv_forward if kind == "conv" else self._attention_forward
            s: dict = {"kind": kind, "pre": f"model.layers.{i}.", "dropout": train}
            h = self.block(h, s, bucket, lambda s: mix(s["pre"], s, trace))
            del s["xn"]            # xn, xf and g are recomputed by backward (see _recompute)
            if self.recompute_mlp:
                del s["a"], s["b"]      # and so are a and b
            trace.layers.append(s if i >= keep_from else None)
        trace.h_out = h
        fin = run(_k("rmsnorm"), bucket=bucket, x=h, w=self.p("model.embedding_norm.weight"), eps=cfg.norm_eps)
        trace.hn, trace.inv = fin["y"], fin["inv"]                                                  # (T, D), (T,)
        return trace

    def block(self, h: Tensor, s: dict, bucket: int, mix) -> Tensor:
        """One decoder layer (its name prefix in s["pre"]) from its input h: the operator norm,
        ``mix(s)`` (the conv or attention over the normed s["xn"] up to its out_proj's input: the
        forward's, or a decode step's against an inference cache), out_proj with the residual added
        in its GEMM's epilogue, then the SwiGLU MLP, whose w2 adds the second residual the same way.
        What backward reads is left in ``s``."""
        run, pre = self._run, s["pre"]
        s["h"] = h                                                                                  # (T, D) layer input
        s["xn"], s["inv_op"] = self._norm(h, pre + "operator_norm.weight", bucket)                  # (T, D), (T,)
        mixed = mix(s)                                                             # (T, D) conv, (T, H * E) attention
        h1 = self._linear(mixed, pre + OUT_PROJ[s["kind"]], bucket, saved=s, residual=h)           # (T, D) h + op
        s["h1"] = h1
        xf, s["inv_ffn"] = self._norm(h1, pre + "ffn_norm.weight", bucket)                          # (T, D), (T,)
        s["a"] = self._linear(xf, pre + "feed_forward.w1", bucket, saved=s)                         # (T, F)
        s["b"] = self._linear(xf, pre + "feed_forward.w3", bucket, saved=s)                         # (T, F)
        g = run(_k("silu_mul"), bucket=bucket, a=s["a"], b=s["b"])["y"]                             # (T, F) silu(a) * b
        return self._linear(g, pre + "feed_forward.w2", bucket, saved=s, residual=h1)               # (T, D) h1 + w2(g)

    def _norm(self, x: Tensor, name: str, bucket: int) -> tuple[Tensor, Tensor]:
        """rmsnorm(x) * w and the rows' 1/rms."""
        out = self._run(_k("rmsnorm"), bucket=bucket, x=x, w=self.p(name), eps=self.cfg.norm_eps)
        return out["y"], out["inv"]

    def _recompute(self, s: dict, bucket: int, gate: bool = True) -> None:
        """Put back what forward did not keep: the normed inputs xn and xf and (``gate``: w2's
        backward reads it) the SwiGLU output g (one [T, F] and two [T, D] per layer, the largest
        activations after a and b), and with recompute_mlp a and b as well (two more [T, F]: the
        largest, for two matmuls per layer). The same kernels on the same inputs give bit-identical
        values, so gradients are unchanged."""
        pre = s["pre"]
        s["xn"] = self._norm(s["h"], pre + "operator_norm.weight", bucket)[0]                       # (T, D)
        s["xf"] = self._norm(s["h1"], pre + "ffn_norm.weight", bucket)[0]                           # (T, D)
        if "a" not in s:
            s["a"] = self._linear(s["xf"], pre + "feed_forward.w1", bucket, saved=s)                # (T, F)
            s["b"] = self._linear(s["xf"], pre + "feed_forward.w3", bucket, saved=s)                # (T, F)
        if gate:
            s["g"] = self._run(_k("silu_mul"), bucket=bucket, a=s["a"], b=s["b"])["y"]              # (T, F)

    def _linear(self, x: Tensor, name: str, bucket: int, saved: dict | None = None,
                residual: Tensor | None = None) -> Tensor:
        """y = x W^T (+ residual) (+ b): torch.nn.Linear with W stored [out, in]; the residual is
        added in the GEMM's epilogue. A LoRA adapter's low-rank activation is kept in ``saved``
        (the layer's trace) for the backward."""
        w = self.p(name + ".weight")
        r = {"r": residual} if residual is not None else {}
        if self.lora and name in self.lora.by_module:
            y, u = self.lora.forward(self._run, x, name, w, bucket, dropout=_training_pass(saved), **r)
            if saved is not None:
                saved["lora:" + name] = u
        else:
            y = self._run(_k("linear"), bucket=bucket, x=x, w=w, **r)["y"]
        if name + ".bias" in self._params:
            self._run(_k("bias_add"), bucket=bucket, y=y, b=self.p(name + ".bias"))
        return y

    def _conv_forward(self, pre: str, s: dict, trace: Trace) -> Tensor:
        t, d, taps = s["xn"].shape[0], self.cfg.hidden_size, self.cfg.conv_L_cache
        s["bcx"] = self._linear(s["xn"], pre + "conv.in_proj", trace.bucket, saved=s)               # (T, 3D) = B, C, x
        args = {"bcx": trace.by_sequence(s["bcx"].view(t, 3, d)),                                    # (T, 3, D)
                "w": self.p(pre + "conv.conv.weight").view(d, taps)}                                 # (D, L)
        if self.cfg.conv_bias:
            args["b"] = self.p(pre + "conv.conv.bias")
        s["c"] = self._run(_k("short_conv"), bucket=trace.seq_bucket, **args)["y"].view(t, d)      # (T, D) C * conv(B x)
        return s["c"]                                                                               # out_proj's input

    def _attention_forward(self, pre: str, s: dict, trace: Trace) -> Tensor:
        cfg, run, bucket = self.cfg, self._run, trace.bucket
        t, h, g, e = s["xn"].shape[0], cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
        a = pre + "self_attn."
        s["q"] = self._linear(s["xn"], a + "q_proj", bucket, saved=s).view(t, h, e)                 # (T, H, E)
        s["k"] = self._linear(s["xn"], a + "k_proj", bucket, saved=s).view(t, g, e)                 # (T, G, E)
        s["v"] = self._linear(s["xn"], a + "v_proj", bucket, saved=s).view(t, g, e)                 # (T, G, E)
        qn = run(_k("head_rmsnorm"), bucket=bucket, x=s["q"], w=self.p(a + "q_layernorm.weight"), eps=cfg.norm_eps)
        kn = run(_k("head_rmsnorm"), bucket=bucket, x=s["k"], w=self.p(a + "k_layernorm.weight"), eps=cfg.norm_eps)
        s["qn"], s["q_inv"], s["kn"], s["k_inv"] = qn["y"], qn["inv"], kn["y"], kn["inv"]          # (T,H,E) (T,H) ..
        cos, sin = self.rope_tables(bucketed(t, bucket), trace.seq if trace.batch > 1 else None)
        s["cos"], s["sin"] = cos.rows(0, t), sin.rows(0, t)                                        # (T, R)
        qr = run(_k("rope"), bucket=bucket, x=s["qn"].view(t, h, 2, e // 2), cos=s["cos"], sin=s["sin"])["y"]
        kr = run(_k("rope"), bucket=bucket, x=s["kn"].view(t, g, 2, e // 2), cos=s["cos"], sin=s["sin"])["y"]
        s["qr"], s["kr"] = qr.view(t, h, e), kr.view(t, g, e)                                      # (T, H, E), (T, G, E)
        by_seq = trace.by_sequence
        att = run(_k("attention"), bucket=trace.seq_bucket, q=by_seq(s["qr"]), k=by_seq(s["kr"]), v=by_seq(s["v"]))
        s["o"], s["lse"] = att["o"].view(t, h, e), att["lse"].view(t, h)                           # (T, H, E), (T, H)
        return s["o"].view(t, h * e)                                                                # out_proj's input

    def logits(self, input_ids, bucket: int = 1) -> np.ndarray:
        """float32 [T, vocab] logits of a sequence (materialised: for checks, not for training)."""
        trace = self.forward(input_ids, bucket)
        return self.head_logits(trace.hn, bucket)

    def head_logits(self, hn: Tensor, bucket: int = 1) -> np.ndarray:
        """float32 [rows, vocab] logits of final-normed hidden states [rows, D], read back."""
        y = self.engine.empty((hn.shape[0], self.cfg.vocab_size), "f32")
        return self._run(_k("linear"), bucket=bucket, x=hn, w=self.lm_head, out={"y": y})["y"].numpy()

    # ---- generation ----
    def generate(self, prompt_ids, max_new_tokens: int = 32, do_sample: bool = False, temperature: float = 1.0,
                 top_k: int = 0, top_p: float = 1.0, eos_token_id=None, seed: int = 0, on_token=None):
        """The new tokens after a prompt (a list of ids), or a list of such lists for a list of
        prompts (of any lengths; decoded as one batch). Greedy unless ``do_sample``; sampling is
        reproducible per ``seed``. Each sequence stops after ``max_new_tokens`` or an end id
        (kept, as transformers keeps it): ``eos_token_id`` (an id or a list), by default the
        model's (``generation_eos``). ``on_token(index, token)`` sees each token as it is picked.
        Everything is checked before any GPU work."""
        single = len(prompt_ids) > 0 and np.ndim(prompt_ids[0]) == 0 if isinstance(prompt_ids, (list, tuple)) \
            else np.ndim(prompt_ids) == 1
        prompts = [self.check_ids(p, "prompt_ids" if single else f"prompt_ids[{i}]")
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
        sampling = Sampling(do_sample, temperature, top_k, top_p)
        eos = self._eos_ids(eos_token_id)
        out = generate(self, [p[0] for p in prompts], max_new_tokens, sampling, eos, seed, on_token)
        return out[0] if single else out

    def _eos_ids(self, eos_token_id) -> frozenset[int]:
        ids = self.generation_eos if eos_token_id is None else (
            [eos_token_id] if np.ndim(eos_token_id) == 0 else list(eos_token_id))
        for i in ids:
            if not isinstance(i, (int, np.integer)) or isinstance(i, bool) or not 0 <= i < self.cfg.vocab_size:
                raise ValueError(f"eos_token_id {i!r} is not a token id of the vocabulary 0..{self.cfg.vocab_size - 1}")
        return frozenset(int(i) for i in ids)

    # ---- backward ----
    def zero_grad(self, params: list[Tensor] | None = None) -> None:
        """Give each parameter (default: all) a zeroed .grad. Missing gradients are carved side by
        side out of arenas (runtime/arena.py), in the order given, so passes over every gradient
        (its zeroing here, the gradient norm) take a dispatch per arena run, not per tensor."""
        params = list(params if params is not None else self.parameters())
        missing = list({id(t): t for t in params if t.grad is None}.values())
        for t, g in zip(missing, arena.carve_like(self.engine, missing)):
            t.grad = g
        for run in arena.runs([t.grad for t in params]):
            self.engine.zero_(run.span)

    def _trained(self, name: str) -> bool:
        return self._is_trained(self._params[name])

    def _is_trained(self, t: Tensor) -> bool:
        return t.grad is not None and id(t) in self._train_ids

    def check_trainable(self, params) -> None:
        """Refuse, before any GPU work, what backward cannot train: frozen f16 base weights."""
        ids = {id(t) for t in params}
        named = self.named_parameters()
        halves = [n for n, t in named.items() if id(t) in ids and t.dtype == "f16"]
        if halves:
            raise ValueError(f"{halves[0]} is a frozen f16 base weight (add_lora(base_dtype='f16')); it cannot be "
                             "trained: train the adapters (lora_parameters()), or keep the base in f32")

    def backward_start(self, params) -> int:
        """The first decoder layer a backward for ``params`` reaches (the number of layers when it
        reaches none): what ``forward(keep_from=...)`` may drop below."""
        ids = {id(t) for t in params}
        lowest = self._lowest_trained_layer(lambda t: id(t) in ids)
        return len(self.cfg.layer_types) if lowest is None else lowest

    def _lowest_trained_layer(self, trained) -> int | None:
        """The first decoder layer backward must reach: 0 when the embedding is ``trained``, None when
        no layer and not the final norm is (the LM head alone: backward has nothing to do)."""
        if trained(self.p("model.embed_tokens.weight")):
            return 0
        named = self.named_parameters()
        layers = [_layer_of(n) for n, t in named.items() if _layer_of(n) is not None and trained(t)]
        if layers:
            return min(layers)
        return len(self.cfg.layer_types) if trained(self.p("model.embedding_norm.weight")) else None

    def gradient_order(self, params) -> list[Tensor]:
        """``params`` in the order backward finishes their gradients: the final norm's, then each
        layer's from the last down, then the rest (the embedding, an untied LM head). A
        data-parallel sync stages them in this order while the backward still runs."""
        return [p for stage in self._gradient_stages(params) for p in stage]

    def _gradient_stages(self, params) -> list[list[Tensor]]:
        """``params`` by when backward finishes their gradients (see gradient_order): stage 0 the
        final norm, stage ``_layer_stage(i)`` layer i, the last stage the rest."""
        last = len(self.cfg.layer_types) + 1
        stage_of = {}
        for name, t in self.named_parameters().items():
            layer = _layer_of(name)
            stage_of[id(t)] = (0 if name == "model.embedding_norm.weight"
                               else self._layer_stage(layer) if layer is not None else last)
        stages: list[list[Tensor]] = [[] for _ in range(last + 1)]
        for p in params:
            stages[stage_of.get(id(p), last)].append(p)
        return stages

    def _layer_stage(self, layer: int) -> int:
        """The stage of layer ``layer``'s gradients: backward finishes the last layer first."""
        return len(self.cfg.layer_types) - layer

    def backward(self, trace: Trace, d_hn: Tensor, params: list[Tensor], on_ready=None) -> None:
        """Add the gradients of every parameter in ``params`` (which must have .grad) given the
        gradient of the final normed hidden state d_hn (T, D). The reverse of ``forward``, pruned
        to what the trained parameters need: nothing below the lowest layer that holds one.
        ``on_ready(tensors)``, when given, is called as soon as the recorded work has finished the
        gradients of these parameters (the final norm's, then each layer's; not the rest, which
        are finished when backward returns), so their readback can be recorded right behind it."""
        stages = self._gradient_stages(params) if on_ready is not None else None

        def ready(stage: int) -> None:
            if stages is not None and stages[stage]:
                on_ready(stages[stage])
        self.check_trainable(params)
        ids = {id(t) for t in params}
        missing = [n for n, t in self.named_parameters().items() if id(t) in ids and t.grad is None]
        if missing:
            raise ValueError(f"parameters without .grad (call zero_grad first): {missing[:3]}")
        self._train_ids = ids
        lowest = self._lowest_trained_layer(self._is_trained)
        if lowest is None:
            return
        dropped = [i for i in range(lowest, len(trace.layers)) if trace.layers[i] is None]
        if dropped:
            raise ValueError(f"this trace kept no activations for layers {', '.join(map(str, dropped))} "
                             f"(forward(keep_from=...)), which a backward for these parameters needs (it starts at "
                             f"layer {lowest})")
        bucket = trace.bucket
        # hn = rmsnorm(h_out)
        dh = self._norm_backward(trace.h_out, trace.inv, "model.embedding_norm.weight", d_hn, bucket)   # (T, D)
        ready(0)
        for i in reversed(range(lowest, len(trace.layers))):
            s = trace.layers[i]
            pre = s["pre"]
            w2, bias = pre + "feed_forward.w2", pre + "feed_forward.w2.bias"
            self._recompute(s, bucket, gate=bool(self.lora and w2 in self.lora.by_module)
                            or self._trained(w2 + ".weight") or (bias in self._params and self._trained(bias)))
            # Each [T, F] tensor is dropped (back to the pool) right after its last use, so the peak
            # holds as few of them as possible; a second backward over this trace recomputes them.
            # h = h1 + f;  f = w2(g);  g = silu(a) * b: d_a and d_b from w2's input-gradient GEMM
            gab = self._linear_backward(s.pop("g", None), w2, dh, bucket, saved=s, gate=(s.pop("a"), s.pop("b")))
            # a = w1(xf); b = w3(xf)
            xf = s.pop("xf")
            dxf = self._linear_backward(xf, pre + "feed_forward.w1", gab.pop("d_a"), bucket, saved=s)  # (T, D)
            self._linear_backward(xf, pre + "feed_forward.w3", gab.pop("d_b"), bucket, into=dxf, saved=s)
            # xf = rmsnorm(h1): dh becomes d(h1)
            self._norm_backward(s["h1"], s["inv_ffn"], pre + "ffn_norm.weight", dxf, bucket, into=dh)
            del xf, dxf
            # h1 = h + op
            if s["kind"] == "conv":
                dxn = self._conv_backward(pre, s, dh, trace)                                       # (T, D)
            else:
                dxn = self._attention_backward(pre, s, dh, trace)                                  # (T, D)
            del s["xn"]
            # xn = rmsnorm(h): dh becomes d(h)
            self._norm_backward(s["h"], s["inv_op"], pre + "operator_norm.weight", dxn, bucket, into=dh)
            ready(self._layer_stage(i))
        # h_in = embed(ids)
        emb = "model.embed_tokens.weight"
        if self._trained(emb):
            ids = trace.ids                      # slots skip the padding token: torch's padding_idx
            self._run(_k("embedding_backward"), bucket=bucket, dims={"V": self.cfg.vocab_size}, g=dh,
                      order=ids.order, bounds=ids.bounds, rows=ids.rows,
                      out={"d_table": self._params[emb].grad}, accumulate={"d_table"})

    def _linear_backward(self, x: Tensor | None, name: str, dy: Tensor, bucket: int, into: Tensor | None = None,
                         need_dx: bool = True, saved: dict | None = None, gate: tuple[Tensor, Tensor] | None = None):
        """y = x W^T (+ b): dx = dy W (new, or added into ``into``), W.grad += dy^T x, b.grad += sum dy.
        ``gate`` = (a, b): x is SwiGLU's silu(a) * b, and the gradients in a and b are returned
        instead ({"d_a", "d_b"}), stored by dx's GEMM from its epilogue; x may then be None when
        nothing else reads it (W and b frozen, no adapter)."""
        w = self._params[name + ".weight"]
        run = self._run
        dx = None
        if self.lora and name in self.lora.by_module:
            u = saved.pop("lora:" + name, None) if saved is not None else None
            dx = self.lora.backward(run, _grad, self._is_trained, x, name, w, dy, bucket, u,
                                    dropout=_training_pass(saved), dx=into, need_dx=need_dx, gate=gate)
        elif gate is not None:
            dx = run(_grad("swiglu_down", ("a", "b")), bucket=bucket, a=gate[0], b=gate[1], w=w, d_y=dy)
        elif need_dx:
            out = {"d_x": into} if into is not None else {}
            dx = run(_grad("linear", ("x",)), bucket=bucket, x=x, w=w, d_y=dy, out=out,
                     accumulate={"d_x"} if into is not None else set())["d_x"]
        if self._trained(name + ".weight"):
            run(_grad("linear", ("w",)), bucket=bucket, x=x, w=w, d_y=dy, out={"d_w": w.grad}, accumulate={"d_w"})
        if name + ".bias" in self._params and self._trained(name + ".bias"):
            run(_k("bias_grad"), bucket=bucket, dy=dy, out={"db": self._params[name + ".bias"].grad},
                accumulate={"db"})
        return dx

    def _norm_backward(self, x: Tensor, inv: Tensor, name: str, dy: Tensor, bucket: int,
                       into: Tensor | None = None) -> Tensor:
        """y = x * inv * w: dx (new, or added into ``into``) and w.grad += ..."""
        w = self._params[name]
        out = {"d_x": into} if into is not None else {}
        acc = {"d_x"} if into is not None else set()
        if self._trained(name):
            out["d_w"] = w.grad
            acc.add("d_w")
            kernel = _grad("rmsnorm", ("x", "w"), ("y",))
        else:
            kernel = _grad("rmsnorm", ("x",), ("y",))
        return self._run(kernel, bucket=bucket, x=x, w=w, inv=inv, d_y=dy, out=out, accumulate=acc)["d_x"]

    def _conv_backward(self, pre: str, s: dict, d_op: Tensor, trace: Trace) -> Tensor:
        t, d, taps, bucket = s["xn"].shape[0], self.cfg.hidden_size, self.cfg.conv_L_cache, trace.bucket
        # op = out_proj(c)
        dc = self._linear_backward(s["c"], pre + "conv.out_proj", d_op, bucket, saved=s)            # (T, D)
        # c = C * conv(B x)
        names = {"w": pre + "conv.conv.weight", "b": pre + "conv.conv.bias"}
        wrt = ["bcx"] + [k for k, n in names.items() if n in self._params and self._trained(n)]
        args = {"bcx": trace.by_sequence(s["bcx"].view(t, 3, d)), "w": self.p(names["w"]).view(d, taps),
                "d_y": trace.by_sequence(dc)}
        if self.cfg.conv_bias:
            args["b"] = self.p(names["b"])
        out = {"d_w": self.p(names["w"]).grad.view(d, taps)} if "w" in wrt else {}
        if "b" in wrt:
            out["d_b"] = self.p(names["b"]).grad
        g = self._run(_grad("short_conv", tuple(wrt)), bucket=trace.seq_bucket, out=out, accumulate=set(out), **args)
        # bcx = in_proj(xn)
        return self._linear_backward(s["xn"], pre + "conv.in_proj", g["d_bcx"].view(t, 3 * d), bucket, saved=s)  # (T, D)

    def _attention_backward(self, pre: str, s: dict, d_op: Tensor, trace: Trace) -> Tensor:
        cfg, run, bucket = self.cfg, self._run, trace.bucket
        t, h, g, e = s["xn"].shape[0], cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
        a = pre + "self_attn."
        # op = out_proj(o)
        do = self._linear_backward(s["o"].view(t, h * e), a + "out_proj", d_op, bucket, saved=s)    # (T, H*E)
        # o, lse = attention(qr, kr, v)
        by_seq = trace.by_sequence
        ga = run(_grad("attention", ("q", "k", "v"), ("o",)), bucket=trace.seq_bucket, q=by_seq(s["qr"]), k=by_seq(s["kr"]),
                 v=by_seq(s["v"]), o=by_seq(s["o"]), lse=by_seq(s["lse"]), d_o=by_seq(do.view(t, h, e)))
        ga = {x: ga[x].view(t, *ga[x].shape[-2:]) for x in ("d_q", "d_k", "d_v")}                # (T, heads, E)
        draw = {}
        for x, heads, ln in (("q", h, "q_layernorm"), ("k", g, "k_layernorm")):
            # xr = rope(xn)
            dn = run(_grad("rope", ("x",)), bucket=bucket, cos=s["cos"], sin=s["sin"],
                     d_y=ga[f"d_{x}"].view(t, heads, 2, e // 2))["d_x"]                           # (T, heads, 2, R)
            # xn = head_rmsnorm(x)
            draw[x] = self._norm_backward_heads(s[x], s[f"{x}_inv"], a + ln + ".weight", dn.view(t, heads, e), bucket)
        # q, k, v = projections of xn
        dxn = self._linear_backward(s["xn"], a + "q_proj", draw["q"].view(t, h * e), bucket, saved=s)  # (T, D)
        self._linear_backward(s["xn"], a + "k_proj", draw["k"].view(t, g * e), bucket, into=dxn, saved=s)
        self._linear_backward(s["xn"], a + "v_proj", ga["d_v"].view(t, g * e), bucket, into=dxn, saved=s)
        return dxn

    def _norm_backward_heads(self, x: Tensor, inv: Tensor, name: str, dy: Tensor, bucket: int) -> Tensor:
        w = self._params[name]
        if self._trained(name):
            return self._run(_grad("head_rmsnorm", ("x", "w"), ("y",)), bucket=bucket, x=x, w=w, inv=inv,
                                   d_y=dy, out={"d_w": w.grad}, accumulate={"d_w"})["d_x"]
        return self._run(_grad("head_rmsnorm", ("x",), ("y",)), bucket=bucket, x=x, w=w, inv=inv,
                               d_y=dy)["d_x"]


_NUMPY = {"f32": np.float32, "f16": np.float16}
_BACKWARDS: dict[tuple, object] = {}


def _layer_of(name: str) -> int | None:
    """The decoder layer a parameter belongs to, from its name (the model's "model.layers.3.…" or
    PEFT's "base_model.model.model.layers.3.…"), or None."""
    at = re.search(r"\blayers\.(\d+)\.", name)
    return int(at.group(1)) if at else None


def _training_pass(saved: dict | None) -> bool:
    """Whether the layer trace ``saved`` is a training pass's (forward(train=True): LoRA dropout applies)."""
    return bool(saved and saved.get("dropout"))


def _grad(name: str, wrt: tuple[str, ...] | None = None, cotangents: tuple[str, ...] | None = None):
    """The backward kernels of a shipped kernel, made once per (wrt, cotangents)."""
    key = (name, wrt, cotangents)
    if key not in _BACKWARDS:
        _BACKWARDS[key] = grad(library.get(name), list(wrt) if wrt else None, list(cotangents) if cotangents else None)
    return _BACKWARDS[key]
