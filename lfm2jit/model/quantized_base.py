"""A frozen base weight held in a quantized format on the device (add_lora(base_dtype="nf4"|"int8")):
the packed tensors the decoding kernels read (ops/quantized.py), standing where the model keeps the
parameter. It is never trained; ``numpy()`` gives the dequantized float32 weight."""
from __future__ import annotations

import numpy as np

from ..runtime import Tensor
from .quantize import NF4_CODE, Int8Weight, Nf4Weight, dequantize_int8, dequantize_nf4, quantize_as

QUANTIZED_DTYPES = ("nf4", "int8")


class QuantizedWeight:
    """A 2-D weight [out, in] (or an MoE block's experts [E, out, in]) quantized as ``dtype`` ("nf4":
    blocks of 64 with a float32 absmax each; "int8": per output row) and uploaded packed: u32 words
    of codes ``q``, float32 scales ``s`` and, for NF4, the codebook ``c``."""

    grad = None          # frozen: backward computes no gradient for it

    def __init__(self, ctx, name: str, array: np.ndarray, dtype: str):
        if dtype not in QUANTIZED_DTYPES:
            raise ValueError(f"{name}: quantized dtype must be one of {', '.join(QUANTIZED_DTYPES)}, got {dtype!r}")
        shape = tuple(array.shape) if hasattr(array, "shape") else np.shape(array)
        if len(shape) not in (2, 3):
            raise ValueError(f"{name}: only linear weights (2-D) and experts (3-D) can be held as {dtype}, this "
                             f"one is {shape}")
        self.name, self.dtype, self.shape = name, dtype, shape
        self.tensors = {k: Tensor.from_numpy(ctx, v) for k, v in self._quantized(array).items()}

    def _quantized(self, array) -> dict[str, np.ndarray]:
        """The packed tensors of ``array``: a float array, or this format's host form (single absmaxes)
        as the checkpoint reader quantized it (model/checkpoint.py ``hold``)."""
        form = Nf4Weight if self.dtype == "nf4" else Int8Weight
        if isinstance(array, (Nf4Weight, Int8Weight)):
            if not isinstance(array, form) or getattr(array, "double_quant", False):
                raise ValueError(f"{self.name}: a quantized weight held as {type(array).__name__} cannot be "
                                 f"uploaded as {self.dtype}")
            self.host = array
        else:
            self.host = quantize_as(array, self.dtype, self.name)
        if self.dtype == "nf4":
            return {"q": self.host.words(), "s": self.host.absmax, "c": NF4_CODE}
        return {"q": self.host.words(), "s": self.host.scale}

    def write(self, array) -> None:
        """Hold ``array`` (float, this weight's shape) instead, quantized (a checkpoint's base being
        restored: written dequantized, it quantizes back to the same codes)."""
        if tuple(np.shape(array)) != self.shape:
            raise ValueError(f"{self.name}: cannot write {list(np.shape(array))} into a {list(self.shape)} weight")
        for k, v in self._quantized(np.asarray(array, np.float32)).items():
            self.tensors[k].write(v)

    @property
    def nbytes(self) -> int:
        return sum(t.nbytes for t in self.tensors.values())

    def numpy(self) -> np.ndarray:
        """The dequantized weight, float32 in its shape."""
        return dequantize_nf4(self.host) if self.dtype == "nf4" else dequantize_int8(self.host)

    def args(self, param: str) -> dict[str, Tensor]:
        """The decoding kernel's arguments for its weight parameter ``param``."""
        return {f"{param}_{k}": t for k, t in self.tensors.items()}

    def __repr__(self) -> str:
        return f"QuantizedWeight({self.name}, {self.dtype}, {list(self.shape)})"
