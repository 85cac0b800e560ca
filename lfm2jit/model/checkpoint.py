"""Hugging Face LFM2 checkpoints: the parameter table, and safetensors in and out.

Reads f32, f16 and bf16 tensors (bf16 widened to f32 on load) from ``model.safetensors`` or a
sharded ``model.safetensors.index.json``; writes ``model.safetensors`` (f32, or f16 / bf16 rounded to
nearest even) that transformers' Lfm2ForCausalLM loads.
"""
from __future__ import annotations

import json
import struct
from pathlib import Path

import numpy as np
from safetensors import TensorSpec, serialize_file

from .config import Lfm2Config

_DTYPES = {"F32": np.float32, "F16": np.float16, "BF16": np.uint16, "F64": np.float64}
SAVE_DTYPES = {"f32": "float32", "f16": "float16", "bf16": "bfloat16"}     # ours -> safetensors' names
_STORED = {"F32": "f32", "F64": "f32", "F16": "f16", "BF16": "bf16"}


class CheckpointError(ValueError):
    """Missing, unexpected or mis-shaped tensors, or an unreadable file; the message lists them."""


def parameter_shapes(cfg: Lfm2Config) -> dict[str, tuple[int, ...]]:
    """Every parameter of the model, by its transformers name, in the model's order."""
    d, e = cfg.hidden_size, cfg.head_dim
    shapes: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (cfg.vocab_size, d)}
    for i, kind in enumerate(cfg.layer_types):
        p = f"model.layers.{i}."
        shapes[p + "operator_norm.weight"] = (d,)
        if kind == "conv":
            shapes[p + "conv.in_proj.weight"] = (3 * d, d)
            if cfg.conv_bias:
                shapes[p + "conv.in_proj.bias"] = (3 * d,)
            shapes[p + "conv.conv.weight"] = (d, 1, cfg.conv_L_cache)
            if cfg.conv_bias:
                shapes[p + "conv.conv.bias"] = (d,)
            shapes[p + "conv.out_proj.weight"] = (d, d)
            if cfg.conv_bias:
                shapes[p + "conv.out_proj.bias"] = (d,)
        else:
            h, g = cfg.num_attention_heads, cfg.num_key_value_heads
            shapes[p + "self_attn.q_proj.weight"] = (h * e, d)
            shapes[p + "self_attn.k_proj.weight"] = (g * e, d)
            shapes[p + "self_attn.v_proj.weight"] = (g * e, d)
            shapes[p + "self_attn.out_proj.weight"] = (d, h * e)
            shapes[p + "self_attn.q_layernorm.weight"] = (e,)
            shapes[p + "self_attn.k_layernorm.weight"] = (e,)
        shapes[p + "ffn_norm.weight"] = (d,)
        shapes[p + "feed_forward.w1.weight"] = (cfg.ff_dim, d)
        shapes[p + "feed_forward.w3.weight"] = (cfg.ff_dim, d)
        shapes[p + "feed_forward.w2.weight"] = (d, cfg.ff_dim)
    shapes["model.embedding_norm.weight"] = (d,)
    if not cfg.tie_word_embeddings:
        shapes["lm_head.weight"] = (cfg.vocab_size, d)
    return shapes


def read_safetensors(path: Path) -> dict[str, np.ndarray]:
    """All tensors of one file as float32 arrays (bf16 and f16 widened)."""
    raw = Path(path).read_bytes()
    if len(raw) < 8:
        raise CheckpointError(f"{path} is not a safetensors file (too short)")
    (n,) = struct.unpack("<Q", raw[:8])
    try:
        header = json.loads(raw[8:8 + n])
    except (json.JSONDecodeError, UnicodeDecodeError):
        raise CheckpointError(f"{path} has an unreadable safetensors header") from None
    base = 8 + n
    out = {}
    for name, meta in header.items():
        if name == "__metadata__":
            continue
        if meta["dtype"] not in _DTYPES:
            raise CheckpointError(f"{path}: tensor {name!r} has dtype {meta['dtype']}; expected F32, F16 or BF16")
        start, end = meta["data_offsets"]
        arr = np.frombuffer(raw, dtype=_DTYPES[meta["dtype"]], count=(end - start) // np.dtype(_DTYPES[meta["dtype"]]).itemsize,
                            offset=base + start)
        if meta["dtype"] == "BF16":
            arr = (arr.astype(np.uint32) << 16).view(np.float32)
        out[name] = arr.astype(np.float32).reshape(meta["shape"])
    return out


