"""The Trainer against a PyTorch reference, and its semantics: accumulation, buckets, padding,
loss scaling, errors that change nothing, checkpoints and resume."""
from __future__ import annotations

import math

import numpy as np
import pytest
import torch
import transformers

from lfm2jit import ComputeEngine
from lfm2jit.model import Lfm2Config, Lfm2Model
from trainer import SGD, AdamW, CosineWithWarmup, GradScaler, TrainError, Trainer


def hf_model(cfg: Lfm2Config, seed: int = 0, dtype=torch.float64):
    torch.manual_seed(seed)
    hcfg = transformers.Lfm2Config(**{k: v for k, v in cfg.to_dict().items() if k not in ("architectures", "model_type")})
    m = transformers.Lfm2ForCausalLM(hcfg).to(dtype)
    with torch.no_grad():          # norms away from 1 so that their gradients matter
        for n, p in m.named_parameters():
            if "norm" in n:
                p.add_(torch.randn_like(p) * 0.1)
    return m


def weights_of(m) -> dict[str, np.ndarray]:
    return {k: v.detach().float().numpy() for k, v in m.state_dict().items()}


def sequences(cfg: Lfm2Config, lengths, seed: int = 3):
    r = np.random.default_rng(seed)
    out = []
    for n in lengths:
        ids = r.integers(1, cfg.vocab_size, n + 1)
        mask = (r.random(n) > 0.3).astype(np.float32)
        mask[0] = 1.0
        out.append((ids[:-1], ids[1:], mask))
    return out


def torch_train(m, data, *, steps, accum, lr_at, clip, betas, eps, wd):
    """The PyTorch loop the Trainer must match: mean CE over supervised tokens / accum, clip, AdamW."""
    params = [p for p in m.parameters()]
    opt = torch.optim.AdamW(params, lr=lr_at(1), betas=betas, eps=eps, weight_decay=wd)
    losses, i = [], 0
    for k in range(1, steps + 1):
        opt.zero_grad()
        for _ in range(accum):
            ids, tgt, mask = data[i % len(data)]
            i += 1
            logits = m(torch.tensor(ids)[None]).logits[0]
            ce = torch.nn.functional.cross_entropy(logits, torch.tensor(tgt), reduction="none")
            loss = (ce * torch.tensor(mask, dtype=ce.dtype)).sum() / mask.sum()
            (loss / accum).backward()
            losses.append(loss.item())
        torch.nn.utils.clip_grad_norm_(params, clip)
        for g in opt.param_groups:
            g["lr"] = lr_at(k)
        opt.step()
    return losses


@pytest.fixture
def tiny():
    return Lfm2Config.preset("tiny")


def test_training_matches_pytorch(ctx, tiny):
    """AdamW + clipping + masked loss + accumulation 3 + cosine schedule, 10 optimizer steps."""
    ref = hf_model(tiny)
    engine = ComputeEngine(ctx)
    model = Lfm2Model(tiny, ctx, engine, tensors=weights_of(ref))
    sched = CosineWithWarmup(2e-3, warmup_steps=3, total_steps=10, min_lr=1e-4)
    tr = (Trainer(model, AdamW(lr=2e-3, betas=(0.9, 0.95), eps=1e-6, weight_decay=0.01), ctx, engine)
          .with_length_bucket(16).with_grad_accum_steps(3).with_clip_grad_norm(1.0).with_lr_scheduler(sched))
    data = sequences(tiny, [20, 37, 9, 50, 31])
    ours = []
    for i in range(30):
        ids, tgt, mask = data[i % len(data)]
        ours.append(tr.train_step_masked(ids, tgt, mask, model.parameters()))
    want = torch_train(ref, data, steps=10, accum=3, lr_at=sched.lr_at, clip=1.0, betas=(0.9, 0.95), eps=1e-6, wd=0.01)
    assert tr.optimizer_steps() == 10
    assert [s.stepped for s in ours] == [i % 3 == 2 for i in range(30)]
    for s, w in zip(ours, want):
        assert abs(s.loss - w) / abs(w) < 1e-4
    final = weights_of(ref)
    for name, t in model.named_parameters().items():
        got, exp = t.numpy(), final[name]
        err = np.abs(got - exp).max() / np.abs(exp).max()
        assert err < 1e-3, f"{name}: {err}"
    assert ours[-1].lr == pytest.approx(sched.lr_at(10))
