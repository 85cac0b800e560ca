"""LoRA on an MoE model's expert tensors (issue 47), held to PEFT's ``target_parameters`` on
transformers' Lfm2MoeForCausalLM: logits, loss and every A and B gradient in float64, adapter files
in both directions, merging, AdamW steps against torch, an f16 base, and clear refusals.

PEFT keeps an expert tensor's adapter as lora_A [E r, in] and lora_B [out, r E] (lfm2jit/model/lora.py
says how); lfm2jit holds them as A [E, r, in] and B [E, out, r], so its tensors and gradients are
compared in PEFT's layout (``experts_to_peft``). B is randomised where a test needs gradients through
A (PEFT's B starts at zero).
"""
from __future__ import annotations

import copy
import dataclasses
import json

import numpy as np
import pytest

from lfm2jit.model import AdapterError, Lfm2Config, Lfm2Model, Lfm2MoeConfig, LoraConfig
from lfm2jit.model.lora import experts_from_peft, experts_to_peft, parameter_peft_names
from lfm2jit.model.lora_attach import base_linears
from model_passes import BUCKET
from numerics import rel_err, worst
from references import masked_inputs, moe_hf_model, peft_on_copy
from trainer import AdamW, Trainer

torch = pytest.importorskip("torch", reason="PEFT on transformers is the reference")
transformers = pytest.importorskip("transformers")
peft = pytest.importorskip("peft")

EXPERTS = ("experts.gate_up_proj", "experts.down_proj")


def ours_from_hf(hf, cfg, ctx, engine) -> Lfm2Model:
    return Lfm2Model(cfg, ctx, engine, tensors={n: t.detach().numpy() for n, t in hf.state_dict().items()})


def peft_model(hf, r: int, alpha: float, params=EXPERTS, modules=(), seed: int = 0, **extra):
    """PEFT's LoRA on a copy of ``hf`` (``target_parameters``), B randomised (seeded)."""
    return peft_on_copy(hf, peft.LoraConfig(r=r, lora_alpha=alpha, target_modules=list(modules),
                                            target_parameters=list(params), **extra), seed)


def masked_loss(logits, targets, mask):
    sel = torch.as_tensor(mask != 0)
    return torch.nn.functional.cross_entropy(logits[sel], torch.as_tensor(targets)[sel])


def peft_reference(model, ids, targets, mask):
    """float64 logits, the masked mean loss and the adapters' gradients by saved PEFT name (eager
    experts and attention: transformers' grouped experts take no float64)."""
    ref = copy.deepcopy(model).double()
    ref.base_model.model.config._experts_implementation = "eager"
    ref.base_model.model.config._attn_implementation = "eager"
    logits = ref(input_ids=torch.as_tensor(ids)[None]).logits[0]
    loss = masked_loss(logits, targets, mask)
    loss.backward()
    grads = {n.replace(".default", ""): p.grad.numpy() for n, p in ref.named_parameters() if "lora_" in n}
    return logits.detach().numpy(), loss.item(), grads


def in_peft_layout(model: Lfm2Model, arrays: dict) -> dict:
    """Arrays by PEFT name in lfm2jit's layout (A [E, r, in], B [E, out, r]) -> PEFT's shapes."""
    out = dict(arrays)
    for a, b in parameter_peft_names(model.lora.by_parameter).values():
        out[a], out[b] = experts_to_peft(out[a], out[b])
    return out


def loss_and_grads(model: Lfm2Model, ids, targets, mask, params):
    """The trainer's passes for ``params``: the loss and their gradients, by PEFT name in PEFT's shapes."""
    from lfm2jit.ops.lmhead import lm_head_cross_entropy
    model.zero_grad(params)
    trace = model.forward(ids, BUCKET)
    res = lm_head_cross_entropy(model.engine, trace.hn, model.lm_head, targets, mask,
                                normalizer=float(np.count_nonzero(mask)), bucket=BUCKET)
    model.backward(trace, res.dh, params)
    grads = {n: t.grad.numpy() for n, t in model.lora.named.items()}
    return res.loss_value(), in_peft_layout(model, grads)


