"""The staged driver: source -> AST -> IR (checked) -> parts -> per-specialization KernelSpec -> WGSL.

Each stage is a separate call so every intermediate can be inspected or dumped (``dump``). Kernels
are the user-facing objects: ``compile_source`` makes them, ``grad`` differentiates one, and both
run as the parts ``ir.partition`` splits them into. Two cache levels: specs in memory per
specialization (on the Kernel), generated WGSL on disk by a hash of the compiler's own source and
the spec, so editing the compiler invalidates every kernel it generated before.
"""
from __future__ import annotations

import functools
import hashlib
import pickle
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from .codegen.render import render, templates_dir
from .dsl import ast
from .dsl.errors import DslError
from .ir import intrinsics
from .ir.check import build_kernel
from .ir.defaults import fix_defaults
from .ir.grad import grad_ir
from .ir.nodes import KernelIR, TensorArg, format_ir
from .ir.ops import Op
from .ir.partition import Partition, partition
from .ir.retype import retype
from .safefiles import CheckedFiles, write_atomic
from .schedule import PORTABLE, KernelSpec, Target, specialize

PACKAGE_DIR = Path(__file__).resolve().parent


class Kernel:
    """One checked kernel and the parts it runs as; specializations are made per (sizes, bucket,
    accumulate, tiles) and memoised."""

    def __init__(self, ir: KernelIR, source: ast.KernelDef | None = None, split: Partition | None = None):
        self.split = split if split is not None else partition(ir)
        one = len(self.split.parts) == 1 and not self.split.temps
        self.ir = self.split.parts[0] if one else ir      # one part: the kernel itself, with its structure
        self.ast = source
        self._specs: dict[tuple, KernelSpec] = {}
        self._variants: dict[tuple, Kernel] = {}

    @functools.cached_property
    def kernels(self) -> list["Kernel"]:
        """The parts, each a one-part kernel (this kernel itself when it is one part)."""
        if len(self.split.parts) == 1 and not self.split.temps:
            return [self]
        return [Kernel(p, split=Partition((p,), ())) for p in self.split.parts]

    @property
    def part(self) -> KernelIR:
        """The one part of a one-part kernel."""
        if len(self.kernels) != 1:
            raise ValueError(f"{self.name} runs as {len(self.kernels)} kernels "
                             f"({', '.join(k.name for k in self.kernels)}); use each of .kernels")
        return self.split.parts[0]

    @functools.cached_property
    def add_only_outputs(self) -> frozenset[str]:
        """Outputs only added into (scatters): they must be passed in out= and accumulated."""
        return frozenset(name for name, n in self.ir.results.items()
                         if n.op == Op.PROJ and intrinsics.get(n.srcs[0].arg).adds_only)

    def variant(self, storage: str, keep=frozenset()) -> "Kernel":
        """This kernel with f32 tensors stored as ``storage`` ("f16"), computing in f32; the
        tensors named in ``keep`` stay f32 (see ir/retype.py)."""
        if storage == "f32":
            return self
        if storage not in ("f16",):
            raise ValueError(f"{self.name}: storage precision must be f32 or f16, got {storage!r}")
        unknown = sorted(set(keep) - self.tensor_names)
        if unknown:
            raise ValueError(f"{self.name}: cannot keep {unknown} in f32: the kernel has no such tensors")
        key = (storage, frozenset(keep))
        if all(t.name in key[1] for t in self.ir.inputs + self.ir.outputs if t.dtype == "f32"):
            return self                   # nothing left to retype
        if key not in self._variants:
            self._variants[key] = self._derived(retype(self.ir, storage, key[1]))
        return self._variants[key]

    def with_f16(self, names) -> "Kernel":
        """This kernel with the tensors in ``names`` stored as f16 and the rest as declared: the dtype
        variant a call specializes (engine.run's ``f16=``)."""
        names = frozenset(names)
        unknown = sorted(names - self.tensor_names)
        if unknown:
            raise ValueError(f"{self.name}: cannot store {unknown} as f16: the kernel has no such tensors")
        return self.variant("f16", self.tensor_names - names) if names else self

    def without(self, omitted) -> "Kernel":
        """This kernel as a call that leaves out the defaulted inputs in ``omitted`` runs it: each
        fixed to its default (see ir/defaults.py)."""
        omitted = frozenset(omitted)
        if not omitted:
            return self
        key = ("without", omitted)
        if key not in self._variants:
            self._variants[key] = self._derived(fix_defaults(self.ir, omitted))
        return self._variants[key]

    def _derived(self, ir: KernelIR) -> "Kernel":
        return Kernel(ir, self.ast)

    @property
    def tensor_names(self) -> frozenset[str]:
        return frozenset(t.name for t in self.ir.inputs + self.ir.outputs)

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

    @property
    def temps(self) -> tuple[TensorArg, ...]:
        return self.split.temps

    def __repr__(self) -> str:
        ins = ", ".join(f"{t.name}: {t.dtype}[{', '.join(t.shape)}]" for t in self.ir.inputs)
        ins += "".join(f", {s}: f32" for s in self.ir.scalars)
        outs = ", ".join(f"{t.name}: {t.dtype}[{', '.join(t.shape)}]" for t in self.ir.outputs)
        return f"kernel {self.name}({ins}) -> ({outs})"

    def specialize(self, dims: dict[str, int], bucket: int = 1, accumulate: frozenset[str] = frozenset(),
                   tiles=None, target: Target = PORTABLE) -> KernelSpec:
        """The spec of a one-part kernel at these sizes, for a device offering ``target`` (the
        portable target by default). ``tiles`` overrides the schedule's tile choice: a TileConfig
        or MatrixTiles for a matmul, an AttentionTiles for attention (see schedule.specialize)."""
        # dims in the caller's order: callers pass them in a fixed order, and another order only
        # makes a second entry for the same specialization
        key = (tuple(dims.items()), bucket, frozenset(accumulate), tiles, target)
        spec = self._specs.get(key)
        if spec is None:
            spec = self._specs[key] = specialize(self.part, dims, bucket, frozenset(accumulate), tiles, target)
        return spec

    def wgsl(self, dims: dict[str, int], bucket: int = 1, accumulate: frozenset[str] = frozenset()) -> str:
        return render(self.specialize(dims, bucket, accumulate))

    def format_ir(self) -> str:
        return format_ir(self.ir)


