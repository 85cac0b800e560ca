"""LFM2-MoE checkpoints (``lfm2_moe``): the tensor table, the two expert layouts, safetensors in and out.

transformers keeps each sparse layer's experts fused in memory::

    model.layers.{i}.feed_forward.experts.gate_up_proj   [E, 2I, D]   w1 (rows :I) then w3 (rows I:)
    model.layers.{i}.feed_forward.experts.down_proj      [E, D, I]    w2

and saves them per expert (its conversion mapping for ``lfm2_moe`` merges them on load)::

    model.layers.{i}.feed_forward.experts.{e}.w1.weight  [I, D]
    model.layers.{i}.feed_forward.experts.{e}.w3.weight  [I, D]
    model.layers.{i}.feed_forward.experts.{e}.w2.weight  [D, I]

beside the router ``feed_forward.gate.weight`` [E, D] and the f32 buffer ``feed_forward.expert_bias`` [E]
(when ``use_expert_bias``). The first ``num_dense_layers`` layers have the dense MLP
(``feed_forward.w1/w3/w2.weight``, width ``intermediate_size``). lfm2jit's form is the per-expert one:
it reads both forms (a model directory, a state dict) and writes the per-expert form.
"""
from __future__ import annotations

import re
from pathlib import Path

import numpy as np

from .checkpoint import (SAVE_DTYPES, CheckpointError, Tensors, _narrow, check_tensors, initial_array, load_checkpoint,
                         parameter_shapes, write_config)
from .moe_config import Lfm2MoeConfig
from .quantize import QuantizedHost, quantized_concat, quantized_reshape, quantized_rows
from .shards import write_weights

EXPERT_BIAS = "feed_forward.expert_bias"
_PER_EXPERT = re.compile(r"model\.layers\.(\d+)\.feed_forward\.experts\.(\d+)\.(w[123])\.weight")
_FUSED = re.compile(r"model\.layers\.(\d+)\.feed_forward\.experts\.(gate_up_proj|down_proj)")


def moe_tensor_shapes(cfg: Lfm2MoeConfig) -> dict[str, tuple[int, ...]]:
    """Every tensor of an lfm2_moe checkpoint in the per-expert form, by its transformers name, in the
    model's order: parameters, and the ``expert_bias`` buffers (see ``is_buffer``)."""
    dense = parameter_shapes(cfg)          # the backbone, with the dense MLP in every layer
    d, i_moe, n_exp = cfg.hidden_size, cfg.moe_intermediate_size, cfg.num_experts
    moe = set(cfg.moe_layers)
    shapes: dict[str, tuple[int, ...]] = {}
    for name, shape in dense.items():
        m = re.fullmatch(r"model\.layers\.(\d+)\.feed_forward\.(w[123])\.weight", name)
        if m is None or int(m.group(1)) not in moe:
            shapes[name] = shape
            continue
        if m.group(2) != "w1":        # the whole sparse block is written where the dense w1 was
            continue
        p = f"model.layers.{m.group(1)}.feed_forward."
        shapes[p + "gate.weight"] = (n_exp, d)
        for e in range(n_exp):
            shapes[p + f"experts.{e}.w1.weight"] = (i_moe, d)
            shapes[p + f"experts.{e}.w3.weight"] = (i_moe, d)
            shapes[p + f"experts.{e}.w2.weight"] = (d, i_moe)
        if cfg.use_expert_bias:
            shapes[p + "expert_bias"] = (n_exp,)
    return shapes


def moe_model_shapes(cfg: Lfm2MoeConfig) -> dict[str, tuple[int, ...]]:
    """The model's parameters as it holds them, by transformers' in-memory names, in the model's
    order: each sparse layer's experts fused (``experts.gate_up_proj`` [E, 2I, D] and
    ``experts.down_proj`` [E, D, I], as ``fuse_experts`` stacks them), no buffers."""
    out: dict[str, tuple[int, ...]] = {}
    e, d, i = cfg.num_experts, cfg.hidden_size, cfg.moe_intermediate_size
    for name, shape in moe_parameter_shapes(cfg).items():
        m = _PER_EXPERT.fullmatch(name)
        if m is None:
            out[name] = shape
        elif m.group(2) == "0" and m.group(3) == "w1":
            p = f"model.layers.{m.group(1)}.feed_forward.experts."
            out[p + "gate_up_proj"], out[p + "down_proj"] = (e, 2 * i, d), (e, d, i)
    return out


