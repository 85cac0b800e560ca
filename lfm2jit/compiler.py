"""The staged driver: source -> AST -> IR (checked) -> per-specialization KernelSpec -> WGSL.

Each stage is a separate call so every intermediate can be inspected or dumped.
"""
from __future__ import annotations

import functools

from .codegen.render import render
from .dsl.parser import parse
from .ir.autodiff import grad_ir
from .ir.build import build_kernel
from .ir.nodes import KernelIR, format_ir
from .ir.ops import Op
from .ir.partition import partition
from .ir.retype import retype
from .schedule import KernelSpec, specialize


class Kernel:
    """One checked kernel; specializations are made per (sizes, bucket) and memoised."""

    def __init__(self, ir: KernelIR):
        self.ir = ir
        self._specs: dict[tuple, KernelSpec] = {}
        self._variants: dict[str, Kernel] = {}

    @functools.cached_property
    def add_only_outputs(self) -> frozenset[str]:
        """Outputs only added into (scatters): they must be passed in out= and accumulated."""
        from . import intrinsics
        return frozenset(name for name, n in self.ir.results.items()
                         if n.op == Op.PROJ and intrinsics.get(n.srcs[0].arg).adds_only)

    def variant(self, storage: str, keep=frozenset()) -> "Kernel":
        """This kernel with f32 tensors stored as ``storage`` ("f16"), computing in f32; the
        tensors named in ``keep`` stay f32 (see ir/retype.py)."""
        if storage == "f32":
            return self
        if storage not in ("f16",):
            raise ValueError(f"{self.name}: storage precision must be f32 or f16, got {storage!r}")
        key = (storage, frozenset(keep))
        if all(t.name in key[1] for t in self.ir.inputs + self.ir.outputs if t.dtype == "f32"):
            return self                   # nothing left to retype
        if key not in self._variants:
            self._variants[key] = Kernel(retype(self.ir, storage, key[1]))
        return self._variants[key]

    @property
    def tensor_names(self) -> frozenset[str]:
        return frozenset(t.name for t in self.ir.inputs + self.ir.outputs)

    @property
    def name(self) -> str:
        return self.ir.name

    def __repr__(self) -> str:
        ins = ", ".join(f"{t.name}: {t.dtype}[{', '.join(t.shape)}]" for t in self.ir.inputs)
        ins += "".join(f", {s}: f32" for s in self.ir.scalars)
        outs = ", ".join(f"{t.name}: {t.dtype}[{', '.join(t.shape)}]" for t in self.ir.outputs)
        return f"kernel {self.name}({ins}) -> ({outs})"

    def specialize(self, dims: dict[str, int], bucket: int = 1,
                   accumulate: frozenset[str] = frozenset(), tiles=None) -> KernelSpec:
        """``tiles`` overrides the schedule's tile choice: a TileConfig for a matmul, an AttentionTiles
        for attention (the autotuner tries several; see schedule.specialize)."""
        # dims in the caller's order: callers pass them in a fixed order, and another order only
        # makes a second entry for the same specialization
        key = (tuple(dims.items()), bucket, frozenset(accumulate), tiles)
        spec = self._specs.get(key)
        if spec is None:
            spec = self._specs[key] = specialize(self.ir, dims, bucket, frozenset(accumulate), tiles)
        return spec

    def wgsl(self, dims: dict[str, int], bucket: int = 1, accumulate: frozenset[str] = frozenset()) -> str:
        return render(self.specialize(dims, bucket, accumulate))

    def format_ir(self) -> str:
        return format_ir(self.ir)


class Backward:
    """The backward pass of a kernel: one or more kernels (autodiff output split by schedule).

    Inputs are the forward inputs it reads, the forward outputs it reuses, and cotangents
    ``d_<output>``; outputs are gradients ``d_<input>``.
    """

    def __init__(self, forward: Kernel, ir: KernelIR, kernels: list[Kernel] | None = None):
        self.forward = forward
        self.ir = ir
        self.kernels = kernels if kernels is not None else [Kernel(part) for part in partition(ir)]
        self._variants: dict[tuple, Backward] = {}

    def variant(self, storage: str, keep=frozenset()) -> "Backward":
        """Every kernel of this backward pass as ``Kernel.variant(storage, keep)`` (each keeping
        the names in ``keep`` that it has)."""
        if storage == "f32":
            return self
        key = (storage, frozenset(keep))
        if key not in self._variants:
            self._variants[key] = Backward(self.forward, self.ir, [k.variant(storage, key[1] & k.tensor_names)
                                                                  for k in self.kernels])
        return self._variants[key]

    @property
    def name(self) -> str:
        return self.ir.name

    @property
    def inputs(self) -> list[str]:
        return [t.name for t in self.ir.inputs]

    @property
    def scalars(self) -> list[str]:
        return list(self.ir.scalars)

    @property
    def outputs(self) -> list[str]:
        return [t.name for t in self.ir.outputs]

    def __repr__(self) -> str:
        return f"backward of {self.forward.name}: " + "; ".join(repr(k) for k in self.kernels)


def grad(kernel: Kernel, wrt: list[str] | None = None, cotangents: list[str] | None = None) -> Backward:
    """Reverse-mode derivative of a kernel: gradients for ``wrt`` inputs (default all float inputs)
    given cotangents for ``cotangents`` outputs (default all outputs)."""
    return Backward(kernel, grad_ir(kernel.ir, wrt, cotangents))


class Module:
    """The kernels of one source, by name (``module.rmsnorm`` or ``module["rmsnorm"]``)."""

    def __init__(self, kernels: dict[str, Kernel], filename: str):
        self.kernels = kernels
        self.filename = filename

    def __getitem__(self, name: str) -> Kernel:
        try:
            return self.kernels[name]
        except KeyError:
            raise KeyError(f"no kernel {name!r} in {self.filename}; it has: {', '.join(self.kernels)}") from None

    def __getattr__(self, name: str) -> Kernel:
        if name.startswith("_") or name in ("kernels", "filename"):
            raise AttributeError(name)
        try:
            return self[name]
        except KeyError as e:
            raise AttributeError(str(e)) from None

    def __iter__(self):
        return iter(self.kernels.values())

    def __len__(self) -> int:
        return len(self.kernels)


def compile_source(text: str, filename: str = "<source>") -> Module:
    """Parse and check every kernel in ``text``; raises DslError with file:line:col on any problem."""
    src = parse(text, filename)
    kernels: dict[str, Kernel] = {}
    for kdef in src.kernels:
        if kdef.name in kernels:
            from .dsl.errors import DslError
            raise DslError(f"kernel {kdef.name!r} is defined twice", filename=filename, line=kdef.loc.line,
                           column=kdef.loc.column, source=text, expected="unique kernel names")
        kernels[kdef.name] = Kernel(build_kernel(kdef, src))
    return Module(kernels, filename)
