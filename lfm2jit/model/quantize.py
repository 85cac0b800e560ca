"""Quantized formats of a frozen base's linear weights, in numpy: NF4 (QLoRA's, as bitsandbytes
stores it) and int8 per output channel. Quantize and dequantize only; the GPU side reads the
packed words these produce (`Nf4Weight.words`, `Int8Weight.words`).

NF4 (Dettmers et al. 2023, "QLoRA"; bitsandbytes' `quantize_4bit(quant_type="nf4")`):
- the weight is flattened row-major and cut into blocks of `blocksize` (64) values; the last block
  may be short. Each block keeps its absmax (float32);
- each value is scaled by the block's reciprocal absmax (`x * (1 / max(absmax, 1e-38))` in float32;
  a short last block divides, `x / max(absmax, 1e-38)`, and keeps max(absmax, 1e-38)), clamped to [-1, 1], and takes the index of
  the nearest of the 16 NF4 codebook values; a value exactly on the midpoint of two neighbours takes
  the lower one (the midpoints are float32 `(c[i] + c[i + 1]) / 2`);
- two codes go in a byte, the even element in the high nibble: byte j = q[2j] << 4 | q[2j + 1]
  (an odd count is padded with code 7, 0.0's);
- dequantized value = codebook[q] * absmax, one float32 product.
Double quantization (bitsandbytes' `compress_statistics=True`): offset = the mean of the absmaxes,
then absmax - offset is quantized blockwise in blocks of 256 with the signed 8-bit dynamic code
(`create_dynamic_map()`): each block's absmax s2 (float32) and each value's code as bitsandbytes'
CPU quantizer picks it (a lookup table; `quantize_dynamic`). Dequantized absmax =
dynamic[q2] * s2 + offset (float32), then as above.

The offset is the only float reduction in the format. bitsandbytes takes it from torch's float32
`mean()`, whose summation order depends on the CPU's vector width and threads; here it is the
float64 sum rounded once to float32, divided by the count in float32. A checkpoint carries its
offset, and loading uses the stored one.

int8 per output channel (symmetric): row n's scale = absmax(W[n]) / 127 (float32), its codes
round(W[n, k] * 127 / absmax) (half to even, computed in float64, in [-127, 127]; a zero row has
scale 0 and codes 0); dequantized value = code * scale (float32)."""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ..runtime.host_threads import in_ranges

# bitsandbytes' NF4 codebook: the normal distribution's quantiles (float32, sorted, 0.0 at index 7).
NF4_CODE = np.array([
    -1.0, -0.6961928009986877, -0.5250730514526367, -0.39491748809814453, -0.28444138169288635,
    -0.18477343022823334, -0.09105003625154495, 0.0, 0.07958029955625534, 0.16093020141124725,
    0.24611230194568634, 0.33791524171829224, 0.44070982933044434, 0.5626170039176941,
    0.7229568362236023, 1.0], dtype=np.float32)

NF4_BLOCKSIZES = (64,)
ABSMAX_BLOCKSIZE = 256


class QuantizeError(ValueError):
    """A weight that cannot be quantized (non-finite values, an unsupported block size), naming it."""


