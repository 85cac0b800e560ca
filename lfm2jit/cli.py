"""``python -m lfm2jit``: list the shipped kernels and dump any stage of what they compile to.

Dumping shows exactly what the engine would compile for the same sizes and bucket (the source as
parsed, the IR and its parts, each part's spec, the WGSL), so a kernel can be read, diffed or fed
to another shader compiler without running anything on a GPU.
"""
from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

from .driver import STAGES, Kernel, compile_source, grad, stages
from .engine import subgroup_feature
from .safefiles import untrusted_reason, write_atomic
from .dsl.errors import DslError
from .ir.nodes import SEQ_AXIS
from .ops import library
from .schedule import PORTABLE, MatrixConfig, Target
from .settings import SettingsError

# A device like Dawn on an H200 lists: f16 x f16 -> f32 subgroup matrices of 16x16x16, subgroups of 32,
# with 48 KiB of workgroup memory; lfm2jit raises its storage-buffer count and binding size past
# WebGPU's defaults (8, 128 MiB).
MATRIX_UNITS = Target((MatrixConfig(16, 16, 16, "f16", "f32"),), 32, 49152, storage_buffers=16, binding_bytes=1 << 30)

DEFAULT_SIZE = 64


class UsageError(Exception):
    """A bad command line: reported on stderr with exit status 2, like argparse's own errors."""


def positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}")
    return value


def axis_size(text: str) -> tuple[str, int]:
    """``AXIS=SIZE`` -> (axis, size)."""
    axis, sep, size = text.partition("=")
    if not sep or not axis.strip().isidentifier():
        raise argparse.ArgumentTypeError(f"{text!r} is not AXIS=SIZE (e.g. D=64)")
    try:
        return axis.strip(), positive_int(size)
    except argparse.ArgumentTypeError:
        raise argparse.ArgumentTypeError(f"{text!r}: SIZE must be a positive integer") from None


def lookup(name: str) -> Kernel:
    """A shipped kernel by name, or a kernel of a user's source file: ``FILE.lk`` (its one kernel) or
    ``FILE.lk:KERNEL``."""
    path, kernel_name = name, None
    if not name.endswith(".lk"):
        head, sep, tail = name.rpartition(":")
        if sep and head.endswith(".lk"):
            path, kernel_name = head, tail
    if path.endswith(".lk"):
        return lookup_file(Path(path), kernel_name)
    kernels = library.kernels()
    if name not in kernels:
        raise UsageError(f"no shipped kernel named {name!r}; available: {', '.join(sorted(kernels))} "
                         "(or give a source file: FILE.lk[:KERNEL])")
    return kernels[name]


def lookup_file(path: Path, kernel_name: str | None) -> Kernel:
    """The kernel ``kernel_name`` of the source file ``path`` (its only kernel when not named)."""
    try:
        text = path.read_text()
    except (OSError, UnicodeDecodeError) as e:
        raise UsageError(f"cannot read {path}: {getattr(e, 'strerror', None) or e}") from None
    try:
        module = compile_source(text, str(path))
    except DslError as e:       # file:line:column, the line, and what was expected
        raise UsageError(str(e)) from None
    names = [k.name for k in module]
    if not names:
        raise UsageError(f"{path} defines no kernel")
    if kernel_name is None:
        if len(names) > 1:
            raise UsageError(f"{path} defines {len(names)} kernels ({', '.join(names)}): "
                             f"name one as {path}:KERNEL")
        kernel_name = names[0]
    if kernel_name not in names:
        raise UsageError(f"{path} has no kernel named {kernel_name!r}; it defines {', '.join(names)}")
    return next(k for k in module if k.name == kernel_name)


def sizes_for(kernel: Kernel, given: dict[str, int], bucket: int) -> dict[str, int]:
    """A size for every symbolic axis: the given one, else T = the bucket and any other axis = 64."""
    axes = [a for a in kernel.ir.axes if a not in kernel.ir.fixed_dims and not a.endswith("+1")]   # V + 1 follows V
    unknown = sorted(set(given) - set(axes))
    if unknown:
        raise UsageError(f"kernel {kernel.name!r} has no axis {', '.join(unknown)}; its axes are {', '.join(axes)}")
    return {a: given.get(a, bucket if a == SEQ_AXIS else DEFAULT_SIZE) for a in axes}


