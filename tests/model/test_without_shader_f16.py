"""An adapter without the shader-f16 feature (tests/no_f16.py requests the test adapter's device
without it): f16 activations, an f16 LoRA base and f16 kernels are refused with one line naming
what was asked for, the adapter and the missing feature, before any GPU work (not run in f32:
each was asked for to halve memory); an f16 checkpoint still loads, widened to f32, and runs."""
from __future__ import annotations

import numpy as np
import pytest

from lfm2jit import ComputeEngine
from lfm2jit.model import Lfm2Model, LoraConfig
from micro_model import micro
from no_f16 import context_without_f16


@pytest.fixture(scope="module")
def no_f16():
    ctx, calls = context_without_f16()
    assert not ctx.has_f16 and "shader-f16" not in ctx.features
    return ctx, ComputeEngine(ctx), calls


def refused(calls, fn, *args, allowed=(), **kwargs) -> str:
    """The one-line ValueError ``fn`` raises, checked to come before any GPU work (but the kinds
    in ``allowed``)."""
    before = {k: v for k, v in calls.items() if k not in allowed}
    with pytest.raises(ValueError) as e:
        fn(*args, **kwargs)
    after = {k: v for k, v in calls.items() if k not in allowed}
    assert after == before, f"GPU work before the refusal: {after} after {before}"
    message = str(e.value)
    assert "\n" not in message and "shader-f16" in message, message
    return message


def test_f16_activations_are_refused_before_any_gpu_work(no_f16):
    ctx, engine, calls = no_f16
    msg = refused(calls, Lfm2Model, micro(), ctx, engine, activation_dtype="f16")
    assert msg == (f"f16 activations need the shader-f16 feature, which adapter {ctx.name!r} lacks; use f32")


def test_f16_checkpoints_load_widened_and_f16_activations_from_them_are_refused(no_f16, ctx, engine, tmp_path):
    """A checkpoint stored as f16 loads on the adapter without shader-f16 (widened to f32 as it is
    read) and gives the logits it gives on the full device; asking for f16 activations while
    loading it is refused before the checkpoint is read (the directory below has none)."""
    small, small_engine, calls = no_f16
    Lfm2Model(micro(), ctx, engine, seed=5).save_pretrained(tmp_path / "m", dtype="f16")
    ids = np.array([3, 9, 1, 40, 7, 22, 5])
    want = Lfm2Model.from_pretrained(tmp_path / "m", ctx, engine).logits(ids)
    model = Lfm2Model.from_pretrained(tmp_path / "m", small, small_engine)
    assert {t.dtype for t in model.parameters()} == {"f32"}
    np.testing.assert_array_equal(model.logits(ids), want)
    assert calls["create_shader_module"] > 0          # it did run on the device without shader-f16
    msg = refused(calls, Lfm2Model.from_pretrained, tmp_path / "no-such-model", small, small_engine, "f16")
    assert f"which adapter {small.name!r} lacks" in msg


def test_an_f16_lora_base_is_refused_and_the_model_is_left_as_it_was(no_f16, tmp_path):
    ctx, engine, calls = no_f16
    model = Lfm2Model(micro(), ctx, engine, seed=1)
    params = model.named_parameters()
    msg = refused(calls, model.add_lora, LoraConfig(r=2), base_dtype="f16")
    assert msg == (f"base_dtype='f16' (f16 base weights) needs the shader-f16 feature, which adapter {ctx.name!r} "
                   "lacks; use base_dtype='f32'")
    assert model.lora is None and model.named_parameters() == params
    assert {t.dtype for t in params.values()} == {"f32"}
    # load_adapter refuses before it reads the directory (there is none here)
    assert refused(calls, model.load_adapter, tmp_path / "no-such-adapter", base_dtype="f16") == msg
    assert model.lora is None
    model.add_lora(LoraConfig(r=2), base_dtype="f32")         # f32 bases need nothing
    assert len(model.lora_parameters()) > 0


def test_engine_run_with_f16_tensors_is_refused_before_any_gpu_work(no_f16):
    """engine.run(f16=...) or f16 tensors make a kernel that stores f16 values (WGSL `enable f16;`):
    refused in one line naming them, before a buffer, shader or dispatch is made (the recorder
    refuses such a shader too, for kernels built some other way); f32 runs as usual."""
    ctx, engine, calls = no_f16
    x = np.arange(12, dtype=np.float32).reshape(3, 4)
    x16 = engine.tensor(x, "f16")            # storing f16 bytes needs no feature; computing on them does
    msg = refused(calls, engine.run, "scale", x=x16, alpha=2.0, f16={"x", "y"})
    assert msg == (f"scale: x, y stored as f16 need the shader-f16 feature that adapter {ctx.name!r} lacks; "
                   "pass f32 tensors (no f16=)")
    np.testing.assert_array_equal(engine.run("scale", x=engine.tensor(x), alpha=2.0)["y"].numpy(), 2 * x)
