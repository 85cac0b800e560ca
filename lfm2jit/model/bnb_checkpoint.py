"""Reading a checkpoint transformers saved with a bitsandbytes 4-bit quantization config
(``BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4")``, double quantization or not):
each quantized weight is stored as its packed codes (``W``, uint8), its absmaxes (``W.absmax``:
float32, or uint8 codes with ``W.nested_absmax`` and ``W.nested_quant_map`` when double quantized),
the codebook (``W.quant_map``) and a JSON quant state (``W.quant_state.bitsandbytes__nf4``: shape,
block sizes, the nested offset). They are dequantized here exactly as bitsandbytes' dequantize_4bit
does (lfm2jit/model/quantize.py); ``Lfm2Model.from_pretrained(..., base_dtype="nf4")`` then
quantizes them again as it uploads them, which gives back the same codes and absmaxes (a block's
largest value is exactly +-absmax, every other one exactly a code times it), except in blocks whose
absmax is below 1e-38 (float32 subnormals, which bitsandbytes scales by 1 / 1e-38)."""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from .quantize import ABSMAX_BLOCKSIZE, DYNAMIC_CODE, NF4_CODE, Nf4Weight, dequantize_nf4

STATE = ".quant_state.bitsandbytes__"
PARTS = (".absmax", ".quant_map", ".nested_absmax", ".nested_quant_map")


class Bnb4bitError(ValueError):
    pass


def quantization_config(directory: Path) -> dict | None:
    """config.json's quantization_config when it is bitsandbytes' 4-bit one, else None."""
    path = Path(directory) / "config.json"
    try:
        q = json.loads(path.read_text()).get("quantization_config")
    except (OSError, ValueError, AttributeError):
        return None
    if isinstance(q, dict) and q.get("quant_method") == "bitsandbytes" and (q.get("load_in_4bit") or q.get("_load_in_4bit")):
        return q
    return None


def dequantize_stored(raw: dict[str, np.ndarray], where: str) -> dict[str, np.ndarray]:
    """``raw`` (a checkpoint's tensors in their stored dtypes) with each 4-bit weight dequantized to
    float32 and its quantization tensors dropped."""
    out = dict(raw)
    for key in [k for k in raw if STATE in k]:
        name, kind = key.split(STATE)
        if kind != "nf4":
            raise Bnb4bitError(f"{where}: {name} is stored as bitsandbytes {kind}; only nf4 is supported")
        state = json.loads(bytes(raw[key]).decode())
        if state.get("blocksize") != 64:
            raise Bnb4bitError(f"{where}: {name} has NF4 block size {state.get('blocksize')}; only 64 is supported")
        if not np.array_equal(raw[name + ".quant_map"].astype(np.float32), NF4_CODE):
            raise Bnb4bitError(f"{where}: {name}.quant_map is not the NF4 codebook")
        shape = tuple(int(s) for s in state["shape"])
        codes = [name] + ([name + ".absmax"] if name + ".nested_absmax" in raw else [])
        wrong = [n for n in codes if raw[n].dtype != np.uint8]
        if wrong:
            raise Bnb4bitError(f"{where}: {wrong[0]} holds 4-bit codes but is stored as {raw[wrong[0]].dtype}, not U8")
        packed = raw[name].reshape(-1)
        if name + ".nested_absmax" in raw:
            if state.get("nested_blocksize") != ABSMAX_BLOCKSIZE or not np.array_equal(
                    raw[name + ".nested_quant_map"].astype(np.float32), DYNAMIC_CODE):
                raise Bnb4bitError(f"{where}: {name}'s absmaxes are double quantized in a way other than "
                                   "blocks of 256 with the 8-bit dynamic code")
            q = Nf4Weight(shape, packed, 64, absmax_codes=raw[name + ".absmax"].astype(np.uint8),
                          absmax_scales=raw[name + ".nested_absmax"].astype(np.float32),
                          offset=np.float32(state["nested_offset"]))
        else:
            q = Nf4Weight(shape, packed, 64, absmax=raw[name + ".absmax"].astype(np.float32))
        out[name] = dequantize_nf4(q)
        for suffix in PARTS + (STATE + kind,):
            out.pop(name + suffix, None)
    stray = [n for n, a in out.items() if a.dtype == np.uint8]
    if stray:
        raise Bnb4bitError(f"{where}: {stray[0]} is stored as U8 but is no 4-bit weight (it has no quant_state)")
    return out