def describe_sizes(sizes: dict[str, int]) -> str:
    return ", ".join(f"{a}={s}" for a, s in sizes.items())


# The device limits the planners read (engine.target_of, runtime/context.py), each with what it decides.
SCHEDULE_LIMITS = {
    "max-storage-buffer-binding-size": "a tensor larger than this is bound in pieces",
    "max-buffer-size": "the largest one buffer (a tensor or an arena of them) may be",
    "max-compute-workgroup-storage-size": "workgroup memory: bounds the GEMM and attention tiles",
    "max-compute-invocations-per-workgroup": "bounds the invocations of one workgroup (a tile's threads)",
    "max-storage-buffers-per-shader-stage": "the tensors (and pieces of them) one kernel may bind",
    "min-storage-buffer-offset-alignment": "where a piece of a tensor, or a tensor in an arena, may start",
}
LIMIT_MODE_HELP = {"raised": "the adapter's highest limits were asked for",
                   "default": "WebGPU's default limits were asked for, as browsers and many integrated GPUs give"}


def feature_lines(ctx) -> list[str]:
    """One line per optional feature that decides a schedule: present or absent, and what that means."""
    subgroups = bool(subgroup_feature(ctx.features))
    rows = [("shader-f16", ctx.has_f16, "f16 activations and f16 bases can run",
             "--f16, --lora-f16-base and f16 bases (add_lora(base_dtype='f16')) are refused with one error line"),
            ("subgroups", subgroups, "matrix attention's forward may meet a row's maximum by shuffles "
             "(MatrixAttentionTiles.shuffle, an autotuner candidate)",
             "MatrixAttentionTiles.shuffle is refused; nothing else uses them outside subgroup matrices"),
            ("subgroup matrices", ctx.has_subgroup_matrix,
             f"f16 products may run on the matrix units ({len(ctx.subgroup_matrix_configs)} configs)",
             "f16 products take the portable SIMT path")]
    return [f"  {name}: {'present' if has else 'absent'}: {yes if has else no}" for name, has, yes, no in rows]


def cache_lines(ctx, cache_dir) -> list[str]:
    """Where each layer of compiled pipelines is kept between processes (docs/design.md)."""
    if cache_dir is None:
        return ["LFM2JIT_CACHE_DIR unset: a new process compiles every pipeline again"]
    refused = untrusted_reason(cache_dir)
    if refused:
        return [f"LFM2JIT_CACHE_DIR={cache_dir} is not used: {refused}"]
    drivers = {os.environ.get(n) for n in ("MESA_SHADER_CACHE_DIR", "__GL_SHADER_DISK_CACHE_PATH")} - {None}
    dawn = (f"Dawn's blob cache (SPIR-V, Vulkan pipeline cache): {ctx.binaries.cache.files.root}"
            if ctx.binaries is not None
            else "no pipeline cache of the implementation's own (Dawn's with LFM2JIT_DAWN_BLOB_CACHE=on)")
    return [f"LFM2JIT_CACHE_DIR={cache_dir}: compiled pipelines kept between processes:",
            f"  the shipped kernels' syntax trees: {cache_dir / 'ast'}",
            f"  generated WGSL: {cache_dir}", f"  {dawn}",
            f"  the driver's shader disk cache (Mesa, NVIDIA): {', '.join(sorted(drivers))}"]


