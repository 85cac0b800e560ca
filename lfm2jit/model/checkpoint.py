"""Hugging Face LFM2 checkpoints: the parameter table, and safetensors in and out.

Reads f32, f16 and bf16 tensors (bf16 widened to f32 on load) from ``model.safetensors`` or a
sharded ``model.safetensors.index.json``; writes ``model.safetensors`` or shards with that index (f32, or
f16 / bf16 rounded to nearest even) that transformers' Lfm2ForCausalLM loads.
"""
from __future__ import annotations

import json
import mmap
import os
import struct
from pathlib import Path
from typing import Callable

import numpy as np

from ..safefiles import replace_with
from .config import Lfm2Config
from .quantize import quantize_as
from .shards import write_weights

SAVE_DTYPES = {"f32": "float32", "f16": "float16", "bf16": "bfloat16"}     # ours -> safetensors' names
_STORED = {"F32": "f32", "F64": "f32", "F16": "f16", "BF16": "bf16"}
# (name, shape) -> how a tensor is held as it is read: float32 (a false value), float16 (True,
# an f16 base's) or quantized ("nf4", "int8": a quantized base's, see ``hold``)
Narrow = Callable[[str, tuple], "bool | str | None"]


EMBEDDING, FINAL_NORM = "model.embed_tokens.weight", "model.embedding_norm.weight"


class CheckpointError(ValueError):
    """Missing, unexpected or mis-shaped tensors, or an unreadable file; the message lists them."""


def parameter_shapes(cfg: Lfm2Config) -> dict[str, tuple[int, ...]]:
    """Every parameter of the model, by its transformers name, in the model's order."""
    d, e = cfg.hidden_size, cfg.head_dim
    shapes: dict[str, tuple[int, ...]] = {EMBEDDING: (cfg.vocab_size, d)}
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
    shapes[FINAL_NORM] = (d,)
    if not cfg.tie_word_embeddings:
        shapes["lm_head.weight"] = (cfg.vocab_size, d)
    return shapes


_ITEMSIZE = {"F64": 8, "F32": 4, "F16": 2, "BF16": 2, "I64": 8, "I32": 4, "I16": 2, "I8": 1, "U8": 1, "BOOL": 1}
_RAW = {"F64": np.float64, "F32": np.float32, "F16": np.float16, "BF16": np.uint16, "I64": np.int64,
        "I32": np.int32, "I16": np.int16, "I8": np.int8, "U8": np.uint8, "BOOL": np.bool_}
FLOAT_DTYPES = ("F32", "F16", "BF16", "F64")
MAX_HEADER = 100 << 20          # safetensors' own limit on the header's size


