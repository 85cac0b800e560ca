"""Recorder: compiles shaders into pipelines once, records dispatches, submits them together.

Work is recorded, not run: ``dispatch`` appends one command (pipeline, bind group, workgroups,
info block). What is recorded goes into one command encoder when ``flush`` is called, which
reading a tensor does by itself, and every SUBMIT_EVERY dispatches, so the GPU works through a
step while the host is still recording it. Nothing here knows the compiler: a shader arrives as
WGSL text with its binding table and entry points (``Shader``).

Where the implementation compiles pipelines asynchronously (Dawn, on its worker threads), or the
context has compile threads of its own (LFM2JIT_COMPILE_THREADS), ``build`` only issues the
compiles; the first flush waits for them. While compiles are pending, the periodic flush is put
off (up to RING_BLOCKS dispatches), so all of a window's compiles are issued before any wait and
run in parallel.
"""
from __future__ import annotations

import contextlib
import functools
import math
import re
from collections import OrderedDict
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass

import numpy as np
import wgpu

from .pool import BufferPool
from .program import Program
from .tensor import ITEMSIZE, Tensor, buffer_bytes, infer_dtype

MAX_GROUPS_PER_DIM = 65535
INFO_BYTES = 256           # one info block (t_valid + scalars) per dispatch: the uniform offset alignment
SUBMIT_EVERY = 32          # recorded dispatches per submission: the GPU starts on them while Python records more
RING_BLOCKS = 1024         # info blocks in the ring: the dispatches recorded while pipelines still compile
MAX_QUERIES = 4096
_ENABLES_F16 = re.compile(r"^\s*enable\b[^;]*\bf16\b", re.MULTILINE)    # WGSL's `enable f16;` directive


class ShaderCompileError(RuntimeError):
    """The adapter's shader compiler rejected generated WGSL (a compiler bug, not a user error)."""


@dataclass(frozen=True)
class Shader:
    """What the runtime needs to make pipelines: WGSL, the storage bindings (number, read-only),
    each entry point with its workgroup grid (an int is folded into x and y), and a cache key."""
    label: str
    key: str
    wgsl: str
    bindings: tuple[tuple[int, bool], ...]
    entry_points: tuple[tuple[str, int | tuple[int, int, int]], ...]


class Compiled:
    """A shader's pipelines, one per entry point, dispatched in order ("main", then e.g. "reduce"),
    and their bind group layout. Where they were issued asynchronously they are promises until
    ``pipelines`` is first read, which waits for them."""

    def __init__(self, shader: Shader, made: tuple, layout, issued: bool = False):
        self.shader = shader
        self.layout = layout
        self.made = made          # the pipelines, or promises of them while issued
        self.pending = issued

    @property
    def pipelines(self) -> tuple:
        if self.pending:
            try:
                self.made = tuple(p.sync_wait() for p in self.made)
            except Exception as e:  # noqa: BLE001 - the implementation's error, e.g. a workgroup over the limits
                raise refused(self.shader, e) from None
            self.pending = False
        return self.made

    @property
    def wgsl(self) -> str:
        return self.shader.wgsl

    @functools.cached_property
    def stages(self) -> list[tuple[int, tuple[int, int, int]]]:
        """(entry point index, workgroups) of each dispatch one call of this shader records."""
        return [(i, grid if isinstance(grid, tuple) else fold_workgroups(grid) + (1,))
                for i, (_, grid) in enumerate(self.shader.entry_points)]


class ThreadMade:
    """A pipeline being made synchronously on one of the recorder's compile threads, waited for
    as the implementation's own promises are (``sync_wait``)."""

    def __init__(self, future: Future):
        self.future = future

    def sync_wait(self):
        return self.future.result()


def refused(shader: Shader, error: Exception) -> ShaderCompileError:
    return ShaderCompileError(f"the adapter refused a pipeline for kernel {shader.label!r} (spec {shader.key}):\n"
                              f"{error}\n--- WGSL ---\n{shader.wgsl}")


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


