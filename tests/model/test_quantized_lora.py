"""LoRA on a quantized frozen base (add_lora(base_dtype="nf4"|"int8")): logits, loss and every adapter
gradient against PEFT + torch on the same dequantized weights (lfm2jit/model/quantize.py)."""
from __future__ import annotations

import copy

import numpy as np
import pytest
import torch

from numerics import rel_err
from references import masked_inputs
from lfm2jit.model import Lfm2Model, LoraConfig
from lfm2jit.model.lora import DEFAULT_TARGETS
from lfm2jit.model.quantize import dequantize_int8, dequantize_nf4, quantize_int8, quantize_nf4
from lfm2jit.model.quantized_base import QuantizedWeight
from test_lora import BUCKET, hf_base, loss_and_grads, mg, ours_from_hf, peft_model, peft_reference, share_adapters  # noqa: F401

DEQUANTIZE = {"nf4": lambda w, n: dequantize_nf4(quantize_nf4(w, n)),
              "int8": lambda w, n: dequantize_int8(quantize_int8(w, n))}


def _linears(model):
    return [n for n in model.named_parameters() if ".layers." in n and n.endswith(("proj.weight", "w1.weight",
                                                                                    "w2.weight", "w3.weight"))]


SOME = ("q_proj", "in_proj", "w1")       # the other linears (w2's SwiGLU product among them) plain


# each format once, each on one of the two models (the format's fetch does not depend on the model's shape)
@pytest.mark.parametrize("name,targets,dtype", [("untied_bias_g2_attn_first", SOME, "nf4"),
                                                ("tied_g1_attn_mid", DEFAULT_TARGETS, "int8")])
def test_lora_on_a_quantized_base_equals_peft_on_the_dequantized_weights(mg, ctx, engine, dtype, name, targets):
    hf, kwargs = hf_base(mg, name, 21)
    theirs = peft_model(hf, 4, 8, targets=targets, seed=2)
    ours = ours_from_hf(hf, ctx, engine)
    params = ours.add_lora(LoraConfig(r=4, alpha=8, target_modules=targets), base_dtype=dtype)
    assert ours.base_dtype == dtype
    share_adapters(theirs, ours)
    linears = _linears(ours)
    assert linears and all(isinstance(ours.p(n), QuantizedWeight) for n in linears)
    with torch.no_grad():                  # the reference: PEFT on the dequantized base
        for n, p in theirs.named_parameters():
            key = n.replace("base_model.model.", "").replace(".base_layer", "")
            if key in linears:
                p.copy_(torch.from_numpy(DEQUANTIZE[dtype](p.detach().numpy(), key)))
    for n in linears:                      # what the device holds decodes to exactly those weights
        assert np.array_equal(ours.p(n).numpy(), DEQUANTIZE[dtype](hf.state_dict()[n].float().numpy(), n))
    ids, targets, mask = masked_inputs(kwargs["vocab_size"], 25, 3)
    want_logits, want_loss, want_grads = peft_reference(theirs, ids, targets, mask)
    assert rel_err(ours.logits(ids, bucket=BUCKET), want_logits) < 1e-4
    loss, grads = loss_and_grads(ours, ids, targets, mask, params)
    assert abs(loss - want_loss) < 1e-5
    assert set(grads) == set(want_grads)
    assert max(rel_err(grads[n], want_grads[n]) for n in want_grads) < 1e-3
    with pytest.raises(ValueError, match=f"frozen {dtype} base weight"):
        loss_and_grads(ours, ids, targets, mask, params + [ours.p(linears[0])])


def test_a_quantized_base_is_built_as_it_is_uploaded_and_merges_into_a_plain_model(mg, ctx, engine):
    hf, kwargs = hf_base(mg, "tied_g1_attn_mid", 5)
    ours = ours_from_hf(hf, ctx, engine)
    cfg = ours.cfg
    tensors = {n: t.detach().float().numpy() for n, t in hf.state_dict().items()}
    built = Lfm2Model(cfg, ctx, engine, tensors=tensors, base_dtype="nf4")
    assert built.base_dtype == "nf4"
    linears = _linears(built)
    packed = sum(built.p(n).nbytes for n in linears)
    assert packed < sum(tensors[n].size for n in linears) * 4 / 6      # about 4.5 bits a weight, not 32
    ids = masked_inputs(kwargs["vocab_size"], 20, 1)[0]
    params = built.add_lora(LoraConfig(r=4, alpha=8))                 # None keeps the model's nf4 base
    for t in params:
        t.write(np.random.default_rng(0).standard_normal(t.shape).astype(np.float32) * 0.1)
    before = built.logits(ids, bucket=BUCKET)
    built.merge_lora()
    assert built.base_dtype == "f32" and all(built.p(n).dtype == "f32" for n in linears)
    assert rel_err(built.logits(ids, bucket=BUCKET), before) < 1e-4
    with pytest.raises(ValueError, match="base_dtype='int8': this model's base is nf4"):
        Lfm2Model(cfg, ctx, engine, tensors=tensors, base_dtype="nf4").add_lora(LoraConfig(r=2), base_dtype="int8")


def test_a_bitsandbytes_4bit_checkpoint_loads_with_its_exact_weights(mg, ctx, engine, tmp_path):
    """transformers + bitsandbytes (CPU) quantize a model to NF4 with double quantization and save it;
    from_pretrained reads it back: every quantized weight equal bit for bit to bitsandbytes'
    dequantize_4bit, held as NF4 again (the same codes and absmaxes), and logits those of the
    dequantized model."""
    import bitsandbytes.functional as bnbf
    from transformers import AutoModelForCausalLM, BitsAndBytesConfig
    hf, kwargs = hf_base(mg, "untied_bias_g2_attn_first", 9)
    hf.save_pretrained(tmp_path / "f32")
    config = BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_use_double_quant=True,
                                bnb_4bit_compute_dtype=torch.float32)
    quantized = AutoModelForCausalLM.from_pretrained(tmp_path / "f32", quantization_config=config, device_map="cpu")
    quantized.save_pretrained(tmp_path / "nf4")
    ours = Lfm2Model.from_pretrained(tmp_path / "nf4", ctx, engine, base_dtype="nf4")
    assert ours.base_dtype == "nf4"
    held = {}
    for name, module in quantized.named_modules():
        state = getattr(getattr(module, "weight", None), "quant_state", None)
        if state is not None:
            # dequantized as one row: bitsandbytes' C kernel on an AVX-512 CPU cuts blocks per row, wrong
            # where a row is not a whole number of blocks (48 here); the flat row is NF4's meaning
            flat = copy.copy(state)
            flat.shape = torch.Size([int(np.prod(state.shape))])
            held[name + ".weight"] = bnbf.dequantize_4bit(module.weight.data, flat).numpy().reshape(tuple(state.shape))
    assert sorted(held) == sorted(_linears(ours))
    for n, want in held.items():
        assert np.array_equal(ours.p(n).numpy().view(np.uint32), want.view(np.uint32)), n
    with torch.no_grad():
        for n, p in hf.named_parameters():
            if n in held:
                p.copy_(torch.from_numpy(held[n]))
    ids = masked_inputs(kwargs["vocab_size"], 21, 1)[0]
    ref = hf.double()
    ref.config._attn_implementation = "eager"
    with torch.no_grad():
        want = ref(input_ids=torch.as_tensor(ids)[None]).logits[0].numpy()
    assert rel_err(ours.logits(ids, bucket=BUCKET), want) < 1e-4
