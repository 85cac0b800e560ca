"""Training checkpoints: resuming equals not stopping; the model part loads into transformers; a save
killed midway (or between its two renames) leaves the previous checkpoint loadable; saving in the
middle of an accumulation window is refused."""
from __future__ import annotations

import os
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
import transformers

import trainer.checkpoint as ckpt_module
from numerics import rel_err
from lfm2jit.model import Lfm2Model
from micro_model import make_data, micro, snap
from trainer import SGD, AdamW, CosineWithWarmup, GradScaler, TrainError, Trainer


@pytest.fixture(scope="module")
def cfg():
    return micro()


def opt_state(tr) -> dict[str, np.ndarray]:
    return tr.optimizer.state_arrays({id(t): n for n, t in tr.model.named_parameters().items()})


def adamw_trainer(cfg, ctx, engine, seed=0, schedule=True):
    model = Lfm2Model(cfg, ctx, engine, seed=seed)
    tr = (Trainer(model, AdamW(lr=1e-2, betas=(0.9, 0.95), weight_decay=0.01), ctx, engine).with_length_bucket(16)
          .with_grad_accum_steps(2).with_clip_grad_norm(0.5)
          .with_grad_scaler(GradScaler(init_scale=1024.0, growth_interval=1)))
    if schedule:
        tr.with_lr_scheduler(CosineWithWarmup(1e-2, warmup_steps=2, total_steps=5, min_lr=1e-3))
    return model, tr


def test_resume_equals_the_uninterrupted_run(ctx, engine, cfg, tmp_path):
    data = make_data(cfg, [10, 14, 8, 12, 15, 9, 11, 13], seed=51)
    ck = tmp_path / "ckpt"
    # uninterrupted: 4 optimizer steps, saving after the second (saving changes nothing)
    model, tr = adamw_trainer(cfg, ctx, engine)
    straight = []
    for n, (i, t, m) in enumerate(data):
        straight.append(tr.train_step_masked(i, t, m, model.parameters()))
        if n == 3:
            tr.save_checkpoint(ck, data_position={"epoch": 0, "next": 4})
            at_save = (snap(model), opt_state(tr), tr.scaler.scale)
    assert tr.optimizer_steps() == 4 and at_save[2] == 4096.0

    # a fresh process: other random weights, a fresh optimizer and scaler, no schedule given
    model2, tr2 = adamw_trainer(cfg, ctx, engine, seed=123, schedule=False)
    assert tr2.load_checkpoint(ck) == {"epoch": 0, "next": 4}
    assert tr2.optimizer_steps() == 2 and tr2.step_in_accum == 0
    assert tr2.scaler.scale == 4096.0 and tr2.lr_scheduler == tr.lr_scheduler
    for n, a in snap(model2).items():
        assert np.array_equal(a, at_save[0][n]), n
    state = opt_state(tr2)
    assert state.keys() == at_save[1].keys() and all(np.array_equal(state[k], at_save[1][k]) for k in state)

    resumed = [tr2.train_step_masked(i, t, m, model2.parameters()) for i, t, m in data[4:]]
    assert tr2.optimizer_steps() == 4
    for a, b in zip(resumed, straight[4:]):
        assert a.loss == pytest.approx(b.loss, rel=1e-6, abs=0)
        assert (a.stepped, a.skipped, a.lr, a.loss_scale) == (b.stepped, b.skipped, b.lr, b.loss_scale)
        assert (a.grad_norm is None and b.grad_norm is None) or a.grad_norm == pytest.approx(b.grad_norm, rel=1e-6)
    final = snap(model)
    for n, a in snap(model2).items():
        assert rel_err(a, final[n]) <= 1e-6, n


def test_checkpoint_model_loads_into_transformers(ctx, engine, cfg, tmp_path):
    model, tr = adamw_trainer(cfg, ctx, engine, seed=4)
    for i, t, m in make_data(cfg, [12, 9], seed=53):
        tr.train_step_masked(i, t, m, model.parameters())
    tr.save_checkpoint(tmp_path / "ck")
    hf = transformers.Lfm2ForCausalLM.from_pretrained(tmp_path / "ck" / "model", torch_dtype=torch.float32).eval()
    hf_weights = hf.state_dict()
    for n, a in snap(model).items():
        assert np.array_equal(hf_weights[n].numpy(), a), n
    ids = make_data(cfg, [17], seed=55)[0][0]
    with torch.no_grad():
        want = hf(torch.tensor(ids)[None]).logits[0].numpy()
    assert rel_err(model.logits(ids, bucket=16), want) < 1e-4


