"""The one exception type for everything wrong with a kernel source: syntax, names, shapes, dtypes."""
from __future__ import annotations

_WIDTH = 100   # longest source excerpt shown under the message


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
        # Lines are counted as the lexer counts them: only "\n" ends a line (str.splitlines would also
        # split at \r, \f, \v, \x1c.. and show the wrong line). Every character shows as one: white
        # space (tab, \r, \f) as a blank and other unprintable ones as U+FFFD, so the caret stays
        # under the column and an offending control character is visible.
        lines = self.source.split("\n") if self.source else []
        if 1 <= self.line <= len(lines):
            text = "".join(c if c.isprintable() else " " if c.isspace() else "\ufffd"
                           for c in lines[self.line - 1]).rstrip()
            caret = max(self.column - 1, 0)
            if len(text) > _WIDTH:  # show a window of a very long line around the column
                start = max(0, min(caret - _WIDTH // 2, len(text) - _WIDTH))
                head = "..." if start else ""
                text = head + text[start:start + _WIDTH] + ("..." if start + _WIDTH < len(text) else "")
                caret += len(head) - start
            parts.append("    " + text)
            parts.append("    " + " " * caret + "^")
        if self.expected:
            parts.append(f"expected: {self.expected}")
        return "\n".join(parts)