def _int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def parse_safetensors_header(raw: bytes, path, dtypes=FLOAT_DTYPES, size: int | None = None
                             ) -> tuple[dict[str, dict], int]:
    """The tensor entries of a safetensors file's bytes, every one checked against the file: a JSON
    object of {"dtype", "shape", "data_offsets"} entries, dtypes among ``dtypes``, offsets within the
    file and not overlapping, each tensor's byte count equal to its shape's. Returns them with the
    offset of the data section. Any problem is a CheckpointError naming the file (and tensor).
    ``size``: the file's length, when ``raw`` holds only its beginning (the header)."""
    size = len(raw) if size is None else size
    if size < 8:
        raise CheckpointError(f"{path}: not a safetensors file ({size} bytes; the header length alone takes 8)")
    (n,) = struct.unpack("<Q", bytes(raw[:8]))
    if n > MAX_HEADER or 8 + n > size:
        raise CheckpointError(f"{path}: not a safetensors file or cut short: its header claims {n} bytes but the "
                              f"file has {size}")
    try:
        header = json.loads(bytes(raw[8:8 + n]))
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise CheckpointError(f"{path}: unreadable safetensors header (not JSON: {e})") from None
    if not isinstance(header, dict):
        raise CheckpointError(f"{path}: the safetensors header is a JSON {type(header).__name__}; expected an object "
                              "of tensor entries")
    base, data_size = 8 + n, size - 8 - n
    entries: dict[str, dict] = {}
    for name, meta in header.items():
        if name == "__metadata__":
            if not isinstance(meta, dict) or not all(isinstance(v, str) for v in meta.values()):
                raise CheckpointError(f"{path}: __metadata__ must be an object of strings, got {meta!r:.80}")
            continue
        where = f"{path}: tensor {name!r}"
        if not isinstance(meta, dict):
            raise CheckpointError(f"{where}: expected an object with dtype, shape and data_offsets, got {meta!r:.80}")
        lacking = [k for k in ("dtype", "shape", "data_offsets") if k not in meta]
        if lacking:
            raise CheckpointError(f"{where} lacks {', '.join(lacking)}")
        dtype, shape, offsets = meta["dtype"], meta["shape"], meta["data_offsets"]
        if dtype not in dtypes:
            raise CheckpointError(f"{where} has dtype {dtype!r}; expected {', '.join(dtypes)}")
        if not isinstance(shape, list) or not all(_int(d) and d >= 0 for d in shape):
            raise CheckpointError(f"{where}: shape must be a list of sizes >= 0, got {shape!r:.80}")
        if (not isinstance(offsets, list) or len(offsets) != 2 or not all(_int(o) for o in offsets)
                or not 0 <= offsets[0] <= offsets[1]):
            raise CheckpointError(f"{where}: data_offsets must be [begin, end] with 0 <= begin <= end, "
                                  f"got {offsets!r:.80}")
        if offsets[1] > data_size:
            raise CheckpointError(f"{where}: data_offsets {offsets} reach past the end of the file (its data section "
                                  f"has {data_size} bytes): the file is cut short or its header is damaged")
        want = int(np.prod(shape, dtype=np.int64)) * _ITEMSIZE[dtype]
        if offsets[1] - offsets[0] != want:
            raise CheckpointError(f"{where}: shape {shape} of {dtype} takes {want} bytes but data_offsets {offsets} "
                                  f"hold {offsets[1] - offsets[0]}")
        entries[name] = {"dtype": dtype, "shape": shape, "data_offsets": offsets}
    spans = sorted((m["data_offsets"][0], m["data_offsets"][1], name) for name, m in entries.items()
                   if m["data_offsets"][1] > m["data_offsets"][0])
    for (_, end, a), (begin, _, b) in zip(spans, spans[1:]):
        if begin < end:
            raise CheckpointError(f"{path}: the data of tensors {a!r} and {b!r} overlap")
    return entries, base


def read_file_bytes(path) -> bytes:
    try:
        return Path(path).read_bytes()
    except FileNotFoundError:
        raise CheckpointError(f"{path}: no such file") from None
    except OSError as e:
        raise CheckpointError(f"{path}: cannot be read ({e.strerror or e})") from None


def map_file(path):
    """The file's bytes mapped read-only (the page cache's, not copies on the heap: a shard of a
    large checkpoint is never held twice while its tensors are widened or quantized); an empty
    file, which cannot be mapped, as b""."""
    try:
        with open(path, "rb") as f:
            return mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) if os.fstat(f.fileno()).st_size else b""
    except FileNotFoundError:
        raise CheckpointError(f"{path}: no such file") from None
    except OSError as e:
        raise CheckpointError(f"{path}: cannot be read ({e.strerror or e})") from None


def read_safetensors_raw(path, dtypes=FLOAT_DTYPES, raw: bytes | None = None) -> dict[str, np.ndarray]:
    """All tensors of one file in their stored dtypes (BF16 as its uint16 bits), checked as
    ``parse_safetensors_header`` describes; ``raw``: the file's bytes, if already read (else the
    file is mapped, and the arrays are read-only views of it)."""
    raw = map_file(path) if raw is None else raw
    entries, base = parse_safetensors_header(raw, path, dtypes)
    out = {}
    for name, meta in entries.items():
        start, end = meta["data_offsets"]
        arr = np.frombuffer(raw, dtype=_RAW[meta["dtype"]], count=(end - start) // _ITEMSIZE[meta["dtype"]],
                            offset=base + start)
        out[name] = arr.reshape(meta["shape"])
    return out