def cmd_info(args) -> None:
    """The WebGPU implementation and adapter lfm2jit would use, what each implementation lists, and
    the limits and features of the device it gets that decide the schedules."""
    if args.startup:
        return run_startup_bench()
    from .runtime.context import AdapterError, WgpuContext, _quiet_stderr, describe, ensure_runtime_dir
    from .runtime.implementations import IMPLEMENTATIONS
    from .settings import DAWN_ROBUSTNESS_TOGGLES, settings
    ensure_runtime_dir()    # before any driver opens, as WgpuContext.create does (else lavapipe complains)
    for name, impl in IMPLEMENTATIONS.items():
        try:
            with _quiet_stderr():   # as dawn_has_gpu: Dawn explains on stderr why it lists no adapter
                found = [describe(a) for a in impl.adapters()]
        except Exception as e:  # noqa: BLE001 - an implementation that cannot start is reported, not fatal
            found = [f"(cannot start: {type(e).__name__}: {e})"]
        print(f"{name}: {'; '.join(found) or '(no adapters)'}")
    try:
        ctx = WgpuContext.create()
    except AdapterError as e:
        raise UsageError(str(e)) from None
    opts = settings()
    print(f"\nLFM2JIT_WEBGPU={opts.webgpu}: {ctx.implementation}, adapter {ctx.name}")
    if ctx.implementation == "dawn":
        print(f"LFM2JIT_DAWN_ROBUSTNESS={opts.dawn_robustness}: device toggles "
              + (", ".join(DAWN_ROBUSTNESS_TOGGLES[opts.dawn_robustness]) or "none (Dawn clamps every access)"))
    print(f"features requested: {', '.join(sorted(ctx.features)) or 'none'}")
    print("subgroup matrix configs: " + ("; ".join(str(c) for c in ctx.subgroup_matrix_configs) or "none"))
    mode = opts.matrix_units
    print(f"LFM2JIT_MATRIX_UNITS={mode}: f16 products on "
          + {"off": "the portable SIMT path",
             "emulate": "the matrix templates, subgroup matrices emulated in plain WGSL (slow; for testing)"}.get(
              mode, "the matrix units" if ctx.subgroup_matrix_configs else "the portable SIMT path (no matrix units)"))
    print("\n" + "\n".join(cache_lines(ctx, opts.cache_dir)))
    print("\nfeatures that decide the schedules:")
    print("\n".join(feature_lines(ctx)))
    limits_mode = getattr(opts, "limits", "raised")
    print(f"\nLFM2JIT_LIMITS={limits_mode}: {LIMIT_MODE_HELP.get(limits_mode, '')}; the device's limits that decide "
          "the schedules:")
    for key, what in SCHEDULE_LIMITS.items():
        value = ctx.limits.get(key)
        size = "" if not isinstance(value, int) or value < 2 ** 20 else (
            f" ({value >> 20} MiB)" if value % 2 ** 20 == 0 else f" (about {round(value / 2 ** 20)} MiB)")
        print(f"  {key}: {'(not reported)' if value is None else value}{size}: {what}")


def run_startup_bench() -> None:
    """benches/startup.py at its defaults: it trains (the trainer is not part of this package), so
    it runs from a source checkout, as python -m lfm2jit.bench does."""
    import runpy
    script = Path(__file__).resolve().parents[1] / "benches" / "startup.py"
    if not script.exists():
        raise UsageError(f"--startup runs benches/startup.py, which is not here ({script}); it ships with the "
                         "source checkout (git clone, then pip install -e .)")
    sys.argv = [str(script)]
    runpy.run_path(str(script), run_name="__main__")


def cmd_list(args) -> None:
    for kernel in library.kernels().values():
        sizes = sizes_for(kernel, {}, DEFAULT_SIZE)
        schedules = ", ".join(k.specialize({a: sizes[a] for a in k.ir.axes if a in sizes}, DEFAULT_SIZE).template
                              for k in kernel.kernels)
        print(repr(kernel))
        print(f"    schedule: {schedules} (at {describe_sizes(sizes)}, bucket {DEFAULT_SIZE})")


