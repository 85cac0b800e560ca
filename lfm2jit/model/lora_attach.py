"""Putting LoRA adapters on a model's parameters (optionally narrowing the frozen base to f16) and
folding them back in (merge)."""
from __future__ import annotations

import numpy as np

from ..runtime import Tensor, arena
from ..runtime.tensor import DTYPES
from .adapters import LoraAdapters
from .moe_checkpoint import model_parameter_shapes
from .config import Lfm2Config
from .lora import LoraConfig, experts_from_peft, is_expert_tensor, parameter_peft_names
from .quantize import nf4_splits_whole
from .quantized_base import QUANTIZED_DTYPES, QuantizedWeight

BASE_DTYPES = ("f32", "f16") + QUANTIZED_DTYPES


def check_base_dtype(base_dtype: str, ctx) -> None:
    """A one-line ValueError, before any GPU work, for a base dtype the adapter cannot run.

    base_dtype="f16" on an adapter without the shader-f16 feature is refused rather than kept as
    f32: what was asked for is half the base's memory, so a silent f32 fallback would hand back a
    model twice the size that was planned for (and that may not fit), with nothing said."""
    if base_dtype not in BASE_DTYPES:
        raise ValueError(f"base_dtype must be one of {', '.join(map(repr, BASE_DTYPES))}, got {base_dtype!r}")
    if base_dtype == "f16" and not ctx.has_f16:
        raise ValueError(f"base_dtype='f16' (f16 base weights) needs the shader-f16 feature, which adapter "
                         f"{ctx.name!r} lacks; use base_dtype='f32'")


def upload_adapters(ctx, config: LoraConfig, modules, weights: dict[str, np.ndarray], seed: int,
                    parameters=None) -> LoraAdapters:
    """The adapters' A and B matrices (by PEFT name, in PEFT's shapes) uploaded side by side
    (runtime/arena.py), PEFT names kept; the expert tensors' in lfm2jit's layout."""
    weights = dict(weights)
    for name, (a, b) in parameter_peft_names(parameters or {}).items():
        weights[a], weights[b] = experts_from_peft(weights[a], weights[b], parameters[name][0])
    return LoraAdapters(config, dict(zip(weights, arena.upload(ctx, list(weights.values())))), modules, seed,
                        tuple(parameters or ()))


def base_linears(cfg: Lfm2Config) -> list[str]:
    """The decoder's linear weights and an MoE model's expert tensors: what base_dtype="f16" narrows."""
    return [n for n, shape in model_parameter_shapes(cfg).items() if is_base_linear(n, shape)]


def is_base_linear(name: str, shape) -> bool:
    """Whether base_dtype="f16" narrows the tensor ``name`` of this shape: a decoder linear's weight or
    an expert tensor, fused or (as checkpoints store them) one expert's w1, w3 or w2."""
    return (name.startswith("model.layers.") and name.endswith(".weight") and len(shape) == 2) or is_expert_tensor(name)


def held_as(base_dtype: str):
    """The ``Narrow`` (model/checkpoint.py) that holds a base of ``base_dtype`` as it is read or drawn:
    f16 or quantized base linears and expert tensors (an MoE router stays float32, and so does an
    expert tensor whose experts do not split into whole NF4 blocks: quantized after fusing, on
    upload), or None for an f32 base."""
    if base_dtype == "f16":
        return is_base_linear
    if base_dtype not in QUANTIZED_DTYPES:
        return None

    def form(name: str, shape) -> str | None:
        if not is_base_linear(name, shape) or is_router(name):
            return None
        if base_dtype == "nf4" and is_expert_tensor(name):
            pieces = shape[0] * (2 if name.endswith("gate_up_proj") else 1) if len(shape) == 3 else 1
            return base_dtype if nf4_splits_whole(shape, pieces) else None
        return base_dtype
    return form


def is_router(name: str) -> bool:
    """Whether ``name`` is an MoE block's router weight (feed_forward.gate: [E, D])."""
    return name.endswith(".feed_forward.gate.weight")


def base_forms(linears, base_dtype: str) -> tuple[set[str], set[str]]:
    """Of a model's base linears, (those held as f16, those quantized) under ``base_dtype``: all as
    f16 for "f16"; for "nf4" / "int8" all quantized but an MoE router, which stays f32 (4-bit
    rounding would move its top-k picks); none for "f32"."""
    if base_dtype in QUANTIZED_DTYPES:
        return set(), {n for n in linears if not is_router(n)}
    return (set(linears) if base_dtype == "f16" else set()), set()


def upload_parameters(ctx, arrays: dict[str, np.ndarray], to_f16: set[str], base_dtype: str = "f16") -> dict[str, Tensor]:
    """The arrays as parameters: those named in ``to_f16`` as ``base_dtype`` (f16 in an arena of
    their own; "nf4" / "int8": each quantized as it is uploaded, a QuantizedWeight, except an MoE
    router's; one already quantized as it was read is uploaded as it is), the others as f32 in another,
    in the arrays' order. Each array is narrowed as it is written, so no f32 copy of a narrowed group
    is ever held on the device."""
    halves, quantized = base_forms(to_f16, base_dtype)
    new: dict[str, Tensor] = {n: QuantizedWeight(ctx, n, arrays[n], base_dtype) for n in arrays if n in quantized}
    for dtype, names in (("f32", [n for n in arrays if n not in halves and n not in quantized]),
                         ("f16", [n for n in arrays if n in halves])):
        new.update(zip(names, arena.upload(ctx, [arrays[n] for n in names], dtype)))
    return {n: new[n] for n in arrays}


def reupload(ctx, params: dict[str, Tensor], to_f16: set[str], base_dtype: str = "f16") -> dict[str, Tensor]:
    """upload_parameters of the parameters' values (new tensors, the same order), so the old arena,
    and with it the f32 copies, is freed: an arena lives while any view of it does."""
    return upload_parameters(ctx, {n: t.numpy() for n, t in params.items()}, to_f16, base_dtype)


def merge(params: dict[str, Tensor], lora: LoraAdapters) -> None:
    """W += s * B A for every adapted module, in float64, stored as the weight's dtype (an f16 base
    is rounded to f16, as merging into a half-precision base in PEFT is)."""
    s = lora.config.scaling
    held = [n for n, t in params.items() if isinstance(t, QuantizedWeight)]
    if held:              # a quantized base is dequantized first: the merged model is a plain f32 one
        ctx = params[held[0]].tensors["q"].ctx
        params.update(zip(held, arena.upload(ctx, [params[n].numpy() for n in held], "f32")))
    for module, ad in lora.by_module.items():
        w = params[module + ".weight"]
        merged = w.numpy().astype(np.float64) + s * (ad.b.numpy().astype(np.float64) @ ad.a.numpy().astype(np.float64))
        w.write(merged.astype(DTYPES[w.dtype]))
    for name, ad in lora.by_parameter.items():      # W[e] += s * B[e] A[e], each expert
        w = params[name]
        delta = np.einsum("eor,eri->eoi", ad.b.numpy().astype(np.float64), ad.a.numpy().astype(np.float64))
        w.write((w.numpy().astype(np.float64) + s * delta).astype(DTYPES[w.dtype]))
