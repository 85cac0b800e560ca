"""The quantized base formats (lfm2jit/model/quantize.py) against bitsandbytes (CPU torch; a
test-only reference) bit for bit, and against a float64 numpy statement of the published
algorithms."""
import os

os.environ.setdefault("CUDA_VISIBLE_DEVICES", "")

import numpy as np
import pytest
import torch

import bitsandbytes.functional as bnbf

from lfm2jit.model.quantize import (DYNAMIC_CODE, NF4_CODE, QuantizeError, dequantize_int8, dequantize_nf4,
                                    quantize_int8, quantize_nf4)


def _mids():
    return (NF4_CODE[:-1] + NF4_CODE[1:]) / np.float32(2)


def _adversarial(rng):
    """Tensors of 64-blocks each with a hard case; shapes with short last blocks and odd counts."""
    mids = _mids()
    blocks = [
        np.zeros(64),                                              # all zeros
        np.r_[1e4, rng.standard_normal(63) * 1e-3],                # one outlier
        np.r_[1.0, np.float32(mids).astype(np.float64)[rng.integers(0, 15, 63)]],   # exact midpoints
        np.r_[-1.0, -np.float32(mids).astype(np.float64)[rng.integers(0, 15, 63)]],
        rng.standard_normal(64) * 1e-30,                           # tiny
        rng.standard_normal(64) * 1e-39,                           # subnormal (absmax clamped to 1e-38)
        rng.standard_normal(64) * 1e30,                            # huge
        rng.uniform(-1, 1, 64) * 3.3e38,                          # near float32's max
        np.full(64, -2.5),                                         # one value, negative
        np.r_[np.zeros(63), 7.0],
    ]
    return np.concatenate(blocks).astype(np.float32)


def _weights():
    rng = np.random.default_rng(0)
    yield "random [96, 200]", rng.standard_normal((96, 200)).astype(np.float32)
    yield "random odd [7, 37]", (rng.standard_normal((7, 37)) * 0.02).astype(np.float32)
    yield "one element", np.array([[0.3]], np.float32)
    yield "adversarial", _adversarial(rng).reshape(10, 64)
    yield "adversarial, short last block", _adversarial(rng)[:-27].reshape(-1, 613)
    yield "many blocks (double quant over several 256-blocks)", (rng.standard_normal((300, 192)) * rng.uniform(
        0.01, 3, (300, 1))).astype(np.float32)


WEIGHTS = list(_weights())


def _bnb(w, double):
    q, state = bnbf.quantize_4bit(torch.from_numpy(w), blocksize=64, compress_statistics=double,
                                  quant_type="nf4")
    return q, state


@pytest.mark.parametrize("name,w", WEIGHTS, ids=[n for n, _ in WEIGHTS])
def test_nf4_equals_bitsandbytes(name, w):
    q, state = _bnb(w, double=False)
    ours = quantize_nf4(w, name)
    assert np.array_equal(ours.packed, q.numpy().reshape(-1))
    assert np.array_equal(ours.absmax.view(np.uint32), state.absmax.numpy().view(np.uint32))
    want = bnbf.dequantize_4bit(q, state).numpy()
    got = dequantize_nf4(ours)
    assert got.shape == want.shape and np.array_equal(got.view(np.uint32), want.view(np.uint32))


def test_nf4_in_ranges_on_host_threads_equals_bitsandbytes(monkeypatch):
    """A tensor large enough to be quantized in ranges of blocks on four host threads (with a short
    last block): the same codes and absmaxes as bitsandbytes."""
    from lfm2jit.runtime.host_threads import RANGE_BYTES
    monkeypatch.setenv("LFM2JIT_HOST_COPY_THREADS", "4")
    rng = np.random.default_rng(5)
    w = (rng.standard_normal((1100, 1031)) * rng.uniform(0.01, 3, (1100, 1))).astype(np.float32)
    assert w.nbytes >= 2 * RANGE_BYTES
    q, state = _bnb(w, double=False)
    ours = quantize_nf4(w, "large")
    assert np.array_equal(ours.packed, q.numpy().reshape(-1))
    assert np.array_equal(ours.absmax.view(np.uint32), state.absmax.numpy().view(np.uint32))


