"""LoRA dropout: the GPU's masks against the generator lfm2jit/schedule/dropout.py states (written
out again here in numpy), and training with dropout against PEFT + torch given the same masks (PEFT's
own masks come from torch's generator, so the reference takes ours)."""
from __future__ import annotations

import numpy as np
import pytest

from numerics import rel_err
from lfm2jit import grad
from lfm2jit.model import LoraConfig
from lfm2jit.model.adapters import dropout_key
from lfm2jit.ops import library
from lfm2jit.ops.lmhead import lm_head_cross_entropy
from references import masked_inputs
from test_lora import (BUCKET, hf_base, mg, ours_from_hf, peft_model, peft_reference,  # noqa: F401 (mg: fixture)
                       share_adapters, torch_step)
from trainer import AdamW, Trainer

torch = pytest.importorskip("torch")


def pcg(v: np.ndarray) -> np.ndarray:
    s = v * np.uint32(747796405) + np.uint32(2891336453)
    w = ((s >> ((s >> np.uint32(28)) + np.uint32(4))) ^ s) * np.uint32(277803737)
    return (w >> np.uint32(22)) ^ w


def mask_of(key: np.ndarray, shape: tuple[int, int]) -> np.ndarray:
    """The stated generator: element i of [T, D] (i = t * D + d) kept, times the scale, where
    pcg(pcg(i ^ k0) ^ k1) >= threshold."""
    k = np.asarray(key).view(np.uint32)
    with np.errstate(over="ignore"):
        h = pcg(pcg(np.arange(shape[0] * shape[1], dtype=np.uint32).reshape(shape) ^ k[0]) ^ k[1])
    return np.where(h >= k[2], k[3:4].view(np.float32)[0], np.float32(0.0))


@pytest.mark.parametrize("case", range(8))
def test_dropout_kernel_draws_the_stated_masks(ctx, engine, case):
    """Random shapes, probabilities and keys (f16 storage on odd cases where the device has it): the
    output and its gradient equal x * m exactly, the accumulating form y + x * m within one rounding,
    and the dropped share is p."""
    rng = np.random.default_rng(100 + case)
    t, d, p = int(rng.integers(1, 90)), int(rng.integers(1, 70)), float(rng.choice([0.0, 0.05, 0.1, 0.5, 0.9]))
    dtype = "f16" if case % 2 and ctx.has_f16 else "f32"
    kern = library.get("dropout") if dtype == "f32" else library.get("dropout").variant("f16")
    key = dropout_key(p, rng.integers(0, 2 ** 32, 2, dtype=np.uint64))
    m = mask_of(key, (t, d))
    x = rng.standard_normal((t, d)).astype(np.float32)
    xs = x.astype(np.float16).astype(np.float32) if dtype == "f16" else x
    want = (xs * m).astype(np.float16) if dtype == "f16" else xs * m
    k = engine.tensor(key, "i32")
    y = engine.run(kern, x=engine.tensor(x, dtype), key=k)["y"].numpy()
    assert np.array_equal(y, want)
    dy, base = (rng.standard_normal((t, d)).astype(np.float32) for _ in range(2))
    g = grad(library.get("dropout"), ["x"])
    dx = engine.run(g, x=engine.tensor(x), key=k, d_y=engine.tensor(dy))["d_x"].numpy()
    assert np.array_equal(dx, dy * m)
    acc = engine.tensor(base)
    engine.run("dropout", x=engine.tensor(dy), key=k, out={"y": acc}, accumulate={"y"})
    product = dy.astype(np.float64) * m
    exact = base + product          # f32 roundings of the product and the sum, or one (a fused fma)
    ulps = np.spacing(np.abs(exact).astype(np.float32)) + np.spacing(np.abs(product).astype(np.float32))
    assert np.all(np.abs(acc.numpy() - exact) <= ulps)
    n = t * d
    assert abs(np.mean(m == 0) - p) <= 4 * np.sqrt(p * (1 - p) / n) + 1.0 / n
    assert np.all(m[m != 0] == np.float32(1 / (1 - p)))