class Backward(Kernel):
    """The backward pass of a kernel, run as one or more parts like any kernel.

    Inputs are the forward inputs it reads, the forward outputs it reuses, and cotangents
    ``d_<output>``; outputs are gradients ``d_<input>``.
    """

    def __init__(self, forward: Kernel, ir: KernelIR, split: Partition | None = None):
        super().__init__(ir, forward.ast, split)
        self.forward = forward

    def _derived(self, ir: KernelIR) -> "Backward":
        return Backward(self.forward, ir)

    def __repr__(self) -> str:
        return f"backward of {self.forward.name}: " + "; ".join(Kernel.__repr__(k) for k in self.kernels)


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


def compile_source(text: str, filename: str = "<source>", cache: CheckedFiles | None = None) -> Module:
    """Parse and check every kernel in ``text``; raises DslError with file:line:col on any problem.
    ``cache``: where the syntax tree is kept between processes (``parsed``)."""
    src = parsed(text, filename, cache)
    kernels: dict[str, Kernel] = {}
    for kdef in src.kernels:
        if kdef.name in kernels:
            raise DslError(f"kernel {kdef.name!r} is defined twice", filename=filename, line=kdef.loc.line,
                           column=kdef.loc.column, source=text, expected="unique kernel names")
        kernels[kdef.name] = Kernel(build_kernel(kdef, src), kdef)
    return Module(kernels, filename)


# ---- kernels by name ----

_lookup: Callable[[str], Kernel] | None = None


def name_kernels_with(lookup: Callable[[str], Kernel]) -> None:
    """Let callers name a kernel instead of passing it (``engine.run("adamw", ...)``): ``lookup``
    finds it. The shipped library registers itself (ops/library.py), so the engine needs no ops."""
    global _lookup
    _lookup = lookup


def kernel_named(kernel: Kernel | str) -> Kernel:
    """``kernel`` itself, or the kernel of that name."""
    if not isinstance(kernel, str):
        return kernel
    if _lookup is None:
        raise KeyError(f"no kernel library to find {kernel!r} in: import lfm2jit.ops.library")
    return _lookup(kernel)


# ---- the WGSL disk cache ----

@functools.lru_cache(maxsize=1)
def compiler_fingerprint() -> str:
    h = hashlib.sha256()
    files = sorted(PACKAGE_DIR.rglob("*.py")) + sorted(PACKAGE_DIR.rglob("*.lark")) \
        + sorted(templates_dir().glob("*.wgsl.j2"))
    for f in files:
        h.update(f.name.encode())
        h.update(f.read_bytes())
    return h.hexdigest()[:16]


@dataclass
class CacheStats:
    hits: int = 0
    misses: int = 0
    disk_hits: int = 0
    compile_seconds: float = 0.0

    def as_dict(self) -> dict:
        return dict(vars(self))


