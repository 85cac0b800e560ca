"""A new model's initialisation on the GPU (lfm2jit/model/device_init.py, ops/kernels/init.lk):
the init_normal kernel against an independent float64 meaning of the same generator (its hash in
numpy integers, then sqrt(2) erfinv by torch in float64), its draws normal in law, and a model's
tensors initialised as transformers initialises LFM2 and LFM2-MoE."""
import dataclasses

import numpy as np
import pytest

from lfm2jit.model import Lfm2Config, Lfm2Model
from lfm2jit.model.checkpoint import EMBEDDING, initial_value
from lfm2jit.model.device_init import CHUNK, draw_normal, tensor_keys
from lfm2jit.model.moe_checkpoint import model_parameter_shapes
from lfm2jit.model.moe_config import Lfm2MoeConfig
from lfm2jit.runtime import arena

torch = pytest.importorskip("torch")


def lowbias32(x: np.ndarray) -> np.ndarray:
    """Chris Wellons' lowbias32 integer hash, on uint32 arrays."""
    x = x ^ (x >> np.uint32(16))
    x = x * np.uint32(0x7FEB352D)
    x = x ^ (x >> np.uint32(15))
    x = x * np.uint32(0x846CA68B)
    return x ^ (x >> np.uint32(16))


def reference_normal(key: int, start: int, n: int, std: float) -> np.ndarray:
    """What entries start..start+n of a tensor drawn under ``key`` mean, in float64: the 23-bit
    uniform x in (-1, 1) of the keyed hash of each index, and std * sqrt(2) * erfinv(x) exactly."""
    i = (np.arange(start, start + n, dtype=np.uint64) & 0xFFFFFFFF).astype(np.uint32)
    with np.errstate(over="ignore"):
        h = lowbias32(lowbias32(i) ^ np.uint32(key))
    x = ((h >> np.uint32(9)).astype(np.float64) + 0.5) * 2.0 ** -22 - 1.0
    return std * np.sqrt(2.0) * torch.special.erfinv(torch.from_numpy(x)).numpy()


def drawn(engine, key: int, start: int, n: int, std: float, dtype: str = "f32") -> np.ndarray:
    out = engine.empty((n,), dtype)
    engine.run("init_normal", bucket=CHUNK, dims={"T": n}, out={"w": out}, f16=("w",) if dtype == "f16" else (),
               key_hi=key >> 16, key_lo=key & 0xFFFF, start_hi=start >> 16, start_lo=start & 0xFFFF, std=std)
    return out.numpy()


def close_to_reference(got: np.ndarray, want: np.ndarray, std: float) -> None:
    """Giles' f32 erfinv and f32 log against the exact erfinv: a few f32 roundings of the value."""
    np.testing.assert_allclose(got.astype(np.float64), want, rtol=1e-6, atol=1e-7 * std)


def test_init_normal_is_its_generator_in_float64(engine):
    """Random keys and starts (across the 16-bit halves the scalars carry, up to 2^32 - 1) and sizes
    (partial buckets, several workgroups)."""
    rng = np.random.default_rng(2024)
    cases = [(0, 0, 1000), (0xFFFFFFFF, 0xFFFF, 3000), (0x10000, 0xFFFFFFFF - 40, 30)] + [
        (int(rng.integers(0, 2 ** 32)), int(rng.integers(0, 2 ** 32 - CHUNK)), int(rng.integers(1, 5000)))
        for _ in range(8)]
    for key, start, n in cases:
        std = float(rng.uniform(0.01, 2.0))
        close_to_reference(drawn(engine, key, start, n, std), reference_normal(key, start, n, std), std)


def test_init_normal_in_f16_is_the_f32_draw_rounded(engine):
    f32 = drawn(engine, 77, 123456, 4099, 0.02)
    f16 = drawn(engine, 77, 123456, 4099, 0.02, "f16")
    assert f16.dtype == np.float16
    np.testing.assert_array_equal(f16, f32.astype(np.float16))


@pytest.mark.parametrize("limit", [None, 4096])
def test_a_tensor_drawn_in_chunks_and_pieces_holds_one_draw_of_it(engine, monkeypatch, limit):
    """Entry i of a tensor is the generator's draw i however the tensor is cut: CHUNK entries a
    dispatch, one binding (here 4 KiB, 1024 entries: a small device) a piece."""
    if limit is not None:
        monkeypatch.setattr(arena, "buffer_limit", lambda ctx: limit)
    n = 2 * CHUNK + 4099 if limit is None else 5 * 1024 + 17
    t = engine.empty((n,), "f32")
    draw_normal(engine, t, 99, 0.5)
    close_to_reference(t.numpy(), reference_normal(99, 0, n, 0.5), 0.5)


