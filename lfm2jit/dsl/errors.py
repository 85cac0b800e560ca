"""The one exception type for everything wrong with a kernel source: syntax, names, shapes, dtypes."""
from __future__ import annotations


class DslError(Exception):
    """A located error in a DSL source.

    Prints as ``file:line:col: message``, then the offending source line with a caret under the
    column, then what was expected, so a user can fix the source without reading the compiler.
    """

    def __init__(self, message: str, *, filename: str = "<source>", line: int = 0, column: int = 0,
                 source: str | None = None, expected: str | None = None):
        self.message = message
        self.filename = filename
        self.line = line
        self.column = column
        self.source = source
        self.expected = expected
        super().__init__(self._format())

    def _format(self) -> str:
        head = f"{self.filename}:{self.line}:{self.column}: {self.message}"
        parts = [head]
        lines = self.source.splitlines() if self.source else []
        if 1 <= self.line <= len(lines):
            text = lines[self.line - 1].expandtabs(1)
            parts.append("    " + text)
            parts.append("    " + " " * max(self.column - 1, 0) + "^")
        if self.expected:
            parts.append(f"expected: {self.expected}")
        return "\n".join(parts)
