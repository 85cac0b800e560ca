"""``UsageError``: bad flags or input, which every command reports as one line with exit status 2."""
from __future__ import annotations

import sys

class UsageError(Exception):
    """Bad flags or inputs: reported as one line, exit status 2."""


def report(error: Exception) -> int:
    """Print ``error`` as one line on stderr; the exit status that goes with a usage error."""
    print(f"error: {error}", file=sys.stderr)
    return 2