# bitsandbytes' signed 8-bit dynamic code (`create_dynamic_map(signed=True, max_exponent_bits=7,
# total_bits=8)`, Dettmers 2015): for e = 0..6, the 2^e midpoints of torch.linspace(0.1, 1, 2^e + 1)
# (float32) times 10^(e - 6), with both signs, then 0 and 1; sorted. Written out as float32 values,
# as bitsandbytes writes out NF4's, since torch's float32 linspace is not numpy's.
DYNAMIC_CODE = np.array([
    -0.99296874, -0.9789063, -0.96484375, -0.9507812, -0.93671876, -0.92265624, -0.9085938,
    -0.89453125, -0.8804687, -0.86640626, -0.85234374, -0.8382813, -0.82421875, -0.8101562,
    -0.79609376, -0.78203124, -0.7679688, -0.75390625, -0.7398437, -0.72578126, -0.7117188, -0.6976563,
    -0.68359375, -0.6695312, -0.65546876, -0.6414063, -0.6273438, -0.61328125, -0.5992187, -0.58515626,
    -0.5710938, -0.5570313, -0.54296875, -0.5289062, -0.5148437, -0.50078124, -0.4867187, -0.47265625,
    -0.45859373, -0.44453126, -0.43046874, -0.41640624, -0.40234375, -0.38828123, -0.37421876,
    -0.36015624, -0.34609374, -0.33203125, -0.31796873, -0.30390626, -0.28984374, -0.27578127,
    -0.26171875, -0.24765624, -0.23359375, -0.21953125, -0.20546874, -0.19140625, -0.17734376,
    -0.16328125, -0.14921875, -0.13515624, -0.12109375, -0.107031256, -0.09859375, -0.09578126,
    -0.092968754, -0.09015625, -0.08734375, -0.08453125, -0.08171876, -0.07890625, -0.07609375,
    -0.07328125, -0.070468746, -0.067656256, -0.06484375, -0.06203125, -0.059218753, -0.05640625,
    -0.05359375, -0.05078125, -0.04796875, -0.04515625, -0.042343747, -0.03953125, -0.036718752,
    -0.03390625, -0.03109375, -0.028281251, -0.02546875, -0.02265625, -0.019843752, -0.01703125,
    -0.01421875, -0.01140625, -0.00971875, -0.009156249, -0.00859375, -0.00803125, -0.00746875,
    -0.00690625, -0.00634375, -0.00578125, -0.0052187503, -0.0046562497, -0.00409375, -0.0035312497,
    -0.00296875, -0.00240625, -0.00184375, -0.0012812499, -0.0009437501, -0.00083125, -0.00071875006,
    -0.0006062501, -0.00049375003, -0.00038125002, -0.00026875004, -0.00015625001, -8.875e-05,
    -6.625e-05, -4.375e-05, -2.1249998e-05, -7.75e-06, -3.2500002e-06, -5.5000004e-07, 0,
    5.5000004e-07, 3.2500002e-06, 7.75e-06, 2.1249998e-05, 4.375e-05, 6.625e-05, 8.875e-05,
    0.00015625001, 0.00026875004, 0.00038125002, 0.00049375003, 0.0006062501, 0.00071875006,
    0.00083125, 0.0009437501, 0.0012812499, 0.00184375, 0.00240625, 0.00296875, 0.0035312497,
    0.00409375, 0.0046562497, 0.0052187503, 0.00578125, 0.00634375, 0.00690625, 0.00746875, 0.00803125,
    0.00859375, 0.009156249, 0.00971875, 0.01140625, 0.01421875, 0.01703125, 0.019843752, 0.02265625,
    0.02546875, 0.028281251, 0.03109375, 0.03390625, 0.036718752, 0.03953125, 0.042343747, 0.04515625,
    0.04796875, 0.05078125, 0.05359375, 0.05640625, 0.059218753, 0.06203125, 0.06484375, 0.067656256,
    0.070468746, 0.07328125, 0.07609375, 0.07890625, 0.08171876, 0.08453125, 0.08734375, 0.09015625,
    0.092968754, 0.09578126, 0.09859375, 0.107031256, 0.12109375, 0.13515624, 0.14921875, 0.16328125,
    0.17734376, 0.19140625, 0.20546874, 0.21953125, 0.23359375, 0.24765624, 0.26171875, 0.27578127,
    0.28984374, 0.30390626, 0.31796873, 0.33203125, 0.34609374, 0.36015624, 0.37421876, 0.38828123,
    0.40234375, 0.41640624, 0.43046874, 0.44453126, 0.45859373, 0.47265625, 0.4867187, 0.50078124,
    0.5148437, 0.5289062, 0.54296875, 0.5570313, 0.5710938, 0.58515626, 0.5992187, 0.61328125,
    0.6273438, 0.6414063, 0.65546876, 0.6695312, 0.68359375, 0.6976563, 0.7117188, 0.72578126,
    0.7398437, 0.75390625, 0.7679688, 0.78203124, 0.79609376, 0.8101562, 0.82421875, 0.8382813,
    0.85234374, 0.86640626, 0.8804687, 0.89453125, 0.9085938, 0.92265624, 0.93671876, 0.9507812,
    0.96484375, 0.9789063, 0.99296874, 1,], dtype=np.float32)


