"""LoRA held to PEFT + torch: logits and gradients of base + adapter, AdamW steps, adapters read and
written in both directions, merging, frozen f16 bases, the pruned backward, and clear refusals.

The reference is a float64 copy of PEFT's model (``get_peft_model`` on transformers' Lfm2ForCausalLM)
with the same adapter weights; B is randomised where a test needs gradients through A (PEFT's B
starts at zero, which makes A's gradient zero).
"""
from __future__ import annotations

import copy
import importlib.util
import json
from pathlib import Path

import numpy as np
import pytest

from numerics import rel_err
from references import masked_inputs, peft_on_copy
from lfm2jit.model import Lfm2Config, Lfm2Model
from lfm2jit.model import AdapterError, LoraConfig
from lfm2jit.model.config import PRESETS
from lfm2jit.model.lora import DEFAULT_TARGETS
from lfm2jit.ops.lmhead import lm_head_cross_entropy
from trainer import AdamW, Trainer

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
peft = pytest.importorskip("peft")

GOLDEN = Path(__file__).resolve().parents[1] / "golden"
BUCKET = 16
CONFIGS = ("tied_g1_attn_mid", "untied_bias_g2_attn_first", "tied_bias_g4_attn_last")


@pytest.fixture(scope="module")
def mg():
    spec = importlib.util.spec_from_file_location("make_golden", GOLDEN / "make_golden.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def hf_base(mg, name: str, seed: int):
    kwargs = mg.CONFIGS[name][0]
    return mg.build(kwargs, seed), kwargs


def ours_from_hf(hf, ctx, engine) -> Lfm2Model:
    cfg = Lfm2Config.from_dict(hf.config.to_dict())
    tensors = {n: t.detach().float().numpy() for n, t in hf.state_dict().items()}
    return Lfm2Model(cfg, ctx, engine, tensors=tensors)


def peft_model(hf, r: int, alpha: float, targets=DEFAULT_TARGETS, seed: int = 0, **extra):
    """PEFT's LoRA on a copy of ``hf`` with B randomised (seeded), in float32."""
    return peft_on_copy(hf, peft.LoraConfig(r=r, lora_alpha=alpha, target_modules=list(targets), lora_dropout=0.0,
                                            **extra), seed)


def peft_reference(model, ids, targets, mask):
    """float64 logits, masked mean loss and the LoRA parameters' gradients (by saved PEFT name)."""
    ref = copy.deepcopy(model).double()
    ref.base_model.model.config._attn_implementation = "eager"
    logits = ref(input_ids=torch.as_tensor(ids)[None]).logits[0]
    sel = torch.as_tensor(mask != 0)
    loss = torch.nn.functional.cross_entropy(logits[sel], torch.as_tensor(targets)[sel], reduction="sum") / int(sel.sum())
    loss.backward()
    grads = {n.replace(".default", ""): p.grad.numpy() for n, p in ref.named_parameters() if "lora_" in n}
    return logits.detach().numpy(), loss.item(), grads


def share_adapters(theirs, ours: Lfm2Model) -> dict:
    """PEFT's adapter weights written into ours; returns PEFT's parameters by saved name."""
    state = {n.replace(".default", ""): p for n, p in theirs.named_parameters() if "lora_" in n}
    for n, t in ours.lora.named.items():
        t.write(state[n].detach().numpy())
    return state


def torch_step(theirs, opt, ids, targets, mask) -> None:
    """One optimizer step of the PEFT model on the masked mean loss."""
    logits = theirs(input_ids=torch.as_tensor(ids)[None]).logits[0]
    sel = torch.as_tensor(mask != 0)
    loss = torch.nn.functional.cross_entropy(logits[sel], torch.as_tensor(targets)[sel])
    opt.zero_grad()
    loss.backward()
    opt.step()


def loss_and_grads(model: Lfm2Model, ids, targets, mask, params):
    model.zero_grad(params)
    trace = model.forward(ids, BUCKET)
    res = lm_head_cross_entropy(model.engine, trace.hn, model.lm_head, targets, mask,
                                normalizer=float(np.count_nonzero(mask)), bucket=BUCKET)
    model.backward(trace, res.dh, params)
    return res.loss_value(), {n: t.grad.numpy() for n, t in model.named_parameters().items() if any(t is p for p in params)}


@pytest.mark.parametrize("name,r,alpha,rslora", [("tied_g1_attn_mid", 4, 8, False), ("untied_bias_g2_attn_first", 3, 5, False),
                                                 ("tied_bias_g4_attn_last", 8, 16, True)])
def test_peft_adapter_logits_and_gradients(mg, ctx, engine, tmp_path, name, r, alpha, rslora):
    """An adapter PEFT wrote, loaded here: logits, loss and every A and B gradient equal PEFT's."""
    hf, kwargs = hf_base(mg, name, 7)
    theirs = peft_model(hf, r, alpha, use_rslora=rslora, seed=3)
    theirs.save_pretrained(tmp_path)
    ours = ours_from_hf(hf, ctx, engine)
    params = ours.load_adapter(tmp_path)
    assert len(params) == sum("lora_" in n for n, _ in theirs.named_parameters()) > 0
    ids, targets, mask = masked_inputs(kwargs["vocab_size"], 29, 5)
    want_logits, want_loss, want_grads = peft_reference(theirs, ids, targets, mask)
    assert rel_err(ours.logits(ids, bucket=BUCKET), want_logits) < 1e-4
    loss, grads = loss_and_grads(ours, ids, targets, mask, params)
    assert abs(loss - want_loss) < 1e-5
    assert set(grads) == set(want_grads)
    for n in want_grads:
        assert rel_err(grads[n], want_grads[n]) < 1e-3, n


def test_adapter_written_here_loads_in_peft(mg, ctx, engine, tmp_path):
    """save_adapter -> PeftModel.from_pretrained gives the same logits; PEFT reads the config as written."""
    hf, kwargs = hf_base(mg, "tied_bias_g4_attn_last", 9)
    ours = ours_from_hf(hf, ctx, engine)
    config = LoraConfig(r=4, alpha=12, target_modules=("q_proj", "w2", "out_proj"))
    rng = np.random.default_rng(1)
    for t in ours.add_lora(config, seed=2):
        t.write(rng.standard_normal(t.shape).astype(np.float32) * 0.1)     # B too: not a no-op adapter
    ours.save_adapter(tmp_path / "adapter", base_model="tiny")
    loaded = peft.PeftModel.from_pretrained(copy.deepcopy(hf), tmp_path / "adapter").eval()
    assert loaded.peft_config["default"].r == 4 and loaded.peft_config["default"].lora_alpha == 12
    ids = masked_inputs(kwargs["vocab_size"], 21, 4)[0]
    with torch.no_grad():
        want = loaded(input_ids=torch.as_tensor(ids)[None]).logits[0].numpy()
    assert rel_err(ours.logits(ids, bucket=BUCKET), want) < 1e-4
    # the conv's out_proj and the attention's both carry an adapter, as PEFT's suffix matching has it
    names = set(json.loads((tmp_path / "adapter" / "adapter_config.json").read_text())["target_modules"])
    assert names == {"q_proj", "w2", "out_proj"}
    assert any(".conv.out_proj." in n for n in ours.lora.named) and any(".self_attn.out_proj." in n for n in ours.lora.named)


def test_adamw_steps_on_adapters_equal_peft_and_torch(mg, ctx, engine):
    """Four AdamW steps of the adapters alone through the Trainer equal PEFT + torch.optim.AdamW."""
    hf, kwargs = hf_base(mg, "tied_g1_attn_mid", 13)
    theirs = peft_model(hf, 4, 8, seed=5)
    ours = ours_from_hf(hf, ctx, engine)
    config = LoraConfig(r=4, alpha=8)
    params = ours.add_lora(config)
    state = share_adapters(theirs, ours)
    opt = torch.optim.AdamW([p for p in theirs.parameters() if p.requires_grad], lr=5e-3, weight_decay=0.01)
    tr = Trainer(ours, AdamW(lr=5e-3, weight_decay=0.01), ctx, engine).with_length_bucket(BUCKET)
    for step in range(4):
        ids, targets, mask = masked_inputs(kwargs["vocab_size"], 23, 100 + step)
        tr.train_step_masked(ids, targets, mask, params)
        torch_step(theirs, opt, ids, targets, mask)
    for n, t in ours.lora.named.items():
        assert rel_err(t.numpy(), state[n].detach().numpy()) < 1e-4, n
    base = {n: t.detach().numpy() for n, t in hf.state_dict().items()}
    for n, t in ours.named_parameters().items():      # the base never moved
        if n in base:
            assert np.array_equal(t.numpy(), base[n]), n


def test_merge_lora_writes_a_plain_model_transformers_reads(mg, ctx, engine, tmp_path):
    hf, kwargs = hf_base(mg, "untied_bias_g2_attn_first", 17)
    theirs = peft_model(hf, 4, 8, seed=9)
    theirs.save_pretrained(tmp_path / "adapter")
    ours = ours_from_hf(hf, ctx, engine)
    ours.load_adapter(tmp_path / "adapter")
    ids = masked_inputs(kwargs["vocab_size"], 19, 8)[0]
    before = ours.logits(ids, bucket=BUCKET)
    ours.merge_lora()
    assert ours.lora is None and ours.lora_parameters() == []
    assert rel_err(ours.logits(ids, bucket=BUCKET), before) < 1e-5
    ours.save_pretrained(tmp_path / "merged")
    merged = transformers.Lfm2ForCausalLM.from_pretrained(tmp_path / "merged").eval()
    want = theirs.merge_and_unload().eval()
    with torch.no_grad():
        for name, t in want.state_dict().items():
            assert rel_err(merged.state_dict()[name].numpy(), t.numpy()) < 1e-6, name


@pytest.mark.parametrize("engine_kind", ["engine", "matrix_engine"])
def test_f16_base_halves_the_linear_weights_and_stays_frozen(mg, ctx, engine_kind, request):
    """On the portable path and on the matrix units (the device's, or emulated where it has none)."""
    engine = request.getfixturevalue(engine_kind)
    if not ctx.has_f16:
        pytest.skip(f"{ctx.name} has no shader-f16")
    hf, kwargs = hf_base(mg, "tied_g1_attn_mid", 21)
    theirs = peft_model(hf, 4, 8, seed=2)
    ours = ours_from_hf(hf, ctx, engine)
    params = ours.add_lora(LoraConfig(r=4, alpha=8), base_dtype="f16")
    state = share_adapters(theirs, ours)
    linears = [n for n in ours.named_parameters() if ".layers." in n and n.endswith(("proj.weight", "w1.weight",
                                                                                        "w2.weight", "w3.weight"))]
    assert linears and all(ours.p(n).dtype == "f16" for n in linears)
    held = sum({id(t.buffer): t.buffer.size for t in ours.named_parameters().values()}.values())
    align = ctx.limits.get("min-storage-buffer-offset-alignment", 256)
    slots = sum(-(-t.nbytes // align) * align for t in ours.named_parameters().values())
    assert held <= slots + 3 * align       # the f32 copies of the linears are freed with their arena
    with torch.no_grad():                  # the reference: PEFT on the f16-rounded base
        for n, p in theirs.named_parameters():
            if n.replace("base_model.model.", "").replace(".base_layer", "") in linears:
                p.copy_(p.half().float())
    ids, targets, mask = masked_inputs(kwargs["vocab_size"], 25, 3)
    want_logits, want_loss, want_grads = peft_reference(theirs, ids, targets, mask)
    # On the matrix units a product with the f16 base runs in f16: its f32 input is rounded to f16 as
    # it is staged (as PEFT runs a half-precision base layer), about 2**-11 relative per product
    matrix = bool(engine.target.matrix_configs)
    assert rel_err(ours.logits(ids, bucket=BUCKET), want_logits) < (3e-3 if matrix else 1e-4)
    loss, grads = loss_and_grads(ours, ids, targets, mask, params)
    assert abs(loss - want_loss) < (1e-3 if matrix else 1e-5)
    assert max(rel_err(grads[n], want_grads[n]) for n in want_grads) < (2e-2 if matrix else 1e-3)
    with pytest.raises(ValueError, match="frozen f16 base weight"):
        loss_and_grads(ours, ids, targets, mask, params + [ours.p(linears[0])])


def _step_dispatches(model, ctx, engine, params, ids, targets, mask) -> int:
    """Dispatches of one train step (AdamW included), after a first step that compiles and records."""
    tr = Trainer(model, AdamW(lr=1e-3), ctx, engine).with_length_bucket(BUCKET)
    tr.train_step_masked(ids, targets, mask, params)
    engine.synchronize()
    before = engine.dispatches
    tr.train_step_masked(ids, targets, mask, params)
    engine.synchronize()
    return engine.dispatches - before


def test_backward_is_pruned_to_what_the_trained_parameters_need(mg, ctx, engine):
    """LM head alone, the last layer alone and adapters on the last layer: gradients bit-identical to
    a full backward's."""
    kwargs = {**mg.CONFIGS["untied_bias_g2_attn_first"][0], "num_hidden_layers": 4,
              "layer_types": ["full_attention", "conv", "conv", "full_attention"]}
    hf = mg.build(kwargs, 23)
    ids, targets, mask = masked_inputs(kwargs["vocab_size"], 31, 6)
    ours = ours_from_hf(hf, ctx, engine)
    named = ours.named_parameters()
    last = "model.layers.3."
    subsets = {"head": [named["lm_head.weight"]], "last layer": [t for n, t in named.items() if n.startswith(last)]}
    full_grads = loss_and_grads(ours, ids, targets, mask, list(named.values()))[1]
    for what, params in subsets.items():
        for p in named.values():
            p.grad = None
        got = loss_and_grads(ours, ids, targets, mask, params)[1]
        assert got.keys() == {n for n, t in named.items() if any(t is p for p in params)}
        for name in got:
            assert np.array_equal(got[name], full_grads[name]), (what, name)
    lora = ours.add_lora(LoraConfig(r=2, alpha=4, target_modules=(last + "feed_forward.w2",)))
    everything = list(ours.named_parameters().values())
    for p in everything:
        p.grad = None
    with_all = loss_and_grads(ours, ids, targets, mask, everything)[1]
    for p in everything:
        p.grad = None
    only = loss_and_grads(ours, ids, targets, mask, lora)[1]
    assert only.keys() == set(ours.lora.named)
    for name in only:
        assert np.array_equal(only[name], with_all[name]), name


def test_head_or_last_layer_training_takes_at_most_half_the_dispatches(ctx, engine):
    """Issue 15's target at LFM2's published depth (16 layers, their layer types; untied so the
    head is a parameter of its own), at a tiny width: a train step of the LM head or of the last
    layer alone takes at most half the dispatches of full training (the forward is the same)."""
    shape = {**PRESETS["350M"], "hidden_size": 32, "intermediate_size": 64, "num_attention_heads": 4,
             "num_key_value_heads": 2, "vocab_size": 96, "block_multiple_of": 16, "tie_word_embeddings": False}
    model = Lfm2Model(Lfm2Config(**shape), ctx, engine, seed=5)
    named = model.named_parameters()
    ids, targets, mask = masked_inputs(96, 31, 6)
    subsets = {"head": [named["lm_head.weight"]],
               "last layer": [t for n, t in named.items() if n.startswith("model.layers.15.")]}
    full = _step_dispatches(model, ctx, engine, list(named.values()), ids, targets, mask)
    for what, params in subsets.items():
        for p in named.values():
            p.grad = None
        n = _step_dispatches(model, ctx, engine, params, ids, targets, mask)
        assert n <= full / 2, (what, n, full)


@pytest.mark.parametrize("make,match", [
    (lambda: LoraConfig(r=0), "r must be an integer >= 1"),
    (lambda: LoraConfig(alpha=float("nan")), "alpha must be a finite number"),
    (lambda: LoraConfig(dropout=1.5), r"dropout must be in \[0, 1\)"),
    (lambda: LoraConfig(target_modules=()), "target_modules must be non-empty"),
])
def test_bad_lora_configs_are_named(make, match):
    with pytest.raises(AdapterError, match=match):
        make()


def test_bad_adapters_change_nothing(mg, ctx, engine, tmp_path):
    hf, kwargs = hf_base(mg, "tied_g1_attn_mid", 29)
    ours = ours_from_hf(hf, ctx, engine)
    before = {n: t.numpy() for n, t in ours.named_parameters().items()}
    with pytest.raises(AdapterError, match="'o_proj' matches no linear layer of this LFM2 \\(LFM2 calls it 'out_proj'\\)"):
        ours.add_lora(LoraConfig(target_modules=("q_proj", "o_proj")))
    # an adapter of another base shape
    other, _ = hf_base(mg, "tied_bias_g4_attn_last", 29)
    peft_model(other, 4, 8).save_pretrained(tmp_path / "other")
    with pytest.raises(AdapterError, match="other does not fit this model: missing base_model.model.model.layers.1.self_attn.q_proj.lora_A.weight"):
        ours.load_adapter(tmp_path / "other")
    # what lfm2jit cannot run, named from PEFT's config
    peft_model(hf, 4, 8).save_pretrained(tmp_path / "dora")
    cfg = json.loads((tmp_path / "dora" / "adapter_config.json").read_text())
    (tmp_path / "dora" / "adapter_config.json").write_text(json.dumps({**cfg, "use_dora": True}))
    with pytest.raises(AdapterError, match="use_dora = True is not supported"):
        ours.load_adapter(tmp_path / "dora")
    with pytest.raises(AdapterError, match="no adapter_config.json"):
        ours.load_adapter(tmp_path / "nowhere")
    assert ours.lora is None
    assert all(np.array_equal(t.numpy(), before[n]) for n, t in ours.named_parameters().items())
    ours.add_lora(LoraConfig(r=2, dropout=0.1))
    with pytest.raises(AdapterError, match="already has LoRA adapters"):
        ours.add_lora(LoraConfig(r=2))


def test_forward_keeps_only_what_the_backward_reads(mg, ctx, engine):
    """forward(keep_from=backward_start(params)) drops the layers below; the gradients are unchanged,
    the peak of the pool is lower, and a backward that needs a dropped layer is refused."""
    hf, kwargs = hf_base(mg, "tied_g1_attn_mid", 31)
    ours = ours_from_hf(hf, ctx, engine)
    ids, targets, mask = masked_inputs(kwargs["vocab_size"], 27, 2)
    params = [t for n, t in ours.named_parameters().items() if n.startswith("model.layers.3.")]
    start = ours.backward_start(params)
    assert start == 3 and ours.backward_start([ours.p("model.embedding_norm.weight")]) == len(kwargs["layer_types"])

    def run(keep_from):
        ours.zero_grad(params)
        engine.synchronize()
        engine.pool.peak_bytes = engine.pool.in_use_bytes
        trace = ours.forward(ids, BUCKET, keep_from=keep_from)
        res = lm_head_cross_entropy(engine, trace.hn, ours.lm_head, targets, mask,
                                    normalizer=float(np.count_nonzero(mask)), bucket=BUCKET)
        ours.backward(trace, res.dh, params)
        grads = [p.grad.numpy() for p in params]
        del trace, res
        return grads, engine.pool.peak_bytes

    full, full_peak = run(0)
    kept, kept_peak = run(start)
    assert all(np.array_equal(a, b) for a, b in zip(full, kept))
    assert kept_peak < full_peak
    trace = ours.forward(ids, BUCKET, keep_from=start)
    ours.zero_grad([ours.p("model.layers.1.ffn_norm.weight")])
    with pytest.raises(ValueError, match="kept no activations for layers 1, 2 .* starts at layer 1"):
        ours.backward(trace, trace.hn, [ours.p("model.layers.1.ffn_norm.weight")])


def test_the_trainer_refuses_untrainable_parameters_before_gpu_work(mg, ctx, engine):
    from trainer.errors import TrainError
    hf, kwargs = hf_base(mg, "tied_g1_attn_mid", 37)
    ours = ours_from_hf(hf, ctx, engine)
    params = ours.add_lora(LoraConfig(r=2), base_dtype="f16" if ctx.has_f16 else "f32")
    tr = Trainer(ours, AdamW(lr=1e-3), ctx, engine).with_length_bucket(BUCKET)
    ids, targets, mask = masked_inputs(kwargs["vocab_size"], 9, 1)
    before = engine.dispatches
    if ctx.has_f16:
        with pytest.raises(TrainError, match="frozen f16 base weight"):
            tr.train_step_masked(ids, targets, mask, params + [ours.p("model.layers.0.feed_forward.w1.weight")])
    assert engine.dispatches == before and tr.optimizer_steps() == 0
    stats = tr.train_step_masked(ids, targets, mask, params)
    assert stats.stepped
