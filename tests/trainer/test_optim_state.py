"""Optimizer state per parameter, as torch keeps it, against torch.optim fed the same gradients.

Each test trains a micro LFM2 with the Trainer (one sequence per window, no clipping or loss
scale, so ``.grad`` after a step is exactly the gradient it applied) and replays those gradients
into torch.optim.AdamW / SGD over float32 copies of the weights. A parameter left out of a window
has ``grad = None`` on the torch side, so torch skips it and its ``state[p]["step"]`` stays put.
Unlike torch, the Trainer releases the state of parameters a window no longer trains; the
reference then drops their torch state too, which is what a new torch optimizer for them gives.
"""
from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from safetensors.numpy import load_file, save_file

from numerics import rel_err
from lfm2jit.model import Lfm2Model
from micro_model import make_data, micro, snap
from trainer import SGD, AdamW, Batch, LinearWarmup, TrainError, Trainer

HEAD = "model.embed_tokens.weight"        # the micro config ties the LM head to the embedding
TOL = 1e-4                                # on each weight's change since the start, normwise


@pytest.fixture(scope="module")
def cfg():
    return micro()


def subset(model, which: str) -> list[str]:
    names = list(model.named_parameters())
    return {"all": names, "head": [HEAD], "ffn": [n for n in names if ".feed_forward." in n]}[which]


class TorchReference:
    """torch.optim over float32 copies of the model's starting weights."""

    def __init__(self, model, make_optimizer):
        self.params = {n: torch.nn.Parameter(torch.tensor(t.numpy())) for n, t in model.named_parameters().items()}
        self.opt = make_optimizer(list(self.params.values()))

    def step(self, model, trained: list[str], lr: float) -> None:
        """One torch step on the gradients our window applied to ``trained`` (no gradient for the rest)."""
        for n, p in self.params.items():
            p.grad = torch.tensor(model.p(n).grad.numpy()) if n in trained else None
        for g in self.opt.param_groups:
            g["lr"] = lr
        self.opt.step()

    def release(self, names) -> None:
        for n in names:
            self.opt.state.pop(self.params[n], None)

    def steps(self) -> dict[str, int]:
        return {n: int(st["step"]) for n, p in self.params.items() if "step" in (st := self.opt.state.get(p, {}))}


def our_steps(tr) -> dict[str, int]:
    names = {id(t): n for n, t in tr.model.named_parameters().items()}
    return {names[pid]: st["step"] for pid, st in tr.optimizer.state.items()}


def assert_matches(model, ref: TorchReference, w0: dict, what: str) -> None:
    for n, got in snap(model).items():
        want = ref.params[n].detach().numpy()
        if np.array_equal(want, w0[n]):
            assert np.array_equal(got, w0[n]), f"{what}: {n} was never trained but changed"
        else:
            err = rel_err(got - w0[n], want - w0[n])
            assert err < TOL, f"{what}: {n}: rel err {err:.3g} of its change"


def train_windows(tr, model, ref, windows, data, w0, counts=True) -> None:
    """One window per (subset, sequence); after each, weights (and AdamW's counts) equal torch's."""
    for k, (which, (ids, tgt, mask)) in enumerate(zip(windows, data), 1):
        names = subset(model, which)
        if ref is not None:
            ref.release(n for n in ref.params if n not in names)
        stats = tr.train_step_masked(ids, tgt, mask, [model.p(n) for n in names])
        assert stats.stepped
        if ref is not None:
            ref.step(model, names, stats.lr)
            assert_matches(model, ref, w0, f"window {k} ({which})")
            if counts:
                assert our_steps(tr) == ref.steps(), f"window {k} ({which})"


def adamw_reference(model, lr=1e-2):
    return TorchReference(model, lambda ps: torch.optim.AdamW(ps, lr=lr, weight_decay=0.01, foreach=False))


def test_fresh_state_after_set_optimizer_steps_counts_from_one(ctx, engine, cfg):
    """The trainer resumed at step 1000 with fresh optimizer state: the schedule reads step 1001,
    while bias corrections count each parameter's own first update (torch's state["step"] = 1)."""
    sched = LinearWarmup(2e-2, warmup_steps=2000)
    model = Lfm2Model(cfg, ctx, engine, seed=1)
    w0 = snap(model)
    tr = (Trainer(model, AdamW(lr=1.0, weight_decay=0.01), ctx, engine)      # lr never used: the schedule rules
          .with_length_bucket(16).with_lr_scheduler(sched))
    tr.set_optimizer_steps(1000)
    ref = adamw_reference(model)
    data = make_data(cfg, [12, 12, 12], seed=41)
    train_windows(tr, model, ref, ["all"] * 3, data, w0)
    assert tr.optimizer_steps() == 1003 and set(our_steps(tr).values()) == {3}
    # the reference ran at the rates our steps reported: the schedule's at 1001..1003, not at 1..3
    assert [g["lr"] for g in ref.opt.param_groups] == [sched.lr_at(1003)] and sched.lr_at(1003) != sched.lr_at(3)


