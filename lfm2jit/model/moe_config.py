"""Lfm2MoeConfig: an LFM2 mixture-of-experts model's shape, read from and written to Hugging Face
``lfm2_moe`` config.json files (transformers' ``Lfm2MoeConfig``, model ``Lfm2MoeForCausalLM``).

The backbone keys are LFM2's (conv and attention layers, ``layer_types``); the first
``num_dense_layers`` layers have a dense SwiGLU MLP of width ``intermediate_size`` (used as is:
``lfm2_moe`` has no ``block_auto_adjust_ff_dim`` rule), the others a sparse block of ``num_experts``
SwiGLU experts of width ``moe_intermediate_size``, ``num_experts_per_tok`` of them per token.
"""
from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass, fields
from pathlib import Path

from .config import ConfigError, _is_int, _is_real, _shown, check_backbone

MODEL_TYPE = "lfm2_moe"


@dataclass
class Lfm2MoeConfig:
    # defaults are transformers' Lfm2MoeConfig defaults, so a config.json missing a key means the same
    vocab_size: int = 65536
    hidden_size: int = 2048
    intermediate_size: int = 7168            # the dense layers' MLP width, used as is
    moe_intermediate_size: int = 1792        # each expert's width
    num_hidden_layers: int = 32
    num_attention_heads: int = 32
    num_key_value_heads: int = 8
    layer_types: list[str] | None = None     # None: full attention in every layer
    norm_eps: float = 1e-5
    rope_theta: float = 1_000_000.0
    conv_L_cache: int = 3
    conv_bias: bool = False
    tie_word_embeddings: bool = True
    num_dense_layers: int = 2
    num_experts: int = 32
    num_experts_per_tok: int = 4
    use_expert_bias: bool = True
    norm_topk_prob: bool = True
    routed_scaling_factor: float = 1.0
    initializer_range: float = 0.02
    max_position_embeddings: int = 128_000
    pad_token_id: int | None = 0
    bos_token_id: int | None = 1
    eos_token_id: int | list[int] | None = 2

    def __post_init__(self):
        if self.layer_types is None and _is_int(self.num_hidden_layers):
            self.layer_types = ["full_attention"] * self.num_hidden_layers
        self.validate()

    # ---- derived sizes (the names Lfm2Config uses, so the backbone's table reads either) ----
    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_attention_heads

    @property
    def ff_dim(self) -> int:
        """The dense layers' MLP width: intermediate_size, with no adjustment."""
        return self.intermediate_size

    @property
    def attention_layers(self) -> list[int]:
        return [i for i, t in enumerate(self.layer_types) if t == "full_attention"]

    @property
    def moe_layers(self) -> list[int]:
        """The layers with a sparse expert block (all after the first num_dense_layers)."""
        return list(range(self.num_dense_layers, self.num_hidden_layers))

    def validate(self) -> None:
        """Every field's type and range, then the sizes' relations; a ConfigError names the key,
        the value and what was expected."""
        for key in ("vocab_size", "hidden_size", "intermediate_size", "moe_intermediate_size", "num_hidden_layers",
                    "num_attention_heads", "num_key_value_heads", "conv_L_cache", "num_experts",
                    "num_experts_per_tok", "max_position_embeddings"):
            value = getattr(self, key)
            if not _is_int(value) or value < 1:
                raise ConfigError(f"{key} must be a positive integer, got {_shown(value)}")
        if not _is_int(self.num_dense_layers) or self.num_dense_layers < 0:
            raise ConfigError(f"num_dense_layers must be an integer >= 0, got {_shown(self.num_dense_layers)}")
        for key in ("conv_bias", "tie_word_embeddings", "use_expert_bias", "norm_topk_prob"):
            if not isinstance(getattr(self, key), bool):
                raise ConfigError(f"{key} must be true or false, got {_shown(getattr(self, key))}")
        for key, allow_zero in (("norm_eps", False), ("rope_theta", False), ("routed_scaling_factor", False),
                                ("initializer_range", True)):
            value = getattr(self, key)
            if not _is_real(value) or not math.isfinite(value) or value < 0 or (value == 0 and not allow_zero):
                raise ConfigError(f"{key} must be a {'non-negative' if allow_zero else 'positive'} finite number, "
                                  f"got {_shown(value)}")
        check_backbone(self)
        if self.num_experts_per_tok > self.num_experts:
            raise ConfigError(f"num_experts_per_tok {self.num_experts_per_tok} is more than num_experts "
                              f"{self.num_experts}; expected 1..{self.num_experts}")
        if self.num_dense_layers > self.num_hidden_layers:
            raise ConfigError(f"num_dense_layers {self.num_dense_layers} is more than num_hidden_layers "
                              f"{self.num_hidden_layers}; expected 0..{self.num_hidden_layers}")

    # ---- Hugging Face config.json ----
    @classmethod
    def from_dict(cls, d: dict) -> "Lfm2MoeConfig":
        if not isinstance(d, dict):
            raise ConfigError(f"a config must be a JSON object of settings, got {_shown(d)}")
        model_type = d.get("model_type", MODEL_TYPE)
        if model_type != MODEL_TYPE:
            hint = " (a dense LFM2 model: use Lfm2Config)" if model_type == "lfm2" else ""
            raise ConfigError(f"model_type is {model_type!r}, expected {MODEL_TYPE!r}{hint}")
        out: dict = {}

        def alias(names: tuple[str, ...], target: str, value_of=lambda v: v):
            present = [(n, value_of(d[n])) for n in names if d.get(n) is not None]
            if len({json.dumps(v) for _, v in present}) > 1:
                raise ConfigError(f"contradictory values for {target}: " + ", ".join(f"{n}={v!r}" for n, v in present))
            if present:
                out[target] = present[0][1]

        alias(("tie_word_embeddings", "tie_embedding"), "tie_word_embeddings")
        rope = d.get("rope_parameters") or d.get("rope_scaling")
        if rope is not None:
            if not isinstance(rope, dict):
                raise ConfigError(f"rope_parameters must be an object, got {_shown(rope)}")
            kind = rope.get("rope_type", rope.get("type", "default"))
            if kind != "default":
                raise ConfigError(f"rope_parameters.rope_type {kind!r} is not supported; expected 'default'")
            if rope.get("rope_theta") is not None:
                d = dict(d, **{"rope_parameters.rope_theta": rope["rope_theta"]})
        alias(("rope_theta", "rope_parameters.rope_theta"), "rope_theta",
              lambda v: float(v) if _is_real(v) else v)          # validate() names a value of another type
        for f in fields(cls):
            if f.name in d and f.name not in out and f.name != "layer_types":
                out[f.name] = d[f.name]
        lt = d.get("layer_types")
        if lt is not None:
            out["layer_types"] = list(lt) if isinstance(lt, list) else lt     # validate() names a bad one
        elif d.get("full_attn_idxs") is not None:
            idxs, layers = d["full_attn_idxs"], out.get("num_hidden_layers", cls.num_hidden_layers)
            if not isinstance(idxs, list) or not all(_is_int(i) for i in idxs):
                raise ConfigError(f"full_attn_idxs must be a list of layer indices, got {_shown(idxs)}")
            if not _is_int(layers) or layers < 1:
                raise ConfigError(f"num_hidden_layers must be a positive integer, got {_shown(layers)}")
            bad = [i for i in idxs if not 0 <= i < layers]
            if bad:
                raise ConfigError(f"full_attn_idxs has entries {bad} outside 0..{layers - 1}")
            out["layer_types"] = ["full_attention" if i in idxs else "conv" for i in range(layers)]
        cfg = cls(**out)
        head_dim = d.get("head_dim")        # transformers would honour another one
        if head_dim is not None and (not _is_int(head_dim) or head_dim != cfg.head_dim):
            raise ConfigError(f"head_dim {head_dim!r} is not supported: it must equal hidden_size / "
                              f"num_attention_heads = {cfg.head_dim}")
        return cfg

    @classmethod
    def from_json(cls, path) -> "Lfm2MoeConfig":
        """A config.json file, or a model directory holding one."""
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
        """A config.json that transformers' Lfm2MoeConfig reads back to the same model."""
        d = asdict(self)
        d.pop("rope_theta")
        d.update({"model_type": MODEL_TYPE, "architectures": ["Lfm2MoeForCausalLM"],
                  "rope_parameters": {"rope_type": "default", "rope_theta": self.rope_theta}})
        return d

    # ---- presets ----
    @classmethod
    def preset(cls, name: str) -> "Lfm2MoeConfig":
        """Published LFM2-MoE shapes ("8B-A1B", "24B-A2B") and tiny ones for tests ("tiny-moe", ...)."""
        if name not in MOE_PRESETS:
            raise ConfigError(f"unknown MoE preset {name!r}; available: {', '.join(MOE_PRESETS)}")
        return cls(**MOE_PRESETS[name])