def test_init_normal_draws_are_normal_in_law(engine):
    """2^20 draws: mean, standard deviation, a Kolmogorov-Smirnov distance to the normal CDF and
    the two-sided tails within a few standard errors; no correlation between neighbours, between
    two keys one bit apart, or between a key's draws and the same key's shifted by one."""
    n = 1 << 20
    z = drawn(engine, 12345, 0, n + 1, 1.0).astype(np.float64)
    a, shifted = z[:n], z[1:]
    other = drawn(engine, 12345 ^ 1, 0, n, 1.0).astype(np.float64)
    se = 1 / np.sqrt(n)
    assert abs(a.mean()) < 5 * se and abs(a.std() - 1) < 5 * se
    s = np.sort(a)
    cdf = 0.5 * (1 + torch.special.erf(torch.from_numpy(s / np.sqrt(2))).numpy())
    ks = max(np.max(np.arange(1, n + 1) / n - cdf), np.max(cdf - np.arange(n) / n))
    assert ks < 1.63 * se                         # the 1% critical value
    for k, p in ((2, 0.0455003), (3, 0.0026998), (4, 0.0000633)):
        assert abs(np.mean(np.abs(a) > k) - p) < 5 * np.sqrt(p * (1 - p) / n), k
    for b in (shifted, other):
        assert abs(np.corrcoef(a, b)[0, 1]) < 5 * se


def _tiny_moe() -> Lfm2MoeConfig:
    return dataclasses.replace(Lfm2MoeConfig.preset("tiny-moe"), num_experts=4)


@pytest.mark.parametrize("make", [lambda: Lfm2Config.preset("tiny"), _tiny_moe], ids=["dense", "moe"])
def test_a_new_model_is_initialised_as_transformers_does(ctx, engine, make):
    """Norm weights one, biases, expert_bias buffers and the padding token's embedding row zero; every
    other tensor its key's draws of normal(0, initializer_range): entry for entry the generator's,
    and no tensor's draws another's."""
    cfg = make()
    model = Lfm2Model(cfg, ctx, engine, seed=3)
    shapes = model_parameter_shapes(cfg)
    keys = tensor_keys(3, shapes)
    assert list(model._params) == list(shapes) and len(set(keys.values())) == len(keys)
    std = cfg.initializer_range
    starts = set()
    for name, t in model._params.items():
        got = t.numpy()
        kind = initial_value(name)
        if kind != "normal":
            assert np.array_equal(got, np.full(shapes[name], 1.0 if kind == "ones" else 0.0, np.float32)), name
            continue
        want = reference_normal(keys[name], 0, got.size, std).reshape(shapes[name])
        if name == EMBEDDING and cfg.pad_token_id is not None:
            assert not got[cfg.pad_token_id].any()
            want[cfg.pad_token_id] = 0.0
        close_to_reference(got, want, std)
        starts.add(tuple(got.reshape(-1)[:4]))
    assert len(starts) == sum(initial_value(n) == "normal" for n in shapes)
    for name, b in model._buffers.items():
        assert name.endswith(".expert_bias") and not b.numpy().any()
    assert isinstance(cfg, Lfm2MoeConfig) == bool(model._buffers)


def test_the_seed_alone_decides_the_weights(ctx, engine):
    cfg = Lfm2Config.preset("tiny")
    one, again, other = (Lfm2Model(cfg, ctx, engine, seed=s) for s in (7, 7, 8))
    for name in one._params:
        a, b, c = (m.p(name).numpy() for m in (one, again, other))
        assert np.array_equal(a, b), name
        if initial_value(name) == "normal":
            assert not np.array_equal(a, c), name


@pytest.mark.parametrize("base_dtype", ["f32", "f16"])
def test_a_random_init_draws_nothing_on_the_host(ctx, engine, base_dtype):
    """The host allocates next to nothing of a new model (tracemalloc: the norms' ones and Python's
    own objects), a tenth of its f32 bytes at most, where a host draw would hold all of it."""
    import math
    import tracemalloc
    if base_dtype == "f16" and not ctx.has_f16:
        pytest.skip(f"{ctx.name} has no shader-f16")
    cfg = dataclasses.replace(Lfm2Config.preset("tiny"), hidden_size=128, intermediate_size=512, vocab_size=2048)
    Lfm2Model(cfg, ctx, engine, seed=1, base_dtype=base_dtype)      # its kernels compiled first
    tracemalloc.start()
    try:
        Lfm2Model(cfg, ctx, engine, seed=2, base_dtype=base_dtype)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    f32_bytes = 4 * sum(math.prod(s) for s in model_parameter_shapes(cfg).values())
    assert peak < 0.1 * f32_bytes, (peak, f32_bytes)