def model_parameter_shapes(cfg) -> dict[str, tuple[int, ...]]:
    """The parameters a model of ``cfg`` holds, dense (``parameter_shapes``) or MoE (``moe_model_shapes``)."""
    return moe_model_shapes(cfg) if isinstance(cfg, Lfm2MoeConfig) else parameter_shapes(cfg)


def check_model_tensors(cfg, tensors: dict) -> dict[str, np.ndarray]:
    """A checkpoint's tensors checked against a model of ``cfg``, dense (``check_tensors``) or MoE
    (``check_moe_tensors``: per expert, beside the expert_bias buffers)."""
    return check_moe_tensors(cfg, tensors) if isinstance(cfg, Lfm2MoeConfig) else check_tensors(cfg, tensors)


def moe_model_tensors(cfg: Lfm2MoeConfig, tensors: dict) -> tuple[dict[str, np.ndarray], dict[str, np.ndarray]]:
    """A checkpoint's tensors (either expert form) as the model holds them: its parameters in
    ``moe_model_shapes``' order and form, and its ``expert_bias`` buffers; checked first."""
    fused = fuse_experts(cfg, check_moe_tensors(cfg, tensors))
    params = {n: fused[n] for n in moe_model_shapes(cfg)}
    return params, {n: a for n, a in fused.items() if is_buffer(n)}


def moe_parameter_shapes(cfg: Lfm2MoeConfig) -> dict[str, tuple[int, ...]]:
    """The trainable parameters only (``moe_tensor_shapes`` less the ``expert_bias`` buffers)."""
    return {n: s for n, s in moe_tensor_shapes(cfg).items() if not is_buffer(n)}


def is_buffer(name: str) -> bool:
    """A tensor the checkpoint holds that is not trained: the router's ``expert_bias``."""
    return name.endswith("." + EXPERT_BIAS)


def _where(tensors) -> str:
    src = getattr(tensors, "source", None)
    return f"{src}: " if src is not None else ""


def unfuse_experts(cfg: Lfm2MoeConfig, tensors: dict) -> dict[str, np.ndarray]:
    """``tensors`` with every fused ``experts.gate_up_proj`` / ``experts.down_proj`` split into the
    per-expert w1/w3/w2 tensors (numpy arrays, or anything ``np.asarray`` takes, e.g. CPU torch
    tensors); other tensors pass through. A fused tensor whose expert count or sizes disagree with the
    config, or a layer holding both forms, is a CheckpointError."""
    out = Tensors()
    out.source = getattr(tensors, "source", None)
    fused_layers: set[int] = set()
    n_exp, d, i_moe = cfg.num_experts, cfg.hidden_size, cfg.moe_intermediate_size
    for name, value in tensors.items():
        m = _FUSED.fullmatch(name)
        if m is None:
            out[name] = value
            continue
        layer, kind = int(m.group(1)), m.group(2)
        a = value if isinstance(value, QuantizedHost) else _numpy(value)
        want = (n_exp, 2 * i_moe, d) if kind == "gate_up_proj" else (n_exp, d, i_moe)
        if a.shape != want:
            what = (f"{a.shape[0]} experts but num_experts is {n_exp}" if len(a.shape) == 3 and a.shape[0] != n_exp
                    else f"shape {list(a.shape)}, expected {list(want)} ([num_experts, "
                         + ("2*moe_intermediate_size, hidden_size])" if kind == "gate_up_proj"
                            else "hidden_size, moe_intermediate_size])"))
            raise CheckpointError(f"{_where(tensors)}{name} has {what}")
        fused_layers.add(layer)
        p = f"model.layers.{layer}.feed_forward.experts."
        for e in range(n_exp):
            if kind == "gate_up_proj":
                out[p + f"{e}.w1.weight"] = _expert_rows(a, e, 0, i_moe)
                out[p + f"{e}.w3.weight"] = _expert_rows(a, e, i_moe, 2 * i_moe)
            else:
                out[p + f"{e}.w2.weight"] = _expert_rows(a, e, 0, d)
    both = sorted({int(m.group(1)) for n in tensors if (m := _PER_EXPERT.fullmatch(n))} & fused_layers)
    if both:
        raise CheckpointError(f"{_where(tensors)}layers {both} hold their experts both fused (gate_up_proj/"
                              "down_proj) and per expert (experts.{e}.w1/w3/w2); expected one form")
    return out