@pytest.mark.parametrize("name,w", WEIGHTS, ids=[n for n, _ in WEIGHTS])
def test_nf4_double_quant_equals_bitsandbytes(name, w):
    if np.abs(w).max() > 1e36:
        # absmax - offset of blocks near float32's max: torch's float32 mean overflows to inf there
        w = np.where(np.abs(w) > 1e36, w * 1e-8, w).astype(np.float32)
    q, state = _bnb(w, double=True)
    ours = quantize_nf4(w, name, double_quant=True)
    assert np.array_equal(ours.packed, q.numpy().reshape(-1))
    # The offset is a float32 mean: bitsandbytes sums in torch's order, we in float64 (to one ulp).
    assert abs(float(ours.offset) - float(state.offset)) <= float(np.spacing(np.float32(state.offset))) * 1
    # Everything after the offset is bit for bit, given the same offset.
    absmax = bnbf.quantize_4bit(torch.from_numpy(w), blocksize=64, quant_type="nf4")[1].absmax.numpy()
    from lfm2jit.model.quantize import quantize_dynamic
    codes, scales = quantize_dynamic(absmax - np.float32(state.offset))
    assert np.array_equal(codes, state.absmax.numpy())
    assert np.array_equal(scales.view(np.uint32), state.state2.absmax.numpy().view(np.uint32))
    if ours.offset == np.float32(state.offset):
        assert np.array_equal(ours.absmax_codes, codes)
        want = bnbf.dequantize_4bit(q, state).numpy()
        assert np.array_equal(dequantize_nf4(ours).view(np.uint32), want.view(np.uint32))
    same = type(ours)(ours.shape, ours.packed, absmax_codes=codes, absmax_scales=scales,
                      offset=np.float32(state.offset))
    want = bnbf.dequantize_4bit(q, state).numpy()
    assert np.array_equal(dequantize_nf4(same).view(np.uint32), want.view(np.uint32))


def test_dynamic_code_is_bitsandbytes():
    assert np.array_equal(DYNAMIC_CODE, bnbf.create_dynamic_map().numpy())
    assert np.array_equal(NF4_CODE, bnbf.get_4bit_type("nf4", device="cpu").numpy())


def _nf4_float64(w):
    """QLoRA's NF4 in float64: absmax per 64-block, nearest codebook value (the lower one at a tie)."""
    flat = w.astype(np.float64).reshape(-1)
    code = NF4_CODE.astype(np.float64)
    q, absmax = [], []
    for i in range(0, flat.size, 64):
        block = flat[i:i + 64]
        m = np.abs(block).max()
        absmax.append(m if block.size == 64 else max(m, np.float32(1e-38)))   # bitsandbytes keeps a short
        # last block's absmax clamped (a zero block there stores 1e-38; its values are 0 either way)
        x = block / max(m, 1e-38)
        dist = np.abs(x[:, None] - code[None, :])
        q.extend(np.argmin(dist, axis=1))                   # argmin takes the first (lower) at a tie
    return np.array(q), np.array(absmax)


@pytest.mark.parametrize("name,w", WEIGHTS, ids=[n for n, _ in WEIGHTS])
def test_nf4_equals_float64_statement(name, w):
    ours = quantize_nf4(w, name)
    q64, absmax64 = _nf4_float64(w)
    assert np.array_equal(ours.absmax.astype(np.float64), absmax64)
    # float32 scaling may move a value that lies within float32 rounding of a midpoint across it
    x64 = w.astype(np.float64).reshape(-1) / np.maximum(np.repeat(absmax64, 64)[:w.size], 1e-38)
    near = np.abs(x64[:, None] - _mids().astype(np.float64)[None, :]).min(axis=1) <= 1e-6
    codes = ours.codes().astype(np.int64)
    assert np.array_equal(codes[~near], q64[~near])
    assert np.all(np.abs(codes[near] - q64[near]) <= 1)
    want = NF4_CODE.astype(np.float64)[codes] * np.repeat(absmax64, 64)[:w.size]
    assert np.array_equal(dequantize_nf4(ours).reshape(-1).astype(np.float64), want.astype(np.float32).astype(np.float64))


def test_nf4_words_hold_bitsandbytes_nibbles():
    w = np.random.default_rng(1).standard_normal((5, 27)).astype(np.float32)
    ours = quantize_nf4(w)
    words, codes = ours.words(), ours.codes()
    i = np.arange(codes.size)
    shift = 8 * ((i >> 1) & 3) + 4 * (1 - (i & 1))
    assert np.array_equal((words[i >> 3] >> shift.astype(np.uint32)) & 15, codes)


@pytest.mark.parametrize("rows,cols", [(33, 70), (1100, 1031)])   # the second in ranges of rows on 4 threads
def test_int8_per_channel(rows, cols, monkeypatch):
    monkeypatch.setenv("LFM2JIT_HOST_COPY_THREADS", "4")
    rng = np.random.default_rng(2)
    w = (rng.standard_normal((rows, cols)) * rng.uniform(0.001, 5, (rows, 1))).astype(np.float32)
    w[3] = 0.0
    w[5, 7] = 300.0
    q = quantize_int8(w, "w")
    absmax = np.abs(w.astype(np.float64)).max(axis=1)
    want = np.round(w.astype(np.float64) / np.where(absmax > 0, absmax, 1)[:, None] * 127)
    assert np.array_equal(q.codes.astype(np.float64), want)
    assert np.array_equal(q.scale, (absmax / 127).astype(np.float32))
    assert np.array_equal(dequantize_int8(q), (want * (absmax / 127).astype(np.float32)[:, None]).astype(np.float32))
    assert np.all(np.abs(dequantize_int8(q) - w) <= (absmax / 127)[:, None] * 0.5 + 1e-6 * absmax[:, None])
    i = np.arange(q.codes.size)
    words = q.words()
    got = ((words[i >> 2] >> (8 * (i & 3)).astype(np.uint32)) & 255).astype(np.uint8).view(np.int8)
    assert np.array_equal(got, q.codes.reshape(-1))


