"""LoRA adapters on LFM2's linear layers, in PEFT's terms and files.

A targeted layer y = x W^T gains y += s * (x A^T) B^T with A [r, in], B [out, r] and
s = alpha / r (alpha / sqrt(r) with rsLoRA), A initialised as PEFT does (kaiming-uniform with
a = sqrt(5): uniform in +-1/sqrt(in)) and B at zero, so a new adapter changes nothing.

Targets are matched as PEFT matches ``target_modules`` given as a list: a module is targeted when
its name equals a target or ends with "." + target. "out_proj" therefore targets both the
attention's and the conv's output projection, as it does in PEFT. Saved tensors are named as
``PeftModel.save_pretrained`` names them: "base_model.model.<module>.lora_A.weight".

An MoE model's fused expert tensors W [E, out, in] (experts.gate_up_proj, experts.down_proj) are
targeted as PEFT's ``target_parameters`` targets them (matched the same way, on the parameter's
full name): each expert e gets its own rank-r pair, W[e] + s * B_e A_e. PEFT stores them as one
lora_A [E r, in], expert e's rows e r .. e r + r - 1, and one lora_B [out, r E] whose column
k E + e is B_e's column k (the experts interleaved). Two targeted tensors of one module nest
PEFT's wrappers in the module's parameter order, so the first (gate_up_proj) is saved under
"<module>.base_layer.lora_A.weight" and the last (down_proj) under "<module>.lora_A.weight".
lfm2jit keeps them as A [E, r, in] and B [E, out, r] (``experts_from_peft`` / ``experts_to_peft``).
PEFT refuses dropout on such targets, and so does lfm2jit.
"""
from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from .moe_checkpoint import model_parameter_shapes
from .config import Lfm2Config

LFM2_LINEARS = ("q_proj", "k_proj", "v_proj", "out_proj", "in_proj", "w1", "w2", "w3")
DEFAULT_TARGETS = LFM2_LINEARS            # Liquid's fine-tuning recipe: every linear layer of the decoder
LLAMA_NAMES = {"o_proj": "out_proj", "gate_proj": "w1", "up_proj": "w3", "down_proj": "w2"}
EXPERT_TENSORS = ("feed_forward.experts.gate_up_proj", "feed_forward.experts.down_proj")
PEFT_PREFIX = "base_model.model."
CONFIG_FILE, WEIGHTS_FILE = "adapter_config.json", "adapter_model.safetensors"


class AdapterError(ValueError):
    """An adapter that does not fit the model or that lfm2jit cannot run; raised before any change."""


