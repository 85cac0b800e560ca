"""A new model's parameters initialised on the GPU, as transformers initialises LFM2: normal(0,
initializer_range) weights, ones for norm weights, zeros for biases, an MoE router's expert_bias
buffers and the padding token's embedding row. The normal draws are the ``init_normal`` kernel's
(ops/kernels/init.lk), so nothing is drawn on the host or uploaded but the norms' ones.

Every tensor has a key from the seed and its place among the model's parameters, and each entry
depends on that key and its index alone: a base held as f16 holds the f32 model's values rounded
to f16, a quantized base the f32 model's values quantized, and a tensor drawn in pieces what one
draw of it would hold."""
from __future__ import annotations

import numpy as np

from ..runtime import Tensor, arena
from ..runtime.tensor import ITEMSIZE
from .checkpoint import EMBEDDING, initial_value
from .lora_attach import base_forms, base_linears
from .moe_checkpoint import model_parameter_shapes, moe_tensor_shapes, is_buffer
from .moe_config import Lfm2MoeConfig
from .quantize import nf4_splits_whole, quantize_as, quantized_concat, quantized_reshape
from .quantized_base import QuantizedWeight

CHUNK = 1 << 18     # entries per dispatch: one pipeline (the T bucket) serves every tensor size


def tensor_keys(seed: int, names) -> dict[str, int]:
    """A 32-bit key per tensor name, in order, from ``seed`` (numpy's SeedSequence: distinct seeds
    give unrelated keys)."""
    names = list(names)
    return dict(zip(names, map(int, np.random.SeedSequence(seed).generate_state(len(names), np.uint32))))


def draw_normal(engine, t: Tensor, key: int, std: float, start: int = 0) -> None:
    """Record filling ``t`` (f32 or f16) with normal(0, std) under ``key``: its entry j is
    init_normal's draw for (key, start + j), one binding's piece at a time and CHUNK entries a
    dispatch."""
    item = ITEMSIZE[t.dtype]
    for (piece,) in arena.cut(t.view(t.size)):
        for at in range(0, piece.size, CHUNK):
            n = min(CHUNK, piece.size - at)
            engine.run("init_normal", bucket=CHUNK, dims={"T": n}, f16=("w",) if t.dtype == "f16" else (),
                       out={"w": piece.bytes_view(piece.offset + at * item, n * item)},
                       key_hi=key >> 16, key_lo=key & 0xFFFF, start_hi=start >> 16, start_lo=start & 0xFFFF, std=std)
            start += n


def _drawn_quantized(ctx, engine, shape, key: int, std: float, dtype: str, name: str):
    """A tensor's normal draws quantized as ``dtype`` on the host, an expert at a time where the
    experts split into whole blocks (the host holds one expert in f32), else whole: the same codes
    and scales as quantizing the whole tensor."""
    experts = shape[0] if len(shape) == 3 and (dtype == "int8" or nf4_splits_whole(shape, shape[0])) else 1
    piece = shape[1:] if experts > 1 else shape
    parts = []
    for e in range(experts):
        scratch = Tensor.empty(ctx, piece)
        draw_normal(engine, scratch, key, std, start=e * scratch.size)
        parts.append(quantize_as(scratch.numpy(), dtype, name))
    return parts[0] if experts == 1 else quantized_reshape(quantized_concat(parts), shape)


def initial_parameters(ctx, engine, cfg, seed: int, base_dtype: str = "f32") -> tuple[dict[str, Tensor], dict[str, Tensor]]:
    """(parameters, buffers) of a new model of ``cfg`` (dense or MoE), in ``model_parameter_shapes``'
    order: base linears as ``base_dtype`` says (f16 drawn as f16; "nf4" / "int8" drawn into a
    temporary f32 tensor, read back and quantized, one tensor or expert at a time; ``base_forms``), the
    rest f32, side by side in arenas (runtime/arena.py)."""
    shapes = model_parameter_shapes(cfg)
    keys = tensor_keys(seed, shapes)
    halves, quantized = base_forms(base_linears(cfg), base_dtype)
    params: dict[str, Tensor] = {}
    for dtype, names in (("f32", [n for n in shapes if n not in halves and n not in quantized]),
                         ("f16", [n for n in shapes if n in halves])):
        params.update(zip(names, arena.allocate(ctx, [shapes[n] for n in names], dtype)))
    std = cfg.initializer_range
    for name in shapes:
        if name in quantized:
            params[name] = QuantizedWeight(ctx, name, _drawn_quantized(ctx, engine, shapes[name], keys[name], std,
                                                                       base_dtype, name), base_dtype)
            continue
        kind = initial_value(name)
        if kind == "normal":
            draw_normal(engine, params[name], keys[name], std)
        elif kind == "ones":
            params[name].write(np.ones(shapes[name], np.float32))
    pad = cfg.pad_token_id
    if pad is not None and 0 <= pad < cfg.vocab_size:      # nn.Embedding(padding_idx) starts at zero
        table = params[EMBEDDING]
        row = table.nbytes // cfg.vocab_size
        engine.zero_(table.bytes_view(table.offset + pad * row, row))
    buffers = ({n: Tensor.from_numpy(ctx, np.zeros(s, np.float32)) for n, s in moe_tensor_shapes(cfg).items()
                if is_buffer(n)} if isinstance(cfg, Lfm2MoeConfig) else {})
    return {n: params[n] for n in shapes}, buffers