@pytest.mark.parametrize("bad", [np.inf, -np.inf, np.nan])
def test_non_finite_refused(bad):
    w = np.ones((4, 64), np.float32)
    w[2, 5] = bad
    with pytest.raises(QuantizeError, match=r"model\.layers\.0\.self_attn\.q_proj\.weight: .*\(2, 5\)"):
        quantize_nf4(w, "model.layers.0.self_attn.q_proj.weight")
    with pytest.raises(QuantizeError, match=r"model\.layers\.1\.feed_forward\.w1\.weight"):
        quantize_int8(w, "model.layers.1.feed_forward.w1.weight")


def test_unsupported_blocksize_refused():
    with pytest.raises(QuantizeError, match=r"lm_head\.weight: NF4 block size 128 is not supported"):
        quantize_nf4(np.ones((4, 64), np.float32), "lm_head.weight", blocksize=128)


@pytest.mark.parametrize("name,w", WEIGHTS, ids=[n for n, _ in WEIGHTS])
def test_quantizing_a_dequantized_weight_gives_it_back(name, w):
    """What a checkpoint of a quantized base (saved dequantized) and a bitsandbytes checkpoint rely
    on: a block's largest value is exactly +-absmax and every other one a code times it, so
    quantizing again gives the same codes and absmaxes (and int8 the same codes and scales)."""
    q = quantize_nf4(w, name)
    again = quantize_nf4(dequantize_nf4(q), name)
    # except blocks whose absmax is below 1e-38 (subnormal): those are scaled by 1 / 1e-38, so no code is +-1
    off = np.unique(np.nonzero(again.codes() != q.codes())[0] // 64).tolist() + np.nonzero(again.absmax != q.absmax)[0].tolist()
    assert all(q.absmax[b] < 1e-38 for b in off)
    assert np.array_equal(again.absmax[q.absmax >= 1e-38], q.absmax[q.absmax >= 1e-38])
    if w.ndim == 2:
        i = quantize_int8(w, name)
        again = quantize_int8(dequantize_int8(i), name)
        assert np.array_equal(again.codes, i.codes) and np.array_equal(again.scale, i.scale)


@pytest.mark.parametrize("seed", range(6))
def test_quantized_pieces_join_and_split_as_the_float_weight_does(seed):
    """Experts quantized one by one and joined (quantized_concat, quantized_reshape) hold the codes
    and scales of the joined float weight quantized whole, and rows cut from it (quantized_rows) those
    of the piece quantized alone, on random shapes whose pieces are whole NF4 blocks; a piece that
    is not is refused by name."""
    from lfm2jit.model.quantize import (nf4_splits_whole, quantize_as, quantized_concat, quantized_reshape,
                                        quantized_rows)
    rng = np.random.default_rng(seed)
    experts, rows, cols = int(rng.integers(1, 5)), int(rng.integers(1, 9)), 64 * int(rng.integers(1, 4))
    pieces = [rng.standard_normal((rows, cols)).astype(np.float32) * rng.uniform(0.01, 3) for _ in range(2 * experts)]
    pieces[0][0, :3] = 0.0                                   # a block with zeros and one larger value
    pieces[-1][-1, -1] = 40.0
    whole = np.stack([np.concatenate(pieces[2 * e:2 * e + 2]) for e in range(experts)])
    assert nf4_splits_whole(whole.shape, 2 * experts)

    def parts(q):
        return [q.packed, q.absmax] if hasattr(q, "packed") else [q.codes, q.scale]
    for fmt in ("nf4", "int8"):
        held = [quantize_as(p, fmt, f"piece {i}") for i, p in enumerate(pieces)]
        joined = quantized_concat(held)
        joined = quantized_reshape(joined, (experts, joined.shape[0] // experts, cols))
        direct = quantize_as(whole, fmt)
        assert joined.shape == direct.shape == whole.shape
        for got, want in zip(parts(joined), parts(direct)):
            np.testing.assert_array_equal(got, want)
        flat = quantized_reshape(direct, (2 * experts * rows, cols))
        for i in range(2 * experts):
            for got, want in zip(parts(quantized_rows(flat, i * rows, (i + 1) * rows)), parts(held[i])):
                np.testing.assert_array_equal(got, want)
    odd = quantize_as(rng.standard_normal((3, 40)).astype(np.float32), "nf4")     # 120 values: not whole blocks
    with pytest.raises(QuantizeError, match="not whole blocks of 64"):
        quantized_rows(odd, 1, 2)
    with pytest.raises(QuantizeError, match="not whole blocks of 64"):
        quantized_concat([odd, odd])
    assert not nf4_splits_whole((4, 3, 40), 4)