def cmd_dump(args) -> None:
    kernel = lookup(args.name)
    sizes = sizes_for(kernel, dict(args.dim), args.bucket)
    if args.backward:   # the first output is the kernel's result; the others are saved statistics
        try:
            kernel = grad(kernel, cotangents=[kernel.ir.outputs[0].name])
        except DslError as e:
            raise UsageError(f"{kernel.name} has no backward:\n{e}") from None
    wanted = [s for s in STAGES if s == "wgsl" or getattr(args, s)]
    try:
        text = stages(kernel, sizes, args.bucket, MATRIX_UNITS if args.matrix_units else PORTABLE)
    except DslError as e:      # a part the target cannot run (e.g. more storage bindings than WebGPU's default 8)
        raise UsageError(f"{kernel.name} cannot be planned at {describe_sizes(sizes)}:\n{e}") from None
    for stage in wanted:
        if args.out is not None:
            path = args.out / f"{kernel.name}.{stage}"
            write_atomic(path, text[stage])
            print(f"wrote {path} ({describe_sizes(sizes)}, bucket {args.bucket})")
        elif stage == "wgsl":
            sys.stdout.write(text[stage])
        else:           # as WGSL comments, so the printed text stays one valid shader
            print(f"// ---- {stage} ----")
            print("".join(f"// {line}\n" for line in text[stage].splitlines()))


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m lfm2jit",
                                description="List lfm2jit's shipped kernels and dump what they compile to.")
    sub = p.add_subparsers(dest="command", required=True, metavar="COMMAND")
    ls = sub.add_parser("list", help="each shipped kernel's signature and the template it schedules to")
    ls.set_defaults(run=cmd_list)
    info = sub.add_parser("info", help="the WebGPU implementation and adapter in use, and the features and limits that "
                                           "decide the schedules")
    info.add_argument("--startup", action="store_true",
                      help="instead: cold and warm start-up, the time to the first finished train step of a fresh "
                           "process with an empty and with a warm cache (benches/startup.py; its flags there)")
    info.set_defaults(run=cmd_info)
    dump = sub.add_parser("dump", help="print (or write) what one kernel compiles to (WGSL by default)",
                          description="Print the stages one kernel (shipped, or from FILE.lk) compiles to at concrete sizes: "
                                      "the WGSL, and with --ast (the source as parsed), --ir (the IR, and each "
                                      "part when the kernel runs as several), --spec (each part's typed spec) "
                                      "those stages as WGSL comments before it. Axes not given with --dim "
                                      f"default: T to the bucket, any other to {DEFAULT_SIZE}.")
    dump.add_argument("name", metavar="NAME", help="shipped kernel name (see `list`), or a source file: "
                      "FILE.lk (its one kernel) or FILE.lk:KERNEL (one of several)")
    dump.add_argument("--bucket", type=positive_int, default=1, metavar="N",
                      help="length bucket: T is rounded up to a multiple of N (default 1)")
    dump.add_argument("--dim", type=axis_size, action="append", default=[], metavar="AXIS=SIZE",
                      help=f"size of one axis, repeatable (missing axes default: T=bucket, others {DEFAULT_SIZE})")
    dump.add_argument("--out", type=Path, metavar="DIR",
                      help="write DIR/NAME.wgsl (and DIR/NAME.ast, .ir, .spec) instead of printing")
    for stage, what in (("ast", "the kernel's source as parsed"), ("ir", "the typed IR and its parts"),
                        ("spec", "each part's spec: template, bindings, entry points, parameters")):
        dump.add_argument(f"--{stage}", action="store_true", help=f"also print {what}")
    dump.add_argument("--matrix-units", action="store_true",
                      help="schedule for a device with f16 subgroup matrices (16x16x16, subgroups of 32), as "
                           "Dawn on an NVIDIA GPU has: contractions of f16 operands use the matrix units")
    dump.add_argument("--backward", action="store_true",
                      help="dump the backward kernels autodiff derives: gradients of every float input "
                           "given a cotangent for the first output")
    dump.set_defaults(run=cmd_dump)
    return p


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    try:
        args.run(args)
    except (UsageError, SettingsError) as e:
        print(f"python -m lfm2jit {args.command}: error: {e}", file=sys.stderr)
        return 2
    except BrokenPipeError:     # `dump ... | head`: the reader has all it wanted
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
    return 0
