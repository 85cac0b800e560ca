"""The kernel tests run with WebGPU's default limits (tests/default_limits.py)."""
from default_limits import ctx, engine  # noqa: F401 - fixtures, found by name