class Recorder:
    def __init__(self, ctx, timing: bool = False):
        self.ctx = ctx
        self.device = ctx.device
        self.pool = BufferPool(ctx.device)
        self.timing = bool(timing and ctx.has_timestamps)
        self.timings: list[tuple[str, float]] = []   # (shader label, GPU seconds) per timed dispatch
        self._pipelines: dict[tuple[str, str], Compiled] = {}
        self.compiles_async = getattr(ctx, "compiles_async", False)
        # threads that make pipelines synchronously, all of a window's at once (0: the implementation's way)
        self.compile_threads = getattr(ctx, "compile_threads", 0)
        self._compile_pool: ThreadPoolExecutor | None = None
        self._compiling: list[Compiled] = []    # issued, not yet waited for
        self._commands: list[tuple] = []
        self._keepalive: list = []
        self.dispatches = 0
        self._fence = None
        self._infos: list[bytes] = []     # info block of each recorded dispatch, in order
        self._ring = None                 # uniform buffer the info blocks are written to at flush
        self._bind_groups = LRU(8192)     # (layout, ring, bindings) -> bind group
        self.capturing: Program | None = None
        ctx.register(self)

    # ---- pipelines ----
    def pipeline(self, key: str) -> Compiled | None:
        """The pipelines made before for the shader with this key, or None."""
        return self._pipelines.get((key, self.ctx.name))

    def build(self, shader: Shader) -> Compiled:
        features = getattr(self.ctx, "features", None)
        if features is not None and "shader-f16" not in features and _ENABLES_F16.search(shader.wgsl):
            # one line, before the shader compiler's multi-line refusal: f16 storage or math was asked
            # for (engine.run(f16=...), f16 tensors), and is refused, not widened to f32 behind the caller
            raise ValueError(f"kernel {shader.label!r} stores or computes f16 values, which needs the shader-f16 "
                             f"feature that adapter {self.ctx.name!r} lacks; run it on f32 tensors (no f16=)")
        try:
            module = self.device.create_shader_module(code=shader.wgsl, label=shader.label)
        except Exception as e:  # wgpu raises its own validation error types
            raise ShaderCompileError(f"the shader compiler rejected kernel {shader.label!r} "
                                     f"(spec {shader.key}):\n{e}\n--- WGSL ---\n{shader.wgsl}") from None
        compute = wgpu.ShaderStage.COMPUTE
        entries = [{"binding": 0, "visibility": compute,
                    "buffer": {"type": wgpu.BufferBindingType.uniform, "has_dynamic_offset": True}}]
        for binding, read_only in shader.bindings:
            kind = wgpu.BufferBindingType.read_only_storage if read_only else wgpu.BufferBindingType.storage
            entries.append({"binding": binding, "visibility": compute, "buffer": {"type": kind}})
        layout = self.device.create_bind_group_layout(entries=entries)
        pipeline_layout = self.device.create_pipeline_layout(bind_group_layouts=[layout])
        create, issued = self._pipeline_maker()
        try:
            made = tuple(create(layout=pipeline_layout, label=shader.label, compute={"module": module, "entry_point": name})
                         for name, _ in shader.entry_points)
        except Exception as e:  # noqa: BLE001 - e.g. a workgroup over the adapter's limits
            raise refused(shader, e) from None
        compiled = Compiled(shader, made, layout, issued=issued)
        if compiled.pending:
            self._compiling.append(compiled)
        self._pipelines[(shader.key, self.ctx.name)] = compiled
        return compiled

    def _pipeline_maker(self):
        """How ``build`` makes a pipeline, and whether what it returns is still being made."""
        if self.compile_threads:
            if self._compile_pool is None:
                self._compile_pool = ThreadPoolExecutor(self.compile_threads, thread_name_prefix="lfm2jit-compile")
            pool, make = self._compile_pool, self.device.create_compute_pipeline
            return (lambda **kw: ThreadMade(pool.submit(make, **kw))), True
        if self.compiles_async:
            return self.device.create_compute_pipeline_async, True
        return self.device.create_compute_pipeline, False

    def _wait_for_compiles(self) -> None:
        """Wait for the pipelines still compiling. One the adapter refused is forgotten, and the work
        recorded since the last flush, which cannot run without it, is dropped before the error."""
        compiling, self._compiling = self._compiling, []
        settle = getattr(self.ctx, "settle_compiles", None)
        promises = [p for compiled in compiling for p in compiled.made if not isinstance(p, ThreadMade)]
        if settle is not None and promises:     # all of them at once, then each is read without waiting
            settle(promises)
        refused = None
        for compiled in compiling:          # every one waited for, so none is left to fail mid-encoding
            try:
                compiled.pipelines
            except ShaderCompileError as e:
                self._pipelines.pop((compiled.shader.key, self.ctx.name), None)
                refused = refused or e
        if refused is not None:
            self._commands, self._infos = [], []
            self.ctx.release(self)
            self._keepalive.clear()
            raise refused

    # ---- tensors ----
    def empty(self, shape, dtype: str = "f32", capacity: int | None = None, exact: bool = False) -> Tensor:
        """A pooled tensor (contents undefined); ``capacity`` elements reserved, at least its size;
        ``exact``: a buffer of just that size, not its pool size class (see BufferPool.acquire). One
        larger than the device's largest buffer is held, unpooled, in parts (Tensor.empty); a reserved
        capacity that large is refused, as parts cannot grow into a bucket."""
        n = max(math.prod(shape), capacity or 0)
        largest = self.ctx.limits.get("max-buffer-size")
        if largest is not None and buffer_bytes(n, dtype) > largest and n == math.prod(shape):
            return Tensor.empty(self.ctx, shape, dtype)
        if largest is not None and buffer_bytes(n, dtype) > largest:
            raise ValueError(f"a {dtype}{list(shape)} work tensor needs {buffer_bytes(n, dtype)} bytes; the device's "
                             f"largest buffer is {largest} (max-buffer-size): use a shorter length bucket or a "
                             "smaller model, or raise the limits (LFM2JIT_LIMITS=raised)")
        buf = self.pool.acquire(buffer_bytes(n, dtype), exact)
        return Tensor(self.ctx, buf, shape, dtype, capacity=buf.size // ITEMSIZE[dtype], on_free=self.pool.release)

    def tensor(self, array, dtype: str | None = None) -> Tensor:
        """Upload a numpy array into a pooled tensor."""
        arr = np.asarray(array)
        t = self.empty(arr.shape, dtype or infer_dtype(arr))
        t.write(arr)
        return t

    # ---- recording ----
    def dispatch(self, compiled: Compiled, tensors: list[Tensor], info: bytes,
                 scalar_names: tuple[str, ...] = (), scalars: tuple[float, ...] = ()) -> None:
        """Record one call of a compiled shader over ``tensors`` (in binding order) with one info block."""
        if len(info) > INFO_BYTES:
            raise ValueError(f"{compiled.shader.label}: {len(scalars)} scalars do not fit the {INFO_BYTES}-byte "
                             "info block")
        stages = compiled.stages
        for _, groups in stages:
            if max(groups) > MAX_GROUPS_PER_DIM:
                raise ValueError(f"{compiled.shader.label}: dispatch of {groups} workgroups exceeds "
                                 f"{MAX_GROUPS_PER_DIM} per dimension")
        bind_group = self._bind_group(compiled, tensors)
        for stage, groups in stages:      # every stage reads the same info block
            self._record(("dispatch", compiled, stage, bind_group, groups, len(self._infos) * INFO_BYTES))
        self._infos.append(info)
        if self.capturing is not None:
            self.capturing.add_call(compiled, tensors, stages, scalar_names, scalars, info)
        self._keepalive.extend(t.buffer for t in tensors)   # buffers, not tensors: freed tensors recycle at once
        self.dispatches += 1
        if len(self._infos) == RING_BLOCKS or (len(self._infos) >= SUBMIT_EVERY and not self._compiling):
            self.flush()          # submit, so the GPU starts; the info ring is then reused

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
        (buffer, byte offset, byte size) of each tensor, in the shader's binding order."""
        entries = [{"binding": 0, "resource": {"buffer": info_buffer, "offset": 0, "size": INFO_BYTES}}]
        entries += [{"binding": i + 1, "resource": {"buffer": b, "offset": o, "size": n}}
                    for i, (b, o, n) in enumerate(bindings)]
        return self.device.create_bind_group(layout=compiled.layout, entries=entries)

    def _info_ring(self):
        """The uniform ring holding one info block per recorded dispatch (RING_BLOCKS of them; the
        recorder flushes when it is full, so a flush never needs more)."""
        if self._ring is None:
            self._ring = self.device.create_buffer(size=RING_BLOCKS * INFO_BYTES,
                                                   usage=wgpu.BufferUsage.UNIFORM | wgpu.BufferUsage.COPY_DST)
        return self._ring

    def _record(self, command: tuple) -> None:
        """Append a command; while any is unsubmitted the context holds this engine, so work recorded
        on an engine the caller let go of still runs at the next read (ctx.flush)."""
        if not self._commands:
            self.ctx.hold(self)
        self._commands.append(command)

    def _record_transfer(self, command: tuple) -> None:
        self._record(command)
        if self.capturing is not None:
            self.capturing.add_transfer(command)

    # ---- submission ----
    def flush(self) -> None:
        """Encode every recorded dispatch into one command encoder and submit it."""
        if not self._commands:
            return
        self._wait_for_compiles()
        commands, self._commands = self._commands, []
        infos, self._infos = self._infos, []
        self.ctx.release(self)
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
        for at, size in tensor._spans(nbytes):         # a tensor in several buffers: a clear per part
            piece = tensor.bytes_view(tensor.offset + at, size)
            command = ("clear", piece.buffer, piece.offset, size)
            self._record_transfer(command)
            self._keepalive.append(piece.buffer)
        return tensor

    def copy_rows(self, src: Tensor, dst: Tensor, n: int | None = None, src_start: int = 0,
                  dst_start: int = 0) -> Tensor:
        """Record copying rows ``src[src_start : src_start + n]`` of the leading axis into
        ``dst[dst_start : dst_start + n]`` (the same dtype and row size; ``n`` defaults to all of
        src), in order with the recorded dispatches. Rows may start anywhere: this is how an
        inference cache takes a step's rows, which a binding (offsets aligned to 256 bytes) cannot."""
        row = math.prod(src.shape[1:])
        n = src.shape[0] - src_start if n is None else n
        if src.dtype != dst.dtype or row != math.prod(dst.shape[1:]):
            raise ValueError(f"copy_rows: {src!r} and {dst!r} must have the same dtype and row size")
        if n < 1 or not (0 <= src_start and src_start + n <= src.shape[0] and 0 <= dst_start
                         and dst_start + n <= dst.shape[0]):
            raise ValueError(f"copy_rows: {n} rows from row {src_start} of {src!r} to row {dst_start} of {dst!r} "
                             "are out of range")
        src.whole_buffer("copy_rows")
        dst.whole_buffer("copy_rows")
        item = ITEMSIZE[src.dtype]
        at_src, at_dst, nbytes = src.offset + src_start * row * item, dst.offset + dst_start * row * item, n * row * item
        if nbytes % 4 or at_src % 4 or at_dst % 4:
            raise ValueError(f"copy_rows: {nbytes} bytes from byte {at_src} to byte {at_dst}; WebGPU copies whole "
                             "4-byte words")
        if src.buffer is dst.buffer and at_src < at_dst + nbytes and at_dst < at_src + nbytes:
            raise ValueError("copy_rows: the rows overlap in one buffer; WebGPU cannot copy them in place")
        command = ("copy", src.buffer, at_src, dst.buffer, at_dst, nbytes)
        self._record_transfer(command)
        self._keepalive.extend((src.buffer, dst.buffer))
        return dst

    def copy_into_buffer(self, src: Tensor, buffer, offset: int, replayed: bool = False) -> None:
        """Record copying all of ``src``'s elements into a raw wgpu buffer at byte ``offset`` (a
        host-mappable staging buffer, see staging.py), in order with the recorded dispatches. Inside
        capture() only when ``replayed``: the caller reads the buffer on the host after every replay
        of the program itself (a train step's gradients staged for data parallelism) and keeps the
        buffer alive while the program lives."""
        self._host_buffer_copy(src, buffer, offset, into_buffer=True, replayed=replayed)

    def copy_from_buffer(self, buffer, offset: int, dst: Tensor) -> None:
        """Record copying ``dst``'s size in bytes from byte ``offset`` of a raw wgpu buffer (a
        host-written staging buffer, see staging.py) into ``dst``, in order with the recorded
        dispatches. Not inside capture(): a replay would copy whatever the host left there."""
        self._host_buffer_copy(dst, buffer, offset, into_buffer=False)

    def _host_buffer_copy(self, tensor: Tensor, buffer, offset: int, into_buffer: bool, replayed: bool = False) -> None:
        """Record a copy of all of ``tensor`` into (or from) a staging buffer at byte ``offset``:
        refused inside capture() unless ``replayed``, and unless it moves whole words within the buffer."""
        name, side = ("copy_into_buffer", "read") if into_buffer else ("copy_from_buffer", "written")
        tensor.whole_buffer(name)
        if self.capturing is not None and not replayed:
            raise RuntimeError(f"{name} inside engine.capture(): its buffer is {side} on the host, which a "
                               "replayed program cannot repeat")
        nbytes = tensor.size * ITEMSIZE[tensor.dtype]
        if nbytes % 4 or offset % 4 or tensor.offset % 4 or offset + nbytes > buffer.size:
            where = (f"{nbytes} bytes of {tensor!r} to byte {offset} of a {buffer.size}-byte buffer" if into_buffer
                     else f"{nbytes} bytes from byte {offset} of a {buffer.size}-byte buffer into {tensor!r}")
            raise ValueError(f"{name}: {where}; WebGPU copies whole 4-byte words within the buffer")
        ends = (tensor.buffer, tensor.offset, buffer, offset) if into_buffer else (buffer, offset, tensor.buffer, tensor.offset)
        command = ("copy", *ends, nbytes)
        self._record_transfer(command)
        self._keepalive.extend((tensor.buffer, buffer))

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
                if command[0] != "dispatch":      # clears and copies run between compute passes
                    if cpass is not None:
                        cpass.end()
                        cpass = None
                    _transfer(encoder, command)
                    continue
                _, compiled, stage, bind_group, groups, info_at = command
                if cpass is None:
                    cpass = encoder.begin_compute_pass()
                cpass.set_pipeline(compiled.pipelines[stage])
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
            if command[0] != "dispatch":
                _transfer(encoder, command)
                continue
            _, compiled, stage, bind_group, groups, info_at = command
            cpass = encoder.begin_compute_pass(timestamp_writes={
                "query_set": qs, "beginning_of_pass_write_index": 2 * i, "end_of_pass_write_index": 2 * i + 1})
            cpass.set_pipeline(compiled.pipelines[stage])
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
            self.timings.append((compiled.shader.label, float(stamps[2 * i + 1] - stamps[2 * i]) * 1e-9))

    def synchronize(self) -> None:
        """Flush and wait until the GPU has finished everything submitted."""
        self.flush()
        # Reading a buffer back waits for the queue (wgpu 0.32's on_submitted_work_done_sync is broken).
        if self._fence is None:
            self._fence = self.device.create_buffer(size=16, usage=wgpu.BufferUsage.COPY_SRC)
        self.device.queue.read_buffer(self._fence, 0, 4)


def _transfer(encoder, command) -> None:
    """Encode a recorded clear or copy (outside any compute pass)."""
    if command[0] == "clear":
        _, buffer, offset, nbytes = command
        encoder.clear_buffer(buffer, offset, nbytes)
    else:
        _, src, src_offset, dst, dst_offset, nbytes = command
        encoder.copy_buffer_to_buffer(src, src_offset, dst, dst_offset, nbytes)
