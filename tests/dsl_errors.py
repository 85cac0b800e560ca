"""The check every located-DslError test makes: where it points, and how it prints."""
from __future__ import annotations

import pytest

from lfm2jit import DslError, compile_source


def printable(s: str) -> str:
    """How a source line is shown: one character per character, blanks for white space."""
    return "".join(c if c.isprintable() else " " if c.isspace() else "\ufffd" for c in s)


def assert_dsl_error(text, line, col, token, message, expected, filename="bad.lk"):
    """compile_source(text) raises DslError at (line, col), where ``token`` starts, and prints it all."""
    with pytest.raises(DslError) as info:
        compile_source(text, filename)
    err = info.value
    assert (err.line, err.column) == (line, col), str(err)
    assert err.filename == filename
    src_line = text.split("\n")[line - 1]
    assert src_line[col - 1:].startswith(token), f"{token!r} is not at {line}:{col} of {src_line!r}"
    assert message in err.message, str(err)
    assert err.expected and expected in err.expected, str(err)
    out = str(err).split("\n")
    assert out[0] == f"{filename}:{line}:{col}: {err.message}"
    shown, caret = out[1], out[2]                                  # the offending line, and a caret
    assert caret.rstrip() == caret and caret.endswith("^") and set(caret[:-1]) == {" "}
    assert shown[len(caret) - 1:].startswith(printable(token)), "the caret is not under the token"
    if len(src_line) <= 100:                                       # (a long one is shown as an excerpt)
        assert shown == "    " + printable(src_line).rstrip()
        assert caret == "    " + " " * (col - 1) + "^"
    assert out[-1] == f"expected: {err.expected}"
    return err
