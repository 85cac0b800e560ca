"""The decoder's layers as typed forward/backward pairs: each forward returns the activations its
backward reads, as a dataclass with a shape per field."""
from .attention import Attention, AttentionSaved, Rope
from .base import Residual, ResidualSaved, Rows
from .conv import Conv, ConvSaved
from .kernels import Kernels, LoraSaved, backward_of
from .mlp import Mlp, MlpSaved
from .moe import Moe, MoeSaved

__all__ = ["Attention", "AttentionSaved", "Conv", "ConvSaved", "Kernels", "LoraSaved", "Mlp", "MlpSaved", "Moe", "MoeSaved", "Residual",
           "ResidualSaved", "Rope", "Rows", "backward_of", "decoder_block"]


def decoder_block(kernels: Kernels, cfg, index: int, rope: Rope, keep_ab: bool = True) -> list[Residual]:
    """Decoder layer ``index`` as the list its forward runs in order (backward: reversed): its
    mixer (the conv or the attention, by ``cfg.layer_types``), then the MLP, or an MoE model's
    sparse block in its ``moe_layers``. ``keep_ab=False`` (recompute_mlp): the MLP's or the experts'
    up-projections are computed again in the backward rather than kept."""
    kind = cfg.layer_types[index]
    mixer = Conv(kernels, cfg, index) if kind == "conv" else Attention(kernels, cfg, index, rope)
    sparse = index in getattr(cfg, "moe_layers", ())
    return [mixer, Moe(kernels, cfg, index, keep_ab) if sparse else Mlp(kernels, cfg, index, keep_ab)]