def assert_like_peft(ours: Lfm2Model, theirs, params, length: int, seed: int, logits_tol: float, loss_tol: float,
                     grad_tol: float):
    """Logits, loss and every adapter gradient of ``ours`` against PEFT's on masked inputs of ``length``
    tokens; returns the inputs."""
    ids, targets, mask = masked_inputs(ours.cfg.vocab_size, length, seed)
    want_logits, want_loss, want_grads = peft_reference(theirs, ids, targets, mask)
    assert rel_err(ours.logits(ids, bucket=BUCKET), want_logits) < logits_tol
    loss, grads = loss_and_grads(ours, ids, targets, mask, params)
    assert abs(loss - want_loss) < loss_tol
    assert set(grads) == set(want_grads)
    err, name = worst(grads, want_grads)
    assert err < grad_tol, f"worst gradient {name}: rel err {err:.2e}"
    return ids, targets, mask


# (preset, changes, r, alpha, rslora, target_parameters, target_modules)
CASES = [
    ("tiny-moe", {}, 4, 8, False, EXPERTS, ()),
    ("tiny-moe-untied", {}, 3, 5, True, EXPERTS, ("q_proj", "w2")),
    ("tiny-moe-top1", {}, 2, 6, False, ("experts.down_proj",), ()),
    ("tiny-moe", dict(num_experts=8, num_experts_per_tok=4, num_dense_layers=0), 2, 4, False,
     ("gate_up_proj",), ("in_proj",)),
]


@pytest.mark.parametrize("preset,changes,r,alpha,rslora,params,modules", CASES,
                         ids=["top2-tied", "top2-untied-rslora-mixed", "top1-down-only", "top4-8experts-gate-up"])
def test_peft_adapter_logits_and_gradients(ctx, engine, tmp_path, preset, changes, r, alpha, rslora, params, modules):
    """An adapter PEFT wrote, loaded here: logits, loss and every A and B gradient equal PEFT's."""
    cfg = dataclasses.replace(Lfm2MoeConfig.preset(preset), **changes)
    hf = moe_hf_model(cfg, seed=r + 7)
    theirs = peft_model(hf, r, alpha, params, modules, use_rslora=rslora, seed=3)
    theirs.save_pretrained(tmp_path)
    ours = ours_from_hf(hf, cfg, ctx, engine)
    trained = ours.load_adapter(tmp_path)
    assert len(trained) == sum("lora_" in n for n, _ in theirs.named_parameters()) > 0
    assert len(ours.lora.by_parameter) == len(params) * (cfg.num_hidden_layers - cfg.num_dense_layers)
    assert_like_peft(ours, theirs, trained, 29, 5, 1e-5, 1e-5, 2e-5)     # 29: slots and tokens padded in their buckets


def test_adapter_written_here_loads_in_peft_and_merges_as_peft_does(ctx, engine, tmp_path):
    """save_adapter -> PeftModel.from_pretrained: the same logits, PEFT's config as written; then
    merge_lora equals PEFT's merge_and_unload, and transformers reads the merged model."""
    cfg = Lfm2MoeConfig.preset("tiny-moe-untied")
    hf = moe_hf_model(cfg, seed=9)
    ours = ours_from_hf(hf, cfg, ctx, engine)
    config = LoraConfig(r=4, alpha=12, target_modules=("out_proj",), target_parameters=EXPERTS)
    rng = np.random.default_rng(1)
    for t in ours.add_lora(config, seed=2):
        t.write(rng.standard_normal(t.shape).astype(np.float32) * 0.1)     # B too: not a no-op adapter
    ours.save_adapter(tmp_path / "adapter", base_model="tiny")
    written = json.loads((tmp_path / "adapter" / "adapter_config.json").read_text())
    assert written["target_parameters"] == list(EXPERTS) and written["target_modules"] == ["out_proj"]
    loaded = peft.PeftModel.from_pretrained(copy.deepcopy(hf), tmp_path / "adapter").eval()
    assert loaded.peft_config["default"].r == 4 and set(loaded.peft_config["default"].target_parameters) == set(EXPERTS)
    ids = masked_inputs(cfg.vocab_size, 21, 4)[0]
    with torch.no_grad():
        want = loaded(input_ids=torch.as_tensor(ids)[None]).logits[0].numpy()
    before = ours.logits(ids, bucket=BUCKET)
    assert rel_err(before, want) < 1e-5
    # and back: what PEFT loaded is what was written, tensor for tensor
    mine = ours.lora.peft_arrays()
    state = {n.replace(".default", ""): p.detach().numpy() for n, p in loaded.named_parameters() if "lora_" in n}
    assert set(state) == set(mine)
    for n, a in mine.items():
        np.testing.assert_array_equal(state[n], a, err_msg=n)

    again = ours_from_hf(hf, cfg, ctx, engine)          # and lfm2jit reads its own file back as it was
    again.load_adapter(tmp_path / "adapter")
    for n, t in ours.lora.named.items():
        np.testing.assert_array_equal(again.lora.named[n].numpy(), t.numpy(), err_msg=n)

    ours.merge_lora()
    assert ours.lora is None
    assert rel_err(ours.logits(ids, bucket=BUCKET), before) < 1e-5
    ours.save_pretrained(tmp_path / "merged")
    merged = transformers.Lfm2MoeForCausalLM.from_pretrained(tmp_path / "merged").eval()
    reference = loaded.merge_and_unload().eval()
    have = merged.state_dict()
    for name, t in reference.state_dict().items():
        assert rel_err(have[name].numpy(), t.numpy()) < 1e-6, name


