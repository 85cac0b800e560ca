"""Kernels on a frozen quantized weight: any kernel with a weight parameter ``w: f32[N, K]`` (or an
experts' ``w: f32[E, N, K]``) gets a variant in which ``w`` is a statement decoding it from a packed
format, written in the kernel language (lfm2jit/model/quantize.py states the formats). A contraction
or grouped GEMM reading the decoded weight computes it in the GEMM's operand fetch (ir/partition.py's
prologue), so the f32 weight never exists in memory; gradients are grad() of the variant, decoding
the same way.

The packed tensors of weight ``w`` are ``w_q`` (u32 words of codes, the weight's elements in
row-major order) and ``w_s`` (f32: NF4's block absmaxes, int8's scales per row of the last axis),
and for NF4 ``w_c``, the 16-entry codebook.
"""
from __future__ import annotations

from dataclasses import replace

from ..driver import Backward, Kernel, compile_source, grad
from ..dsl import ast
from . import library

FORMATS = ("nf4", "int8")

# Each format's parameters and decoding statements, for weight {w} over axes [{rows}, {k}]; {flat}
# is an element's row-major position.
_PARAMS = {
    "nf4": "{w}_q: u32[{w}_P], {w}_s: f32[{w}_B], {w}_c: f32[{w}_C]",
    "int8": "{w}_q: u32[{w}_P], {w}_s: f32[{rows}]",
}
_DECODE = {
    "nf4": """
    {w}_i = {flat}
    {w}_n = (gather({w}_q, {w}_i >> 3) >> (({w}_i & 6) * 4 + 4 - ({w}_i & 1) * 4)) & 15
    {w} = gather({w}_c, {w}_n) * gather({w}_s, {w}_i >> 6)""",
    "int8": """
    {w}_i = {flat}
    {w}_b = (gather({w}_q, {w}_i >> 2) >> (({w}_i & 3) * 8)) & 255
    {w} = (f32({w}_b) - 256 * f32({w}_b > 127)) * {w}_s""",
}

_CACHE: dict[tuple, Kernel] = {}


def decoded(kernel: Kernel | str, weight: str, fmt: str) -> Kernel:
    """``kernel`` (a shipped kernel's name, a compiled kernel, or a Backward of one) with its 2-D or
    3-D f32 input ``weight`` decoded from ``fmt``; for a Backward, grad() of the decoded forward with the
    same gradients and cotangents."""
    if fmt not in FORMATS:
        raise ValueError(f"quantized format must be one of {', '.join(FORMATS)}, got {fmt!r}")
    kernel = library.get(kernel) if isinstance(kernel, str) else kernel
    if isinstance(kernel, Backward):
        fwd = kernel.forward
        outputs = {t.name for t in fwd.ir.outputs}
        wrt = [t.name[2:] for t in kernel.ir.outputs]
        cot = [t.name[2:] for t in kernel.ir.inputs if t.name.startswith("d_") and t.name[2:] in outputs]
        key = ("bwd", id(fwd), weight, fmt, tuple(wrt), tuple(cot))
        if key not in _CACHE:
            _CACHE[key] = grad(decoded(fwd, weight, fmt), wrt, cot)
        return _CACHE[key]
    key = (id(kernel), weight, fmt)
    if key not in _CACHE:
        _CACHE[key] = _decoded(kernel, weight, fmt)
    return _CACHE[key]


def unpacked(kernel, args: dict) -> tuple:
    """``kernel`` and its arguments with each packed weight (an argument whose ``dtype`` is one of
    FORMATS and whose ``args(name)`` gives its packed tensors, as model/quantized_base.py's
    QuantizedWeight) passed as those tensors, to the kernel's variant decoding it; the weight's
    axis sizes join ``dims`` (the packed tensors do not carry them)."""
    args = dict(args)
    for name, value in list(args.items()):
        if getattr(value, "dtype", None) in FORMATS and hasattr(value, "args"):
            axes = weight_axes(kernel, name)
            kernel = decoded(kernel, name, value.dtype)
            del args[name]
            args.update(value.args(name))
            args["dims"] = {**args.get("dims", {}), **dict(zip(axes, value.shape))}
    return kernel, args


def weight_axes(kernel: Kernel | str, weight: str) -> tuple[str, ...]:
    """The axes ([E,] N, K) of ``kernel``'s weight parameter (a Backward's: its forward's): a decoded
    weight's packed tensors do not carry them, so a call passes their sizes."""
    kernel = library.get(kernel) if isinstance(kernel, str) else kernel
    kdef = (kernel.forward if isinstance(kernel, Backward) else kernel).ast
    param = next((p for p in (kdef.inputs if kdef else ()) if p.name == weight), None)
    if param is None or len(param.type.dims) not in (2, 3):
        raise ValueError(f"{kernel.name}: no 2-D or 3-D weight parameter {weight!r}")
    return tuple(str(d) for d in param.type.dims)


def _flat_index(axes: list[str]) -> str:
    """An element's row-major position over ``axes``, as a kernel-language u32 expression."""
    expr = f"u32(index({axes[0]}))"
    for a in axes[1:]:
        expr = f"{'(' + expr + ')' if '+' in expr else expr} * size({a}) + u32(index({a}))"
    return expr


def _decoded(kernel: Kernel, weight: str, fmt: str) -> Kernel:
    kdef = kernel.ast
    if kdef is None:
        raise ValueError(f"{kernel.name}: no source to derive a quantized variant from")
    param = next((p for p in kdef.inputs if p.name == weight), None)
    if param is None or param.type.dtype != "f32" or len(param.type.dims) not in (2, 3) or param.default is not None:
        raise ValueError(f"{kernel.name}: {weight!r} is not a 2-D or 3-D f32 input without a default; only such "
                         "a weight can be quantized")
    axes = [str(d) for d in param.type.dims]
    names = dict(w=weight, rows=", ".join(axes[:-1]), k=axes[-1], flat=_flat_index(axes))
    text = ast.unparse(ast.SourceFile("", "", (replace(kdef, name=f"{kdef.name}_{weight}_{fmt}"),)))
    head, body = text.split("{\n", 1)
    declared = f"{weight}: f32[{', '.join(axes)}]"
    if head.count(declared) != 1:
        raise ValueError(f"{kernel.name}: cannot find the declaration {declared!r}")
    head = head.replace(declared, _PARAMS[fmt].format(**names))
    source = head + "{" + _DECODE[fmt].format(**names) + "\n" + body
    (out,) = list(compile_source(source, f"<{kernel.name} with {weight} in {fmt}>"))
    return out