def _check_finite(w: np.ndarray, name: str) -> np.ndarray:
    w = np.asarray(w)
    if w.dtype not in (np.float16, np.float32, np.float64):
        raise QuantizeError(f"{name}: cannot quantize a {w.dtype} tensor (float16/32/64 only)")
    bad = ~np.isfinite(w)
    if bad.any():
        where = np.unravel_index(int(np.argmax(bad)), w.shape)
        kind = "NaN" if np.isnan(w[where]) else "inf"
        raise QuantizeError(f"{name}: cannot quantize a weight holding {kind} (first at index "
                            f"{tuple(int(i) for i in where)}; {int(bad.sum())} non-finite values)")
    return w.astype(np.float32)


def _blocks(flat: np.ndarray, blocksize: int) -> list[np.ndarray]:
    return [flat[i:i + blocksize] for i in range(0, flat.size, blocksize)]


@dataclass(frozen=True)
class Nf4Weight:
    """A weight in NF4: `packed` uint8 [ceil(n / 2)] (bitsandbytes' bytes), and either `absmax`
    float32 [blocks] or, double quantized, `absmax_codes` uint8 [blocks] + `absmax_scales` float32
    [ceil(blocks / 256)] + `offset`."""
    shape: tuple[int, ...]
    packed: np.ndarray
    blocksize: int = 64
    absmax: np.ndarray | None = None
    absmax_codes: np.ndarray | None = None
    absmax_scales: np.ndarray | None = None
    offset: np.float32 | None = None

    @property
    def double_quant(self) -> bool:
        return self.absmax_codes is not None

    def block_absmax(self) -> np.ndarray:
        """float32 [blocks]: the blocks' absmaxes (dequantized when double quantized)."""
        if not self.double_quant:
            return self.absmax
        scale = np.repeat(self.absmax_scales, ABSMAX_BLOCKSIZE)[:self.absmax_codes.size]
        return (DYNAMIC_CODE[self.absmax_codes] * scale + np.float32(self.offset)).astype(np.float32)

    def codes(self) -> np.ndarray:
        """uint8 [n]: the 4-bit index of each element, unpacked (row-major order)."""
        q = np.empty(self.packed.size * 2, np.uint8)
        q[0::2], q[1::2] = self.packed >> 4, self.packed & 15
        return q[:int(np.prod(self.shape))]

    def words(self) -> np.ndarray:
        """uint32 [ceil(n / 8)]: the packed bytes read as little-endian 32-bit words (padded with
        zero bytes), what a shader binds: element i is bits 8 * ((i >> 1) & 3) + 4 * (1 - (i & 1))
        .. +3 of word i >> 3."""
        b = np.zeros(-(-self.packed.size // 4) * 4, np.uint8)
        b[:self.packed.size] = self.packed
        return b.view("<u4").astype(np.uint32)


NF4_CHUNK = 1 << 18        # values quantized at a time: small temporaries
_NF4_MIDS = (NF4_CODE[:-1] + NF4_CODE[1:]) / np.float32(2.0)     # float32, between neighbouring codes


def _nf4_codes(scaled: np.ndarray) -> np.ndarray:
    """The NF4 code of each value already divided by its block's absmax: clamped to [-1, 1], the
    first codebook midpoint >= the value (ties at a midpoint take the lower code)."""
    scaled = np.clip(scaled, np.float32(-1.0), np.float32(1.0)).reshape(-1)
    codes = np.zeros(scaled.size, np.uint8)
    for mid in _NF4_MIDS:                 # the count of midpoints below the value
        codes += scaled > mid
    return codes


def quantize_nf4(w, name: str = "weight", blocksize: int = 64, double_quant: bool = False) -> Nf4Weight:
    """NF4 of `w` (any shape; float16/32/64, held as float32 first) as bitsandbytes stores it."""
    if blocksize not in NF4_BLOCKSIZES:
        raise QuantizeError(f"{name}: NF4 block size {blocksize} is not supported (supported: "
                            f"{', '.join(map(str, NF4_BLOCKSIZES))})")
    w = _check_finite(w, name)
    flat = w.reshape(-1)
    if flat.size == 0:
        raise QuantizeError(f"{name}: cannot quantize an empty tensor")
    absmax = np.empty(-(-flat.size // blocksize), np.float32)
    q = np.empty(flat.size + flat.size % 2, np.uint8)
    q[flat.size:] = 7                                     # pad: 0.0's code (bitsandbytes pads 0.0)
    whole = flat.size // blocksize
    step = max(1, NF4_CHUNK // blocksize)                 # whole blocks a chunk: bounded temporaries

    def quantize_blocks(start: int, stop: int) -> None:
        with np.errstate(over="ignore", under="ignore"):  # numpy keeps its error state per thread
            for b0 in range(start, stop, step):
                blocks = flat[b0 * blocksize:min(stop, b0 + step) * blocksize].reshape(-1, blocksize)
                absmax[b0:b0 + len(blocks)] = top = np.abs(blocks).max(axis=1)
                inverse = np.float32(1.0) / np.maximum(top, np.float32(1e-38))
                q[b0 * blocksize:(b0 + len(blocks)) * blocksize] = _nf4_codes(blocks * inverse[:, None])

    # ranges of whole blocks on the host's threads (numpy lets go of the GIL in its array loops)
    in_ranges(quantize_blocks, whole, whole * blocksize * flat.itemsize)
    with np.errstate(over="ignore", under="ignore"):
        if whole < absmax.size:                           # a short last block: bitsandbytes keeps it clamped
            block = flat[whole * blocksize:]
            absmax[-1] = div = max(np.abs(block).max(), np.float32(1e-38))
            q[whole * blocksize:flat.size] = _nf4_codes(block / div)
    packed = (q[0::2] << 4) | q[1::2]
    if not double_quant:
        return Nf4Weight(tuple(w.shape), packed.astype(np.uint8), blocksize, absmax=absmax)
    offset = np.float32(np.float32(np.sum(absmax, dtype=np.float64)) / np.float32(absmax.size))
    codes, scales = quantize_dynamic(absmax - offset, name)
    return Nf4Weight(tuple(w.shape), packed.astype(np.uint8), blocksize, absmax_codes=codes,
                     absmax_scales=scales, offset=offset)


LUT_SIZE = 65536


def _dynamic_lut(code: np.ndarray) -> np.ndarray:
    """bitsandbytes' CPU lookup table: [-1, 1] cut into 65536 points v_i = -1 + 2 i / 65535
    (float32), each mapped to the first code whose float32 midpoint with the next is >= v_i."""
    mids = np.float32(0.5) * (code[:-1] + code[1:])
    i = np.arange(LUT_SIZE, dtype=np.float32)
    v = np.float32(-1.0) + (np.float32(2.0) * i) / np.float32(LUT_SIZE - 1)
    return np.searchsorted(mids, v, side="left").astype(np.uint8)


_DYNAMIC_LUT = _dynamic_lut(DYNAMIC_CODE)


def quantize_dynamic(a: np.ndarray, name: str = "absmax", blocksize: int = ABSMAX_BLOCKSIZE):
    """Blockwise 8-bit dynamic quantization of float32 `a` as bitsandbytes' CPU quantizer (0.50)
    does it: uint8 codes [n], float32 block absmaxes s [ceil(n / blocksize)]. A value's code is
    looked up, not searched: x = clamp(a * (1 / s), -1, 1) (float32), LUT index
    trunc(fma((x + 1) * 0.5, 65535, 0.5)), and the table of `_dynamic_lut` (so a value within
    1/65535 of a midpoint may take the farther code, as bitsandbytes' does). A block of zeros
    has s = 0 and codes 0."""
    a = _check_finite(a, name)
    codes = np.empty(a.size, np.uint8)
    scales = np.empty(-(-a.size // blocksize), np.float32)
    with np.errstate(over="ignore", under="ignore"):
        for b, block in enumerate(_blocks(a, blocksize)):
            scales[b] = s = np.abs(block).max()
            if s == 0:
                codes[b * blocksize:b * blocksize + block.size] = 0
                continue
            x = np.clip(block * (np.float32(1.0) / s), np.float32(-1.0), np.float32(1.0))
            half = ((x + np.float32(1.0)) * np.float32(0.5)).astype(np.float64)
            # one fused multiply-add, rounded once to float32 (exact in float64 before that)
            idx = (half * (LUT_SIZE - 1) + 0.5).astype(np.float32).astype(np.int64)
            codes[b * blocksize:b * blocksize + block.size] = _DYNAMIC_LUT[idx]
    return codes, scales


def dequantize_nf4(q: Nf4Weight) -> np.ndarray:
    """float32 in q.shape: codebook[code] * its block's absmax."""
    absmax = np.repeat(q.block_absmax(), q.blocksize)[:int(np.prod(q.shape))]
    return (NF4_CODE[q.codes()] * absmax).astype(np.float32).reshape(q.shape)


@dataclass(frozen=True)
class Int8Weight:
    """A weight [N, K] (or an experts' [E, N, K]) in int8 per output channel: `codes` int8 in its
    shape, `scale` float32 [N] ([E, N]), one per row of the last axis."""
    codes: np.ndarray
    scale: np.ndarray

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(self.codes.shape)

    def words(self) -> np.ndarray:
        """uint32 [ceil(N K / 4)]: the codes' bytes (two's complement) as little-endian words,
        element i in bits 8 * (i & 3) .. +7 of word i >> 2."""
        b = np.zeros(-(-self.codes.size // 4) * 4, np.int8)
        b[:self.codes.size] = self.codes.reshape(-1)
        return b.view("<u4").astype(np.uint32)


INT8_CHUNK = 1 << 16       # values quantized at a time (whole rows)


def quantize_int8(w, name: str = "weight") -> Int8Weight:
    w = _check_finite(w, name)
    if w.ndim not in (2, 3):
        raise QuantizeError(f"{name}: int8 per output channel needs a 2-D weight (or an experts' 3-D one), "
                            f"got shape {w.shape}")
    absmax = np.abs(w).max(axis=-1).astype(np.float64)
    safe = np.where(absmax > 0, absmax, 1.0).reshape(-1)
    rows = w.reshape(-1, w.shape[-1])
    codes = np.empty(rows.shape, np.int8)
    step = max(1, INT8_CHUNK // rows.shape[1])

    def quantize_rows(start: int, stop: int) -> None:
        for r0 in range(start, stop, step):       # in float64, a chunk of whole rows at a time
            r1 = min(stop, r0 + step)
            block = rows[r0:r1].astype(np.float64)
            block *= 127.0
            block /= safe[r0:r1, None]
            codes[r0:r1] = np.clip(np.rint(block, out=block), -127, 127, out=block)

    in_ranges(quantize_rows, len(rows), rows.nbytes)      # ranges of rows on the host's threads
    return Int8Weight(codes.reshape(w.shape), (absmax / 127.0).astype(np.float32))


def dequantize_int8(q: Int8Weight) -> np.ndarray:
    return (q.codes.astype(np.float32) * q.scale[..., None]).astype(np.float32)


# A quantized weight read from a checkpoint is quantized as it is read (checkpoint.py ``hold``), so the
# host never holds the base in float32; an MoE checkpoint's experts are then split or joined in that
# form (moe_checkpoint.py). These keep the meaning of numpy's reshape, leading-axis slice and
# concatenate, and give the codes quantizing the joined float tensor would: NF4's blocks run over
# row-major elements, so a piece must start and end on a block boundary (int8's scales are per row).

QuantizedHost = Nf4Weight | Int8Weight


def quantized_reshape(q: QuantizedHost, shape: tuple[int, ...]) -> QuantizedHost:
    """``q`` seen in another shape of as many elements (int8: the last axis, the scales' row, kept)."""
    shape = tuple(int(s) for s in shape)
    if int(np.prod(shape)) != int(np.prod(q.shape)):
        raise QuantizeError(f"cannot view a {list(q.shape)} quantized weight as {list(shape)}")
    if isinstance(q, Int8Weight):
        if shape[-1] != q.shape[-1]:
            raise QuantizeError(f"an int8 weight keeps its last axis (its scales' rows): {list(q.shape)} -> {list(shape)}")
        return Int8Weight(q.codes.reshape(shape), q.scale.reshape(shape[:-1]))
    return Nf4Weight(shape, q.packed, q.blocksize, absmax=q.absmax, absmax_codes=q.absmax_codes,
                     absmax_scales=q.absmax_scales, offset=q.offset)


def quantized_rows(q: QuantizedHost, start: int, stop: int) -> QuantizedHost:
    """Rows ``start:stop`` of ``q``'s leading axis, as ``q[start:stop]`` of the float weight."""
    row = int(np.prod(q.shape[1:]))
    if isinstance(q, Int8Weight):
        return Int8Weight(q.codes[start:stop], q.scale[start:stop])
    first, last = start * row, stop * row
    _check_nf4_piece(q, first, last)
    return Nf4Weight((stop - start,) + tuple(q.shape[1:]), q.packed[first // 2:last // 2], q.blocksize,
                     absmax=q.absmax[first // q.blocksize:-(-last // q.blocksize)])


def quantized_concat(parts: list[QuantizedHost]) -> QuantizedHost:
    """``parts`` joined along their leading axis, as np.concatenate of the float weights."""
    head = parts[0]
    shape = (sum(p.shape[0] for p in parts),) + tuple(head.shape[1:])
    if isinstance(head, Int8Weight):
        return Int8Weight(np.concatenate([p.codes for p in parts]), np.concatenate([p.scale for p in parts]))
    for p in parts[:-1]:                    # a short last block may only end the joined weight
        _check_nf4_piece(p, 0, int(np.prod(p.shape)), ends_weight=False)
    return Nf4Weight(shape, np.concatenate([p.packed for p in parts]), head.blocksize,
                     absmax=np.concatenate([p.absmax for p in parts]))


def _check_nf4_piece(q: Nf4Weight, first: int, last: int, ends_weight: bool = True) -> None:
    """Elements ``first:last`` of ``q`` form whole blocks of their own (the last may be short where
    it ends ``q`` and ``ends_weight``)."""
    n = int(np.prod(q.shape))
    short_end = last % q.blocksize and not (ends_weight and last == n)
    if q.double_quant or first % q.blocksize or short_end or first % 2 or last % 2:
        raise QuantizeError(f"elements {first}:{last} of a {list(q.shape)} NF4 weight are not whole blocks of "
                            f"{q.blocksize} (or it is double quantized): quantize the joined weight instead")


def nf4_splits_whole(shape: tuple[int, ...], pieces: int, blocksize: int = 64) -> bool:
    """Whether a weight of ``shape`` cut into ``pieces`` equal parts along its leading axis (or
    joined from such parts) keeps NF4's blocks whole: each part a whole number of blocks."""
    n = int(np.prod(shape))
    return n % pieces == 0 and (n // pieces) % blocksize == 0


def quantize_as(w: np.ndarray, dtype: str, name: str = "weight") -> QuantizedHost:
    """``w`` quantized as ``dtype`` ("nf4": blocks of 64, absmaxes in float32; "int8": per row)."""
    if dtype == "nf4":
        return quantize_nf4(w, name)
    if dtype == "int8":
        return quantize_int8(w, name)
    raise QuantizeError(f"{name}: quantized dtype must be nf4 or int8, got {dtype!r}")