def fuse_experts(cfg: Lfm2MoeConfig, tensors: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """The per-expert tensors of each sparse layer stacked into transformers' in-memory form
    (``experts.gate_up_proj`` [E, 2I, D], ``experts.down_proj`` [E, D, I]); others pass through.
    ``tensors`` must hold every expert (as ``check_moe_tensors`` leaves them)."""
    out: dict[str, np.ndarray] = {}
    for name, a in tensors.items():
        m = _PER_EXPERT.fullmatch(name)
        if m is None:
            out[name] = a
            continue
        layer, e = int(m.group(1)), int(m.group(2))
        if e != 0 or m.group(3) != "w1":
            continue
        p = f"model.layers.{layer}.feed_forward.experts."
        ex = range(cfg.num_experts)
        out[p + "gate_up_proj"] = _stacked([[tensors[p + f"{k}.w1.weight"], tensors[p + f"{k}.w3.weight"]] for k in ex])
        out[p + "down_proj"] = _stacked([[tensors[p + f"{k}.w2.weight"]] for k in ex])
    return out


def _expert_rows(a, e: int, lo: int, hi: int):
    """``a[e, lo:hi]`` of a fused expert tensor [E, R, C], a float array or a quantized one."""
    if not isinstance(a, QuantizedHost):
        return a[e, lo:hi]
    rows = a.shape[1]
    return quantized_rows(quantized_reshape(a, (a.shape[0] * rows,) + tuple(a.shape[2:])), e * rows + lo, e * rows + hi)


def _stacked(experts: list[list]):
    """Each expert's pieces joined along their rows, the experts stacked: [E, rows, C] (float arrays
    or quantized ones, as the pieces are)."""
    if not isinstance(experts[0][0], QuantizedHost):
        return np.stack([np.concatenate(pieces) for pieces in experts])
    joined = quantized_concat([p for pieces in experts for p in pieces])
    return quantized_reshape(joined, (len(experts), joined.shape[0] // len(experts)) + tuple(joined.shape[1:]))


def check_moe_tensors(cfg: Lfm2MoeConfig, tensors: dict) -> dict[str, np.ndarray]:
    """The checkpoint's tensors in the per-expert form (fused experts split), checked against
    ``moe_tensor_shapes``; a tied checkpoint's lm_head is dropped. Expert counts that disagree with
    ``num_experts``, missing, unexpected or mis-shaped tensors are one CheckpointError listing them."""
    tensors = unfuse_experts(cfg, tensors)
    where = _where(tensors)
    want = moe_tensor_shapes(cfg)
    have = dict(tensors)
    if cfg.tie_word_embeddings:
        have.pop("lm_head.weight", None)     # some tied checkpoints store it anyway
    per_layer: dict[int, set[int]] = {}
    for n in have:
        if (m := _PER_EXPERT.fullmatch(n)):
            per_layer.setdefault(int(m.group(1)), set()).add(int(m.group(2)))
    counts = [f"layer {i} has {max(es) + 1} experts" for i, es in sorted(per_layer.items())
              if max(es) + 1 != cfg.num_experts]
    if counts:
        raise CheckpointError(f"{where}checkpoint does not match the config: " + ", ".join(counts)
                              + f" but num_experts is {cfg.num_experts}")
    missing = [n for n in want if n not in have]
    unexpected = [n for n in have if n not in want]
    misshaped = [f"{n}: {list(_shape(have[n]))} (expected {list(want[n])})"
                 for n in want if n in have and _shape(have[n]) != want[n]]
    if missing or unexpected or misshaped:
        parts = []
        if missing:
            parts.append("missing: " + ", ".join(_compact(missing)))
        if unexpected:
            parts.append("unexpected: " + ", ".join(_compact(unexpected)))
        if misshaped:
            parts.append("wrong shape: " + "; ".join(misshaped[:8]) + (f"; ... {len(misshaped) - 8} more"
                                                                       if len(misshaped) > 8 else ""))
        raise CheckpointError(f"{where}checkpoint does not match the config: " + " | ".join(parts))
    return {n: _float(have[n]) for n in want}


def _shape(value) -> tuple[int, ...]:
    return tuple(value.shape) if hasattr(value, "shape") else np.shape(value)


def _float(value) -> np.ndarray:
    """float32, or float16 or quantized as given (an f16 or quantized base read so: widening it
    would undo that)."""
    if isinstance(value, QuantizedHost):
        return value
    a = _numpy(value)
    return a if a.dtype == np.float16 else a.astype(np.float32, copy=False)


def _numpy(value) -> np.ndarray:
    """A numpy array of a tensor: numpy as is; torch (any float dtype, bf16 too) widened on the CPU."""
    if hasattr(value, "detach"):
        value = value.detach().cpu()
        return value.float().numpy() if value.is_floating_point() else value.numpy()
    return np.asarray(value)


def _compact(names: list[str], limit: int = 12) -> list[str]:
    return names if len(names) <= limit else names[:limit] + [f"... {len(names) - limit} more"]


def load_moe_pretrained(directory, cfg: Lfm2MoeConfig | None = None
                        ) -> tuple[Lfm2MoeConfig, dict[str, np.ndarray]]:
    """A model directory's config (config.json, unless ``cfg`` is given) and its tensors in the
    per-expert form as float32, from ``model.safetensors`` or the shards that
    ``model.safetensors.index.json`` names; experts stored fused or per expert."""
    d = Path(directory)
    cfg = Lfm2MoeConfig.from_json(d) if cfg is None else cfg
    return cfg, check_moe_tensors(cfg, load_checkpoint(d))


def save_moe_pretrained(directory, cfg: Lfm2MoeConfig, tensors: dict, dtype: str = "f32",
                        max_shard_size=None) -> list[Path]:
    """Writes config.json and the per-expert tensors (``tensors`` in either form) that transformers'
    Lfm2MoeForCausalLM loads: one ``model.safetensors``, or shards of at most ``max_shard_size`` (bytes
    or "5GB") with ``model.safetensors.index.json``. ``dtype``: f32, f16 or bf16 for the parameters;
    the ``expert_bias`` buffers stay f32, as transformers keeps them. Returns the weight files."""
    if dtype not in SAVE_DTYPES:
        raise ValueError(f"save dtype must be one of {', '.join(SAVE_DTYPES)}, got {dtype!r}")
    checked = check_moe_tensors(cfg, tensors)
    d = write_config(directory, cfg, dtype)
    arrays, dtypes = {}, {}
    for name, a in checked.items():
        keep_f32 = is_buffer(name)
        arrays[name] = _narrow(a, "f32" if keep_f32 else dtype)
        dtypes[name] = "float32" if keep_f32 else SAVE_DTYPES[dtype]
    return write_weights(d, arrays, max_shard_size, dtypes)


def init_moe_tensors(cfg: Lfm2MoeConfig, seed: int) -> dict[str, np.ndarray]:
    """A new LFM2-MoE's tensors (per expert, beside the expert_bias buffers) as host arrays,
    initialised as transformers does (``initial_value``; the padding token's embedding row zero),
    drawn by numpy; ``Lfm2Model`` draws its own on the GPU (model/device_init.py)."""
    rng = np.random.default_rng(seed)
    out = {name: initial_array(rng, name, shape, cfg.initializer_range) for name, shape in moe_tensor_shapes(cfg).items()}
    pad = cfg.pad_token_id
    if pad is not None:
        out["model.embed_tokens.weight"][pad] = 0.0
    return out
