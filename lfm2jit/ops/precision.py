"""Mixed precision: which tensors a call with f16 activations stores as f16.

In f16 mode activations and their gradients are stored as f16, while parameters, parameter
gradients, optimizer state and per-row statistics stay f32, and every kernel computes in f32
(loads widen, stores narrow). A call's dtypes follow the tensors it is given, so the call sites
stay the same as in f32 mode: an input stays f32 when the tensor passed is f32, an output when
``out=`` gives an f32 tensor or it is a statistic in ``STATISTICS``; every other float tensor is
stored as f16. The engine runs the variant they make (``engine.run(..., f16=names)``).
"""
from __future__ import annotations

from . import library
from ..driver import Kernel
from ..runtime.tensor import Tensor

ACTIVATION_DTYPES = ("f32", "f16")
STATISTICS = frozenset({"inv", "lse"})   # rmsnorm's 1/rms and attention's log-sum-exp: small, reused by backward


def check_activation_dtype(dtype: str, ctx) -> str:
    """``dtype`` if the adapter can run it; a clear error before any GPU work otherwise."""
    if dtype not in ACTIVATION_DTYPES:
        raise ValueError(f"activation dtype must be one of {', '.join(ACTIVATION_DTYPES)}, got {dtype!r}")
    if dtype == "f16" and not ctx.has_f16:
        raise ValueError(f"f16 activations need the shader-f16 feature, which adapter {ctx.name!r} lacks; "
                         "use f32")
    return dtype


def f16_tensors(kernel: Kernel, dtype: str, args: dict, out: dict | None = None) -> frozenset[str]:
    """The tensors of ``kernel`` that a call with these arguments stores as f16 when activations are
    ``dtype``. With f32 activations only the f16 tensors given (a frozen base weight kept as f16)."""
    if dtype == "f32":
        given = {n for n, t in {**args, **(out or {})}.items() if isinstance(t, Tensor) and t.dtype == "f16"}
        return frozenset(given) & kernel.tensor_names
    keep = {n for n, t in args.items() if isinstance(t, Tensor) and t.dtype == "f32"}
    keep |= {n for n, t in (out or {}).items() if t.dtype == "f32"}
    return kernel.tensor_names - keep - STATISTICS


def run(engine, kernel: Kernel | str, dtype: str, *, out: dict | None = None, **args) -> dict[str, Tensor]:
    """``engine.run`` of ``kernel`` (or the shipped kernel of that name) with the tensors this call
    stores as f16 when activations are ``dtype``."""
    kernel = library.get(kernel) if isinstance(kernel, str) else kernel
    return engine.run(kernel, out=out, f16=f16_tensors(kernel, dtype, args, out), **args)
