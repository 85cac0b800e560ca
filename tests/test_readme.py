"""The README's Python examples run as written (on this machine's adapter, in a scratch directory),
so the documentation keeps matching the code. A block that uses a name an earlier block defines is
run after it, whatever its place in the text."""
from __future__ import annotations

import os
import re
from pathlib import Path

README = Path(__file__).resolve().parents[1] / "README.md"


def python_blocks() -> list[str]:
    return re.findall(r"^```python\n(.*?)^```", README.read_text(), re.S | re.M)


def test_readme_python_examples_run(tmp_path, capsys):
    blocks = python_blocks()
    assert len(blocks) >= 6
    namespace: dict = {}
    pending = list(enumerate(blocks))
    cwd = os.getcwd()
    os.chdir(tmp_path)
    try:
        while pending:
            waiting = []
            for i, code in pending:
                try:
                    exec(compile(code, f"README.md python block {i + 1}", "exec"), namespace)
                except NameError:
                    waiting.append((i, code))
            assert len(waiting) < len(pending), f"blocks {[i + 1 for i, _ in waiting]} use names no block defines"
            pending = waiting
    finally:
        os.chdir(cwd)
    out = capsys.readouterr().out
    assert "backward of rmsnorm: kernel rmsnorm_bwd_d_x" in out and "6.5" in out
    assert "bad.lk:2:13: unknown name 'q'" in out
