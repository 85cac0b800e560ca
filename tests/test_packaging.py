"""The wheel is self-contained: templates, kernel sources and grammar ship inside it, and a kernel
renders from an install that cannot see the checkout."""
from __future__ import annotations

import os
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGE_DATA = ["lfm2jit/templates/pointwise.wgsl.j2", "lfm2jit/templates/rowreduce.wgsl.j2",
                "lfm2jit/templates/_common.wgsl.j2", "lfm2jit/dsl/grammar.lark"]


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("wheel")
    r = subprocess.run([sys.executable, "-m", "pip", "wheel", str(ROOT), "--no-deps", "-q", "-w", str(out)],
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout + r.stderr
    (whl,) = out.glob("lfm2jit-*.whl")
    return whl


def test_wheel_ships_templates_kernels_and_grammar(wheel):
    names = set(zipfile.ZipFile(wheel).namelist())
    missing = [n for n in PACKAGE_DATA if n not in names]
    assert not missing, f"not in the wheel: {missing}"
    kernels = {p.relative_to(ROOT).as_posix() for p in (ROOT / "lfm2jit" / "ops" / "kernels").glob("*.lk")}
    assert kernels, "no kernel sources in the checkout"
    assert not kernels - names, f"kernel sources missing from the wheel: {sorted(kernels - names)}"


def test_wheel_ships_every_module_of_the_checkout(wheel):
    """pyproject lists packages explicitly; a new subpackage left off that list fails here."""
    names = set(zipfile.ZipFile(wheel).namelist())
    modules = {p.relative_to(ROOT).as_posix() for p in (ROOT / "lfm2jit").rglob("*.py")}
    missing = sorted(modules - names)
    assert not missing, f"modules missing from the wheel (add their package to pyproject.toml): {missing}"


def test_installed_wheel_renders_a_kernel_without_the_checkout(wheel, tmp_path):
    target = tmp_path / "site"
    r = subprocess.run([sys.executable, "-m", "pip", "install", "--no-deps", "-q", "--target", str(target),
                        str(wheel)], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout + r.stderr
    code = ("import lfm2jit, lfm2jit.ops.library as lib; "
            "print(lfm2jit.__file__); print(lib.get('rmsnorm').wgsl({'T': 8, 'D': 16}, 8))")
    env = {k: v for k, v in os.environ.items() if not k.startswith("PYTHON")} | {"PYTHONPATH": str(target)}
    r = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, env=env, capture_output=True, text=True,
                       timeout=120)
    assert r.returncode == 0, r.stderr
    origin, wgsl = r.stdout.split("\n", 1)
    assert Path(origin).is_relative_to(target), f"imported lfm2jit from {origin}, not the installed wheel"
    assert "@compute" in wgsl and "const D: u32 = 16u;" in wgsl