@dataclass(frozen=True)
class LoraConfig:
    """PEFT's LoraConfig, the part lfm2jit runs. ``dropout`` applies to training passes only
    (evaluation and generation leave it out, as PEFT's eval mode does)."""
    r: int = 8
    alpha: float = 16.0
    target_modules: tuple[str, ...] = DEFAULT_TARGETS
    dropout: float = 0.0
    use_rslora: bool = False
    target_parameters: tuple[str, ...] = ()     # PEFT's: an MoE model's expert tensors, e.g. "experts.gate_up_proj"

    def __post_init__(self):
        for field in ("target_modules", "target_parameters"):
            value = getattr(self, field)
            value = () if value is None else (value,) if isinstance(value, str) else value
            object.__setattr__(self, field, tuple(value))
        if isinstance(self.r, bool) or not isinstance(self.r, int) or self.r < 1:
            raise AdapterError(f"LoraConfig.r must be an integer >= 1, got {self.r!r}")
        if not (isinstance(self.alpha, (int, float)) and math.isfinite(self.alpha) and self.alpha > 0):
            raise AdapterError(f"LoraConfig.alpha must be a finite number > 0, got {self.alpha!r}")
        if not (isinstance(self.dropout, (int, float)) and 0.0 <= self.dropout < 1.0):
            raise AdapterError(f"LoraConfig.dropout must be in [0, 1), got {self.dropout!r}")
        if not all(isinstance(t, str) and t for t in self.target_modules + self.target_parameters):
            raise AdapterError(f"LoraConfig.target_modules and target_parameters must be non-empty names, got "
                               f"{self.target_modules!r} and {self.target_parameters!r}")
        if not self.target_modules and not self.target_parameters:
            raise AdapterError("LoraConfig.target_modules must be non-empty when there are no target_parameters: "
                               "the adapter would target nothing")
        if self.target_parameters and self.dropout:
            raise AdapterError(f"LoraConfig.dropout = {self.dropout!r} with target_parameters: dropout cannot be "
                               "applied to an adapter on a weight tensor (PEFT refuses it too); use dropout=0")

    @property
    def scaling(self) -> float:
        return self.alpha / (math.sqrt(self.r) if self.use_rslora else self.r)

    def modules(self, cfg: Lfm2Config) -> dict[str, tuple[int, int]]:
        """The targeted linear modules of a model of ``cfg``, by name, with their (out, in) sizes.
        A target that matches no linear layer is an error: tools written for Llama's names
        (o_proj, gate_proj, ...) would otherwise train nothing there without a word."""
        linears = {name[:-len(".weight")]: shape for name, shape in model_parameter_shapes(cfg).items()
                   if name.startswith("model.layers.") and name.endswith(".weight") and len(shape) == 2}
        found = {}
        for target in self.target_modules:
            hits = {m: s for m, s in linears.items() if m == target or m.endswith("." + target)}
            if not hits:
                hint = f" (LFM2 calls it {LLAMA_NAMES[target]!r})" if target in LLAMA_NAMES else ""
                raise AdapterError(f"LoRA target {target!r} matches no linear layer of this LFM2{hint}; "
                                   f"LFM2's linear layers are {', '.join(LFM2_LINEARS)}")
            found.update(hits)
        return {m: linears[m] for m in linears if m in found}         # in the model's order

    def parameters(self, cfg: Lfm2Config) -> dict[str, tuple[int, int, int]]:
        """The targeted expert tensors of a model of ``cfg`` (``target_parameters``), by full name, with
        their (experts, out, in) sizes, in the model's order. A target that matches none is an error
        naming what there is."""
        shapes = {n: s for n, s in model_parameter_shapes(cfg).items() if n.startswith("model.layers.")}
        stacked = {n: s for n, s in shapes.items() if is_expert_tensor(n)}
        found = set()
        for target in self.target_parameters:
            hits = {n for n in stacked if n == target or n.endswith("." + target)}
            if not hits:
                flat = [n for n in shapes if n == target or n.endswith("." + target)]
                if flat:
                    why = (f"it names {len(flat)} weight(s) of {len(shapes[flat[0]])} dimension(s) (e.g. {flat[0]}); "
                           "target their modules with target_modules instead")
                elif stacked:
                    why = "this model's expert tensors are " + ", ".join(sorted({_short(n) for n in stacked}))
                else:
                    why = "this model has no expert tensors (a dense LFM2: use target_modules)"
                raise AdapterError(f"LoRA target parameter {target!r} matches no expert tensor; {why}")
            found.update(hits)
        return {n: stacked[n] for n in stacked if n in found}

    def to_peft(self, base_model: str | None = None) -> dict:
        return {"peft_type": "LORA", "task_type": "CAUSAL_LM", "r": self.r, "lora_alpha": self.alpha,
                "target_modules": list(self.target_modules),
                "target_parameters": list(self.target_parameters) or None, "lora_dropout": self.dropout, "bias": "none",
                "use_rslora": self.use_rslora, "fan_in_fan_out": False, "modules_to_save": None,
                "init_lora_weights": True, "use_dora": False, "base_model_name_or_path": base_model}

    @classmethod
    def from_peft(cls, config: dict, where: str = CONFIG_FILE) -> "LoraConfig":
        """The config of a PEFT adapter_config.json; what lfm2jit cannot run is named."""
        if config.get("peft_type") != "LORA":
            raise AdapterError(f"{where}: peft_type {config.get('peft_type')!r}, lfm2jit runs LORA adapters only")
        unsupported = {"bias": ("none", None), "fan_in_fan_out": (False, None), "modules_to_save": (None, []),
                       "use_dora": (False, None), "rank_pattern": ({}, None), "alpha_pattern": ({}, None),
                       "layers_to_transform": (None,), "layers_pattern": (None, [])}
        for key, fine in unsupported.items():
            if key in config and config[key] not in fine:
                raise AdapterError(f"{where}: {key} = {config[key]!r} is not supported (expected {fine[0]!r})")
        targets, params = config.get("target_modules"), config.get("target_parameters")
        if not (isinstance(params, (list, tuple)) or params is None):
            raise AdapterError(f"{where}: target_parameters must be a list of parameter names, got {params!r}")
        if not (isinstance(targets, (list, tuple, str)) or (targets is None and params)):
            raise AdapterError(f"{where}: target_modules must be a list of module names, got {targets!r}")
        try:
            lora = cls(r=config.get("r", 8), alpha=config.get("lora_alpha", 8), target_modules=targets,
                       dropout=config.get("lora_dropout", 0.0) or 0.0, use_rslora=bool(config.get("use_rslora", False)),
                       target_parameters=params)
        except AdapterError as e:
            raise AdapterError(f"{where}: {e}") from None
        for target in lora.target_modules:       # LoraConfig.modules would say it without naming the file
            if target.rpartition(".")[2] not in LFM2_LINEARS:
                hint = f" (LFM2 calls it {LLAMA_NAMES[target]!r})" if target in LLAMA_NAMES else ""
                raise AdapterError(f"{where}: LoRA target {target!r} matches no linear layer of this LFM2{hint}; "
                                   f"LFM2's linear layers are {', '.join(LFM2_LINEARS)}")
        return lora