def test_unfrozen_parameters_count_their_own_steps(ctx, engine, cfg):
    """Six head-only steps, then every parameter: the head's seventh update beside the others' first."""
    model = Lfm2Model(cfg, ctx, engine, seed=2)
    w0 = snap(model)
    tr = Trainer(model, AdamW(lr=1e-2, weight_decay=0.01), ctx, engine).with_length_bucket(16)
    ref = adamw_reference(model)
    train_windows(tr, model, ref, ["head"] * 6 + ["all"] * 3, make_data(cfg, [12] * 9, seed=43), w0)
    counts = our_steps(tr)
    assert counts.pop(HEAD) == 9 and set(counts.values()) == {3}


@pytest.mark.parametrize("dampening,nesterov", [(0.1, False), (0.0, True)])
def test_sgd_momentum_buffers_start_on_each_parameters_first_step(ctx, engine, cfg, dampening, nesterov):
    """Two head-only steps, then every parameter: only the new parameters' buffers start as their
    gradient; the head's keeps its momentum."""
    model = Lfm2Model(cfg, ctx, engine, seed=3)
    w0 = snap(model)
    kw = dict(lr=0.1, momentum=0.9, dampening=dampening, weight_decay=0.01, nesterov=nesterov)
    tr = Trainer(model, SGD(**kw), ctx, engine).with_length_bucket(16)
    ref = TorchReference(model, lambda ps: torch.optim.SGD(ps, foreach=False, **kw))
    train_windows(tr, model, ref, ["head"] * 2 + ["all"] * 3, make_data(cfg, [12] * 5, seed=45), w0, counts=False)


def test_parameters_left_out_are_released_and_start_afresh_when_trained_again(ctx, engine, cfg):
    """Two windows of everything, two of the feed-forward weights (the rest give up .grad and
    state), two of everything: the rest start again at step 1, the feed-forward weights at 5. Torch
    keeps the state of parameters it skips; its reference here drops it, as the Trainer does."""
    model = Lfm2Model(cfg, ctx, engine, seed=4)
    w0 = snap(model)
    tr = Trainer(model, AdamW(lr=1e-2, weight_decay=0.01), ctx, engine).with_length_bucket(16)
    ref = adamw_reference(model)
    data = make_data(cfg, [12] * 6, seed=47)
    ffn = subset(model, "ffn")
    train_windows(tr, model, ref, ["all", "all", "ffn", "ffn"], data[:4], w0)
    assert set(our_steps(tr)) == set(ffn) and set(our_steps(tr).values()) == {4}
    for n, p in model.named_parameters().items():
        assert (p.grad is not None) == (n in ffn), n
    names = {id(t): n for n, t in model.named_parameters().items()}
    assert {k.partition("::")[0] for k in tr.optimizer.state_arrays(names)} == set(ffn)
    train_windows(tr, model, ref, ["all", "all"], data[4:], w0)
    counts = our_steps(tr)
    assert {counts.pop(n) for n in ffn} == {6} and set(counts.values()) == {2}


def test_mixed_step_counts_replay_bit_identically(ctx, engine, cfg):
    """Recorded optimizer pieces, one per group of equal counts, replay with each group's own
    bias corrections: the same weights, bit for bit, as running every step."""
    windows = ["head"] * 3 + ["all"] * 4 + ["ffn"] * 3 + ["all"] * 3
    data = make_data(cfg, [12] * len(windows), seed=49)
    runs = []
    for replay in (0, 2):
        model = Lfm2Model(cfg, ctx, engine, seed=5)
        tr = Trainer(model, AdamW(lr=1e-2), ctx, engine).with_length_bucket(16).with_replay(replay)
        train_windows(tr, model, None, windows[:7], data[:7], None)
        groups = sum(key[0] == "optimizer" for key in tr.recorded._programs)
        train_windows(tr, model, None, windows[7:], data[7:], None)
        runs.append((snap(model), tr, groups))
    (plain, _, _), (played, tr, groups) = runs
    assert groups == 2 and tr.recorded.replays > 0     # the head's piece and the others' were both recorded
    for n in plain:
        assert np.array_equal(played[n], plain[n]), n


def test_params_may_be_any_iterable(ctx, engine, cfg):
    """A generator is read once per call, however many sequences the call trains."""
    data = make_data(cfg, [12, 9, 14, 11, 10, 13], seed=51)
    runs = {}
    for kind in ("list", "generator", "iterator"):
        model = Lfm2Model(cfg, ctx, engine, seed=6)
        tr = Trainer(model, AdamW(lr=1e-2), ctx, engine).with_length_bucket(16).with_grad_accum_steps(2)

        def params():
            ps = model.parameters()
            return {"list": ps, "generator": (p for p in ps), "iterator": iter(ps)}[kind]
        stats = tr.train_sequences(data[:2], params())
        stats += [tr.train_step_masked(i, t, m, params()) for i, t, m in data[2:4]]
        stats += tr.train_batch(Batch.from_token_lists([np.r_[i, t[-1]] for i, t, _ in data[4:]]), params())
        runs[kind] = ([(s.loss, s.stepped) for s in stats], snap(model))
        assert tr.optimizer_steps() == 3
    for kind in ("generator", "iterator"):
        assert runs[kind][0] == runs["list"][0], kind
        for n, a in runs["list"][1].items():
            assert np.array_equal(runs[kind][1][n], a), (kind, n)
    with pytest.raises(TrainError, match="params must be an iterable of the model's tensors, got int"):
        tr.train_step(*data[0][:2], 5)