def read_safetensors(path: Path, raw: bytes | None = None, narrow: Narrow | None = None) -> dict[str, np.ndarray]:
    """All tensors of one file as float32 arrays (bf16 and f16 widened), or as ``narrow(name, shape)``
    says (``hold``: an f16 or quantized base's, one by one, so the host never holds the checkpoint in
    f32 at once)."""
    return {name: _stored(name, arr, narrow) for name, arr in read_safetensors_raw(path, FLOAT_DTYPES, raw).items()}


def _widen(arr: np.ndarray) -> np.ndarray:
    if arr.dtype == np.uint16:          # BF16
        arr = (arr.astype(np.uint32) << 16).view(np.float32)
    return arr.astype(np.float32)


def _stored(name: str, arr: np.ndarray, narrow: Narrow | None):
    """``arr`` widened to float32, then held as ``narrow`` says (``hold``)."""
    arr = _widen(arr)
    return hold(name, arr, narrow(name, arr.shape) if narrow is not None else None)


def hold(name: str, arr: np.ndarray, form):
    """A float32 array as a ``Narrow`` form says: itself, float16, or quantized ("nf4", "int8": the
    host form model/quantize.py gives, which the model uploads as is), so a base too large for the
    host in float32 is never held whole in it."""
    if not form:
        return arr
    if form is True or form == "f16":
        return arr.astype(np.float16, copy=False)
    return quantize_as(arr, form, name)


def _weight_files(d: Path) -> list[Path]:
    """The safetensors files of a model directory: model.safetensors, or the shards its index names."""
    index = d / "model.safetensors.index.json"
    if index.exists():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise CheckpointError(f"{index}: not valid JSON ({e})") from None
        except (TypeError, KeyError):
            raise CheckpointError(f"{index}: expected a JSON object with a weight_map") from None
        except OSError as e:
            raise CheckpointError(f"{index}: cannot be read ({e.strerror or e})") from None
        if not isinstance(weight_map, dict) or not all(isinstance(v, str) for v in weight_map.values()):
            raise CheckpointError(f"{index}: weight_map must be an object of tensor name -> file name")
        shards = sorted(set(weight_map.values()))
        bad = [s for s in shards if Path(s).name != s or s in ("", ".", "..")]
        if bad:
            raise CheckpointError(f"{index}: weight_map names {bad[0]!r}; expected file names inside {d}")
        for shard in shards:
            if not (d / shard).is_file():
                raise CheckpointError(f"{index.name} names shard {shard}, which is missing from {d}")
        return [d / s for s in shards]
    single = d / "model.safetensors"
    if not single.exists():
        raise CheckpointError(f"no model.safetensors or model.safetensors.index.json in {d}")
    return [single]


class Tensors(dict):
    """Tensors read from a model directory, which ``check_tensors`` names in its errors."""
    source: Path | None = None


def load_checkpoint(directory: Path, narrow: Narrow | None = None) -> dict[str, np.ndarray]:
    """The float32 tensors of a model directory (float16 or quantized where ``narrow`` says, each as
    it is read: ``hold``).
    A checkpoint transformers saved with a bitsandbytes 4-bit (NF4) quantization config has its
    quantized weights dequantized exactly (bnb_checkpoint.py)."""
    from .bnb_checkpoint import Bnb4bitError, dequantize_stored, quantization_config
    tensors = Tensors()
    tensors.source = Path(directory)
    if quantization_config(directory) is None:
        for f in _weight_files(Path(directory)):
            tensors.update(read_safetensors(f, narrow=narrow))
        return tensors
    raw: dict[str, np.ndarray] = {}
    for f in _weight_files(Path(directory)):
        raw.update(read_safetensors_raw(f, FLOAT_DTYPES + ("U8",)))
    try:
        stored = dequantize_stored(raw, str(directory))
    except (Bnb4bitError, KeyError, ValueError) as e:
        raise CheckpointError(f"{directory}: a bitsandbytes 4-bit checkpoint lfm2jit cannot read: {e}") from None
    tensors.update((n, _stored(n, a, narrow)) for n, a in stored.items())
    return tensors


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
    tensors_in, tensors = tensors, dict(tensors)
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
        where = getattr(tensors_in, "source", None)
        raise CheckpointError((f"{where}: " if where is not None else "") + "checkpoint does not match the config: "
                              + " | ".join(parts))
    return {n: tensors[n] for n in want}