def load_checkpoint(directory: Path) -> dict[str, np.ndarray]:
    d = Path(directory)
    index = d / "model.safetensors.index.json"
    if index.exists():
        weight_map = json.loads(index.read_text())["weight_map"]
        tensors: dict[str, np.ndarray] = {}
        for shard in sorted(set(weight_map.values())):
            if not (d / shard).exists():
                raise CheckpointError(f"{index.name} names shard {shard}, which is missing from {d}")
            tensors.update(read_safetensors(d / shard))
        return tensors
    single = d / "model.safetensors"
    if not single.exists():
        raise CheckpointError(f"no model.safetensors or model.safetensors.index.json in {d}")
    return read_safetensors(single)


def read_generation_eos(directory: Path) -> list[int]:
    """generation_config.json's end ids (an id or a list), or [] without the file or the key."""
    path = Path(directory) / "generation_config.json"
    if not path.exists():
        return []
    try:
        eos = json.loads(path.read_text()).get("eos_token_id")
    except (ValueError, AttributeError) as err:
        raise ValueError(f"{path}: not a JSON object of generation settings ({err})") from None
    ids = [] if eos is None else eos if isinstance(eos, list) else [eos]
    if not all(isinstance(i, int) and not isinstance(i, bool) for i in ids):
        raise ValueError(f"{path}: eos_token_id must be an id or a list of ids, got {eos!r}")
    return ids


def check_tensors(cfg: Lfm2Config, tensors: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """The tensors the model needs, checked against the table; a tied checkpoint's lm_head is dropped."""
    want = parameter_shapes(cfg)
    tensors = dict(tensors)
    if cfg.tie_word_embeddings:
        tensors.pop("lm_head.weight", None)     # some tied checkpoints store it anyway
    missing = [n for n in want if n not in tensors]
    unexpected = [n for n in tensors if n not in want]
    misshaped = [f"{n}: {list(tensors[n].shape)} (expected {list(want[n])})"
                 for n in want if n in tensors and tuple(tensors[n].shape) != want[n]]
    if missing or unexpected or misshaped:
        parts = []
        if missing:
            parts.append("missing: " + ", ".join(missing))
        if unexpected:
            parts.append("unexpected: " + ", ".join(unexpected))
        if misshaped:
            parts.append("wrong shape: " + "; ".join(misshaped))
        raise CheckpointError("checkpoint does not match the config: " + " | ".join(parts))
    return {n: tensors[n] for n in want}


def stored_dtype(directory: Path) -> str:
    """The dtype most of a checkpoint's tensor bytes are stored in: "f32", "f16" or "bf16"."""
    d = Path(directory)
    index = d / "model.safetensors.index.json"
    files = sorted({d / f for f in json.loads(index.read_text())["weight_map"].values()}) if index.exists() \
        else [d / "model.safetensors"]
    sizes: dict[str, int] = {}
    for f in files:
        with f.open("rb") as fh:
            (n,) = struct.unpack("<Q", fh.read(8))
            header = json.loads(fh.read(n))
        for name, meta in header.items():
            if name != "__metadata__" and meta["dtype"] in _STORED:
                key = _STORED[meta["dtype"]]
                sizes[key] = sizes.get(key, 0) + meta["data_offsets"][1] - meta["data_offsets"][0]
    return max(sizes, key=sizes.get) if sizes else "f32"


def _narrow(a: np.ndarray, dtype: str) -> np.ndarray:
    a = np.ascontiguousarray(a, np.float32)
    if dtype == "f16":
        return a.astype(np.float16)
    if dtype == "bf16":            # round to nearest even, as torch's .to(torch.bfloat16) does
        bits = a.view(np.uint32).astype(np.uint64)
        return ((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16).astype(np.uint16)
    return a


def save_checkpoint(directory: Path, cfg: Lfm2Config, tensors: dict[str, np.ndarray], dtype: str = "f32") -> None:
    if dtype not in SAVE_DTYPES:
        raise ValueError(f"save dtype must be one of {', '.join(SAVE_DTYPES)}, got {dtype!r}")
    d = Path(directory)
    d.mkdir(parents=True, exist_ok=True)
    config = cfg.to_dict()
    config["torch_dtype"] = config["dtype"] = SAVE_DTYPES[dtype]
    (d / "config.json").write_text(json.dumps(config, indent=2))
    arrays = {n: _narrow(a, dtype) for n, a in tensors.items()}
    specs = {n: TensorSpec(dtype=SAVE_DTYPES[dtype], shape=a.shape, data_ptr=a.ctypes.data, data_len=a.nbytes)
             for n, a in arrays.items()}
    serialize_file(specs, str(d / "model.safetensors"), {"format": "pt"})