def test_adamw_steps_on_expert_adapters_equal_peft_and_torch(ctx, engine):
    """Three AdamW steps of the adapters alone through the Trainer equal PEFT + torch.optim.AdamW;
    the base, experts included, never moves."""
    cfg = Lfm2MoeConfig.preset("tiny-moe")
    hf = moe_hf_model(cfg, seed=13)
    theirs = peft_model(hf, 4, 8, EXPERTS, ("q_proj",), seed=5)
    ours = ours_from_hf(hf, cfg, ctx, engine)
    params = ours.add_lora(LoraConfig(r=4, alpha=8, target_modules=("q_proj",), target_parameters=EXPERTS))
    state = {n.replace(".default", ""): p for n, p in theirs.named_parameters() if "lora_" in n}
    named = {n: state[n].detach().numpy() for n in ours.lora.named}
    for p, (a, b) in parameter_peft_names(ours.lora.by_parameter).items():
        named[a], named[b] = experts_from_peft(named[a], named[b], cfg.num_experts)
    for n, t in ours.lora.named.items():
        t.write(named[n])
    opt = torch.optim.AdamW([p for p in theirs.parameters() if p.requires_grad], lr=5e-3, weight_decay=0.01)
    tr = Trainer(ours, AdamW(lr=5e-3, weight_decay=0.01), ctx, engine).with_length_bucket(BUCKET)
    for step in range(3):
        ids, targets, mask = masked_inputs(cfg.vocab_size, 23, 100 + step)
        tr.train_step_masked(ids, targets, mask, params)
        loss = masked_loss(theirs(input_ids=torch.as_tensor(ids)[None]).logits[0], targets, mask)
        opt.zero_grad()
        loss.backward()
        opt.step()
    have = ours.lora.peft_arrays()
    for n, t in state.items():
        assert rel_err(have[n], t.detach().numpy()) < 1e-4, n
    base = {n: t.detach().numpy() for n, t in hf.state_dict().items()}
    for n, t in ours.named_parameters().items():
        if n in base:
            assert np.array_equal(t.numpy(), base[n]), n


def test_a_model_loaded_with_an_f16_base_equals_one_narrowed_after_loading(ctx, engine, tmp_path):
    """from_pretrained(base_dtype="f16") narrows each tensor as it is uploaded (an 8B base never
    exists in f32 on the device): the same f16 values, the same logits, no f32 copies held; an
    adapter keeps that base, and one asking for an f32 base is refused before anything changes."""
    if not ctx.has_f16:
        pytest.skip(f"{ctx.name} has no shader-f16")
    cfg = Lfm2MoeConfig.preset("tiny-moe")
    moe_hf_model(cfg, seed=23).save_pretrained(tmp_path)
    narrowed_after = Lfm2Model.from_pretrained(tmp_path, ctx, engine)
    narrowed_after.add_lora(LoraConfig(r=2, target_parameters=EXPERTS), base_dtype="f16")
    loaded = Lfm2Model.from_pretrained(tmp_path, ctx, engine, base_dtype="f16")
    assert loaded.base_dtype == "f16" and narrowed_after.base_dtype == "f16"
    assert {n for n, t in loaded.named_parameters().items() if t.dtype == "f16"} == set(base_linears(cfg))
    for n, t in narrowed_after._params.items():
        np.testing.assert_array_equal(loaded.p(n).numpy(), t.numpy(), err_msg=n)
    held = sum({id(t.buffer): t.buffer.size for t in loaded.parameters()}.values())
    assert held < sum(t.size for t in loaded.parameters()) * 4 * 0.75     # most of it in f16, no f32 copy
    with pytest.raises(ValueError, match="base_dtype='f32': this model's base is f16"):
        loaded.add_lora(LoraConfig(r=2, target_parameters=EXPERTS), base_dtype="f32")
    assert loaded.lora is None
    loaded.add_lora(LoraConfig(r=2, target_parameters=EXPERTS))             # None: the base as it was built
    assert loaded.base_dtype == "f16"
    ids = masked_inputs(cfg.vocab_size, 19, 5)[0]
    np.testing.assert_array_equal(loaded.logits(ids, bucket=BUCKET), narrowed_after.logits(ids, bucket=BUCKET))


