"""ComputeEngine: the compile driver over the runtime. ``run`` checks a call, compiles each part of
the kernel once per specialization (sizes, bucket, tiles, the tensors stored as f16, the device),
and records one dispatch per part. It imports nothing above the driver and runtime: kernels passed
by name are found through the driver (ops/library.py registers the shipped ones).

Arguments are validated before any GPU work. A kernel that partition() split into parts runs them
in order, with the temporaries between them taken from the buffer pool and given back when the
call is recorded. Kernels never read or write rows at or past ``t_valid`` (the real sequence
length), so inputs need no padding copies and padded rows of outputs are never written.
"""
from __future__ import annotations

import math
import numbers
import struct
from dataclasses import dataclass

from .driver import Backward, CacheStats, Kernel, Timer, WgslDiskCache, generate_wgsl, kernel_named
from .ir.nodes import SEQ_AXIS
from .ir.shapes import derived_size
from .runtime.recorder import Compiled, Recorder, Shader
from .runtime.tensor import ITEMSIZE, Tensor
from .safefiles import write_atomic
from .schedule import pieces
from .schedule import EMULATED_MATRIX_CONFIGS, EMULATED_SUBGROUP, KernelSpec, MatrixConfig, Target, bucketed
from .settings import settings
from .tune.autotune import Tuner

# bytes of the stand-in bound for a piece past a tensor's end (_pieces): a binding offset alignment,
# at least one element of any binding's type (vec4<f32>)
STAND_IN_BYTES = 256


@dataclass
class CompiledKernel:
    """One part's spec and the pipelines made from its WGSL."""
    spec: KernelSpec
    pipelines: Compiled

    @property
    def wgsl(self) -> str:
        return self.pipelines.wgsl


def shader_of(spec: KernelSpec, wgsl: str) -> Shader:
    slots = tuple((b.binding + i, b.access == "read") for b in spec.bindings for i in range(b.pieces))
    return Shader(spec.kernel, spec.key, wgsl, slots,
                  tuple((e.name, e.grid) for e in spec.entry_points))


