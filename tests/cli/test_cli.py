"""`python -m lfm2jit` in subprocesses, as a user runs it: exit codes, stdout, files written."""
from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

from lfm2jit import grad, library

ROOT = Path(__file__).resolve().parents[2]


def cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "lfm2jit", *args], cwd=ROOT, capture_output=True, text=True,
                          timeout=120)


def test_list_shows_every_shipped_kernel_with_its_schedule():
    r = cli("list")
    assert r.returncode == 0, r.stderr
    for kernel in library.kernels().values():
        assert repr(kernel) in r.stdout
    assert "schedule: rowreduce" in r.stdout and "schedule: pointwise" in r.stdout


def test_dump_bakes_the_given_size_into_the_wgsl():
    r = cli("dump", "rmsnorm", "--dim", "D=97")
    assert r.returncode == 0, r.stderr
    assert "const D: u32 = 97u;" in r.stdout
    assert "const T: u32 = 1u;" in r.stdout        # T defaults to the bucket, 1
    assert "@compute" in r.stdout


def test_dump_defaults_t_to_the_bucket_and_rounds_a_given_t_up():
    r = cli("dump", "softmax", "--bucket", "64")
    assert r.returncode == 0, r.stderr
    assert "const T: u32 = 64u;" in r.stdout and "const D: u32 = 64u;" in r.stdout
    r = cli("dump", "softmax", "--bucket", "64", "--dim", "T=65")
    assert "const T: u32 = 128u;" in r.stdout


def test_dump_matches_the_library():
    r = cli("dump", "silu_mul", "--bucket", "32", "--dim", "T=5", "--dim", "F=48")
    assert r.returncode == 0, r.stderr
    assert r.stdout == library.get("silu_mul").wgsl({"T": 5, "F": 48}, 32)


def test_dump_ir_prints_the_ir_as_wgsl_comments():
    r = cli("dump", "rmsnorm", "--ir")
    assert r.returncode == 0, r.stderr
    ir = library.get("rmsnorm").format_ir()
    assert all(f"// {line}" in r.stdout for line in ir.splitlines())
    assert "@compute" in r.stdout


def test_dump_out_writes_name_wgsl(tmp_path):
    out = tmp_path / "kernels"
    r = cli("dump", "add", "--dim", "D=33", "--out", str(out))
    assert r.returncode == 0, r.stderr
    text = (out / "add.wgsl").read_text()
    assert "const D: u32 = 33u;" in text and "@compute" in text
    assert "@compute" not in r.stdout


def test_unknown_kernel_exits_2_listing_the_available_ones():
    r = cli("dump", "no_such_kernel")
    assert r.returncode == 2
    assert "no_such_kernel" in r.stderr
    for name in library.kernels():
        assert name in r.stderr


@pytest.mark.parametrize("bad", ["D", "D=", "D=x", "D=0", "=5", "D=-3"])
def test_bad_dim_exits_2_naming_the_value(bad):
    r = cli("dump", "add", "--dim", bad)
    assert r.returncode == 2
    assert repr(bad) in r.stderr


def test_dim_for_an_axis_the_kernel_lacks_exits_2():
    r = cli("dump", "add", "--dim", "Q=3")
    assert r.returncode == 2
    assert "Q" in r.stderr and "T, D" in r.stderr


def test_dump_backward_prints_every_backward_kernel():
    out = cli("dump", "rmsnorm", "--backward", "--dim", "D=33", "--bucket", "16")
    assert out.returncode == 0, out.stderr
    assert "kernel rmsnorm_bwd_d_x" in out.stdout and "template rowreduce" in out.stdout
    assert "kernel rmsnorm_bwd_d_w" in out.stdout and "template colreduce" in out.stdout
    assert out.stdout.count("@compute") == 2


def test_dump_backward_of_a_kernel_without_one_is_a_clear_error():
    out = cli("dump", "sgd", "--backward")
    assert out.returncode == 2
    assert "in-place outputs" in out.stderr and "Traceback" not in out.stderr


def test_dump_backward_of_the_embedding_is_a_sort_and_a_scatter():
    """gather's adjoint in its table: bucket_sort of the ids, then segment_sum's deterministic scatter-add."""
    out = cli("dump", "embedding", "--backward", "--bucket", "8")
    assert out.returncode == 0, out.stderr
    assert "template bucket_sort" in out.stdout and "template embedding_grad" in out.stdout


NOT_DIFFERENTIABLE = {"in place", "has no gradient rule"}
# dump plans for WebGPU's default limits: attention_decode's backward fuses a column reduction over
# 10 tensors, more than the default 8 storage buffers a kernel may bind (decoding needs no backward);
# attention_segments' dk/dv kernel binds 9 (q, k, v, o, lse, dO, starts, dk, dv)
OVER_THE_LIMITS = {"attention_decode", "attention_segments"}


def test_dump_backward_of_every_shipped_kernel(capsys):
    """Every differentiable shipped kernel dumps its backward WGSL (one shader per part); the others
    (in-place optimizer kernels) say why, never with a traceback."""
    from lfm2jit.cli import main
    dumped = 0
    for kernel in library.kernels().values():
        status = main(["dump", kernel.name, "--backward", "--bucket", "8"])
        out, err = capsys.readouterr()
        if status == 0:
            assert out.count("@compute") >= len(grad(kernel, cotangents=[kernel.outputs[0]]).kernels), kernel.name
            dumped += 1
        elif kernel.name in OVER_THE_LIMITS:
            assert status == 2 and "the device allows 8 (max-storage-buffers-per-shader-stage)" in err, err
            assert "Traceback" not in err
        else:
            assert status == 2 and any(reason in err for reason in NOT_DIFFERENTIABLE), (kernel.name, err)
    assert dumped >= 20


