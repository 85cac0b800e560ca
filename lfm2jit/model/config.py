"""Lfm2Config: the model's shape, read from Hugging Face LFM2 config.json files as published."""
from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path

LAYER_TYPES = ("conv", "full_attention")


class ConfigError(ValueError):
    """A config value that is unknown, out of range or contradicts another; names the key."""


def _is_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_real(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def _shown(v) -> str:
    """A value as the message shows it: its JSON type too, so "1.0" (a string) reads apart from 1.0."""
    text = repr(v)
    text = text if len(text) <= 60 else text[:57] + "..."
    kind = {str: "string", list: "list", dict: "object", bool: "boolean", type(None): "null"}.get(type(v))
    return f"{text} ({kind})" if kind else text


def check_backbone(cfg) -> None:
    """The checks every LFM2 config shares (dense and MoE): layer types, token ids against the
    vocabulary, heads dividing the width, an even head dimension."""
    if not isinstance(cfg.layer_types, list) or not all(isinstance(t, str) for t in cfg.layer_types):
        raise ConfigError(f"layer_types must be a list of layer names ({', '.join(LAYER_TYPES)}), "
                          f"got {_shown(cfg.layer_types)}")
    for key in ("pad_token_id", "bos_token_id", "eos_token_id"):
        value = getattr(cfg, key)
        if value is None:
            continue
        ids = value if key == "eos_token_id" and isinstance(value, list) else [value]
        if not ids or not all(_is_int(i) and 0 <= i < cfg.vocab_size for i in ids):
            expected = "an id or a non-empty list of ids" if key == "eos_token_id" else "an id"
            raise ConfigError(f"{key} must be {expected} in 0..{cfg.vocab_size - 1} (vocab_size "
                              f"{cfg.vocab_size}) or null, got {_shown(value)}")
    if cfg.hidden_size % cfg.num_attention_heads:
        raise ConfigError(f"hidden_size {cfg.hidden_size} is not divisible by num_attention_heads "
                          f"{cfg.num_attention_heads}")
    if cfg.num_attention_heads % cfg.num_key_value_heads:
        raise ConfigError(f"num_attention_heads {cfg.num_attention_heads} is not a multiple of "
                          f"num_key_value_heads {cfg.num_key_value_heads}")
    if cfg.head_dim % 2:
        raise ConfigError(f"head_dim {cfg.head_dim} (hidden_size / num_attention_heads) must be even for RoPE")
    if len(cfg.layer_types) != cfg.num_hidden_layers:
        raise ConfigError(f"layer_types has {len(cfg.layer_types)} entries but num_hidden_layers is "
                          f"{cfg.num_hidden_layers}")
    bad = [t for t in cfg.layer_types if t not in LAYER_TYPES]
    if bad:
        raise ConfigError(f"layer_types has unknown values {sorted(set(bad))}; expected {', '.join(LAYER_TYPES)}")


@dataclass
class Lfm2Config:
    # defaults are transformers' Lfm2Config defaults, so a config.json missing a key means the same
    vocab_size: int = 65536
    hidden_size: int = 2560
    intermediate_size: int = 12288           # before the auto-adjust rule (HF's block_ff_dim)
    num_hidden_layers: int = 32
    num_attention_heads: int = 32
    num_key_value_heads: int = 8
    layer_types: list[str] | None = None     # None: full attention in every layer, as transformers
    norm_eps: float = 1e-5
    rope_theta: float = 1_000_000.0
    conv_L_cache: int = 3
    conv_bias: bool = False
    tie_word_embeddings: bool = True
    block_auto_adjust_ff_dim: bool = True
    block_multiple_of: int = 256
    block_ffn_dim_multiplier: float | None = 1.0
    initializer_range: float = 0.02
    max_position_embeddings: int = 128_000
    pad_token_id: int | None = 0
    bos_token_id: int | None = 1
    eos_token_id: int | list[int] | None = 2

    def __post_init__(self):
        if self.layer_types is None and _is_int(self.num_hidden_layers):
            self.layer_types = ["full_attention"] * self.num_hidden_layers
        self.validate()

    # ---- derived sizes ----
    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_attention_heads

    @property
    def ff_dim(self) -> int:
        """The MLP width transformers builds: int(2*ff/3), times the multiplier, rounded up to the
        multiple (LFM2-350M: 6656 -> 4608)."""
        ff = self.intermediate_size
        if self.block_auto_adjust_ff_dim:
            ff = int(2 * ff / 3)
            if self.block_ffn_dim_multiplier is not None:
                ff = int(self.block_ffn_dim_multiplier * ff)
                ff = self.block_multiple_of * ((ff + self.block_multiple_of - 1) // self.block_multiple_of)
        return ff

    @property
    def attention_layers(self) -> list[int]:
        return [i for i, t in enumerate(self.layer_types) if t == "full_attention"]

    def validate(self) -> None:
        """Every field's type and range, then the sizes' relations; a ConfigError names the key."""
        for key in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                    "num_key_value_heads", "conv_L_cache", "block_multiple_of", "max_position_embeddings"):
            value = getattr(self, key)
            if not _is_int(value) or value < 1:
                raise ConfigError(f"{key} must be a positive integer, got {_shown(value)}")
        for key in ("conv_bias", "tie_word_embeddings", "block_auto_adjust_ff_dim"):
            if not isinstance(getattr(self, key), bool):
                raise ConfigError(f"{key} must be true or false, got {_shown(getattr(self, key))}")
        for key, allow_none, allow_zero in (("norm_eps", False, False), ("rope_theta", False, False),
                                            ("block_ffn_dim_multiplier", True, False),
                                            ("initializer_range", False, True)):
            value = getattr(self, key)
            if value is None and allow_none:
                continue
            if not _is_real(value) or not math.isfinite(value) or value < 0 or (value == 0 and not allow_zero):
                raise ConfigError(f"{key} must be a {'non-negative' if allow_zero else 'positive'} finite number"
                                  f"{' or null' if allow_none else ''}, got {_shown(value)}")
        check_backbone(self)
        if self.ff_dim < 1:
            raise ConfigError(f"the MLP width from intermediate_size {self.intermediate_size} and "
                              f"block_ffn_dim_multiplier {self.block_ffn_dim_multiplier} is {self.ff_dim}; expected >= 1")

    # ---- Hugging Face config.json ----
    @classmethod
    def from_dict(cls, d: dict) -> "Lfm2Config":
        if not isinstance(d, dict):
            raise ConfigError(f"a config must be a JSON object of settings, got {_shown(d)}")
        d = dict(d)
        model_type = d.get("model_type", "lfm2")
        if model_type == "lfm2_moe":
            raise ConfigError("model_type is 'lfm2_moe', a mixture-of-experts model: read it with Lfm2MoeConfig "
                              "(from lfm2jit.model import Lfm2MoeConfig); Lfm2Config reads dense 'lfm2' models")
        if model_type != "lfm2":
            raise ConfigError(f"model_type is {model_type!r}, expected 'lfm2'")
        out: dict = {}

        def alias(names: tuple[str, ...], target: str, convert=lambda v: v):
            present = [(n, d[n]) for n in names if n in d and d[n] is not None]
            values = {json.dumps(convert(v)) for _, v in present}
            if len(values) > 1:
                raise ConfigError(f"contradictory values for {target}: "
                                  + ", ".join(f"{n}={v!r}" for n, v in present))
            if present:
                out[target] = convert(present[0][1])

        alias(("intermediate_size", "block_ff_dim"), "intermediate_size")
        alias(("tie_word_embeddings", "tie_embedding"), "tie_word_embeddings")
        alias(("num_attention_heads", "num_heads"), "num_attention_heads")
        alias(("hidden_size", "block_dim"), "hidden_size")
        alias(("norm_eps", "block_norm_eps"), "norm_eps")
        rope = d.get("rope_parameters") or d.get("rope_scaling")
        if isinstance(rope, dict):
            kind = rope.get("rope_type", rope.get("type", "default"))
            if kind != "default":
                raise ConfigError(f"rope_parameters.rope_type {kind!r} is not supported; expected 'default'")
            if "rope_theta" in rope:
                d.setdefault("rope_parameters.rope_theta", rope["rope_theta"])
        alias(("rope_theta", "theta", "rope_parameters.rope_theta"), "rope_theta",
              lambda v: float(v) if _is_real(v) else v)          # validate() names a value of another type
        for f in fields(cls):
            if f.name in d and f.name not in out and f.name != "layer_types":
                out[f.name] = d[f.name]
        layers = out.get("num_hidden_layers", cls.num_hidden_layers)
        idxs = d.get("full_attn_idxs")
        if idxs is not None and (not isinstance(idxs, list) or not all(_is_int(i) for i in idxs)):
            raise ConfigError(f"full_attn_idxs must be a list of layer indices, got {_shown(idxs)}")
        if d.get("layer_types") is not None:
            lt = d["layer_types"]
            out["layer_types"] = list(lt) if isinstance(lt, list) else lt     # validate() names a bad one
            if idxs is not None and isinstance(lt, list):
                implied = [i for i, t in enumerate(out["layer_types"]) if t == "full_attention"]
                if sorted(d["full_attn_idxs"]) != implied:
                    raise ConfigError(f"contradictory values: full_attn_idxs={d['full_attn_idxs']} but layer_types "
                                      f"puts attention at {implied}")
        else:
            if not _is_int(layers) or layers < 1:
                raise ConfigError(f"num_hidden_layers must be a positive integer, got {_shown(layers)}")
            idxs = list(range(layers)) if idxs is None else idxs
            bad = [i for i in idxs if not 0 <= i < layers]
            if bad:
                raise ConfigError(f"full_attn_idxs has entries {bad} outside 0..{layers - 1}")
            out["layer_types"] = ["full_attention" if i in idxs else "conv" for i in range(layers)]
        try:
            cfg = cls(**out)
        except TypeError as e:
            raise ConfigError(str(e)) from None
        head_dim = d.get("head_dim")        # transformers would honour another one
        if head_dim is not None and (not _is_int(head_dim) or head_dim != cfg.head_dim):
            raise ConfigError(f"head_dim {d['head_dim']!r} is not supported: it must equal hidden_size / "
                              f"num_attention_heads = {cfg.head_dim}")
        return cfg

    @classmethod
    def from_json(cls, path) -> "Lfm2Config":
        p = Path(path)
        if p.is_dir():
            p = p / "config.json"
        try:
            data = json.loads(p.read_text())
        except FileNotFoundError:
            raise ConfigError(f"no config file at {p}") from None
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise ConfigError(f"{p} is not valid JSON: {e}") from None
        except OSError as e:
            raise ConfigError(f"{p}: cannot be read ({e.strerror or e})") from None
        try:
            return cls.from_dict(data)
        except ConfigError as e:
            raise ConfigError(f"{p}: {e}") from None

    def to_dict(self) -> dict:
        """A config.json that transformers' Lfm2Config reads back to the same model."""
        d = asdict(self)
        d.update({"model_type": "lfm2", "architectures": ["Lfm2ForCausalLM"],
                  "rope_parameters": {"rope_type": "default", "rope_theta": self.rope_theta}})
        return d

    # ---- presets ----
    @classmethod
    def preset(cls, name: str) -> "Lfm2Config":
        """Published LFM2 shapes ("350M", "700M", "1.2B") and tiny ones for tests ("tiny", "tiny-untied")."""
        if name not in PRESETS:
            raise ConfigError(f"unknown preset {name!r}; available: {', '.join(PRESETS)}")
        return cls(**PRESETS[name])


_PUBLISHED_LAYERS = ["conv", "conv", "full_attention", "conv", "conv", "full_attention", "conv", "conv",
                     "full_attention", "conv", "full_attention", "conv", "full_attention", "conv",
                     "full_attention", "conv"]
# LFM2-2.6B: 30 layers, 8 of them attention, its MLP width used as given (2.6B parameters; the
# attention layers' positions are not checked against its config.json, which a checkpoint brings)
_LAYERS_2_6B = ["full_attention" if i in (2, 6, 10, 14, 18, 21, 24, 27) else "conv" for i in range(30)]
PRESETS: dict[str, dict] = {
    "350M": dict(hidden_size=1024, intermediate_size=6656, num_hidden_layers=16, num_attention_heads=16,
                 num_key_value_heads=8, layer_types=_PUBLISHED_LAYERS),
    "700M": dict(hidden_size=1536, intermediate_size=10240, num_hidden_layers=16, num_attention_heads=24,
                 num_key_value_heads=8, layer_types=_PUBLISHED_LAYERS),
    "1.2B": dict(hidden_size=2048, intermediate_size=12288, num_hidden_layers=16, num_attention_heads=32,
                 num_key_value_heads=8, layer_types=_PUBLISHED_LAYERS),
    "2.6B": dict(hidden_size=2048, intermediate_size=10752, num_hidden_layers=30, num_attention_heads=32,
                 num_key_value_heads=8, layer_types=_LAYERS_2_6B, block_auto_adjust_ff_dim=False),
    "tiny": dict(vocab_size=256, hidden_size=64, intermediate_size=192, num_hidden_layers=4, num_attention_heads=4,
                 num_key_value_heads=2, layer_types=["conv", "full_attention", "conv", "full_attention"],
                 block_multiple_of=16),
    "tiny-untied": dict(vocab_size=256, hidden_size=64, intermediate_size=192, num_hidden_layers=3,
                        num_attention_heads=4, num_key_value_heads=4, layer_types=["full_attention", "conv", "conv"],
                        block_multiple_of=16, tie_word_embeddings=False, conv_bias=True),
}