@pytest.mark.parametrize("source", ["bf16 checkpoint", "random init"])
def test_an_f16_base_is_narrowed_on_the_host_as_it_is_read_or_drawn(ctx, engine, tmp_path, source):
    """The host never holds an f16 base in f32 at once either: a checkpoint's linear and expert
    tensors are narrowed one by one as they are read (the host's peak, tracemalloc: numpy's arrays
    and the file's bytes, well under the f32 build's, at a shape where the experts are most of the
    model); a random init's are drawn on the GPU as f16. Same values as narrowing the f32 model."""
    if not ctx.has_f16:
        pytest.skip(f"{ctx.name} has no shader-f16")
    tracemalloc = pytest.importorskip("tracemalloc")
    cfg = dataclasses.replace(Lfm2MoeConfig.preset("tiny-moe"), num_experts=8, moe_intermediate_size=192)
    Lfm2Model(cfg, ctx, engine, seed=5).save_pretrained(tmp_path, dtype="bf16")

    def build(base_dtype):
        tracemalloc.start()
        try:
            model = (Lfm2Model.from_pretrained(tmp_path, ctx, engine, base_dtype=base_dtype) if source != "random init"
                     else Lfm2Model(cfg, ctx, engine, seed=5, base_dtype=base_dtype))
            return model, tracemalloc.get_traced_memory()[1]
        finally:
            tracemalloc.stop()
    wide, wide_peak = build("f32")
    narrow, narrow_peak = build("f16")
    if source != "random init":
        assert narrow_peak < 0.7 * wide_peak, (narrow_peak, wide_peak)
    for n, t in narrow._params.items():
        want = wide.p(n).numpy()
        np.testing.assert_array_equal(t.numpy(), want.astype(np.float16) if t.dtype == "f16" else want, err_msg=n)


def _packed(weight) -> tuple[np.ndarray, ...]:
    """A QuantizedWeight's host form: (codes, scales) as the device holds them."""
    host = weight.host
    return (host.packed, host.absmax) if weight.dtype == "nf4" else (host.codes, host.scale)


@pytest.mark.parametrize("dtype", ["nf4", "int8"])
@pytest.mark.parametrize("source, width", [("per-expert checkpoint", 192), ("fused checkpoint", 192),
                                           ("random init", 192), ("per-expert checkpoint", 12)])