def peft_names(module: str) -> tuple[str, str]:
    """The names PEFT saves a module's A and B under."""
    return PEFT_PREFIX + module + ".lora_A.weight", PEFT_PREFIX + module + ".lora_B.weight"


def is_expert_tensor(name: str) -> bool:
    """An MoE model's fused expert tensor [E, out, in] (not the conv's 3-D weight)."""
    return name.startswith("model.layers.") and name.endswith(EXPERT_TENSORS)


def _short(name: str) -> str:
    """"model.layers.3.feed_forward.experts.down_proj" -> "experts.down_proj"."""
    return ".".join(name.split(".")[-2:])


def parameter_peft_names(parameters) -> dict[str, tuple[str, str]]:
    """The names PEFT saves each targeted tensor's A and B under: PEFT wraps a module once per
    targeted tensor, in the module's parameter order, each wrapper around the previous one, so all
    but the last sit one ".base_layer" deeper per wrapper around them."""
    by_module: dict[str, list[str]] = {}
    for name in parameters:
        by_module.setdefault(name.rpartition(".")[0], []).append(name)
    out = {}
    for module, names in by_module.items():
        for i, name in enumerate(names):
            out[name] = peft_names(module + ".base_layer" * (len(names) - 1 - i))
    return out


def experts_from_peft(a: np.ndarray, b: np.ndarray, experts: int) -> tuple[np.ndarray, np.ndarray]:
    """PEFT's lora_A [E r, in] and lora_B [out, r E] as lfm2jit's A [E, r, in] and B [E, out, r]."""
    n_out = b.shape[0]
    return (np.ascontiguousarray(a.reshape(experts, -1, a.shape[-1])),
            np.ascontiguousarray(b.reshape(n_out, -1, experts).transpose(2, 0, 1)))