def parsed(text: str, filename: str, files: CheckedFiles | None = None) -> ast.SourceFile:
    """``parse(text, filename)``, kept in ``files`` by a hash of the compiler and both arguments: a
    new process reads the shipped kernels' syntax trees instead of parsing them (ops/library.py)."""
    name = None
    if files is not None:
        name = hashlib.sha256(f"{compiler_fingerprint()}:{filename}:{text}".encode()).hexdigest()[:32] + ".pickle"
        kept = files.load(name)           # None: absent, damaged, or not ours
        if kept is not None:
            try:
                src = pickle.loads(kept)  # a checked entry of this user's own directory (CheckedFiles)
                SOURCE_STATS.read_back += 1
                return src
            except Exception:  # noqa: BLE001 - an entry this compiler cannot read is parsed again
                pass
    from .dsl.parser import parse       # lark, imported only where a source is parsed
    src = parse(text, filename)
    SOURCE_STATS.parsed += 1
    if name is not None:
        files.store(name, pickle.dumps(src))
    return src


@dataclass
class SourceStats:
    """Kernel sources this process parsed, and those it read back parsed from the disk cache."""
    parsed: int = 0
    read_back: int = 0


SOURCE_STATS = SourceStats()


class WgslDiskCache:
    """Generated WGSL as files named by a hash of (compiler fingerprint, spec key), checked and kept
    only in a directory of this user's own (safefiles.CheckedFiles): a planted entry would run as
    this user's kernel."""

    def __init__(self, root: Path):
        self.files = CheckedFiles(root, "LFM2JIT_CACHE_DIR")
        self.root = self.files.root

    def path(self, spec: KernelSpec) -> Path:
        return self.root / self._name(spec)

    @staticmethod
    def _name(spec: KernelSpec) -> str:
        digest = hashlib.sha256(f"{compiler_fingerprint()}:{spec.key}".encode()).hexdigest()[:32]
        return f"{spec.kernel}-{digest}.wgsl"

    def load(self, spec: KernelSpec) -> str | None:
        body = self.files.load(self._name(spec))
        return None if body is None else body.decode(errors="replace")

    def store(self, spec: KernelSpec, wgsl: str) -> None:
        self.files.store(self._name(spec), wgsl.encode())


def generate_wgsl(spec: KernelSpec, disk: WgslDiskCache | None, stats: CacheStats) -> str:
    if disk is not None:
        cached = disk.load(spec)
        if cached is not None:
            stats.disk_hits += 1
            return cached
    wgsl = render(spec)
    if disk is not None:
        disk.store(spec, wgsl)
    return wgsl


class Timer:
    def __enter__(self):
        self.start = time.perf_counter()
        return self

    def __exit__(self, *exc):
        self.seconds = time.perf_counter() - self.start


# ---- dumps ----

STAGES = ("ast", "ir", "spec", "wgsl")


def stages(kernel: Kernel, dims: dict[str, int], bucket: int = 1, target: Target = PORTABLE) -> dict[str, str]:
    """Every stage of a kernel as text: its source (AST unparsed), its IR and its parts' IR, each
    part's spec, and each part's WGSL (the parts separated by a comment naming them)."""
    source = ast.unparse(ast.SourceFile("", "", (kernel.ast,))) if kernel.ast is not None else ""
    ir = [format_ir(kernel.ir)]
    specs, shaders = [], []
    for k in kernel.kernels:
        spec = k.specialize({a: dims[a] for a in k.ir.axes if a in dims}, bucket, target=target)
        if len(kernel.kernels) > 1:
            ir.append(f"part {k.name} ({k.ir.structure.kind})\n" + format_ir(k.ir))
        specs.append(_describe_spec(spec))
        shaders.append(render(spec))
    temps = "".join(f"temporary {t.name}: {t.dtype}[{', '.join(t.shape)}]\n" for t in kernel.temps)
    return {"ast": source, "ir": temps + "\n".join(ir) + "\n", "spec": "\n".join(specs), "wgsl": "".join(shaders)}


def _describe_spec(spec: KernelSpec) -> str:
    lines = [f"spec {spec.kernel}: template {spec.template}, key {spec.key}",
             f"  dims: {', '.join(f'{a}={n}' for a, n in spec.dims)}",
             f"  entry points: {', '.join(f'{e.name} {e.grid}' for e in spec.entry_points)}"]
    lines += [f"  binding {b.binding}: {b.tensor} {b.access} {b.dtype}" + (f"x{b.vector}" if b.vector > 1 else "")
              for b in spec.bindings]
    lines += [f"  scratch {s.tensor}: {s.elements} x {s.dtype}" for s in spec.scratch]
    lines.append(f"  params: {spec.params!r}")
    return "\n".join(lines) + "\n"