def test_a_quantized_base_is_quantized_on_the_host_as_it_is_read_or_drawn(ctx, engine, tmp_path, dtype, source, width):
    """A quantized base is never held in f32 either: each linear and expert tensor is quantized as it
    is read (either expert form), and the experts' pieces joined in that form, the host's peak well
    under the f32 build's; a random init's are drawn on the GPU and quantized one by one. The codes
    and scales are bit for bit those of quantizing the model's f32 tensors whole. Experts that do
    not split into whole NF4 blocks (width 12: 768 elements a piece) are read in f32 and quantized
    whole, as before."""
    from safetensors.numpy import save_file
    from lfm2jit.model.checkpoint import load_checkpoint
    from lfm2jit.model.moe_checkpoint import fuse_experts
    tracemalloc = pytest.importorskip("tracemalloc")
    cfg = dataclasses.replace(Lfm2MoeConfig.preset("tiny-moe"), num_experts=8, moe_intermediate_size=width)
    Lfm2Model(cfg, ctx, engine, seed=5).save_pretrained(tmp_path, dtype="bf16")
    if source == "fused checkpoint":        # the experts as transformers holds them in memory, [E, 2I, D] and [E, D, I]
        fused = fuse_experts(cfg, load_checkpoint(tmp_path))
        (tmp_path / "model.safetensors").unlink()
        save_file({n: np.ascontiguousarray(a, np.float16 if a.ndim > 1 else np.float32) for n, a in fused.items()},
                  str(tmp_path / "model.safetensors"))

    def build(base_dtype):
        tracemalloc.start()
        try:
            model = (Lfm2Model(cfg, ctx, engine, seed=5, base_dtype=base_dtype) if source == "random init"
                     else Lfm2Model.from_pretrained(tmp_path, ctx, engine, base_dtype=base_dtype))
            return model, tracemalloc.get_traced_memory()[1]
        finally:
            tracemalloc.stop()
    wide, wide_peak = build("f32")
    held, held_peak = build(dtype)
    whole = Lfm2Model(cfg, ctx, engine, tensors={n: wide.p(n).numpy() for n in base_linears(cfg)} | {
        n: wide.p(n).numpy() for n in wide._params if n not in base_linears(cfg)} | {
        n: b.numpy() for n, b in wide._buffers.items()}, base_dtype=dtype)
    quantized = [n for n, t in held._params.items() if getattr(t, "dtype", None) == dtype]
    assert len(quantized) == len([n for n in base_linears(cfg) if not n.endswith("feed_forward.gate.weight")])
    for n in quantized:
        for got, want in zip(_packed(held.p(n)), _packed(whole.p(n))):
            np.testing.assert_array_equal(got, want, err_msg=n)
    if width != 12 and source != "random init":
        assert held_peak < 0.6 * wide_peak, (held_peak, wide_peak)


def test_f16_base_narrows_the_experts_and_trains_only_the_adapters(ctx, engine):
    if not ctx.has_f16:
        pytest.skip(f"{ctx.name} has no shader-f16")
    cfg = Lfm2MoeConfig.preset("tiny-moe")
    hf = moe_hf_model(cfg, seed=17)
    ours = ours_from_hf(hf, cfg, ctx, engine)
    params = ours.add_lora(LoraConfig(r=4, alpha=8, target_modules=(), target_parameters=EXPERTS), base_dtype="f16")
    named = ours.named_parameters()
    narrowed = base_linears(cfg)
    assert {n for n, t in named.items() if t.dtype == "f16"} == set(narrowed)
    assert [n for n in narrowed if n.endswith(EXPERTS)] and not [n for n in narrowed if ".conv.conv." in n]
    assert all(t.dtype == "f32" for t in params)
    # the reference: PEFT on the base rounded to f16 as ours was (held in float64)
    rounded = copy.deepcopy(hf)
    with torch.no_grad():
        for n in narrowed:
            rounded.get_parameter(n).copy_(rounded.get_parameter(n).half().float())
    theirs = peft_model(rounded, 4, 8, EXPERTS, seed=2)
    state = {n.replace(".default", ""): p.detach().numpy() for n, p in theirs.named_parameters() if "lora_" in n}
    for a, b in parameter_peft_names(ours.lora.by_parameter).values():
        for name, array in zip((a, b), experts_from_peft(state[a], state[b], cfg.num_experts)):
            ours.lora.named[name].write(array)
    # on the matrix units a product with the f16 base stages its f32 input as f16 (test_lora.py's bounds)
    matrix = bool(engine.target.matrix_configs)
    ids, targets, mask = assert_like_peft(ours, theirs, params, 27, 3, 3e-3 if matrix else 1e-4,
                                          1e-3 if matrix else 1e-5, 2e-2 if matrix else 1e-3)
    with pytest.raises(ValueError, match="frozen f16 base weight"):
        loss_and_grads(ours, ids, targets, mask, params + [named[narrowed[-1]]])
    for n in narrowed:                      # frozen: no gradient
        assert named[n].grad is None or not np.any(named[n].grad.numpy()), n