def stored_dtype(directory: Path) -> str:
    """The dtype most of a checkpoint's tensor bytes are stored in: "f32", "f16" or "bf16"."""
    sizes: dict[str, int] = {}
    for f in _weight_files(Path(directory)):
        try:
            with f.open("rb") as fh:
                head = fh.read(8)
                n = struct.unpack("<Q", head)[0] if len(head) == 8 else 0
                head += fh.read(min(n, MAX_HEADER))
        except OSError as e:
            raise CheckpointError(f"{f}: cannot be read ({e.strerror or e})") from None
        entries, _ = parse_safetensors_header(head, f, size=f.stat().st_size)
        for meta in entries.values():
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


def write_config(directory, cfg, dtype: str) -> Path:
    """Check the save dtype, make the directory and write config.json naming it (dense or MoE
    config); each file is written beside itself and renamed into place: a kill or a full disk
    leaves the old one. Returns the directory."""
    if dtype not in SAVE_DTYPES:
        raise ValueError(f"save dtype must be one of {', '.join(SAVE_DTYPES)}, got {dtype!r}")
    d = Path(directory)
    d.mkdir(parents=True, exist_ok=True)
    config = cfg.to_dict()
    config["torch_dtype"] = config["dtype"] = SAVE_DTYPES[dtype]
    text = json.dumps(config, indent=2)
    replace_with(d / "config.json", lambda tmp: Path(tmp).write_text(text))
    return d


def save_checkpoint(directory: Path, cfg: Lfm2Config, tensors: dict[str, np.ndarray], dtype: str = "f32",
                    max_shard_size=None) -> list[Path]:
    """config.json and the tensors as ``model.safetensors``, or as shards of at most ``max_shard_size``
    (bytes, or "5GB") with ``model.safetensors.index.json`` (shards.write_weights). Returns the weight files."""
    d = write_config(directory, cfg, dtype)
    arrays = {n: _narrow(a, dtype) for n, a in tensors.items()}
    return write_weights(d, arrays, max_shard_size, {n: SAVE_DTYPES[dtype] for n in arrays})


def initial_value(name: str) -> str:
    """How transformers initialises LFM2's (or LFM2-MoE's) tensor ``name``: "ones" (norm weights),
    "zeros" (biases, an MoE router's expert_bias buffer) or "normal" (normal(0, initializer_range))."""
    if "norm" in name:
        return "ones"
    if name.endswith(".bias") or name.endswith(".expert_bias"):
        return "zeros"
    return "normal"


def initial_array(rng: np.random.Generator, name: str, shape, std: float) -> np.ndarray:
    """Tensor ``name`` as ``initial_value`` says, its normal draws float32 from ``rng``."""
    kind = initial_value(name)
    if kind == "normal":
        return rng.standard_normal(shape, dtype=np.float32) * np.float32(std)
    return (np.ones if kind == "ones" else np.zeros)(shape, np.float32)


def init_tensors(cfg: Lfm2Config, seed: int) -> dict[str, np.ndarray]:
    """A new LFM2's tensors as host arrays, initialised as transformers does (``initial_value``; the
    padding token's embedding row zero), drawn by numpy: for tools and tests that want arrays.
    ``Lfm2Model(cfg, ...)`` draws its own on the GPU (model/device_init.py), from another generator."""
    rng = np.random.default_rng(seed)
    out = {name: initial_array(rng, name, shape, cfg.initializer_range) for name, shape in parameter_shapes(cfg).items()}
    pad = cfg.pad_token_id
    if pad is not None and 0 <= pad < cfg.vocab_size:      # nn.Embedding(padding_idx) starts at zero
        out[EMBEDDING][pad] = 0.0
    return out
