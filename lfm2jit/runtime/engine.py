"""ComputeEngine: compiles specs into pipelines once, records dispatches, submits them together.

Work is recorded, not run: ``run`` validates its arguments (before any GPU work), makes or reuses
the pipeline, and appends one dispatch. What is recorded goes into one command encoder when
``flush`` is called, which reading a tensor does by itself, and every SUBMIT_EVERY dispatches, so
the GPU works through a step while the host is still recording it.

Kernels never read or write rows at or past ``t_valid`` (the real sequence length), so inputs need
no padding copies and padded rows of outputs are never written.
"""
from __future__ import annotations

import contextlib
import functools
import math
from collections import OrderedDict
import numbers
import struct
from dataclasses import dataclass

import numpy as np
import wgpu

from .. import library
from ..autotune import Tuner
from ..cache import CacheStats, Timer, WgslDiskCache, generate_wgsl
from ..compiler import Backward, Kernel
from ..ir.nodes import SEQ_AXIS
from ..schedule import KernelSpec
from ..settings import settings
from .pool import BufferPool
from .program import Program
from .tensor import ITEMSIZE, Tensor, buffer_bytes, infer_dtype

MAX_GROUPS_PER_DIM = 65535
INFO_BYTES = 256           # one info block (t_valid + scalars) per dispatch: the uniform offset alignment
SUBMIT_EVERY = 32          # recorded dispatches per submission (and info blocks in the ring): the GPU starts
                           # on them while Python records more
MAX_QUERIES = 4096


class ShaderCompileError(RuntimeError):
    """The adapter's shader compiler rejected generated WGSL (a compiler bug, not a user error)."""


@dataclass
class Compiled:
    spec: KernelSpec
    wgsl: str
    pipelines: tuple          # one per entry point, dispatched in order ("main", then e.g. "reduce")
    layout: object

    @functools.cached_property
    def stages(self) -> list[tuple[object, tuple[int, int, int]]]:
        """(pipeline, workgroups) of each dispatch one call of this kernel records."""
        spec = self.spec
        first = spec.workgroups if isinstance(spec.workgroups, tuple) else fold_workgroups(spec.workgroups) + (1,)
        groups = [first]
        if len(self.pipelines) > 1:
            groups.append(fold_workgroups(spec.context["reduce_workgroups"]) + (1,))
        return list(zip(self.pipelines, groups))


class LRU:
    """A small least-recently-used map."""

    def __init__(self, capacity: int):
        self.capacity = capacity
        self.items: OrderedDict = OrderedDict()

    def get(self, key):
        value = self.items.get(key)
        if value is not None:
            self.items.move_to_end(key)
        return value

    def put(self, key, value):
        self.items[key] = value
        if len(self.items) > self.capacity:
            self.items.popitem(last=False)
        return value