def test_masks_of_different_keys_are_independent(ctx, engine):
    """Two keys' masks drop the same element as often as independent draws do (p^2), and a key's
    mask is the same every call."""
    x = engine.tensor(np.ones((256, 64), np.float32))
    keys = [engine.tensor(dropout_key(0.5, (s, 7 * s + 1)), "i32") for s in (1, 2)]
    a, b = (engine.run("dropout", x=x, key=k)["y"].numpy() == 0 for k in keys)
    assert abs(np.mean(a & b) - 0.25) < 4 * np.sqrt(0.25 * 0.75 / a.size)
    assert np.array_equal(engine.run("dropout", x=x, key=keys[0])["y"].numpy() == 0, a)


class FixedMask(torch.nn.Module):
    """Stands in for PEFT's nn.Dropout: x times a given mask (ours)."""

    def __init__(self, m: np.ndarray):
        super().__init__()
        self.register_buffer("m", torch.as_tensor(m))

    def forward(self, x):
        return x * self.m


def give_peft_our_masks(theirs, ours, t: int) -> None:
    for module, ad in ours.lora.by_module.items():
        layer = theirs.base_model.model.get_submodule(module)
        layer.lora_dropout["default"] = FixedMask(mask_of(ad.key.numpy(), (t, ad.a.shape[1])))


def test_training_pass_gradients_equal_peft_given_the_masks(mg, ctx, engine):
    """forward(train=True) drops each adapter's input by its key's mask: loss and every A and B
    gradient equal PEFT's with those masks; forward without train leaves dropout out."""
    hf, kwargs = hf_base(mg, "untied_bias_g2_attn_first", 31)
    theirs = peft_model(hf, 4, 8, seed=3)
    ours = ours_from_hf(hf, ctx, engine)
    params = ours.add_lora(LoraConfig(r=4, alpha=8, dropout=0.3), seed=11)
    share_adapters(theirs, ours)
    ids, targets, mask = masked_inputs(kwargs["vocab_size"], 29, 5)
    plain = ours.logits(ids, bucket=BUCKET)
    ours.lora.draw_dropout(5, 1)
    give_peft_our_masks(theirs, ours, len(ids))
    _, want_loss, want_grads = peft_reference(theirs, ids, targets, mask)
    ours.zero_grad(params)
    trace = ours.forward(ids, BUCKET, train=True)
    res = lm_head_cross_entropy(engine, trace.hn, ours.lm_head, targets, mask,
                                normalizer=float(np.count_nonzero(mask)), bucket=BUCKET)
    ours.backward(trace, res.dh, params)
    assert abs(res.loss_value() - want_loss) < 1e-5
    for n, t in ours.lora.named.items():
        assert rel_err(t.grad.numpy(), want_grads[n]) < 1e-3, n
    assert np.array_equal(ours.logits(ids, bucket=BUCKET), plain)      # evaluation: no dropout


def test_trainer_steps_with_dropout_equal_peft_and_torch(mg, ctx, engine):
    """Three AdamW steps through the Trainer with dropout 0.2: each pass draws the keys of its step,
    and the adapters end where PEFT + torch.optim.AdamW do given the same masks."""
    hf, kwargs = hf_base(mg, "tied_g1_attn_mid", 37)
    theirs = peft_model(hf, 4, 8, seed=6)
    ours = ours_from_hf(hf, ctx, engine)
    params = ours.add_lora(LoraConfig(r=4, alpha=8, dropout=0.2), seed=4)
    state = share_adapters(theirs, ours)
    opt = torch.optim.AdamW([p for p in theirs.parameters() if p.requires_grad], lr=5e-3, weight_decay=0.01)
    tr = Trainer(ours, AdamW(lr=5e-3, weight_decay=0.01), ctx, engine).with_length_bucket(BUCKET)
    for step in range(3):
        ids, targets, mask = masked_inputs(kwargs["vocab_size"], 23, 200 + step)
        ours.lora.draw_dropout(step, 0)            # what the trainer draws for this pass
        give_peft_our_masks(theirs, ours, len(ids))
        tr.train_step_masked(ids, targets, mask, params)
        torch_step(theirs, opt, ids, targets, mask)
    for n, t in ours.lora.named.items():
        assert rel_err(t.numpy(), state[n].detach().numpy()) < 1e-4, n