def test_info_is_quiet_without_a_runtime_dir():
    """`info` sets the runtime directory before listing adapters and lists them with native stderr
    quieted, as the context does: no lavapipe "XDG_RUNTIME_DIR is invalid", no Dawn warning."""
    import os
    env = {k: v for k, v in os.environ.items() if k != "XDG_RUNTIME_DIR"}
    r = subprocess.run([sys.executable, "-m", "lfm2jit", "info"], cwd=ROOT, capture_output=True, text=True,
                       timeout=120, env=env)
    assert r.returncode == 0, r.stderr
    assert "adapter" in r.stdout
    assert "XDG_RUNTIME_DIR" not in r.stderr and "Warning" not in r.stderr, r.stderr


INFO_LIMIT = re.compile(r"^  ((?:max|min)-[a-z-]+): (\d+)", re.MULTILINE)
# WebGPU's default limits (the spec's Limits table), written out here rather than read from the code
SPEC_DEFAULTS = {"max-storage-buffer-binding-size": 128 << 20, "max-buffer-size": 256 << 20,
                 "max-compute-workgroup-storage-size": 16384, "max-compute-invocations-per-workgroup": 256,
                 "max-storage-buffers-per-shader-stage": 8, "min-storage-buffer-offset-alignment": 256}


def _info(capsys) -> tuple[str, dict[str, int]]:
    from lfm2jit.cli import main
    assert main(["info"]) == 0
    out = capsys.readouterr().out
    return out, {k: int(v) for k, v in INFO_LIMIT.findall(out)}


def test_info_prints_the_limits_and_features_that_decide_the_schedules(ctx, capsys):
    """The device's limits as the context has them (this session's LFM2JIT_LIMITS), and a line for
    each of shader-f16, subgroups and subgroup matrices saying whether the device has it."""
    from lfm2jit.settings import settings
    out, limits = _info(capsys)
    assert set(limits) == set(SPEC_DEFAULTS), out
    assert limits == {k: ctx.limits[k] for k in SPEC_DEFAULTS}
    assert f"LFM2JIT_LIMITS={settings().limits}: " in out
    subgroups = bool({"subgroup", "subgroups"} & set(ctx.features))
    for name, has in (("shader-f16", ctx.has_f16), ("subgroups", subgroups), ("subgroup matrices",
                                                                              ctx.has_subgroup_matrix)):
        assert f"\n  {name}: {'present' if has else 'absent'}: " in out, name
    assert "  subgroup matrices: absent: f16 products take the portable SIMT path" in out or ctx.has_subgroup_matrix


def test_info_under_default_limits_prints_webgpus_defaults_and_raised_the_adapters(ctx, capsys, monkeypatch):
    monkeypatch.setenv("LFM2JIT_LIMITS", "default")
    out, limits = _info(capsys)
    assert limits == SPEC_DEFAULTS, out
    assert "LFM2JIT_LIMITS=default: " in out
    assert "max-storage-buffer-binding-size: 134217728 (128 MiB): " in out
    monkeypatch.setenv("LFM2JIT_LIMITS", "raised")
    out, limits = _info(capsys)
    assert "LFM2JIT_LIMITS=raised: " in out
    raised = [k for k in SPEC_DEFAULTS if k.startswith("max-")]      # min-...-alignment is not raised
    assert {k: limits[k] for k in raised} == {k: ctx.adapter.limits[k] for k in raised}


def test_info_on_an_adapter_without_shader_f16_says_what_is_refused(capsys, monkeypatch):
    from lfm2jit import WgpuContext
    from no_f16 import context_without_f16
    no_f16, _ = context_without_f16()
    monkeypatch.setattr(WgpuContext, "create", classmethod(lambda cls, *a, **k: no_f16))
    out, _ = _info(capsys)
    assert ("\n  shader-f16: absent: --f16, --lora-f16-base and f16 bases (add_lora(base_dtype='f16')) are refused "
            "with one error line\n") in out


USER_SOURCE = """\
kernel double(x: f32[T, D]) -> (y: f32[T, D]) {
    y = x * 2.0
}

kernel triple(x: f32[T, D]) -> (y: f32[T, D]) {
    y = x * 3.0
}
"""


def test_dump_a_users_lk_file(tmp_path):
    one = tmp_path / "one.lk"
    one.write_text(USER_SOURCE.split("\n\n")[0] + "\n")
    r = cli("dump", str(one), "--dim", "D=7")
    assert r.returncode == 0, r.stderr
    assert "const D: u32 = 7u;" in r.stdout and "@compute" in r.stdout
    two = tmp_path / "two.lk"
    two.write_text(USER_SOURCE)
    r = cli("dump", f"{two}:triple", "--dim", "D=5")
    assert r.returncode == 0, r.stderr
    assert "3.0" in r.stdout and "@compute" in r.stdout
    r = cli("dump", str(two))             # several kernels: name one
    assert r.returncode == 2 and "double" in r.stderr and "triple" in r.stderr and f"{two}:KERNEL" in r.stderr
    r = cli("dump", f"{two}:nope")
    assert r.returncode == 2 and "nope" in r.stderr and "double, triple" in r.stderr


def test_dump_a_bad_lk_file_is_a_located_error(tmp_path):
    bad = tmp_path / "bad.lk"
    bad.write_text("kernel f(x: f32[T]) -> (y: f32[T]) {\n    y = x +* 2.0\n}\n")
    r = cli("dump", str(bad))
    assert r.returncode == 2
    assert f"{bad}:2:" in r.stderr and "Traceback" not in r.stderr
    r = cli("dump", str(tmp_path / "missing.lk"))
    assert r.returncode == 2 and "missing.lk" in r.stderr and "Traceback" not in r.stderr