def fold_workgroups(total: int) -> tuple[int, int]:
    """Split a workgroup count over x and y so neither exceeds the per-dimension limit."""
    if total <= MAX_GROUPS_PER_DIM:
        return max(total, 1), 1
    y = -(-total // MAX_GROUPS_PER_DIM)
    if y > MAX_GROUPS_PER_DIM:
        raise ValueError(f"{total} workgroups exceed {MAX_GROUPS_PER_DIM}**2, the most one dispatch can fold")
    return -(-total // y), y


class ComputeEngine:
    def __init__(self, ctx, timing: bool | None = None):
        self.ctx = ctx
        self.device = ctx.device
        self.pool = BufferPool(ctx.device)
        self.stats = CacheStats()
        opts = settings()
        self.disk = WgslDiskCache(opts.cache_dir) if opts.cache_dir else None
        self.dump_dir = opts.dump_dir
        want_timing = opts.timing if timing is None else timing
        self.timing = bool(want_timing and ctx.has_timestamps)
        self.timings: list[tuple[str, float]] = []   # (kernel, GPU seconds) per timed dispatch
        self._pipelines: dict[tuple[str, str], Compiled] = {}
        self._commands: list[tuple[str, Compiled, object, tuple[int, int]]] = []
        self._keepalive: list = []
        self.dispatches = 0
        self._fence = None
        self._infos: list[bytes] = []     # info block of each recorded dispatch, in order
        self._ring = None                 # uniform buffer the info blocks are written to at flush
        self._bind_groups = LRU(8192)     # (layout, ring, bindings) -> bind group
        self.tuner = Tuner(self) if opts.autotune else None
        self.capturing: Program | None = None
        ctx.register(self)

    # ---- compilation ----
    def compile(self, kernel: Kernel | str, dims: dict[str, int], bucket: int = 1,
                accumulate: frozenset[str] = frozenset(), tiles=None) -> Compiled:
        kernel = library.get(kernel) if isinstance(kernel, str) else kernel
        if tiles is None and self.tuner is not None:    # stays None where the template has no candidates
            tiles = self.tuner.tiles(kernel, dims, bucket, accumulate)
        spec = kernel.specialize(dims, bucket, accumulate, tiles)
        key = (spec.key, self.ctx.name)
        compiled = self._pipelines.get(key)
        if compiled is not None:
            self.stats.hits += 1
            return compiled
        self.stats.misses += 1
        with Timer() as t:
            wgsl = generate_wgsl(spec, self.disk, self.stats)
            compiled = self._build(spec, wgsl)
        self.stats.compile_seconds += t.seconds
        self._pipelines[key] = compiled
        if self.dump_dir is not None:
            self.dump_dir.mkdir(parents=True, exist_ok=True)
            (self.dump_dir / f"{spec.kernel}-{spec.key}.wgsl").write_text(wgsl)
        return compiled

    def _build(self, spec: KernelSpec, wgsl: str) -> Compiled:
        try:
            module = self.device.create_shader_module(code=wgsl, label=spec.kernel)
        except Exception as e:  # wgpu raises its own validation error types
            raise ShaderCompileError(f"the shader compiler rejected kernel {spec.kernel!r} "
                                     f"(spec {spec.key}):\n{e}\n--- WGSL ---\n{wgsl}") from None
        compute = wgpu.ShaderStage.COMPUTE
        entries = [{"binding": 0, "visibility": compute,
                    "buffer": {"type": wgpu.BufferBindingType.uniform, "has_dynamic_offset": True}}]
        for b in spec.context["bindings"]:
            kind = wgpu.BufferBindingType.read_only_storage if b["access"] == "read" else wgpu.BufferBindingType.storage
            entries.append({"binding": b["binding"], "visibility": compute, "buffer": {"type": kind}})
        layout = self.device.create_bind_group_layout(entries=entries)
        pipeline_layout = self.device.create_pipeline_layout(bind_group_layouts=[layout])
        pipelines = tuple(self.device.create_compute_pipeline(layout=pipeline_layout, label=spec.kernel,
                                                              compute={"module": module, "entry_point": entry})
                          for entry in spec.context.get("entry_points", ("main",)))
        return Compiled(spec, wgsl, pipelines, layout)

    # ---- tensors ----
    def empty(self, shape, dtype: str = "f32", capacity: int | None = None) -> Tensor:
        """A pooled tensor (contents undefined); ``capacity`` elements reserved, at least its size."""
        n = max(math.prod(shape), capacity or 0)
        buf = self.pool.acquire(buffer_bytes(n, dtype))
        return Tensor(self.ctx, buf, shape, dtype, capacity=buf.size // ITEMSIZE[dtype], on_free=self.pool.release)

    def tensor(self, array, dtype: str | None = None) -> Tensor:
        """Upload a numpy array into a pooled tensor."""
        arr = np.asarray(array)
        t = self.empty(arr.shape, dtype or infer_dtype(arr))
        t.write(arr)
        return t

    # ---- recording ----
    def run(self, kernel: Kernel | Backward | str, *, bucket: int = 1, dims: dict[str, int] | None = None,
            out: dict[str, Tensor] | None = None, accumulate=(), tiles=None, **args) -> dict[str, Tensor]:
        """Record one kernel call; returns its outputs by name. Bad arguments raise before GPU work.

        ``out`` supplies output tensors to write into; outputs named in ``accumulate`` (which must
        be in ``out``) are added to instead of overwritten.
        """
        kernel = library.get(kernel) if isinstance(kernel, str) else kernel
        if isinstance(kernel, Backward):
            if tiles is not None:
                raise ValueError(f"{kernel.name}: tiles= applies to one kernel, and this backward runs "
                                 f"{len(kernel.kernels)} ({', '.join(k.name for k in kernel.kernels)}); run them "
                                 "one by one (backward.kernels) to choose each one's tiles")
            return self._run_backward(kernel, bucket, dims, out or {}, accumulate, args)
        ir = kernel.ir
        accumulate = frozenset(accumulate)
        missing_out = sorted(accumulate - set(out or {}))
        if missing_out:
            raise ValueError(f"{ir.name}: accumulating into {missing_out} needs those tensors in out=")
        scatter = sorted(kernel.add_only_outputs - accumulate)
        if scatter:
            raise ValueError(f"{ir.name}: the kernel adds into {scatter}; pass them in out= (zeroed, or holding "
                             f"what to add to) with accumulate={set(scatter)}")
        sizes, t_valid = self._bind(ir, args, dims or {})
        scalars = []
        for name in ir.scalars:
            v = args[name]
            if not isinstance(v, numbers.Real) or isinstance(v, bool) or not math.isfinite(float(v)):
                raise ValueError(f"{ir.name}: scalar {name!r} must be a finite number, got {v!r}")
            scalars.append(float(v))
        compiled = self.compile(kernel, sizes, bucket, accumulate, tiles)
        spec = compiled.spec
        outputs = self._outputs(ir, spec, sizes, out or {}, args)
        info = struct.pack(f"<I{len(scalars)}f", t_valid, *scalars)
        if len(info) > INFO_BYTES:
            raise ValueError(f"{ir.name}: {len(ir.scalars)} scalars do not fit the {INFO_BYTES}-byte info block")
        tensors = [args[n] for n in spec.inputs] + [outputs[n] for n, _, _ in spec.outputs]
        if spec.context.get("workspace"):       # split-K partial sums: scratch, back in the pool at once
            tensors.append(self.empty((spec.context["workspace"],), "f32"))
        written = {id(outputs[n].buffer): n for n, _, _ in spec.outputs}
        for n in spec.inputs:
            if id(args[n].buffer) in written:
                raise ValueError(f"{ir.name}: output {written[id(args[n].buffer)]!r} shares a buffer with input "
                                 f"{n!r}; WebGPU cannot read and write one buffer in a dispatch")
        bind_group = self._bind_group(compiled, tensors)
        stages = compiled.stages
        for _, groups in stages:
            if max(groups) > MAX_GROUPS_PER_DIM:
                raise ValueError(f"{ir.name}: dispatch of {groups} workgroups exceeds {MAX_GROUPS_PER_DIM} per dimension")
        for pipeline, groups in stages:      # every stage reads the same info block
            self._commands.append(("dispatch", compiled, pipeline, bind_group, groups, len(self._infos) * INFO_BYTES))
        self._infos.append(info)
        if self.capturing is not None:
            self.capturing.add_call(compiled, tensors, stages, ir.scalars, scalars, info)
        self._keepalive.extend(t.buffer for t in tensors)   # buffers, not tensors: freed tensors recycle at once
        self.dispatches += 1
        if len(self._infos) == SUBMIT_EVERY:
            self.flush()          # submit, so the GPU starts; the info ring is then reused
        return outputs

    def _bind_group(self, compiled: Compiled, tensors: list[Tensor]):
        """The bind group for these bindings, made once and reused while cached: a training step
        repeats the same kernels over the same buffers, so most dispatches hit. The info block
        (real length, scalars) is not part of it: it sits in a ring buffer at a dynamic offset."""
        ring = self._info_ring()
        key = (id(compiled.layout), id(ring), tuple((id(t.buffer), t.offset, t.binding_size) for t in tensors))
        hit = self._bind_groups.get(key)
        if hit is not None:
            return hit[0]
        group = self.make_bind_group(compiled, ring, [(t.buffer, t.offset, t.binding_size) for t in tensors])
        # the entry keeps the buffers alive, so their ids in the key cannot be reused by others
        self._bind_groups.put(key, (group, ring, [t.buffer for t in tensors]))
        return group

    def make_bind_group(self, compiled: Compiled, info_buffer, bindings):
        """Binding 0: one info block of ``info_buffer`` (at a dynamic offset); bindings 1..: the
        (buffer, byte offset, byte size) of each tensor, in the kernel's binding order."""
        entries = [{"binding": 0, "resource": {"buffer": info_buffer, "offset": 0, "size": INFO_BYTES}}]
        entries += [{"binding": i + 1, "resource": {"buffer": b, "offset": o, "size": n}}
                    for i, (b, o, n) in enumerate(bindings)]
        return self.device.create_bind_group(layout=compiled.layout, entries=entries)

    def _info_ring(self):
        """The uniform ring holding one info block per recorded dispatch (SUBMIT_EVERY of them; the
        engine flushes when it is full, so a flush never needs more)."""
        if self._ring is None:
            self._ring = self.device.create_buffer(size=SUBMIT_EVERY * INFO_BYTES,
                                                   usage=wgpu.BufferUsage.UNIFORM | wgpu.BufferUsage.COPY_DST)
        return self._ring

    def _run_backward(self, bwd: Backward, bucket, dims, out, accumulate, args) -> dict[str, Tensor]:
        """Run each kernel of a backward pass with the arguments it takes; gradients by name."""
        fwd = bwd.forward.ir     # the forward's arguments are accepted even where the backward needs none
        known = set(bwd.inputs) | set(fwd.scalars) | {t.name for t in fwd.inputs + fwd.outputs}
        unknown = sorted(set(args) - known)
        if unknown:
            raise TypeError(f"{bwd.name}: unknown arguments {unknown} (it takes {', '.join(sorted(known))})")
        grads: dict[str, Tensor] = {}
        for k in bwd.kernels:
            names = [t.name for t in k.ir.inputs] + list(k.ir.scalars)
            own = {o.name for o in k.ir.outputs}
            grads.update(self.run(k, bucket=bucket, dims=dims, out={n: t for n, t in out.items() if n in own},
                                  accumulate=frozenset(accumulate) & own,
                                  **{n: args[n] for n in names if n in args}))
        return grads

    def _bind(self, ir, args: dict, dims: dict[str, int]) -> tuple[dict[str, int], int]:
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
        t_valid = sizes.get(SEQ_AXIS, 1)
        if t_valid < 1:
            raise ValueError(f"{ir.name}: sequence length T must be at least 1, got {t_valid}")
        return sizes, t_valid

    def _outputs(self, ir, spec: KernelSpec, sizes: dict[str, int], out: dict[str, Tensor],
                 args: dict) -> dict[str, Tensor]:
        result = {}
        for (name, dtype, padded), decl in zip(spec.outputs, ir.outputs):
            shape = tuple(sizes[a] for a in decl.shape)
            if name in ir.inouts:
                if name in out:
                    raise ValueError(f"{ir.name}: {name!r} is updated in place; pass it as an input, not in out=")
                result[name] = args[name]
                continue
            given = out.get(name)
            if given is None:
                result[name] = self.empty(shape, dtype, capacity=math.prod(padded))
            else:
                if given.dtype != dtype or given.shape != shape:
                    raise ValueError(f"{ir.name}: out[{name!r}] is {given.dtype}{list(given.shape)}, "
                                     f"expected {dtype}{list(shape)}")
                result[name] = given
        extra = set(out) - set(result)
        if extra:
            raise ValueError(f"{ir.name}: out has unknown outputs {sorted(extra)}")
        return result

    # ---- submission ----
    def flush(self) -> None:
        """Encode every recorded dispatch into one command encoder and submit it."""
        if not self._commands:
            return
        commands, self._commands = self._commands, []
        infos, self._infos = self._infos, []
        if infos:
            blob = b"".join(i.ljust(INFO_BYTES, b"\0") for i in infos)
            self.device.queue.write_buffer(self._info_ring(), 0, blob)
        step = MAX_QUERIES // 2 if self.timing else len(commands)
        for start in range(0, len(commands), step):
            self._submit(commands[start:start + step])
        self._keepalive.clear()

    def zero_(self, tensor: Tensor) -> Tensor:
        """Record clearing a tensor's elements to zero (in order with the recorded dispatches)."""
        nbytes = -(-tensor.size * ITEMSIZE[tensor.dtype] // 4) * 4
        self._commands.append(("clear", tensor.buffer, tensor.offset, nbytes))
        if self.capturing is not None:
            self.capturing.add_clear(tensor.buffer, tensor.offset, nbytes)
        self._keepalive.append(tensor.buffer)
        return tensor

    @contextlib.contextmanager
    def capture(self):
        """Record the work done inside into a replayable Program (see program.py); the work also
        runs as usual. If the block raises, no program is kept."""
        if self.capturing is not None:
            raise RuntimeError("engine.capture() is already open on this engine; captures do not nest")
        self.flush()
        program = self.capturing = Program(self, INFO_BYTES)
        try:
            yield program
        finally:
            self.capturing = None
        program.finish()

    def _submit(self, commands) -> None:
        encoder = self.device.create_command_encoder()
        if not self.timing:
            cpass = None
            for command in commands:
                if command[0] == "clear":      # clears run between compute passes
                    if cpass is not None:
                        cpass.end()
                        cpass = None
                    _, buffer, offset, nbytes = command
                    encoder.clear_buffer(buffer, offset, nbytes)
                    continue
                _, compiled, pipeline, bind_group, groups, info_at = command
                if cpass is None:
                    cpass = encoder.begin_compute_pass()
                cpass.set_pipeline(pipeline)
                cpass.set_bind_group(0, bind_group, [info_at])
                cpass.dispatch_workgroups(*groups)
            if cpass is not None:
                cpass.end()
            self.device.queue.submit([encoder.finish()])
            return
        # Timed: one pass per dispatch, and resolve exactly the queries written in this submission.
        dispatches = [c for c in commands if c[0] == "dispatch"]
        n = 2 * len(dispatches)
        qs = self.device.create_query_set(type=wgpu.QueryType.timestamp, count=max(n, 2))
        i = 0
        for command in commands:
            if command[0] == "clear":
                _, buffer, offset, nbytes = command
                encoder.clear_buffer(buffer, offset, nbytes)
                continue
            _, compiled, pipeline, bind_group, groups, info_at = command
            cpass = encoder.begin_compute_pass(timestamp_writes={
                "query_set": qs, "beginning_of_pass_write_index": 2 * i, "end_of_pass_write_index": 2 * i + 1})
            cpass.set_pipeline(pipeline)
            cpass.set_bind_group(0, bind_group, [info_at])
            cpass.dispatch_workgroups(*groups)
            cpass.end()
            i += 1
        if n == 0:
            self.device.queue.submit([encoder.finish()])
            return
        resolved = self.device.create_buffer(size=8 * n, usage=wgpu.BufferUsage.QUERY_RESOLVE | wgpu.BufferUsage.COPY_SRC)
        encoder.resolve_query_set(qs, 0, n, resolved, 0)
        self.device.queue.submit([encoder.finish()])
        stamps = np.frombuffer(self.device.queue.read_buffer(resolved), dtype=np.uint64)
        for i, (_, compiled, _, _, _, _) in enumerate(dispatches):
            self.timings.append((compiled.spec.kernel, float(stamps[2 * i + 1] - stamps[2 * i]) * 1e-9))

    def synchronize(self) -> None:
        """Flush and wait until the GPU has finished everything submitted."""
        self.flush()
        # Reading a buffer back waits for the queue (wgpu 0.32's on_submitted_work_done_sync is broken).
        if self._fence is None:
            self._fence = self.device.create_buffer(size=16, usage=wgpu.BufferUsage.COPY_SRC)
        self.device.queue.read_buffer(self._fence, 0, 4)