def test_a_killed_save_leaves_the_previous_checkpoint(ctx, engine, cfg, tmp_path, monkeypatch):
    data = make_data(cfg, [10, 14, 8], seed=57)
    model = Lfm2Model(cfg, ctx, engine, seed=5)
    tr = Trainer(model, SGD(lr=0.5, momentum=0.9), ctx, engine).with_length_bucket(16)
    ck = tmp_path / "ckpt"
    tr.train_step_masked(*data[0], model.parameters())
    tr.save_checkpoint(ck, data_position={"next": 1})
    saved = (snap(model), opt_state(tr))
    tr.train_step_masked(*data[1], model.parameters())
    assert tr.optimizer_steps() == 2

    def check_previous():
        fresh = Trainer(Lfm2Model(cfg, ctx, engine, seed=9), SGD(lr=0.5, momentum=0.9), ctx, engine)
        assert fresh.load_checkpoint(ck) == {"next": 1} and fresh.optimizer_steps() == 1
        for n, a in snap(fresh.model).items():
            assert np.array_equal(a, saved[0][n]), n
        state = opt_state(fresh)
        assert state.keys() == saved[1].keys() and all(np.array_equal(state[k], saved[1][k]) for k in state)

    # killed while writing: the model files of the new checkpoint are written, the optimizer half-way
    def half_written(tensors, path):
        Path(path).write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00{\"a\":")
        raise KeyboardInterrupt("killed while writing")
    with monkeypatch.context() as mp:
        mp.setattr(ckpt_module, "save_file", half_written)
        with pytest.raises(KeyboardInterrupt):
            tr.save_checkpoint(ck, data_position={"next": 2})
    assert (tmp_path / f"ckpt.tmp-{os.getpid()}" / "model" / "model.safetensors").exists()
    check_previous()

    # killed between moving the old checkpoint aside and renaming the new one into place
    real_rename = Path.rename

    def rename(self, target):
        if ".tmp-" in self.name:
            raise KeyboardInterrupt("killed between the renames")
        return real_rename(self, target)
    with monkeypatch.context() as mp:
        mp.setattr(Path, "rename", rename)
        with pytest.raises(KeyboardInterrupt):
            tr.save_checkpoint(ck, data_position={"next": 2})
    assert not ck.exists() and (tmp_path / f"ckpt.old-{os.getpid()}" / "trainer.json").exists()
    check_previous()

    # the next save succeeds, replaces it and leaves nothing else behind
    tr.save_checkpoint(ck, data_position={"next": 2})
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt"]
    fresh = Trainer(Lfm2Model(cfg, ctx, engine, seed=9), SGD(lr=0.5, momentum=0.9), ctx, engine)
    assert fresh.load_checkpoint(ck) == {"next": 2} and fresh.optimizer_steps() == 2
    for n, a in snap(fresh.model).items():
        assert np.array_equal(a, model.p(n).numpy()), n


def test_save_survives_leftovers_of_a_killed_process(ctx, engine, cfg, tmp_path):
    """A process killed while removing the previous checkpoint leaves "<dir>.old-<pid>" behind; the
    next process (in a container, often with the same pid) must still be able to save."""
    model = Lfm2Model(cfg, ctx, engine, seed=6)
    tr = Trainer(model, SGD(lr=0.5), ctx, engine).with_length_bucket(16)
    ck = tmp_path / "ckpt"
    tr.train_step_masked(*make_data(cfg, [9], seed=59)[0], model.parameters())
    tr.save_checkpoint(ck)
    for pid in (os.getpid(), 999999):                       # half-removed: the model folder is left, no trainer.json
        shutil.copytree(ck / "model", tmp_path / f"ckpt.old-{pid}" / "model")
    tr.train_step_masked(*make_data(cfg, [11], seed=61)[0], model.parameters())
    tr.save_checkpoint(ck)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt"]
    fresh = Trainer(Lfm2Model(cfg, ctx, engine, seed=9), SGD(lr=0.5), ctx, engine)
    fresh.load_checkpoint(ck)
    assert fresh.optimizer_steps() == 2
    for n, a in snap(fresh.model).items():
        assert np.array_equal(a, model.p(n).numpy()), n


def test_save_mid_window_is_refused_and_writes_nothing(ctx, engine, cfg, tmp_path):
    model = Lfm2Model(cfg, ctx, engine, seed=7)
    tr = Trainer(model, AdamW(lr=1e-2), ctx, engine).with_length_bucket(16).with_grad_accum_steps(3)
    data = make_data(cfg, [9, 12], seed=63)
    tr.save_checkpoint(tmp_path / "ck")                     # before any step: fine
    before = sorted(str(p.relative_to(tmp_path)) for p in tmp_path.rglob("*"))
    for k, (i, t, m) in enumerate(data, 1):
        tr.train_step_masked(i, t, m, model.parameters())
        with pytest.raises(TrainError, match=rf"middle of an accumulation window \({k} of 3 sequences done\)"):
            tr.save_checkpoint(tmp_path / "ck")
        assert tr.step_in_accum == k
    assert sorted(str(p.relative_to(tmp_path)) for p in tmp_path.rglob("*")) == before


def test_load_refuses_a_missing_checkpoint_or_another_optimizer(ctx, engine, cfg, tmp_path):
    model = Lfm2Model(cfg, ctx, engine, seed=8)
    Trainer(model, AdamW(lr=1e-2), ctx, engine).save_checkpoint(tmp_path / "adamw")
    sgd = Trainer(model, SGD(lr=0.1), ctx, engine)
    w = snap(model)
    with pytest.raises(TrainError, match="holds AdamW state but the trainer uses SGD"):
        sgd.load_checkpoint(tmp_path / "adamw")
    with pytest.raises(TrainError, match="no checkpoint at .*nothing"):
        sgd.load_checkpoint(tmp_path / "nothing")
    assert sgd.optimizer_steps() == 0
    for n, a in snap(model).items():
        assert np.array_equal(a, w[n]), n


def test_save_never_replaces_a_directory_that_is_not_a_checkpoint(ctx, engine, cfg, tmp_path):
    model = Lfm2Model(cfg, ctx, engine, seed=8)
    tr = Trainer(model, AdamW(lr=1e-2), ctx, engine)
    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "notes.txt").write_text("not a checkpoint")
    with pytest.raises(TrainError, match="exists and is not a checkpoint"):
        tr.save_checkpoint(mine)
    assert (mine / "notes.txt").read_text() == "not a checkpoint"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["mine"]
    (tmp_path / "empty").mkdir()                             # an empty directory is fine
    tr.save_checkpoint(tmp_path / "empty")
    assert (tmp_path / "empty" / "trainer.json").exists()
