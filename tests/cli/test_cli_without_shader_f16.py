"""`python -m trainer` on an adapter without the shader-f16 feature (in-process, WgpuContext.create
patched to give tests/no_f16.py's context): --f16 and --lora-f16-base end in one error line naming
the flag, the adapter and the missing feature, exit status 2, before any GPU work; the same run
without them trains."""
from __future__ import annotations

import pytest

from lfm2jit import WgpuContext
from no_f16 import context_without_f16
from trainer.cli import main
from trainer.cli.usage import UsageError
from trainer.open_model import load_model

RUN = ["--preset", "tiny", "--steps", "1", "--grad-accum", "1", "--eval-fraction", "0",
       "--no-progress"]


@pytest.fixture
def no_f16(monkeypatch):
    ctx, calls = context_without_f16()
    monkeypatch.setattr(WgpuContext, "create", classmethod(lambda cls, *a, **k: ctx))
    return ctx, calls


@pytest.mark.parametrize("flags,asked,advice", [
    (["--f16"], "--f16 (f16 activations)", "train without --f16"),
    (["--lora-r", "2", "--lora-f16-base"], "--lora-f16-base (f16 base weights)", "train without --lora-f16-base"),
])
def test_f16_flags_are_one_error_line_before_any_gpu_work(no_f16, tmp_path, capsys, flags, asked, advice):
    ctx, calls = no_f16
    assert main([*RUN, *flags, "--out", str(tmp_path / "run")]) == 2
    err = capsys.readouterr().err
    assert err.splitlines() == [f"error: {asked}: adapter {ctx.name!r} lacks the shader-f16 feature; {advice}"]
    assert not calls, f"GPU work before the refusal: {dict(calls)}"


def test_the_same_run_without_f16_flags_trains(no_f16, tmp_path, capsys):
    ctx, calls = no_f16
    assert main([*RUN, "--lora-r", "2", "--out", str(tmp_path / "run")]) == 0, capsys.readouterr().err
    assert calls["submit"] > 0 and (tmp_path / "run" / "metrics.jsonl").is_file()


def test_generate_f16_is_refused_before_the_model_is_read(no_f16, tmp_path):
    """``generate --f16`` (trainer/open_model.py): the directory is not read (there is none here)."""
    ctx, calls = no_f16
    with pytest.raises(UsageError) as e:
        load_model(tmp_path / "no-such-model", None, f16=True)
    assert str(e.value) == f"--f16 (f16 activations): adapter {ctx.name!r} lacks the shader-f16 feature; run without --f16"
    assert not calls
