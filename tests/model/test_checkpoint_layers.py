"""Activation checkpointing (Lfm2Model.checkpoint_layers): a training pass keeps only each
checkpointed decoder layer's input, and the backward runs the layer's forward again right before its
backward. The same kernels on the same inputs (and the same LoRA dropout keys), so the loss, every
gradient and an MoE model's routing statistics are bit-identical to a run that keeps everything,
while the pool's peak is lower."""
from __future__ import annotations

import gc

import numpy as np
import pytest

from model_passes import BUCKET, run_loss_and_grads
from lfm2jit import ComputeEngine
from lfm2jit.model import Lfm2Config, Lfm2Model, LoraConfig
from lfm2jit.model.lfm2 import Checkpointed
from lfm2jit.model.moe_config import Lfm2MoeConfig
from trainer import AdamW, Trainer

EXPERTS = ("experts.gate_up_proj", "experts.down_proj")
MODULES = ("q_proj", "v_proj", "out_proj", "in_proj", "w1", "w2", "w3")


def _config(kind: str):
    return Lfm2MoeConfig.preset("tiny-moe") if kind == "moe" else Lfm2Config.preset("tiny")


def _model(engine, cfg, checkpoint_layers, lora: bool, dtype: str = "f32", recompute_mlp: bool = False):
    """A fresh model, seeded alike, on ``engine`` (its kernels compile once per engine)."""
    model = Lfm2Model(cfg, engine.ctx, engine, seed=1, activation_dtype=dtype, recompute_mlp=recompute_mlp,
                      checkpoint_layers=checkpoint_layers)
    if isinstance(cfg, Lfm2MoeConfig):
        model.router_aux_loss_coef = 0.01           # the balance loss's statistics and gradient too
    if lora:
        moe = isinstance(cfg, Lfm2MoeConfig)
        # dropout on the dense model's (PEFT refuses it on the experts' weight tensors)
        model.add_lora(LoraConfig(r=4, alpha=8, target_modules=MODULES, dropout=0.0 if moe else 0.25,
                                  target_parameters=EXPERTS if moe else ()), seed=3)
        model.lora.draw_dropout(7, 0)
    return model


def _pass(model, ids):
    """One training pass (dropout, routing statistics): loss, every gradient, routed tokens, balance
    loss and the pool's peak over the pass."""
    engine = model.engine
    params = model.lora_parameters() or model.parameters()
    model.zero_grad(params)
    engine.synchronize()
    gc.collect()          # an earlier model's buffers go back now, not during the pass (the peak's base)
    engine.pool.peak_bytes = base = engine.pool.in_use_bytes
    loss, grads = run_loss_and_grads(model, ids, np.roll(ids, -1), np.ones(len(ids), np.float32), params=params,
                                     train=True)
    grads = {n: g for n, g in grads.items() if any(t is model.named_parameters()[n] for t in params)}
    return loss, grads, model.take_routed_tokens(), model.take_router_balance(), engine.pool.peak_bytes - base


def _assert_same(got, want):
    loss, grads, routed, balance, _ = want
    assert got[0] == loss
    assert got[1].keys() == grads.keys() and grads
    for n, g in grads.items():
        assert np.array_equal(got[1][n], g), n
    assert got[2].keys() == routed.keys()
    for i, c in routed.items():
        assert np.array_equal(got[2][i], c), i
    assert got[3] == balance


@pytest.mark.parametrize("kind", ["dense", "moe"])
@pytest.mark.parametrize("lora", [False, True], ids=["full", "lora"])
def test_checkpointed_training_is_bit_identical(engine, kind, lora):
    """'all', the first layer, and all but the last: loss, every gradient, the routed-token counts
    and the balance loss equal the uncheckpointed pass's bit for bit (counted once, not again by the
    backward's rerun). With recompute_mlp too, whose layers a rerun gives their MLP's a and b."""
    cfg = _config(kind)
    ids = np.random.default_rng(0).integers(1, cfg.vocab_size, 40)
    want = _pass(_model(engine, cfg, 0, lora), ids)
    if kind == "moe":
        assert want[2] and all(c.sum() == len(ids) * cfg.num_experts_per_tok for c in want[2].values())
        assert want[3] > 0
    for checkpoint_layers in ("all", 1, cfg.num_hidden_layers - 1):
        _assert_same(_pass(_model(engine, cfg, checkpoint_layers, lora), ids), want)
    _assert_same(_pass(_model(engine, cfg, "all", lora, recompute_mlp=True), ids), want)