@pytest.mark.parametrize("dtype", ["nf4", "int8"])
def test_a_quantized_base_packs_the_experts_and_equals_peft_on_the_dequantized_weights(ctx, engine, dtype):
    """base_dtype nf4/int8 on an MoE model: the experts (3-D) and the decoder linears held packed and
    decoded in the GEMMs, the routers f32; logits, loss and adapter gradients equal PEFT's on a base
    holding the dequantized weights; merging gives a plain f32 model with the same logits."""
    from lfm2jit.model.lora_attach import is_router
    from lfm2jit.model.quantized_base import QuantizedWeight
    cfg = Lfm2MoeConfig.preset("tiny-moe")
    hf = moe_hf_model(cfg, seed=23)
    ours = ours_from_hf(hf, cfg, ctx, engine)
    params = ours.add_lora(LoraConfig(r=4, alpha=8, target_modules=("q_proj", "w1"), target_parameters=EXPERTS),
                           base_dtype=dtype)
    named = ours.named_parameters()
    held = [n for n in base_linears(cfg) if not is_router(n)]
    assert [n for n in held if n.endswith(EXPERTS)] and all(isinstance(named[n], QuantizedWeight) for n in held)
    routers = [n for n in base_linears(cfg) if is_router(n)]
    assert routers and all(named[n].dtype == "f32" for n in routers)
    experts = [n for n in held if n.endswith(EXPERTS)]
    assert sum(named[n].nbytes for n in experts) < sum(named[n].numpy().size for n in experts) * 4 / 3.5
    dequantized = copy.deepcopy(hf)
    with torch.no_grad():
        for n in held:
            dequantized.get_parameter(n).copy_(torch.from_numpy(named[n].numpy()))
    theirs = peft_model(dequantized, 4, 8, EXPERTS, ("q_proj", "w1"), seed=4)
    state = {n.replace(".default", ""): p.detach().numpy() for n, p in theirs.named_parameters() if "lora_" in n}
    for n, t in ours.lora.named.items():
        if n in state and t.shape == state[n].shape:
            t.write(state[n])
    for a, b in parameter_peft_names(ours.lora.by_parameter).values():
        for name, array in zip((a, b), experts_from_peft(state[a], state[b], cfg.num_experts)):
            ours.lora.named[name].write(array)
    ids, targets, mask = assert_like_peft(ours, theirs, params, 27, 3, 1e-4, 1e-5, 1e-3)
    with pytest.raises(ValueError, match=f"frozen {dtype} base weight"):
        loss_and_grads(ours, ids, targets, mask, params + [named[experts[0]]])
    before = ours.logits(ids, bucket=BUCKET)
    ours.merge_lora()
    assert ours.base_dtype == "f32" and all(ours.p(n).dtype == "f32" for n in held)
    assert rel_err(ours.logits(ids, bucket=BUCKET), before) < 1e-4


@pytest.mark.parametrize("make,match", [
    (lambda: LoraConfig(target_modules=(), target_parameters=("experts.up_proj",)), "matches no expert tensor.*gate_up_proj"),
    (lambda: LoraConfig(target_modules=(), target_parameters=("q_proj.weight",)), "target_modules instead"),
    (lambda: LoraConfig(target_parameters=EXPERTS, dropout=0.1), "dropout"),
    (lambda: LoraConfig(target_modules=()), "would target nothing"),
])
def test_bad_expert_targets_are_named(ctx, engine, make, match):
    with pytest.raises(AdapterError, match=match):
        make().parameters(Lfm2MoeConfig.preset("tiny-moe"))


def test_expert_targets_on_a_dense_model_are_refused():
    dense = Lfm2Config(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
                       num_key_value_heads=1, layer_types=["conv", "full_attention"])
    with pytest.raises(AdapterError, match="no expert tensors"):
        LoraConfig(target_modules=(), target_parameters=EXPERTS).parameters(dense)


def test_an_adapter_for_other_experts_is_refused_before_any_change(ctx, engine, tmp_path):
    """PEFT's adapter for 4 experts on a model of 8: the shapes named, no adapter attached."""
    cfg = Lfm2MoeConfig.preset("tiny-moe")
    peft_model(moe_hf_model(cfg, seed=1), 2, 4, seed=1).save_pretrained(tmp_path)
    wider = dataclasses.replace(cfg, num_experts=8)
    model = Lfm2Model(wider, ctx, engine, seed=0)
    with pytest.raises(AdapterError, match=r"experts\.base_layer\.lora_A\.weight has shape \[8, 64\], this model needs \[16, 64\]"):
        model.load_adapter(tmp_path)
    assert model.lora is None and model.lora_parameters() == []
