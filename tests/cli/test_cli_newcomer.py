"""Issue 45, small things a newcomer tripped on: one meaning per flag (--gpu is the GPU, --adapter a
LoRA directory), no empty eval.jsonl, and weights written with the same mode as every other file."""
from __future__ import annotations

import json
import os
import stat

import pytest

from lfm2jit import ComputeEngine
from lfm2jit.model import Lfm2Config, Lfm2Model, LoraConfig
from lfm2jit.model.config import PRESETS
from trainer.cli import main
from trainer.cli.options import build_parser
from trainer.cli.resolve import _with_saved

TINY = ["--preset", "tiny", "--grad-accum", "1", "--eval-max", "2", "--eval-answers", "0", "--no-progress"]


def test_train_takes_gpu_and_refuses_adapter_for_it(tmp_path, capsys):
    rc = main([*TINY, "--steps", "1", "--adapter", "llvmpipe", "--out", str(tmp_path / "a")])
    err = capsys.readouterr().err
    assert rc == 2 and err.count("\n") == 1 and "--gpu" in err and "Traceback" not in err, err
    assert not (tmp_path / "a").exists()
    out = tmp_path / "g"
    rc = main([*TINY, "--steps", "1", "--gpu", "llvmpipe", "--out", str(out)])
    assert rc == 0, capsys.readouterr().err
    settings = json.loads((out / "run.json").read_text())
    assert settings["gpu"] == "llvmpipe" and "adapter" not in settings
    assert settings["packing"] == "pad"         # --packing auto (the default), resolved for a CPU adapter
    assert os.environ.get("LFM2JIT_ADAPTER") == "llvmpipe"
    os.environ.pop("LFM2JIT_ADAPTER")


def test_every_command_spells_the_gpu_flag_gpu():
    from trainer.cli import eval as eval_cmd
    from trainer.cli import generate
    for parser in (build_parser(), generate.build_parser(), eval_cmd.build_parser()):
        assert "--gpu" in parser.format_help()
    assert "--gpu SUBSTRING" in build_parser().format_help()


def test_older_saved_settings_with_adapter_load_as_gpu():
    g = _with_saved({}, {"adapter": "llvmpipe", "seed": 3}, None, [])
    assert g["gpu"] == "llvmpipe" and "adapter" not in g and g["seed"] == 3
    g = _with_saved({"gpu": "other"}, {"adapter": "llvmpipe"}, None, [])
    assert g["gpu"] == "other" and "adapter" not in g


def test_no_eval_jsonl_without_eval_every(tmp_path, capsys):
    out = tmp_path / "o"
    assert main([*TINY, "--steps", "1", "--out", str(out)]) == 0, capsys.readouterr().err
    assert (out / "metrics.jsonl").is_file() and not (out / "eval.jsonl").exists()


@pytest.mark.parametrize("umask", [0o022, 0o077])
def test_weights_get_the_mode_of_the_other_files(tmp_path, ctx, umask):
    """safetensors' writer makes its file 0600; the weights get 0666 less the umask, as config.json."""
    old = os.umask(umask)
    try:
        model = Lfm2Model(Lfm2Config(**PRESETS["tiny"]), ctx, ComputeEngine(ctx), seed=0)
        model.save_pretrained(tmp_path / "m")
        model.add_lora(LoraConfig(r=2, alpha=4.0))
        model.save_adapter(tmp_path / "a")
    finally:
        os.umask(old)
    want = 0o666 & ~umask
    for f in [tmp_path / "m" / "model.safetensors", tmp_path / "m" / "config.json",
              tmp_path / "a" / "adapter_model.safetensors", tmp_path / "a" / "adapter_config.json"]:
        assert stat.S_IMODE(f.stat().st_mode) == want, (f.name, oct(f.stat().st_mode))


@pytest.mark.parametrize("command", [[], ["generate", "--prompt", "hi"], ["eval"]])
@pytest.mark.parametrize("variable,value", [("LFM2JIT_LIMITS", "lowest"), ("LFM2JIT_MATRIX_UNITS", "yes"),
                                            ("LFM2JIT_ADAPTER_INDEX", "-1")])
def test_a_bad_environment_variable_is_one_line_before_anything_runs(tmp_path, capsys, monkeypatch, command,
                                                                      variable, value):
    from lfm2jit.cli import main as lfm2jit_main
    monkeypatch.setenv(variable, value)
    out = tmp_path / "run"
    assert main([*command, "--out", str(out)] if not command else command) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("python -m trainer: error: ") and "\n" not in err and f"{variable}={value!r}" in err
    assert not out.exists()
    assert lfm2jit_main(["info"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("python -m lfm2jit info: error: ") and "\n" not in err and f"{variable}={value!r}" in err


def test_a_slow_device_s_rate_is_not_printed_as_zero():
    from trainer.cli.summary import per_second
    assert [per_second(r) for r in (0.2807, 9.87, 10.2, 15234.5, None)] == ["0.28", "9.9", "10", "15234", "-"]