def _layers(n: int, attention: list[int]) -> list[str]:
    return ["full_attention" if i in attention else "conv" for i in range(n)]


MOE_PRESETS: dict[str, dict] = {
    # huggingface.co/LiquidAI/LFM2-8B-A1B/blob/main/config.json (attention at 2, 6, 10, 14, 18, 21)
    "8B-A1B": dict(vocab_size=65536, hidden_size=2048, intermediate_size=7168, moe_intermediate_size=1792,
                   num_hidden_layers=24, num_attention_heads=32, num_key_value_heads=8,
                   layer_types=_layers(24, [2, 6, 10, 14, 18, 21]), num_dense_layers=2, num_experts=32,
                   num_experts_per_tok=4, eos_token_id=7),
    # huggingface.co/LiquidAI/LFM2-24B-A2B/blob/main/config.json (attention at 2, 6, ..., 38)
    "24B-A2B": dict(vocab_size=65536, hidden_size=2048, intermediate_size=11776, moe_intermediate_size=1536,
                    num_hidden_layers=40, num_attention_heads=32, num_key_value_heads=8,
                    layer_types=_layers(40, list(range(2, 40, 4))), num_dense_layers=2, num_experts=64,
                    num_experts_per_tok=4, eos_token_id=7),
    # tiny shapes for tests: dense layers first, 4-8 experts, top-1/2/4, tied and untied
    "tiny-moe": dict(vocab_size=256, hidden_size=64, intermediate_size=128, moe_intermediate_size=32,
                     num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
                     layer_types=["conv", "full_attention", "conv", "full_attention"], num_dense_layers=1,
                     num_experts=4, num_experts_per_tok=2),
    "tiny-moe-untied": dict(vocab_size=256, hidden_size=64, intermediate_size=96, moe_intermediate_size=48,
                            num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=4,
                            layer_types=["full_attention", "conv", "conv"], num_dense_layers=1, num_experts=8,
                            num_experts_per_tok=4, tie_word_embeddings=False, conv_bias=True,
                            norm_topk_prob=False, routed_scaling_factor=2.5),
    "tiny-moe-top1": dict(vocab_size=256, hidden_size=32, intermediate_size=64, moe_intermediate_size=16,
                          num_hidden_layers=3, num_attention_heads=2, num_key_value_heads=1,
                          layer_types=["conv", "conv", "full_attention"], num_dense_layers=0, num_experts=4,
                          num_experts_per_tok=1, use_expert_bias=False),
}


def read_model_config(path) -> "Lfm2MoeConfig | object":
    """A config.json (or a model directory holding one) as the config its ``model_type`` names:
    Lfm2MoeConfig for ``lfm2_moe``, Lfm2Config for ``lfm2`` (and for a file without the key)."""
    from .config import Lfm2Config
    p = Path(path)
    p = p / "config.json" if p.is_dir() else p
    try:
        kind = json.loads(p.read_text()).get("model_type") if p.exists() else None
    except (json.JSONDecodeError, UnicodeDecodeError, OSError, AttributeError):
        kind = None                                   # the dense reader says what is wrong with the file
    return Lfm2MoeConfig.from_json(p) if kind == MODEL_TYPE else Lfm2Config.from_json(p)