class ComputeEngine(Recorder):
    def __init__(self, ctx, timing: bool | None = None):
        opts = settings()
        super().__init__(ctx, opts.timing if timing is None else timing)
        self.stats = CacheStats()
        self.disk = WgslDiskCache(opts.cache_dir) if opts.cache_dir else None
        self.dump_dir = opts.dump_dir
        self.target = target_of(ctx, opts.matrix_units, opts.matrix_staging)
        self.tuner = Tuner(self) if opts.autotune else None

    # ---- compilation ----
    def compile(self, kernel: Kernel | str, dims: dict[str, int], bucket: int = 1,
                accumulate: frozenset[str] = frozenset(), tiles=None) -> CompiledKernel:
        """The pipelines of a one-part kernel at these sizes (made once per specialization)."""
        kernel = kernel_named(kernel)
        if tiles is None and self.tuner is not None:    # stays None where the template has no candidates
            tiles = self.tuner.tiles(kernel, dims, bucket, accumulate)
        spec = kernel.specialize(dims, bucket, accumulate, tiles, self.target)
        compiled = self.pipeline(spec.key)
        if compiled is not None:
            self.stats.hits += 1
            return CompiledKernel(spec, compiled)
        self.stats.misses += 1
        with Timer() as t:
            wgsl = generate_wgsl(spec, self.disk, self.stats)
            compiled = self.build(shader_of(spec, wgsl))
        self.stats.compile_seconds += t.seconds
        if self.dump_dir is not None:
            write_atomic(self.dump_dir / f"{spec.kernel}-{spec.key}.wgsl", wgsl)
        return CompiledKernel(spec, compiled)

    def _wait_for_compiles(self) -> None:
        """The recorder's wait for pipelines compiling asynchronously, counted in stats.compile_seconds
        (which is host time spent compiling: issuing compiles, and waiting for them)."""
        if not self._compiling:
            return
        with Timer() as t:
            super()._wait_for_compiles()
        self.stats.compile_seconds += t.seconds

    # ---- recording ----
    def run(self, kernel: Kernel | str, *, bucket: int = 1, dims: dict[str, int] | None = None,
            out: dict[str, Tensor] | None = None, accumulate=(), tiles=None, f16=(), **args) -> dict[str, Tensor]:
        """Record one kernel call; returns its outputs by name. Bad arguments raise before GPU work.

        ``out`` supplies output tensors to write into; outputs named in ``accumulate`` (which must
        be in ``out``) are added to instead of overwritten. ``f16`` names the tensors stored as f16
        (the kernel's dtype variant, computing in f32; ops/precision.py chooses them).
        """
        kernel = kernel_named(kernel)
        halves = sorted(set(f16) | {n for n, v in args.items() if isinstance(v, Tensor) and v.dtype == "f16"})
        if halves and not getattr(self.ctx, "has_f16", True):
            raise ValueError(f"{kernel.ir.name}: {', '.join(halves)} stored as f16 need the shader-f16 feature that "
                             f"adapter {self.ctx.name!r} lacks; pass f32 tensors (no f16=)")
        kernel = kernel.with_f16(f16)
        kernel = kernel.without(n for n in kernel.ir.defaults if n not in args)
        ir = kernel.ir
        args, sizing = self._own_arguments(kernel, args)
        args, left_out = self._leading_axes(ir, args)
        left_out.update(a for decl, x in sizing for a in _left_out_axes(decl, x.shape))
        out = {n: self._expand(ir, n, t) for n, t in (out or {}).items()}
        if tiles is not None and len(kernel.kernels) > 1:
            raise ValueError(f"{kernel.name}: tiles= applies to one kernel, and this one runs "
                             f"{len(kernel.kernels)} ({', '.join(k.name for k in kernel.kernels)}); run them "
                             "one by one (kernel.kernels) to choose each one's tiles")
        accumulate = frozenset(accumulate)
        missing_out = sorted(accumulate - set(out))
        if missing_out:
            raise ValueError(f"{ir.name}: accumulating into {missing_out} needs those tensors in out=")
        unknown_acc = sorted(accumulate - {o.name for o in ir.outputs})
        if unknown_acc:
            raise ValueError(f"{ir.name}: cannot accumulate into {unknown_acc}: not outputs")
        scatter = sorted(kernel.add_only_outputs - accumulate)
        if scatter:
            raise ValueError(f"{ir.name}: the kernel adds into {scatter}; pass them in out= (zeroed, or holding "
                             f"what to add to) with accumulate={set(scatter)}")
        sizes, t_valid = self._bind(ir, args, dims or {}, sizing)
        scalars = {}
        for name in ir.scalars:
            v = args[name]
            if not isinstance(v, numbers.Real) or isinstance(v, bool) or not math.isfinite(float(v)):
                raise ValueError(f"{ir.name}: scalar {name!r} must be a finite number, got {v!r}")
            scalars[name] = float(v)
        self._check_packed_layout(ir, sizes, bucket)
        outputs = self._outputs(ir, sizes, bucket, out, args)
        env = {**args, **outputs}
        parts = [(k, self.compile(k, {a: sizes[a] for a in k.ir.axes if a in sizes}, bucket,
                                  accumulate & set(k.outputs), tiles)) for k in kernel.kernels]
        for k, _ in parts:
            written = {id(env[n].buffer): n for n in k.outputs if n in env and n not in k.ir.inouts}
            for n in k.inputs:
                if n in env and id(env[n].buffer) in written:
                    raise ValueError(f"{ir.name}: output {written[id(env[n].buffer)]!r} shares a buffer with input "
                                     f"{n!r}; WebGPU cannot read and write one buffer in a dispatch")
        for t in kernel.temps:         # back in the pool once recorded: later work runs after this call's
            env[t.name] = self.empty(tuple(sizes[a] for a in t.shape), t.dtype,
                                     capacity=math.prod(_padded(sizes, bucket, t.shape)))
        calls = []
        for k, compiled in parts:
            spec = compiled.spec
            names = list(spec.inputs) + [n for n, _, _ in spec.outputs]
            tensors = [env[n] for n in names] + [self.empty((s.elements,), s.dtype) for s in spec.scratch]
            tensors = self._pieces(ir.name, spec, tensors)
            values = tuple(scalars[s] for s in k.ir.scalars)
            calls.append((compiled, tensors, struct.pack(f"<I{len(values)}f", t_valid, *values), k.ir.scalars, values))
        for compiled, tensors, info, names, values in calls:
            self.dispatch(compiled.pipelines, tensors, info, names, values)
        return {n: _drop_leading(outputs[n], decl, left_out) for n, decl in zip(outputs, ir.outputs)}

    def _pieces(self, kernel: str, spec: KernelSpec, tensors: list[Tensor]) -> list[Tensor]:
        """The tensors to bind, in binding order: a tensor the spec binds in pieces becomes one flat
        view per piece. Refuses, before any GPU work, a binding larger than the device allows."""
        limit = self.ctx.limits.get("max-storage-buffer-binding-size")
        most = pieces.piece_bytes(self.target)
        out = []
        for b, t in zip(spec.bindings, tensors):
            spans = pieces.ranges(b, t.offset, t.binding_size, most)
            for at, nbytes in filter(None, spans):
                if limit and nbytes > limit:     # wgpu would fail inside the dispatch: refuse first
                    raise ValueError(f"{kernel}: {b.tensor} binds {nbytes} bytes ({t.dtype}{list(t.shape)}); the "
                                     f"adapter binds at most {limit} (max-storage-buffer-binding-size): split the "
                                     "work or use a smaller length bucket")
            if len(spans) == 1:
                out.append(t if spans[0][1] == t.binding_size else t.bytes_view(*spans[0]))
                continue
            # a piece past the tensor's end (a tensor of fewer rows than the bucket planned for)
            # holds only rows past t_valid, which no template touches: it binds a stand-in of its
            # own, never an alias of the tensor (two writable bindings of one range)
            out += [t.bytes_view(*span) if span else self.empty((STAND_IN_BYTES // ITEMSIZE[t.dtype],), t.dtype)
                    for span in spans]
        return out

    def _leading_axes(self, ir, args: dict) -> tuple[dict, set[str]]:
        """Inputs passed without some optional leading axes (``B?``), viewed with them (size 1),
        and the axes left out."""
        left_out: set[str] = set()
        args = dict(args)
        for t in ir.inputs:
            x = args.get(t.name)
            dropped = _left_out_axes(t, x.shape) if isinstance(x, Tensor) else ()
            if dropped:
                args[t.name] = x.view((1,) * len(dropped) + x.shape)
                left_out.update(dropped)
        return args, left_out

    def _expand(self, ir, name: str, t):
        """An out= tensor given without the output's optional leading axes, viewed with them."""
        decl = next((o for o in ir.outputs if o.name == name), None)
        dropped = _left_out_axes(decl, t.shape) if decl is not None and isinstance(t, Tensor) else ()
        return t.view((1,) * len(dropped) + t.shape) if dropped else t

    @staticmethod
    def _check_packed_layout(ir, sizes: dict[str, int], bucket: int) -> None:
        """Tensors with axes before T hold one padded sequence per leading index, bucketed(T) rows
        apart; a caller's tensor holds them T rows apart, so both agree only when T fills its bucket."""
        t = sizes.get(SEQ_AXIS)
        if t is None or bucketed(t, bucket) == t:
            return
        for decl in ir.inputs + ir.outputs:
            if SEQ_AXIS in decl.shape and math.prod(sizes[a] for a in decl.shape[:decl.shape.index(SEQ_AXIS)]) > 1:
                raise ValueError(f"{ir.name}: {decl.name!r} packs several sequences of T={t} positions, but T is not a "
                                 f"multiple of the length bucket {bucket}: packed sequences must fill whole buckets "
                                 f"(pad them to {bucketed(t, bucket)})")

    def _own_arguments(self, kernel: Kernel, args: dict) -> tuple[dict, list]:
        """The arguments a kernel takes, and (for a backward, which also accepts the forward's
        arguments) the forward tensors it does not read, as (declaration, tensor) pairs: they still
        give sizes (dx of y = mean(x, T) reads no tensor that has T)."""
        if not isinstance(kernel, Backward):
            return args, []
        fwd = kernel.forward.ir
        known = set(kernel.inputs) | set(kernel.scalars) | set(fwd.scalars) | {t.name for t in fwd.inputs + fwd.outputs}
        unknown = sorted(set(args) - known)
        if unknown:
            raise TypeError(f"{kernel.name}: unknown arguments {unknown} (it takes {', '.join(sorted(known))})")
        own = set(kernel.inputs) | set(kernel.scalars)
        decls = {t.name: t for t in fwd.inputs + fwd.outputs}
        sizing = [(decls[n], v) for n, v in args.items() if n not in own and n in decls and isinstance(v, Tensor)]
        return {n: v for n, v in args.items() if n in own}, sizing

    def _bind(self, ir, args: dict, dims: dict[str, int], sizing=()) -> tuple[dict[str, int], int]:
        expected = [t.name for t in ir.inputs] + list(ir.scalars)
        unknown = [k for k in args if k not in expected]
        missing = [k for k in expected if k not in args]
        if unknown or missing:
            raise TypeError(f"{ir.name}: " + "; ".join(
                part for part in (f"unknown arguments {unknown}" if unknown else "",
                                  f"missing arguments {missing}" if missing else "") if part)
                + f" (it takes {', '.join(expected)})")
        sizes: dict[str, int] = dict(ir.fixed_dims)          # integer axes written in the source
        source: dict[str, str] = {a: "the kernel's type" for a in ir.fixed_dims}
        for name, value in dims.items():
            sizes[name], source[name] = value, "dims="
        for t in ir.inputs:
            x = args[t.name]
            if not isinstance(x, Tensor):
                raise TypeError(f"{ir.name}: input {t.name!r} must be a Tensor, got {type(x).__name__}")
            if x.dtype != t.dtype:
                raise ValueError(f"{ir.name}: input {t.name!r} has dtype {x.dtype}, expected {t.dtype}")
            if len(x.shape) != len(t.shape):
                raise ValueError(f"{ir.name}: input {t.name!r} has shape {list(x.shape)}, expected "
                                 f"{len(t.shape)} axes [{', '.join(t.shape)}]")
            for axis, size in zip(t.shape, x.shape):
                fixed = ir.fixed_dims.get(axis)
                if fixed is not None and fixed != size:
                    raise ValueError(f"{ir.name}: input {t.name!r} has size {size} on axis {axis}, expected {fixed}")
                if axis in sizes and sizes[axis] != size:
                    raise ValueError(f"{ir.name}: input {t.name!r} has {axis}={size} but {source[axis]} "
                                     f"says {axis}={sizes[axis]}")
                sizes[axis], source[axis] = size, f"input {t.name!r}"
        for t, x in sizing:
            shape = t.shape[len(_left_out_axes(t, x.shape)):]
            for axis, size in zip(shape, x.shape):
                if axis in sizes and sizes[axis] != size:
                    raise ValueError(f"{ir.name}: forward argument {t.name!r} has {axis}={size} but {source[axis]} "
                                     f"says {axis}={sizes[axis]}")
                sizes.setdefault(axis, size)
                source.setdefault(axis, f"forward argument {t.name!r}")
        for axis in ir.axes:          # integer axes, and "V+1" from V
            size = derived_size(axis, sizes)
            if size is not None and sizes.setdefault(axis, size) != size:
                raise ValueError(f"{ir.name}: {source[axis]} has {axis}={sizes[axis]}, expected {size}")
        missing_axes = [a for a in ir.axes if a not in sizes]
        if missing_axes:
            raise ValueError(f"kernel {ir.name!r} needs sizes for axes {', '.join(missing_axes)} "
                             f"(pass dims={{{missing_axes[0]!r}: ...}})")
        t_valid = sizes.get(SEQ_AXIS, 1)
        if t_valid < 1:
            raise ValueError(f"{ir.name}: sequence length T must be at least 1, got {t_valid}")
        return sizes, t_valid

    def _outputs(self, ir, sizes: dict[str, int], bucket: int, out: dict[str, Tensor],
                 args: dict) -> dict[str, Tensor]:
        result = {}
        for decl in ir.outputs:
            name, dtype = decl.name, decl.dtype
            shape = tuple(sizes[a] for a in decl.shape)
            if name in ir.inouts:
                if name in out:
                    raise ValueError(f"{ir.name}: {name!r} is updated in place; pass it as an input, not in out=")
                result[name] = args[name]
                continue
            given = out.get(name)
            if given is None:
                result[name] = self.empty(shape, dtype, capacity=math.prod(_padded(sizes, bucket, decl.shape)))
            else:
                if given.dtype != dtype or given.shape != shape:
                    raise ValueError(f"{ir.name}: out[{name!r}] is {given.dtype}{list(given.shape)}, "
                                     f"expected {dtype}{list(shape)}")
                result[name] = given
        extra = set(out) - set(result)
        if extra:
            raise ValueError(f"{ir.name}: out has unknown outputs {sorted(extra)}")
        return result


def subgroup_feature(features) -> str:
    """The device's subgroup feature by its implementation's name: Dawn's "subgroups" (its WGSL needs
    `enable subgroups;`), wgpu-native's "subgroup" (naga takes the builtins as they are), "" for none."""
    names = {str(f) for f in features}
    return next((f for f in ("subgroups", "subgroup") if f in names), "")


def target_of(ctx, matrix_units: str = "auto", matrix_staging: str = "f16") -> Target:
    """What the context's device offers the planners: its subgroup matrices (Dawn lists them per
    adapter), the subgroup size they run at, its workgroup memory and storage-binding limits.
    ``matrix_units`` is LFM2JIT_MATRIX_UNITS: "off" offers none, "emulate" the emulated ones on any
    device with f16; ``matrix_staging`` LFM2JIT_MATRIX_STAGING."""
    limits = ctx.limits
    device = dict(workgroup_bytes=int(limits.get("max-compute-workgroup-storage-size", 16384)),
                  storage_buffers=int(limits.get("max-storage-buffers-per-shader-stage", 8)),
                  binding_bytes=int(min(limits.get("max-storage-buffer-binding-size", 128 << 20),
                                        limits.get("max-buffer-size", 256 << 20))),
                  binding_align=int(limits.get("min-storage-buffer-offset-alignment", 256)))
    features = {str(f) for f in getattr(ctx, "features", ())}
    device["subgroups"] = subgroup_feature(features)
    if matrix_units == "off":
        return Target(**device)
    vec4 = matrix_staging == "vec4"
    if matrix_units == "emulate":
        if "shader-f16" not in features:
            raise ValueError(f"LFM2JIT_MATRIX_UNITS=emulate: {ctx.name} has no shader-f16, which the matrix "
                             "templates need even when their subgroup matrices are emulated")
        return Target(EMULATED_MATRIX_CONFIGS, EMULATED_SUBGROUP, emulated=True, vec4_staging=vec4, **device)
    configs = tuple(c for c in (_matrix_config(d) for d in getattr(ctx, "subgroup_matrix_configs", ())) if c)
    info = getattr(ctx, "info", {})
    subgroup = int(info.get("subgroup_min_size") or info.get("subgroupMinSize") or (32 if configs else 0))
    return Target(configs, subgroup if configs else 0, vec4_staging=vec4, **device)


def _matrix_config(d) -> MatrixConfig | None:
    """A config as Dawn describes it (a dict; key spellings vary by version), or None if unreadable."""
    if not isinstance(d, dict):
        d = getattr(d, "__dict__", {})
    get = {k.lower().replace("_", ""): v for k, v in d.items()}.get
    try:
        return MatrixConfig(int(get("m")), int(get("n")), int(get("k")), _dtype(get("componenttype")),
                            _dtype(get("resultcomponenttype") or get("resulttype")))
    except (TypeError, ValueError):
        return None


def _dtype(v) -> str:
    """'f16', 'F16', 'SubgroupMatrixComponentType.F16' ... -> 'f16'."""
    return str(v).rsplit(".", 1)[-1].lower()


def _left_out_axes(decl, shape: tuple[int, ...]) -> tuple[str, ...]:
    """The optional leading axes (``B?``) of ``decl`` that a tensor of ``shape`` leaves out; none
    when it has them all or leaves out more axes than are optional (the shape check names that).
    A backward's gradients drop the axes left out of forward arguments it only sizes from, too."""
    k = len(decl.shape) - len(shape)
    return tuple(decl.optional[:k]) if 0 < k <= len(decl.optional) else ()


def _drop_leading(t: Tensor, decl, left_out: set[str]) -> Tensor:
    """An output returned without the optional leading axes the call's inputs left out."""
    k = 0
    while k < len(decl.optional) and decl.optional[k] in left_out:
        k += 1
    return t.view(t.shape[k:]) if k else t


def _padded(sizes: dict[str, int], bucket: int, shape: tuple[str, ...]) -> tuple[int, ...]:
    """A tensor's shape with T rounded up to the bucket: the rows a kernel of that bucket may address."""
    return tuple(bucketed(sizes[a], bucket) if a == SEQ_AXIS else sizes[a] for a in shape)