@pytest.mark.parametrize("lora", [False, True], ids=["full", "lora"])
def test_checkpointed_training_in_f16_is_bit_identical(ctx, engine, lora):
    if not ctx.has_f16:
        pytest.skip("adapter has no shader-f16")
    cfg = _config("dense")
    ids = np.random.default_rng(1).integers(1, cfg.vocab_size, 40)
    want = _pass(_model(engine, cfg, 0, lora, "f16"), ids)
    _assert_same(_pass(_model(engine, cfg, "all", lora, "f16"), ids), want)


def test_the_peak_drops_to_the_layer_inputs_and_one_layer(ctx):
    """8 layers, T = 256: without checkpointing the pool holds every layer's activations at the end of
    the forward; with 'all' it holds the 8 layer inputs [T, D] and one layer's activations at a time
    (its rerun and backward), with 4 of the 8 in between."""
    cfg = Lfm2Config(vocab_size=64, hidden_size=64, intermediate_size=256, num_hidden_layers=8,
                     num_attention_heads=4, num_key_value_heads=2,
                     layer_types=["conv", "conv", "full_attention", "conv", "conv", "full_attention", "conv", "conv"],
                     block_multiple_of=16)
    ids = np.random.default_rng(2).integers(1, cfg.vocab_size, 256)
    engine = ComputeEngine(ctx)         # its own pool: the module's holds other tests' buffers
    passes = {n: _pass(_model(engine, cfg, n, False), ids) for n in (0, 4, "all")}
    for n in (4, "all"):
        _assert_same(passes[n], passes[0])
    peak = {n: p[4] for n, p in passes.items()}
    assert peak["all"] < peak[4] < peak[0], peak
    assert peak["all"] < 0.5 * peak[0], peak


def test_trainer_steps_with_packing_dropout_and_accumulation_are_bit_identical(ctx, engine):
    """The trainer's path (recorded passes replayed, packed sequences, LoRA dropout keys drawn per
    pass, two passes a step): three optimizer steps, the adapters equal bit for bit."""
    cfg = _config("dense")
    rng = np.random.default_rng(4)
    seqs = [rng.integers(1, cfg.vocab_size, n + 1) for n in (30, 17, 9, 24, 30, 12)]
    adapters = {}
    for checkpoint_layers in (0, 2):
        model = _model(engine, cfg, checkpoint_layers, True)
        params = model.lora_parameters()
        tr = (Trainer(model, AdamW(lr=1e-2), ctx, model.engine).with_length_bucket(BUCKET)
              .with_grad_accum_steps(2).with_replay(2))
        stats = [tr.train_step(s[:-1], s[1:], params) for s in seqs]
        adapters[checkpoint_layers] = [s.loss for s in stats], [p.numpy() for p in params]
    assert adapters[2][0] == adapters[0][0]
    for got, want in zip(adapters[2][1], adapters[0][1]):
        assert np.array_equal(got, want)


def test_only_training_passes_checkpoint(ctx, engine):
    """Evaluation and generation passes (train=False) keep every layer's activations as before; a
    training pass keeps the checkpointed layers' inputs only, below keep_from nothing."""
    cfg = _config("dense")
    model = Lfm2Model(cfg, ctx, engine, seed=1, checkpoint_layers=2)
    ids = np.arange(1, 20)
    assert all(isinstance(s, list) for s in model.forward(ids, BUCKET).layers)
    trace = model.forward(ids, BUCKET, train=True)
    assert [type(s).__name__ for s in trace.layers] == ["Checkpointed", "Checkpointed", "list", "list"]
    assert trace.layers[0].h is trace.h_in
    trace = model.forward(ids, BUCKET, keep_from=1, train=True)
    assert trace.layers[0] is None and isinstance(trace.layers[1], Checkpointed)
    model.checkpoint_layers = "all"
    assert all(isinstance(s, Checkpointed) for s in model.forward(ids, BUCKET, train=True).layers)


@pytest.mark.parametrize("value", [-1, 5, 2.0, "2", "every", True, None])
def test_checkpoint_layers_must_be_all_or_a_number_of_layers(ctx, engine, value):
    with pytest.raises(ValueError, match=r"checkpoint_layers must be 'all' or a number of layers from 0 to 4"):
        Lfm2Model(_config("dense"), ctx, engine, checkpoint_layers=value)