def experts_to_peft(a: np.ndarray, b: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """``experts_from_peft``'s inverse."""
    experts, r, n_in = a.shape
    return a.reshape(experts * r, n_in), np.ascontiguousarray(b.transpose(1, 2, 0).reshape(b.shape[1], r * experts))


def peft_shapes(config: LoraConfig, modules: dict[str, tuple[int, int]],
                parameters: dict[str, tuple[int, int, int]]) -> dict[str, tuple[int, ...]]:
    """Every saved tensor's PEFT name and shape: the modules' A [r, in] and B [out, r], then the
    expert tensors' lora_A [E r, in] and lora_B [out, r E]."""
    want = {}
    for module, (n_out, n_in) in modules.items():
        a, b = peft_names(module)
        want[a], want[b] = (config.r, n_in), (n_out, config.r)
    for name, (a, b) in parameter_peft_names(parameters).items():
        experts, n_out, n_in = parameters[name]
        want[a], want[b] = (experts * config.r, n_in), (n_out, config.r * experts)
    return want


def init_weights(config: LoraConfig, modules: dict[str, tuple[int, int]], seed: int,
                 parameters: dict[str, tuple[int, int, int]] | None = None) -> dict[str, np.ndarray]:
    """A uniform in +-1/sqrt(in) (PEFT's kaiming-uniform, a = sqrt(5)), B zero, by PEFT name, in
    PEFT's shapes."""
    rng = np.random.default_rng(seed)
    out = {}
    for name, shape in peft_shapes(config, modules, parameters or {}).items():
        if name.endswith(".lora_A.weight"):
            bound = 1.0 / math.sqrt(shape[1])
            out[name] = rng.uniform(-bound, bound, shape).astype(np.float32)
        else:
            out[name] = np.zeros(shape, np.float32)
    return out


def check_weights(config: LoraConfig, modules: dict[str, tuple[int, int]], tensors: dict[str, np.ndarray],
                  where: str, parameters: dict[str, tuple[int, int, int]] | None = None) -> dict[str, np.ndarray]:
    """Every A and B of ``modules`` and ``parameters`` with its shape (PEFT's), nothing else, as f32;
    otherwise a list of what is wrong."""
    want = peft_shapes(config, modules, parameters or {})
    problems = [f"missing {n}" for n in want if n not in tensors]
    problems += [f"unexpected {n}" for n in tensors if n not in want]
    problems += [f"{n} has shape {list(tensors[n].shape)}, this model needs {list(s)}"
                 for n, s in want.items() if n in tensors and tuple(tensors[n].shape) != s]
    if problems:
        more = f" (and {len(problems) - 5} more)" if len(problems) > 5 else ""
        raise AdapterError(f"{where} does not fit this model: " + "; ".join(problems[:5]) + more)
    bad = [n for n in want if not np.all(np.isfinite(tensors[n]))]
    if bad:
        raise AdapterError(f"{where}: {bad[0]} holds NaN or infinite values")
    return {n: np.asarray(tensors[n], np.float32) for n in want}


def write_adapter(directory: Path, config: LoraConfig, tensors: dict[str, np.ndarray], base_model: str | None) -> None:
    from safetensors.numpy import save_file

    from ..safefiles import replace_with
    directory.mkdir(parents=True, exist_ok=True)
    # each file is written beside itself and renamed into place: a kill or a full disk leaves the old one
    text = json.dumps(config.to_peft(base_model), indent=2)
    replace_with(directory / CONFIG_FILE, lambda tmp: Path(tmp).write_text(text))
    arrays = {n: np.ascontiguousarray(t, np.float32) for n, t in tensors.items()}
    replace_with(directory / WEIGHTS_FILE, lambda tmp: save_file(arrays, tmp, metadata={"format": "pt"}))


def read_adapter(directory: Path) -> tuple[LoraConfig, dict[str, np.ndarray]]:
    from .checkpoint import CheckpointError, read_safetensors
    directory = Path(directory)
    path = directory / CONFIG_FILE
    if not path.is_file():
        raise AdapterError(f"{directory}: no {CONFIG_FILE} (a PEFT adapter directory has {CONFIG_FILE} and "
                           f"{WEIGHTS_FILE})")
    try:
        config = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise AdapterError(f"{path}: not readable JSON ({e})") from None
    if not isinstance(config, dict):
        raise AdapterError(f"{path}: expected a JSON object, got {type(config).__name__}")
    lora = LoraConfig.from_peft(config, str(path))
    weights = directory / WEIGHTS_FILE
    if not weights.is_file():
        old = " (adapter_model.bin, PEFT's older pickle format, is not read: save it again as safetensors)" \
            if (directory / "adapter_model.bin").is_file() else ""
        raise AdapterError(f"{directory}: no {WEIGHTS_FILE}{old}")
    try:
        tensors = read_safetensors(weights)
    except CheckpointError as e:
        raise AdapterError(str(e)) from None
    return lora, tensors
