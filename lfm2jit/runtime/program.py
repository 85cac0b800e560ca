"""Program: engine work recorded once and replayed without running Python per kernel.

``engine.capture()`` records every dispatch and clear made while it is open (the work also runs
as usual). The program then owns a uniform buffer with one info block per call and its own bind
groups, so a replay only re-encodes the same (pipeline, bind group, workgroups) commands, after
patching named runtime scalars (a learning rate, a loss normalizer) in the info blocks:

    with engine.capture() as program:
        out = engine.run("adamw", p=p, g=g, m=m, v=v, **scalars)
    program.replay({"step_size": 1e-4})       # the same dispatches, one scalar changed

A replay runs the same kernels on the same buffers; new data reaches it by writing into the
tensors it reads (``Tensor.write``) before replaying. What changes the recorded work itself
(shapes, which tensors, which kernels) needs a new capture. Inside a capture, host reads and
writes of tensors raise: a replay could not repeat them. The buffers a program binds are reserved
in the pool while it lives (``close`` gives them back), so nothing else is handed one of them.
"""
from __future__ import annotations

import math
import numbers
import struct
import weakref

import wgpu

SCALARS_AT = 4            # an info block is the real length (u32), then the scalars (f32) in order
# A replay submits in pieces, so the GPU starts while the rest is encoded: the first piece small
# (the GPU idles until it is encoded), each next one twice the last, up to COMMANDS_PER_SUBMIT
# (benches/results/h200_sbs_first_submit_f16.json).
FIRST_SUBMIT = 16
COMMANDS_PER_SUBMIT = 256


class ReplayError(RuntimeError):
    """A program was used in a way it cannot be replayed (closed, unknown or ambiguous scalars)."""


class Program:
    def __init__(self, engine, info_bytes: int):
        self.engine = engine
        self.info_bytes = info_bytes                    # one info block per call, at call index * info_bytes
        self.calls = 0
        self._entries: list[tuple] = []                 # ("call", compiled, bindings, stages, info) | ("clear" | "copy", ...)
        self._scalars: dict[str, list[tuple[int, float]]] = {}   # name -> (byte offset in the infos, captured value)
        self._buffers: dict[int, object] = {}
        self._commands: list[tuple] | None = None      # in the engine's command format, once finished
        self._infos = bytearray()
        self._info_buffer = None
        self._dirty = False
        self._release = None                            # gives the reserved buffers back (close, or collection)

    # ---- capture (called by the engine while recording) ----
    def add_call(self, compiled, tensors, stages, names, values, info: bytes) -> None:
        self._entries.append(("call", compiled, [(t.buffer, t.offset, t.binding_size) for t in tensors], stages, info))
        block = self.calls * self.info_bytes
        for i, (name, value) in enumerate(zip(names, values)):
            self._scalars.setdefault(name, []).append((block + SCALARS_AT + 4 * i, value))
        for t in tensors:
            self._buffers[id(t.buffer)] = t.buffer
        self.calls += 1

    def add_transfer(self, command: tuple) -> None:
        """A recorded clear ("clear", buffer, offset, nbytes) or copy ("copy", src, offset, dst, offset, nbytes)."""
        self._entries.append(command)
        for buffer in command[1:]:
            if not isinstance(buffer, int):
                self._buffers[id(buffer)] = buffer

    def finish(self) -> None:
        """Lay out the info blocks, make the program's bind groups and reserve its buffers."""
        engine, device, size = self.engine, self.engine.device, self.info_bytes
        self._info_buffer = device.create_buffer(size=max(1, self.calls) * size,
                                                 usage=wgpu.BufferUsage.UNIFORM | wgpu.BufferUsage.COPY_DST)
        groups: dict[tuple, object] = {}
        commands = []
        for entry in self._entries:
            if entry[0] != "call":
                commands.append(entry)
                continue
            _, compiled, bindings, stages, info = entry
            key = (id(compiled.layout), tuple((id(b), o, s) for b, o, s in bindings))
            group = groups.get(key)
            if group is None:
                group = groups[key] = engine.make_bind_group(compiled, self._info_buffer, bindings)
            at = len(self._infos)              # this call's block: calls are laid out in capture order
            self._infos += info.ljust(size, b"\0")
            for stage, workgroups in stages:
                commands.append(("dispatch", compiled, stage, group, workgroups, at))
        self._commands = commands
        self._entries = []
        if self._infos:                        # a capture of clears and copies alone has no info blocks
            device.queue.write_buffer(self._info_buffer, 0, bytes(self._infos))
        buffers = list(self._buffers.values())
        engine.pool.reserve(buffers)
        self._release = weakref.finalize(self, engine.pool.unreserve, buffers)

    # ---- use ----
    @property
    def closed(self) -> bool:
        return self._commands is None

    def scalar_names(self) -> list[str]:
        """Scalars a replay can set: those with one value across the whole capture."""
        return sorted(n for n, uses in self._scalars.items() if len({v for _, v in uses}) == 1)

    def replay(self, scalars: dict[str, float] | None = None) -> None:
        """Record the captured work again (submitted at once), with these scalars changed.
        Every name must be a scalar the captured kernels take with one value throughout."""
        if self._commands is None:
            raise ReplayError("this program is closed (or its capture failed); capture the work again")
        patches = []
        for name, value in (scalars or {}).items():
            uses = self._scalars.get(name)
            if uses is None:
                raise ReplayError(f"scalar {name!r} is not taken by any captured kernel "
                                  f"(settable: {', '.join(self.scalar_names()) or 'none'})")
            if len({v for _, v in uses}) > 1:
                raise ReplayError(f"scalar {name!r} had {len({v for _, v in uses})} different values in the "
                                  "capture; a replay can only set a scalar that had one")
            if not isinstance(value, numbers.Real) or isinstance(value, bool) or not math.isfinite(float(value)):
                raise ValueError(f"scalar {name!r} must be a finite number, got {value!r}")
            patches.append((uses, float(value)))
        for uses, value in patches:
            packed = struct.pack("<f", value)
            for at, _ in uses:
                if self._infos[at:at + 4] != packed:
                    self._infos[at:at + 4] = packed
                    self._dirty = True
        engine = self.engine
        engine.flush()                     # work recorded before the replay runs before it
        if self._dirty:
            engine.device.queue.write_buffer(self._info_buffer, 0, bytes(self._infos))
            self._dirty = False
        start, size = 0, FIRST_SUBMIT
        while start < len(self._commands):
            engine._submit(self._commands[start:start + size])
            start, size = start + size, min(2 * size, COMMANDS_PER_SUBMIT)
        engine.dispatches += self.calls

    def close(self) -> None:
        """Give the reserved buffers back to the pool; the program cannot be replayed afterwards."""
        if self._release is not None:
            self._release()
        self._commands, self._buffers, self._info_buffer = None, {}, None