# ---- checkpoints ----

def fresh_trainer(cfg, ctx, engine, seed):
    model = Lfm2Model(cfg, ctx, engine, seed=seed)
    return model, Trainer(model, AdamW(lr=1e-2, weight_decay=0.01), ctx, engine).with_length_bucket(16)


@pytest.mark.parametrize("before,steps", [
    (["head", "head", "all", "all"], {"head": 4, "ffn": 2, "rest": 2}),      # unfrozen: two counts
    (["all", "all", "ffn"], {"ffn": 3}),                                     # the rest released before the save
])
def test_resume_after_changing_subsets_equals_the_uninterrupted_run(ctx, engine, cfg, tmp_path, before, steps):
    data = make_data(cfg, [12] * (len(before) + 3), seed=53)
    ck = tmp_path / "ck"
    model, tr = fresh_trainer(cfg, ctx, engine, seed=7)
    train_windows(tr, model, None, before, data, None)
    tr.save_checkpoint(ck)
    saved = {k.partition("::")[0]: int(v) for k, v in load_file(str(ck / "optimizer.safetensors")).items()
             if k.endswith("::step")}
    named = {n: ("head" if n == HEAD else "ffn" if ".feed_forward." in n else "rest") for n in snap(model)}
    assert saved == {n: steps[g] for n, g in named.items() if g in steps}
    after = ["all"] * 3
    train_windows(tr, model, None, after, data[len(before):], None)

    model2, tr2 = fresh_trainer(cfg, ctx, engine, seed=99)
    tr2.load_checkpoint(ck)
    assert our_steps(tr2) == saved and tr2.optimizer_steps() == len(before)
    train_windows(tr2, model2, None, after, data[len(before):], None)
    final = snap(model)
    for n, a in snap(model2).items():
        assert np.array_equal(a, final[n]), n


def test_a_format_1_checkpoint_gives_every_parameter_with_state_the_global_step(ctx, engine, cfg, tmp_path):
    """Format 1 kept one global step; reading it as every parameter's count resumes as the run that
    wrote it would have gone on (it never changed subsets: all counts equal the global step)."""
    data = make_data(cfg, [12] * 4, seed=55)
    ck = tmp_path / "ck"
    model, tr = fresh_trainer(cfg, ctx, engine, seed=8)
    train_windows(tr, model, None, ["ffn", "ffn"], data, None)
    tr.save_checkpoint(ck)
    train_windows(tr, model, None, ["ffn", "ffn"], data[2:], None)

    meta = json.loads((ck / "trainer.json").read_text())
    assert meta["format"] == 2
    (ck / "trainer.json").write_text(json.dumps({**meta, "format": 1}))
    state = load_file(str(ck / "optimizer.safetensors"))
    save_file({k: v for k, v in state.items() if not k.endswith("::step")}, str(ck / "optimizer.safetensors"))
    model2, tr2 = fresh_trainer(cfg, ctx, engine, seed=99)
    tr2.load_checkpoint(ck)
    assert our_steps(tr2) == {n: 2 for n in subset(model, "ffn")}
    train_windows(tr2, model2, None, ["ffn", "ffn"], data[2:], None)
    final = snap(model)
    for n, a in snap(model2).items():
        assert np.array_equal(a, final[n]), n


def test_load_refuses_other_formats_and_bad_step_counts(ctx, engine, cfg, tmp_path):
    model, tr = fresh_trainer(cfg, ctx, engine, seed=9)
    train_windows(tr, model, None, ["head"], make_data(cfg, [12], seed=57), None)
    ck = tmp_path / "ck"
    tr.save_checkpoint(ck)
    meta = json.loads((ck / "trainer.json").read_text())
    state = load_file(str(ck / "optimizer.safetensors"))
    cases = [
        ({**meta, "format": 7}, state, r"checkpoint format 7, expected 2 \(or 1\)"),
        (meta, {k: v for k, v in state.items() if k != f"{HEAD}::step"}, f"optimizer state of {HEAD} lacks step"),
        (meta, {**state, f"{HEAD}::step": np.array(0, np.int64)}, rf"{HEAD}::step must be one integer >= 1"),
        (meta, {**state, "nothing::m": state[f"{HEAD}::m"]}, "'nothing::m' names no parameter of this model"),
        (meta, {**state, f"{HEAD}::w": state[f"{HEAD}::m"]}, r"AdamW keeps step, m, v per parameter"),
    ]
    _, fresh = fresh_trainer(cfg, ctx, engine, seed=10)
    for m, s, message in cases:
        (ck / "trainer.json").write_text(json.dumps(m))
        save_file(s, str(ck / "optimizer.safetensors"))
        with pytest.raises(TrainError, match=message):
            fresh.load_checkpoint(ck)
        assert not fresh.optimizer.state and fresh.optimizer_steps() == 0, message
