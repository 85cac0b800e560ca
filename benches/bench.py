"""Kernel and train-step benchmarks: ``python -m lfm2jit.bench [--quick] [--json PATH] [--only NAME...]``.

Every line is one measured thing: its time per call (GPU timestamps summed over the call's
dispatches when the adapter has ``timestamp-query``, else host wall clock around a synchronised
loop; the fastest of 3 timings, as a GPU whose clocks dip only ever slows one), the work it does by napkin math (FLOPs and/or the fewest bytes it must move), the rate that
gives, and the fraction of the card's ceiling.

Groups (``--only`` takes group names):

  ref          torch fp32 GEMM (TF32 off), bf16 GEMM and a device-to-device copy, when torch has
               CUDA: the measured ceilings and references the other lines are compared with
  matmul       ``linear`` (y = x W^T) at the LFM2-350M projection shapes for T = 512 and 2048,
               and 4096^3; its two backward products (dX = dY W, dW += dY^T X) at the same shapes
  matrix       the same three products as --f16 runs them (f16 activations, f32 weights): on the
               matrix units (subgroup matrices, under Dawn) where the device has them
  tiles        the matmul template at other TileConfigs (4096^3 and the MLP shapes): what the
               template reaches when the schedule picks bigger tiles
  mtiles       the matrix-unit template at each of its candidate tiles, for fwd, fwd with an f16
               weight, fwd with an f32 result, dX and dW (4096^3 and the T = 2048 MLP/QKV
               shapes)
  staging      the matrix kernels' staging, old against new (issue 51): fwd, dX and dW at the planner's
               tiles with f16 workgroup tiles and with vec4<f16> ones, each also with two stages, at
               the mtiles shapes, and the f16 attention kernels at T = 2048 with each staging; each
               line's speedup over f16 staging, and its result's largest difference from theirs
  attention    causal GQA flash attention forward and backward, T = 512/2048, H=16, G=8, E=64
  atiles       the three f16 attention kernels (fwd, dq, dkdv) at the SIMT template's tiles and at each
               matrix-unit candidate, T = 512/2048
  conv         LFM2's fused gated short conv, forward and backward
  rmsnorm      rmsnorm (saving 1/rms), forward and backward
  pointwise    y = x + z (a pure bandwidth probe for generated elementwise kernels)
  xent         the LM head fused with masked cross-entropy (vocab 65536, D = 1024, T = 512/2048/4096), loss + dh
               + dE, f32 and f16 hidden states
  adamw        AdamW over every parameter tensor of LFM2-350M (354M elements); global grad norm
  lora         a frozen f16 linear layer with a rank-8 LoRA adapter, forward and backward (the
               adapter's gradients and the input gradient) at each LFM2-1.2B linear shape,
               T = 2048, f16 activations, beside the layer's own forward and dX without the
               adapter (both dX added into an existing gradient): what the adapters add to a
               LoRA step, dispatch by dispatch
  train        Trainer.train_step on an LFM2-350M-shaped model: 1x512, 1x2048, 8x512 (grad accum 8)
  packing      mixed-length windows (lengths drawn from the shipped chat data's histogram, tokenized),
               trained with --packing pad and concat on the train group's model: tokens/s of real
               tokens (padding not counted), the rows each mode computes, and the speedup

Ceilings: the datasheet H200 numbers (67 TFLOP/s fp32 without tensor cores, 4.8 TB/s HBM)
unless ``ref`` ran, whose measured copy bandwidth then replaces the datasheet bandwidth.
"""
from __future__ import annotations

import argparse
import contextlib
import functools
import gc
import itertools
import json
import math
import platform
import statistics
import sys
import time
import traceback
from dataclasses import asdict, dataclass, field, replace

import numpy as np

from lfm2jit import ComputeEngine, WgpuContext, grad
from lfm2jit.ops import library
from lfm2jit.schedule.attention import MATRIX_TEMPLATES, choose_tiles, matrix_tiles_problem
from lfm2jit.tune.tiles import MatrixAttentionTiles, TileConfig
from lfm2jit.settings import settings
from lfm2jit.tune.candidates import MATMUL as CANDIDATES
from lfm2jit.tune.candidates import for_spec
from lfm2jit.tune.candidates import matrix as matrix_candidates
from lfm2jit.tune.timing import warm_up

# Datasheet ceilings per adapter-name substring: (fp32 FLOP/s without tensor cores, dense f16
# FLOP/s on the tensor cores, bytes/s)
CEILINGS = {"H200": (67e12, 989e12, 4.8e12), "H100": (67e12, 989e12, 3.35e12)}
# groups whose products run on the matrix units where the device has them (elsewhere: lines
# with f16 in their name)
MATRIX_GROUPS = ("matrix", "mtiles", "staging", "atiles")
GROUPS = ("ref", "matmul", "matrix", "tiles", "mtiles", "staging", "attention", "atiles", "conv", "rmsnorm", "pointwise", "xent", "adamw",
          "lora", "grouped", "limits", "train", "packing")
QUICK_GROUPS = ("matmul", "attention", "conv", "rmsnorm", "pointwise", "xent", "adamw", "grouped", "limits", "train")
GiB = float(1 << 30)


@dataclass
class Line:
    group: str
    name: str
    shape: str
    seconds: float | None = None      # per call
    timer: str = "gpu"                # gpu (timestamps) | wall | cuda (torch events)
    flops: float = 0.0
    bytes: float = 0.0
    bound: str = "compute"            # which ceiling the fraction is taken against: compute, matrix, memory
    wall_seconds: float | None = None  # host wall clock per call (recording + submit + wait)
    extra: dict = field(default_factory=dict)
    error: str | None = None

    def tflops(self) -> float | None:
        return self.flops / self.seconds / 1e12 if self.seconds and self.flops else None

    def gbs(self) -> float | None:
        return self.bytes / self.seconds / 1e9 if self.seconds and self.bytes else None


class Ceilings:
    def __init__(self, adapter_name: str):
        self.flops = self.matrix_flops = self.bw = None
        self.source = "none (unknown adapter)"
        for key, (f, m, b) in CEILINGS.items():
            if key.lower() in adapter_name.lower():
                self.flops, self.matrix_flops, self.bw, self.source = f, m, b, f"{key} datasheet"

    def note(self) -> str:
        return f"# ceilings: {self.source}" + (
            f"; fp32 {self.flops / 1e12:.0f} TFLOP/s, f16 on the matrix units {self.matrix_flops / 1e12:.0f}"
            if self.flops else "")

    def fraction(self, line: Line) -> float | None:
        """Of the fp32 ceiling, or of the f16 tensor-core one for a line on the matrix units."""
        if not line.seconds:
            return None
        ceiling = self.matrix_flops if line.bound == "matrix" else self.flops
        if line.bound in ("compute", "matrix") and line.flops and ceiling:
            return line.flops / line.seconds / ceiling
        if line.bound == "memory" and line.bytes and self.bw:
            return line.bytes / line.seconds / self.bw
        return None


# ---------------------------------------------------------------- timing helpers

# 4096^3 and the LFM2-350M MLP and QKV products at T = 2048 (M x N x K)
MTILE_SHAPES = [(4096, 4096, 4096), (2048, 4608, 1024), (2048, 1024, 4608), (2048, 3072, 1024)]
# each tile is timed this many times and the fastest kept: a shared GPU's other work slows some
# timings several-fold, never speeds one up
MTILE_ROUNDS = 3
MTILE_PRODUCTS = ("fwd", "fwd_w16", "fwd_y32", "dx", "dw")


def _median_split(timings: list[tuple[str, float]], reps: int) -> tuple[float, dict[str, float]]:
    """Median over reps of the summed GPU time of each rep's dispatches, and per-kernel means."""
    n = len(timings) // reps
    per = [sum(s for _, s in timings[i * n:(i + 1) * n]) for i in range(reps)]
    by: dict[str, float] = {}
    for k, s in timings:
        by[k] = by.get(k, 0.0) + s / reps
    return statistics.median(per), by


def time_engine(engine, record, reps: int) -> tuple[float, str, float, dict[str, float]]:
    """Time ``record()`` (which records dispatches): (seconds per call, timer, wall per call, per kernel).
    The GPU is kept busy with it first (timing.warm_up, which also compiles): timed cold, a GPU is
    still raising its clocks."""
    warm_up(engine, record)
    engine.timings.clear()
    t0 = time.perf_counter()
    for _ in range(reps):
        record()
    engine.synchronize()
    wall = (time.perf_counter() - t0) / reps
    if engine.timing and engine.timings and len(engine.timings) % reps == 0:
        gpu, by = _median_split(engine.timings, reps)
        engine.timings.clear()
        return gpu, "gpu", wall, by
    engine.timings.clear()
    return wall, "wall", wall, {}


def time_in_turn(engine, calls: dict, reps: int, rounds: int = MTILE_ROUNDS) -> dict:
    """``time_engine`` of every call of ``calls`` (key -> record), ``rounds`` rounds taking each in
    turn, the fastest of each kept: a clock dip then slows one round of every call, not all the
    rounds of the one timed during it."""
    best = {}
    for _ in range(rounds):
        for key, record in calls.items():
            t = time_engine(engine, record, reps)
            if key not in best or t[0] < best[key][0]:
                best[key] = t
    return best


def time_dispatches(engine, record, reps: int, warm: bool = True) -> list[tuple[str, float]]:
    """(kernel, GPU seconds) of each dispatch ``record()`` makes, in order, the fastest of ``reps``
    calls each (empty without timestamps): which of a call's dispatches holds its time. ``warm``:
    keep the GPU busy with it first (without, the caller has)."""
    if warm:
        warm_up(engine, record)
    engine.timings.clear()
    for _ in range(reps):
        record()
    engine.synchronize()
    timings, engine.timings[:] = list(engine.timings), []
    if not engine.timing or not timings or len(timings) % reps:
        return []
    n = len(timings) // reps
    return [(timings[i][0], min(timings[r * n + i][1] for r in range(reps))) for i in range(n)]


def time_best(engine, record, reps: int, rounds: int = MTILE_ROUNDS) -> tuple[float, str, float, dict[str, float]]:
    """``time_engine`` ``rounds`` times, the fastest kept: a GPU whose clocks dropped while the host
    compiled, or that another tenant shares, slows some timings several-fold, never speeds one up."""
    return min((time_engine(engine, record, reps) for _ in range(rounds)), key=lambda t: t[0])


def _attention_backward_kernels(engine, att, args: dict):
    """The backward's dq and dk/dv kernels of attention ``att``; ``args`` gains the D pass's output (dO . O
    per query, which dk/dv reads), run once here."""
    dq, d_pass, dkdv = grad(att, ["q", "k", "v"], ["o"]).kernels
    (name,) = d_pass.outputs
    args[name] = engine.run(d_pass, **{n: args[n] for n in d_pass.inputs})[name]
    return dq, dkdv


def _rand(rng, shape, scale=1.0):
    return (rng.standard_normal(shape, dtype=np.float32) * scale).astype(np.float32)


# ---------------------------------------------------------------- kernel benchmarks

class Bench:
    def __init__(self, ctx, quick: bool, reps: int, log=print, tile_shapes=None, tiles_matching=None, products=None,
                 grouped_dtypes=("f32", "f16"), grouped_routing="random", xent_chunks=(4096,), xent_dtypes=("f32", "f16")):
        self.ctx = ctx
        self.xent_chunks = xent_chunks
        self.xent_dtypes = xent_dtypes
        self.grouped_dtypes = grouped_dtypes
        self.grouped_routing = grouped_routing
        self.tile_shapes = tile_shapes
        self.tiles_matching = tiles_matching
        self.products = products
        self.quick = quick
        self.reps = reps
        self.log = log
        self.engine = ComputeEngine(ctx, timing=True)
        self.rng = np.random.default_rng(0)
        self.ceil = Ceilings(ctx.name)
        self.lines: list[Line] = []

    def add(self, line: Line) -> Line:
        if (line.bound == "compute" and self.engine.target.matrix_configs
                and (line.group in MATRIX_GROUPS or "f16" in line.name)):
            line.bound = "matrix"        # its fraction is of the f16 matrix units' ceiling
        self.lines.append(line)
        self.log(format_line(line, self.ceil))
        return line

    def guarded(self, group: str, name: str, shape: str, fn):
        """Run one benchmark; a failure becomes a line with the error instead of ending the run."""
        try:
            fn()
        except Exception as e:   # noqa: BLE001 - a benchmark run reports every failure and goes on
            self.add(Line(group, name, shape, error=f"{type(e).__name__}: {e}".splitlines()[0][:300]))
            traceback.print_exc(file=sys.stderr)
        finally:
            gc.collect()
            self.engine.synchronize()

    # ---- reference ceilings through torch ----
    def ref(self):
        try:
            import torch
        except ImportError:
            self.log("# ref: torch not importable; skipped")
            return
        if not torch.cuda.is_available():
            self.log("# ref: torch has no CUDA device; skipped")
            return
        torch.backends.cuda.matmul.allow_tf32 = False
        torch.backends.cudnn.allow_tf32 = False
        torch.set_float32_matmul_precision("highest")
        dev = torch.device("cuda")

        def cuda_time(fn, reps=20, warmup=3):
            for _ in range(warmup):
                fn()
            torch.cuda.synchronize()
            ts = []
            for _ in range(reps):
                a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                a.record()
                fn()
                b.record()
                torch.cuda.synchronize()
                ts.append(a.elapsed_time(b) / 1e3)
            return statistics.median(ts)

        n = 1 << 28   # 1 GiB of f32, copied: 2 GiB moved
        src = torch.randn(n, device=dev)
        dst = torch.empty_like(src)
        s = cuda_time(lambda: dst.copy_(src))
        line = self.add(Line("ref", "torch_copy", f"{n * 4 / GiB:.0f} GiB", s, "cuda", bytes=2 * n * 4,
                             bound="memory"))
        measured_bw = line.bytes / s
        del src, dst
        for m, nn, k in dict.fromkeys(self.gemm_shapes() + list(self.tile_shapes or MTILE_SHAPES)):
            for name, dtype in (("torch_gemm", torch.float32), ("torch_gemm_bf16", torch.bfloat16)):
                x = torch.randn(m, k, device=dev, dtype=dtype)
                w = torch.randn(nn, k, device=dev, dtype=dtype)
                s = cuda_time(lambda: x @ w.T)
                self.add(Line("ref", name, f"{m}x{nn}x{k}", s, "cuda", flops=2.0 * m * nn * k))
                del x, w
        torch.cuda.empty_cache()
        self.ceil.bw = measured_bw
        self.ceil.source += f"; bandwidth measured by torch copy: {measured_bw / 1e12:.2f} TB/s"

    def gemm_shapes(self) -> list[tuple[int, int, int]]:
        """(M, N, K) of y[M, N] = x[M, K] W[N, K]^T."""
        if self.quick:
            return [(64, 96, 80), (128, 128, 128)]
        shapes = []
        for t in (512, 2048, 4096):      # issue 51 names LFM2-350M's products at T = 2048 and 4096
            shapes += [(t, 1024, 1024), (t, 3072, 1024), (t, 4608, 1024), (t, 1024, 4608)]
        return shapes + [(4096, 4096, 4096)]

    # ---- matmul ----
    def matmul(self):
        self._linear_products("matmul", "f32")

    def matrix(self):
        """The three products as --f16 runs them (activations and dY f16, weights and dW f32): on
        the matrix units where the device has f16 subgroup matrices (Dawn), SIMT elsewhere."""
        self._linear_products("matrix", "f16")

    def _linear_products(self, group: str, act: str):
        lin = library.get("linear").without({"r"})
        dx_k, dw_k = grad(lin, ["x"]), grad(lin, ["w"])
        if act == "f16":
            lin, dx_k, dw_k = lin.variant("f16", {"w"}), dx_k.variant("f16", {"w"}), dw_k.variant("f16", {"d_w"})
        size = 2 if act == "f16" else 4
        for m, n, k in self.gemm_shapes():
            shape = f"{m}x{n}x{k}"
            flops = 2.0 * m * n * k

            def one(m=m, n=n, k=k, shape=shape, flops=flops):
                e = self.engine
                x, w = e.tensor(_rand(self.rng, (m, k)), act), e.tensor(_rand(self.rng, (n, k)))
                y = e.empty((m, n), act)
                template = lin.kernels[0].specialize({"T": m, "K": k, "N": n}, 1, target=e.target).template
                s, timer, wall, _ = time_best(e, lambda: e.run(lin, x=x, w=w, out={"y": y}), self.reps)
                self.add(Line(group, "linear_fwd", shape, s, timer, flops, size * (m * k + m * n) + 4.0 * n * k,
                              wall_seconds=wall, extra={"template": template}))
                dy = e.tensor(_rand(self.rng, (m, n)), act)
                dx = e.empty((m, k), act)
                s, timer, wall, _ = time_best(
                    e, lambda: e.run(dx_k, x=x, w=w, d_y=dy, out={"d_x": dx}), self.reps)
                self.add(Line(group, "linear_dx", shape, s, timer, flops, size * (m * n + m * k) + 4.0 * n * k,
                              wall_seconds=wall, extra={"product": f"dX[{m},{k}] = dY[{m},{n}] W[{n},{k}]"}))
                dw = e.zero_(e.empty((n, k)))
                s, timer, wall, _ = time_best(
                    e, lambda: e.run(dw_k, x=x, w=w, d_y=dy, out={"d_w": dw}, accumulate={"d_w"}), self.reps)
                self.add(Line(group, "linear_dw", shape, s, timer, flops, size * (m * n + m * k) + 8.0 * n * k,
                              wall_seconds=wall, extra={"product": f"dW[{n},{k}] += dY^T X (sum over {m})"}))
            self.guarded(group, "linear", shape, one)

    def tiles(self):
        """The same template at other tile configurations (4096^3 and the T=2048 MLP shapes), each
        checked against float64 on its first rows, then all of a shape's timed in turn (time_in_turn)."""
        if self.quick:
            shapes = [(64, 96, 80)]
            configs = [TileConfig(), TileConfig(64, 64, 8, 8, 8), TileConfig(128, 128, 8, 8, 8)]
        else:
            shapes = self.tile_shapes or [(4096, 4096, 4096), (2048, 4608, 1024), (2048, 1024, 4608)]
            configs = list(CANDIDATES)          # what the autotuner chooses from
        lin = library.get("linear").without({"r"})
        for m, n, k in shapes:
            shape = f"{m}x{n}x{k}"

            def one(m=m, n=n, k=k, shape=shape):
                e = self.engine
                xa, wa = _rand(self.rng, (m, k)), _rand(self.rng, (n, k))
                x, w = e.tensor(xa), e.tensor(wa)
                y = e.empty((m, n))
                rows = min(m, 64)
                want = xa[:rows].astype(np.float64) @ wa.astype(np.float64).T
                errors = {}
                for cfg in configs:
                    e.run(lin, x=x, w=w, out={"y": y}, tiles=cfg)
                    errors[cfg] = float(np.abs(y.numpy()[:rows] - want).max() / np.abs(want).max())
                timed = time_in_turn(e, {cfg: functools.partial(e.run, lin, x=x, w=w, out={"y": y}, tiles=cfg)
                                         for cfg in configs}, self.reps)
                for cfg, (s, timer, wall, _) in timed.items():
                    self.add(Line("tiles", f"linear[{cfg.label}]", shape, s, timer, 2.0 * m * n * k,
                                  4.0 * (m * k + n * k + m * n), wall_seconds=wall,
                                  extra={"tiles": asdict(cfg), "rel_err_first_rows": errors[cfg]}))
            self.guarded("tiles", "linear", shape, one)

    def _matching(self, candidates):
        """The candidates whose label contains one of --tiles-matching's texts (all without it)."""
        return [c for c in candidates if not self.tiles_matching or any(m in c.label for m in self.tiles_matching)]

    def mtiles(self):
        """The matrix-unit template at each autotuner candidate for its shape (timed in turn, round by
        round, the planner's pick among them), for the three products
        of a linear layer in --f16 mode, the forward with the weight stored as f16 too (no
        conversion while staging), and the forward with an f32 result (its fragments stored
        straight to memory, no f16 epilogue through workgroup memory): 4096^3 and the LFM2-350M
        shapes at T = 2048 (or --tile-shapes; a shape with N = 8 gives LoRA's rank-8 products)."""
        if not self.engine.target.matrix_configs:
            self.add(Line("mtiles", "matrix_tiles", "-", error="the device has no f16 subgroup matrices"))
            return
        shapes = self.tile_shapes or MTILE_SHAPES
        lin = library.get("linear").without({"r"})
        products = {"fwd": lin.variant("f16", {"w"}), "fwd_w16": lin.variant("f16"),
                    "fwd_y32": lin.variant("f16", {"w", "y"}),
                    "dx": grad(lin, ["x"]).variant("f16", {"w"}).kernels[0],
                    "dw": grad(lin, ["w"]).variant("f16", {"d_w"}).kernels[0]}
        for m, n, k in shapes:
            shape = f"{m}x{n}x{k}"

            def one(m=m, n=n, k=k, shape=shape):
                e = self.engine
                xa, wa, dya = _rand(self.rng, (m, k)), _rand(self.rng, (n, k)), _rand(self.rng, (m, n))
                args = {"x": e.tensor(xa, "f16"), "w": e.tensor(wa), "d_y": e.tensor(dya, "f16")}
                w16 = e.tensor(wa, "f16")
                for name, kern in products.items():
                    if self.products and name not in self.products:
                        continue
                    spec = kern.kernels[0].specialize({"T": m, "K": k, "N": n}, 1, target=e.target)
                    given = {t.name: (w16 if name == "fwd_w16" and t.name == "w" else args[t.name])
                             for t in kern.ir.inputs}
                    # the planner's pick always (benches/probes/best_tiles.py compares the rest against it),
                    # every candidate timed in turn, round by round
                    configs = dict.fromkeys((spec.params.tiles, *self._matching(matrix_candidates(spec.params))))
                    timed = time_in_turn(e, {cfg: functools.partial(e.run, kern, tiles=cfg, **given) for cfg in configs},
                                         self.reps)
                    for cfg, (s, timer, wall, _) in timed.items():
                        self.add(Line("mtiles", f"{name}[{cfg.label}]", shape, s, timer, 2.0 * m * n * k,
                                      2.0 * (m * k + n * k + m * n), wall_seconds=wall,
                                      extra={"tiles": asdict(cfg), "default": cfg == spec.params.tiles}))
            self.guarded("mtiles", "matrix", shape, one)

    def staging(self):
        """The matrix kernels' staging, old against new: each product of a linear layer in --f16 mode
        at the planner's tiles staged through f16 workgroup tiles (four 2-byte stores a fetched vec4)
        and through vec4<f16> ones (one store; fragments loaded in vec4 units), each with one and two
        stages, at MTILE_SHAPES (or --tile-shapes); then the three f16 attention kernels at T = 2048
        (H = 16, G = 8, E = 64) at their picks with each staging."""
        if not self.engine.target.matrix_configs:
            self.add(Line("staging", "matrix_tiles", "-", error="the device has no f16 subgroup matrices"))
            return
        lin = library.get("linear").without({"r"})
        products = {"fwd": (lin.variant("f16", {"w"}), "y"), "dx": (grad(lin, ["x"]).variant("f16", {"w"}), "d_x"),
                    "dw": (grad(lin, ["w"]).variant("f16", {"d_w"}), "d_w")}
        for m, n, k in self.tile_shapes or ([(96, 128, 160)] if self.quick else MTILE_SHAPES):
            shape = f"{m}x{n}x{k}"

            def one(m=m, n=n, k=k, shape=shape):
                e = self.engine
                args = {"x": e.tensor(_rand(self.rng, (m, k)), "f16"), "w": e.tensor(_rand(self.rng, (n, k))),
                        "d_y": e.tensor(_rand(self.rng, (m, n)), "f16")}
                for name, (kern, out) in products.items():
                    given = {t.name: args[t.name] for t in kern.ir.inputs}
                    pick = kern.kernels[0].specialize({"T": m, "K": k, "N": n}, 1, target=e.target).params.tiles
                    staged = [replace(pick, vec4=v) for v in (False, True)]
                    staged += [replace(t, stages=3 - t.stages, prefetch=True) for t in staged]
                    self._staging_lines(name, shape, staged, pick, lambda cfg: e.run(kern, tiles=cfg, **given)[out],
                                        2.0 * m * n * k, 2.0 * (m * k + n * k + m * n))
            self.guarded("staging", "matrix", shape, one)
        t, h, g, e_ = (96, 4, 2, 16) if self.quick else (2048, 16, 8, 64)
        shape = f"T{t} H{h} G{g} E{e_}"

        def attention():
            e = self.engine
            att = library.get("attention").variant("f16")
            q, k, v, do = (e.tensor(_rand(self.rng, s).astype(np.float16))
                           for s in ((t, h, e_), (t, g, e_), (t, g, e_), (t, h, e_)))
            r = e.run(att, q=q, k=k, v=v)
            args = {"q": q, "k": k, "v": v, "o": r["o"], "lse": r["lse"], "d_o": do}
            dq, dkdv = _attention_backward_kernels(e, att, args)
            flops = 2.0 * t * t * h * e_
            for mode, kern, out, f in (("fwd", att.kernels[0], "o", flops), ("dq", dq, "d_q", flops),
                                       ("dkdv", dkdv, "d_k", 1.5 * flops)):
                pick = kern.kernels[0].specialize({"B": 1, "T": t, "H": h, "G": g, "E": e_}, 1, target=e.target).params.tiles
                if not isinstance(pick, MatrixAttentionTiles):
                    self.add(Line("staging", mode, shape, error=f"stays SIMT here ({pick})"))
                    continue
                given = {n: args[n] for n in kern.inputs}
                self._staging_lines(mode, shape, [replace(pick, vec4=v) for v in (False, True)], pick,
                                    lambda cfg: e.run(kern, tiles=cfg, **given)[out], f,
                                    label=lambda c: f"matrix {c.rows}x{c.tile}{'/v4' if c.vec4 else ''}")
        self.guarded("staging", "attention", shape, attention)

    def _staging_lines(self, name, shape, configs, pick, run, flops, nbytes=0.0, label=lambda c: c.label):
        """A line per tiles of ``configs`` (``run(tiles)`` records the kernel and gives its output), all
        timed in turn: the first that runs is the baseline, every line has its speedup over it and its
        result's largest difference from it (the same sums in the same order: 0 where vec4 offsets
        mean what Dawn says)."""
        results = {}
        for cfg in configs:
            try:
                results[cfg] = run(cfg).numpy().astype(np.float64)
            except ValueError as err:      # e.g. two stages of the largest tiles do not fit
                self.add(Line("staging", f"{name}[{label(cfg)}]", shape, error=str(err)[:300]))
        timed = time_in_turn(self.engine, {cfg: functools.partial(run, cfg) for cfg in results}, self.reps)
        if not timed:
            return
        base, want = timed[next(iter(timed))][0], next(iter(results.values()))
        for cfg, (s, timer, wall, _) in timed.items():
            self.add(Line("staging", f"{name}[{label(cfg)}]", shape, s, timer, flops, nbytes, wall_seconds=wall,
                          extra={"tiles": asdict(cfg), "default": cfg == pick, "speedup_over_f16": base / s,
                                 "max_diff_vs_f16": float(np.abs(results[cfg] - want).max())}))

    # ---- attention ----
    def attention(self):
        """f32 (SIMT) and f16 q, k, v (the matrix units where the device has them, else SIMT)."""
        h, g, e_ = (4, 2, 16) if self.quick else (16, 8, 64)
        for dtype in ("f32", "f16"):
            att = library.get("attention") if dtype == "f32" else library.get("attention").variant("f16")
            bwd = grad(att, ["q", "k", "v"], ["o"])
            suffix = "" if dtype == "f32" else "_f16"
            npdt = np.float32 if dtype == "f32" else np.float16
            for t in ((64, 96) if self.quick else (512, 2048)):
                shape = f"T{t} H{h} G{g} E{e_}"
                fwd_flops = 2.0 * t * t * h * e_          # causal: half of 2 products of 2*T*T*E per head
                bwd_flops = 2.5 * fwd_flops               # FA2 convention: 5 products (S, dP, dV, dQ, dK)

                def one(t=t, shape=shape, fwd_flops=fwd_flops, bwd_flops=bwd_flops, att=att, bwd=bwd, suffix=suffix,
                        npdt=npdt):
                    e = self.engine
                    q, k, v = (e.tensor(_rand(self.rng, s).astype(npdt)) for s in ((t, h, e_), (t, g, e_), (t, g, e_)))
                    s, timer, wall, _ = time_best(e, lambda: e.run(att, q=q, k=k, v=v), self.reps)
                    io = np.dtype(npdt).itemsize * (2 * t * h * e_ + 2 * t * g * e_ + t * h)
                    template = att.specialize({"B": 1, "T": t, "H": h, "G": g, "E": e_}, 1, target=e.target).template
                    self.add(Line("attention", "attention_fwd" + suffix, shape, s, timer, fwd_flops, io,
                                  wall_seconds=wall, extra={"template": template}))
                    r = e.run(att, q=q, k=k, v=v)
                    do = e.tensor(_rand(self.rng, (t, h, e_)).astype(npdt))
                    s, timer, wall, by = time_best(
                        e, lambda: e.run(bwd, q=q, k=k, v=v, o=r["o"], lse=r["lse"], d_o=do), self.reps)
                    self.add(Line("attention", "attention_bwd" + suffix, shape, s, timer, bwd_flops, 2 * io,
                                  wall_seconds=wall, extra={"per_kernel_s": by}))
                self.guarded("attention", "attention" + suffix, shape, one)

    def atiles(self):
        """Each f16 attention kernel (fwd, dq, dkdv; H=16, G=8, E=64) at the SIMT template's tiles and at
        every matrix-unit candidate the autotuner tries: which one the planner should pick, per T."""
        if not self.engine.target.matrix_configs:
            self.add(Line("atiles", "attention_tiles", "-", error="the device has no f16 subgroup matrices"))
            return
        h, g, e_ = (4, 2, 16) if self.quick else (16, 8, 64)
        att = library.get("attention").variant("f16")
        for t in ((64, 96) if self.quick else (512, 2048)):
            shape = f"T{t} H{h} G{g} E{e_}"

            def one(t=t, shape=shape):
                e = self.engine
                q, k, v, do = (e.tensor(_rand(self.rng, s).astype(np.float16))
                               for s in ((t, h, e_), (t, g, e_), (t, g, e_), (t, h, e_)))
                r = e.run(att, q=q, k=k, v=v)
                args = {"q": q, "k": k, "v": v, "o": r["o"], "lse": r["lse"], "d_o": do}
                dq, dkdv = _attention_backward_kernels(e, att, args)
                fwd_flops = 2.0 * t * t * h * e_
                for mode, kern, flops in (("fwd", att.kernels[0], fwd_flops), ("dq", dq, 1.0 * fwd_flops),
                                          ("dkdv", dkdv, 1.5 * fwd_flops)):
                    spec = kern.kernels[0].specialize({"B": 1, "T": t, "H": h, "G": g, "E": e_}, 1, target=e.target)
                    matrix = tuple(c for c in (for_spec(spec) if spec.template in MATRIX_TEMPLATES.values() else ())
                                   if matrix_tiles_problem(mode, c, e_, e.target) is None)
                    given = {n: args[n] for n in kern.inputs}
                    configs = dict.fromkeys((choose_tiles(mode, e_), *matrix))
                    timed = time_in_turn(e, {cfg: functools.partial(e.run, kern, tiles=cfg, **given) for cfg in configs},
                                         self.reps)
                    for cfg, (s, timer, wall, _) in timed.items():
                        label = (f"{mode}[matrix {cfg.rows}x{cfg.tile}{'/v4' if cfg.vec4 else ''}{'/x2' if cfg.double else ''}{'/sh' if cfg.shuffle else ''}{'/pr' if cfg.pair else ''}]" if cfg in matrix
                                 else f"{mode}[simt {cfg.rows}x{cfg.tile}x{cfg.row_threads}]")
                        self.add(Line("atiles", label, shape, s, timer, flops, wall_seconds=wall,
                                      extra={"tiles": asdict(cfg), "default": cfg == spec.params.tiles}))
            self.guarded("atiles", "attention", shape, one)

    # ---- conv / rmsnorm / pointwise ----
    def _rows(self):
        d = 64 if self.quick else 1024
        return d, ((64, 100) if self.quick else (512, 2048))

    def conv(self):
        kern = library.get("short_conv")
        bwd = grad(kern, ["bcx", "w"])
        d, ts = self._rows()
        for t in ts:
            shape = f"T{t} D{d}"

            def one(t=t, shape=shape):
                e = self.engine
                bcx = e.tensor(_rand(self.rng, (t, 3, d)))
                w = e.tensor(_rand(self.rng, (d, 3)))
                s, timer, wall, _ = time_best(e, lambda: e.run(kern, bcx=bcx, w=w), self.reps)
                self.add(Line("conv", "short_conv_fwd", shape, s, timer, 9.0 * t * d, 4.0 * (4 * t * d + 3 * d),
                              bound="memory", wall_seconds=wall))
                dy = e.tensor(_rand(self.rng, (t, d)))
                dwt = e.zero_(e.empty((d, 3)))
                s, timer, wall, by = time_best(
                    e, lambda: e.run(bwd, bcx=bcx, w=w, d_y=dy, out={"d_w": dwt}, accumulate={"d_w"}), self.reps)
                self.add(Line("conv", "short_conv_bwd", shape, s, timer, 20.0 * t * d,
                              4.0 * (t * d + 3 * t * d + 3 * t * d + 6 * d), bound="memory", wall_seconds=wall,
                              extra={"per_kernel_s": by}))
            self.guarded("conv", "short_conv", shape, one)

    def rmsnorm(self):
        kern = library.get("rmsnorm")
        bwd = grad(kern, ["x", "w"], ["y"])
        d, ts = self._rows()
        for t in ts:
            shape = f"T{t} D{d}"

            def one(t=t, shape=shape):
                e = self.engine
                x = e.tensor(_rand(self.rng, (t, d)))
                w = e.tensor(_rand(self.rng, (d,)))
                s, timer, wall, _ = time_best(e, lambda: e.run(kern, x=x, w=w, eps=1e-5), self.reps)
                self.add(Line("rmsnorm", "rmsnorm_fwd", shape, s, timer, 4.0 * t * d, 4.0 * (2 * t * d + t + d),
                              bound="memory", wall_seconds=wall))
                r = e.run(kern, x=x, w=w, eps=1e-5)
                dy = e.tensor(_rand(self.rng, (t, d)))
                dwt = e.zero_(e.empty((d,)))
                s, timer, wall, by = time_best(
                    e, lambda: e.run(bwd, x=x, w=w, inv=r["inv"], d_y=dy, out={"d_w": dwt}, accumulate={"d_w"}),
                    self.reps)
                self.add(Line("rmsnorm", "rmsnorm_bwd", shape, s, timer, 8.0 * t * d, 4.0 * (3 * t * d + t + 2 * d),
                              bound="memory", wall_seconds=wall, extra={"per_kernel_s": by}))
            self.guarded("rmsnorm", "rmsnorm", shape, one)

    def pointwise(self):
        kern = library.get("add")
        for t, d in (((64, 64),) if self.quick else ((2048, 1024), (16384, 4096))):
            shape = f"T{t} D{d}"

            def one(t=t, d=d, shape=shape):
                e = self.engine
                x, z = e.tensor(_rand(self.rng, (t, d))), e.tensor(_rand(self.rng, (t, d)))
                y = e.empty((t, d))
                s, timer, wall, _ = time_best(e, lambda: e.run(kern, x=x, z=z, out={"y": y}), self.reps)
                self.add(Line("pointwise", "add", shape, s, timer, 1.0 * t * d, 12.0 * t * d, bound="memory",
                              wall_seconds=wall))
            self.guarded("pointwise", "add", shape, one)

    # ---- fused LM head + cross-entropy ----
    def xent(self):
        """The LM head fused with the loss: f32 hidden states, and f16 ones as --f16 trains (the
        matrix units where the device has them); E f32 in both; chunks of --xent-chunks rows."""
        from lfm2jit.ops.lmhead import lm_head_cross_entropy
        v, d = (1024, 64) if self.quick else (65536, 1024)
        for dtype, t, chunk in itertools.product(self.xent_dtypes, (64,) if self.quick else (512, 2048, 4096),
                                                 (256,) if self.quick else self.xent_chunks):
            shape = f"T{t} V{v} D{d} chunk{chunk}"

            def one(t=t, shape=shape, dtype=dtype, chunk=chunk):
                e = self.engine
                h = e.tensor(_rand(self.rng, (t, d)), dtype)
                E = e.tensor(_rand(self.rng, (v, d), 0.02))
                targets = self.rng.integers(0, v, t).astype(np.int32)
                dh, dE = e.empty((t, d), dtype), e.empty((v, d))
                run = lambda: lm_head_cross_entropy(e, h, E, targets, None, normalizer=float(t), chunk=chunk,
                                                    dh=dh, dE=dE)
                s, timer, wall, by = time_best(e, run, max(2, self.reps // 2))
                # useful work: logits, dh and dE products (6 T V D); the kernel recomputes logits once more
                self.add(Line("xent", "lm_head_xent" + ("" if dtype == "f32" else "_f16"), shape, s, timer,
                              6.0 * t * v * d, 4.0 * (2 * v * d + 2 * t * d), wall_seconds=wall,
                              extra={"executed_flops": 8.0 * t * v * d, "per_kernel_s": by}))
            self.guarded("xent", f"lm_head_xent[{dtype}]", shape, one)

    # ---- what WebGPU's default limits cost: pieces and parts (schedule/pieces.py) ----
    def limits(self):
        """The kernels that touch LFM2-1.2B's embedding (65536 x 2048 f32: four 128 MiB bindings,
        held in two buffers or four), on this device's raised limits and on WebGPU's defaults
        (LFM2JIT_LIMITS=default, a second device in this run), side by side."""
        import os

        from lfm2jit.ops.embedding import slots
        v, d, t = (8192, 256, 64) if self.quick else (65536, 2048, 512)
        saved = os.environ.get("LFM2JIT_LIMITS")
        os.environ["LFM2JIT_LIMITS"] = "default"
        try:
            default = ComputeEngine(WgpuContext.create(), timing=True)
        finally:
            os.environ.pop("LFM2JIT_LIMITS") if saved is None else os.environ.__setitem__("LFM2JIT_LIMITS", saved)
        table = _rand(self.rng, (v, d), 0.02)
        ids = self.rng.integers(0, v, t).astype(np.int32)
        g, h = _rand(self.rng, (t, d)), _rand(self.rng, (t, d))
        order, bounds, rows = slots(ids)
        linear = library.get("linear").without({"r"})

        def kernels(e):
            E, grads = e.tensor(table), e.tensor(np.zeros((v, d), np.float32))   # in parts where a buffer is too small
            args = dict(g=e.tensor(g), order=e.tensor(order), bounds=e.tensor(bounds), rows=e.tensor(rows))
            x, ids_t = e.tensor(h), e.tensor(ids)
            return {"embedding": (lambda: e.run("embedding", table=E, ids=ids_t), 0.0, 8.0 * t * d),
                    "embedding_backward": (lambda: e.run("embedding_backward", dims={"V": v}, out={"d_table": grads},
                                                         accumulate={"d_table"}, **args), 0.0, 12.0 * t * d),
                    "lm_head_logits": (lambda: e.run(linear, x=x, w=E), 2.0 * t * v * d, 4.0 * v * d)}
        shape = f"T{t} V{v} D{d}"
        for name in ("embedding", "embedding_backward", "lm_head_logits"):
            def one(name=name):
                seconds = {}
                for mode, e in (("raised", self.engine), ("default", default)):
                    run, flops, nbytes = kernels(e)[name]
                    seconds[mode], timer, wall, _ = time_best(e, run, self.reps)
                self.add(Line("limits", name, shape, seconds["default"], timer, flops, nbytes, wall_seconds=wall,
                              bound="compute" if flops else "memory",
                              extra={"raised_s": seconds["raised"], "default_vs_raised": seconds["default"] / seconds["raised"]}))
                self.log(f"#   {name}: default limits {seconds['default'] * 1e3:.3f} ms, raised {seconds['raised'] * 1e3:.3f} ms "
                         f"({seconds['default'] / seconds['raised']:.2f}x)")
            self.guarded("limits", name, shape, one)

    # ---- AdamW over LFM2-350M's parameter tensors ----
    def adamw(self):
        from lfm2jit.model.checkpoint import parameter_shapes
        from lfm2jit.model.config import Lfm2Config
        from lfm2jit.ops.optim import adamw_step, global_grad_norm
        cfg = Lfm2Config.preset("tiny" if self.quick else "350M")
        shapes = list(parameter_shapes(cfg).values())
        n = sum(math.prod(s) for s in shapes)
        shape = f"{len(shapes)} tensors, {n / 1e6:.1f}M elements"

        def one():
            e = self.engine
            by_shape: dict[tuple, np.ndarray] = {}
            ps, gs, ms, vs = [], [], [], []
            for s in shapes:
                if s not in by_shape:
                    by_shape[s] = _rand(self.rng, s, 0.02)
                a = by_shape[s]
                ps.append(e.tensor(a))
                gs.append(e.tensor(a * 0.5))
                ms.append(e.tensor(a * 0.1))
                vs.append(e.tensor(np.abs(a) * 0.01))
            kw = dict(lr=1e-4, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.01, gscale=1.0)
            step = [0]

            def run():
                step[0] += 1
                adamw_step(e, ps, gs, ms, vs, step=step[0], **kw)
            s, timer, wall, _ = time_best(e, run, max(2, self.reps // 2))
            self.add(Line("adamw", "adamw_step", shape, s, timer, 16.0 * n, 28.0 * n, bound="memory",
                          wall_seconds=wall, extra={"dispatches": len(shapes)}))
            # the global grad norm reads every gradient once and reads back 8 bytes (a synchronisation)
            e.synchronize()
            e.timings.clear()
            walls = []
            for _ in range(3):
                t0 = time.perf_counter()
                global_grad_norm(e, gs)
                walls.append(time.perf_counter() - t0)
            gpu = sum(s for _, s in e.timings) / 3 if e.timing and e.timings else None
            e.timings.clear()
            self.add(Line("adamw", "global_grad_norm", shape, gpu or statistics.median(walls),
                          "gpu" if gpu else "wall", 2.0 * n, 4.0 * n, bound="memory",
                          wall_seconds=statistics.median(walls), extra={"dispatches": len(shapes) + 2}))
        self.guarded("adamw", "adamw_step", shape, one)


    # ---- the MoE experts' grouped GEMM beside a dense GEMM of the same FLOPs ----
    def grouped(self):
        """The experts' two projections at LFM2-8B-A1B's shapes (32 experts, top-4, D 2048, expert
        width 1792; T = 2048 tokens, so 8192 slots, routed at random): forward, dX and dW of the
        grouped GEMM, each beside the dense GEMM [slots, K] x [N, K]^T of the same FLOPs in this
        run (issue 47's target: within 1.5x). f32, and f16 operands (the matrix units, where the
        device has them; the frozen f16 base)."""
        from lfm2jit.model.moe_config import Lfm2MoeConfig
        cfg = Lfm2MoeConfig.preset("8B-A1B")
        experts, top_k, d, width, t = ((4, 2, 64, 48, 64) if self.quick else
                                       (cfg.num_experts, cfg.num_experts_per_tok, cfg.hidden_size,
                                        cfg.moe_intermediate_size, 2048))
        slots = t * top_k
        if self.grouped_routing == "even":     # every expert the same count: no expert ends in a part tile
            counts = np.full(experts, slots // experts) + (np.arange(experts) < slots % experts)
        else:
            picks = np.argsort(self.rng.random((t, experts)), axis=1)[:, :top_k]  # top-k distinct experts a token
            counts = np.bincount(picks.ravel(), minlength=experts)
        ends = np.cumsum(counts).astype(np.int32)
        gmm = library.get("expert_gate_up")                 # h = x gate_up[e]^T over each expert's slots
        lin = library.get("linear").without({"r"})
        # per kind: (forward, dX, dW) kernels, the weight's and the cotangent's names
        kinds = {"grouped": ((gmm, grad(gmm, ["x"]), grad(gmm, ["gate_up"])), "gate_up", "d_h"),
                 "dense": ((lin, grad(lin, ["x"]), grad(lin, ["w"])), "w", "d_y")}
        for proj, n, k in (("gate_up", 2 * width, d), ("down", d, width)):
            for dtype in self.grouped_dtypes:
                shape = f"S{slots} E{experts} {n}x{k}" + (" even" if self.grouped_routing == "even" else "")

                def one(proj=proj, n=n, k=k, dtype=dtype, shape=shape):
                    e = self.engine
                    x, dy = e.tensor(_rand(self.rng, (slots, k)), dtype), e.tensor(_rand(self.rng, (slots, n)), dtype)
                    ends_t = e.tensor(ends)
                    calls = {}
                    for kind, ((fwd, dx_k, dw_k), w_name, dy_name) in kinds.items():
                        w = e.tensor(_rand(self.rng, (experts, n, k) if kind == "grouped" else (n, k), 0.02), dtype)
                        routing = {"ends": ends_t} if kind == "grouped" else {}
                        y, dx, dw = e.empty((slots, n)), e.empty((slots, k)), e.empty(w.shape)
                        # f16 runs: the operands read are f16, the products are stored as f32
                        for product, kernel, operands, out in (
                                ("fwd", fwd, {"x": x, w_name: w}, {fwd.outputs[0]: y}),
                                ("dx", dx_k, {w_name: w, dy_name: dy}, {"d_x": dx}),
                                ("dw", dw_k, {"x": x, dy_name: dy}, {f"d_{w_name}": dw})):
                            f16 = tuple(operands) if dtype == "f16" else ()
                            calls[kind, product] = functools.partial(e.run, kernel, f16=f16, out=out, **operands, **routing)
                    # grouped and dense in turn: a busy or still warming GPU slows some timings
                    # several-fold, never speeds one up
                    timed = time_in_turn(e, calls, self.reps)
                    for product in ("fwd", "dx", "dw"):
                        dense = timed["dense", product][0]
                        for kind in ("grouped", "dense"):
                            s, timer, wall, _ = timed[kind, product]
                            extra = {"dtype": dtype, "projection": proj}
                            if kind == "grouped":
                                extra["over_dense"] = s / dense
                            self.add(Line("grouped", f"{kind}_{proj}_{product}[{dtype}]", shape, s, timer,
                                          2.0 * slots * n * k, wall_seconds=wall, extra=extra))
                    self.log(f"# {proj}[{dtype}] grouped over dense: " + ", ".join(
                        f"{p} {timed['grouped', p][0] / timed['dense', p][0]:.2f}x" for p in ("fwd", "dx", "dw")))
                self.guarded("grouped", f"{proj}[{dtype}]", shape, one)

    # ---- LoRA adapters at LFM2-1.2B's linear shapes ----
    def lora(self):
        from collections import Counter

        from lfm2jit.model.adapters import LoraAdapters
        from lfm2jit.model.config import Lfm2Config
        from lfm2jit.model.layers import backward_of
        from lfm2jit.model.lora import LoraConfig, init_weights
        from lfm2jit.ops import precision
        cfg = Lfm2Config.preset("tiny" if self.quick else "1.2B")
        config = LoraConfig(r=8, alpha=16.0)
        modules = config.modules(cfg)
        t = 64 if self.quick else 2048
        counts = Counter(modules.values())              # (out, in) -> how many modules of the model have it
        lin = library.get("linear").without({"r"})
        dx_k = grad(lin, ["x"])
        for (n_out, n_in), count in counts.items():
            shape = f"T{t} in{n_in} out{n_out} r{config.r} (x{count})"

            def one(n_out=n_out, n_in=n_in, count=count, shape=shape):
                e = self.engine

                def run(kernel, **args):
                    return precision.run(e, kernel, "f16", **args)
                name = next(m for m, s in modules.items() if s == (n_out, n_in))
                weights = {k: e.tensor(v + 0.01) for k, v in init_weights(config, {name: (n_out, n_in)}, 0).items()}
                ad = LoraAdapters(config, weights, [name])
                trained = {id(w) for w in weights.values()}
                for w in weights.values():
                    w.grad = e.zero_(e.empty(w.shape))
                x, dy = e.tensor(_rand(self.rng, (t, n_in)), "f16"), e.tensor(_rand(self.rng, (t, n_out)), "f16")
                y, dx = e.empty((t, n_out), "f16"), e.empty((t, n_in), "f16")
                w16 = e.tensor(_rand(self.rng, (n_out, n_in), 0.02), "f16")
                u = ad.forward(run, x, name, w16, t)[1]
                for label, record, flops, nbytes in (
                        ("base_fwd", lambda: run(lin, bucket=t, x=x, w=w16, out={"y": y}),
                         2.0 * t * n_in * n_out, 2.0 * (t * n_in + n_in * n_out + t * n_out)),
                        ("base_dx", lambda: run(dx_k, bucket=t, x=x, w=w16, d_y=dy, out={"d_x": dx}, accumulate={"d_x"}),
                         2.0 * t * n_in * n_out, 2.0 * (t * n_out + n_in * n_out + t * n_in)),
                        ("lora_fwd", lambda: ad.forward(run, x, name, w16, t),
                         2.0 * t * n_in * n_out + 2.0 * t * config.r * (n_in + n_out),
                         2.0 * (t * n_in + n_in * n_out + t * n_out)),
                        ("lora_bwd", lambda: ad.backward(run, backward_of, lambda w: id(w) in trained, x, name, w16, dy,
                                                         t, u, dx=dx),
                         2.0 * t * n_in * n_out + 6.0 * t * config.r * (n_in + n_out),
                         2.0 * (2 * t * n_out + 2 * t * n_in + n_in * n_out))):
                    s, timer, wall, by = time_best(e, record, self.reps)
                    order = time_dispatches(e, record, self.reps)
                    self.add(Line("lora", label, shape, s, timer, flops, nbytes, wall_seconds=wall,
                                  extra={"modules": count, "per_kernel_s": by, "dispatches_s": order}))
                    if order:
                        self.log("    dispatches: " + ", ".join(f"{k} {v * 1e6:.1f} us" for k, v in order))
            self.guarded("lora", "lora", shape, one)


# ---------------------------------------------------------------- whole train steps

class _QueueProxy:
    """ctx.queue with read_buffer timed (a read-back is where the host waits for the GPU)."""

    def __init__(self, queue, acc: dict):
        self._queue, self._acc = queue, acc

    def read_buffer(self, *a, **k):
        t0 = time.perf_counter()
        try:
            return self._queue.read_buffer(*a, **k)
        finally:
            self._acc["wait"] += time.perf_counter() - t0

    def __getattr__(self, name):
        return getattr(self._queue, name)


@contextlib.contextmanager
def host_breakdown(ctx, engine):
    """Split host wall time into: encode+submit (flush), wait for read-backs, and the rest (Python
    recording: argument checks, specialisation lookups, bind groups, uniform buffers)."""
    acc = {"flush": 0.0, "wait": 0.0}
    original_flush = engine.flush

    def flush():
        t0 = time.perf_counter()
        try:
            original_flush()
        finally:
            acc["flush"] += time.perf_counter() - t0
    engine.flush = flush
    queue = ctx.queue
    ctx.queue = _QueueProxy(queue, acc)
    try:
        yield acc
    finally:
        engine.flush = original_flush
        del engine.flush            # back to the class method
        ctx.queue = queue


def _kernel_class(name: str) -> str:
    """The profile class of a kernel, by its name (an f16 variant, "xent_dh_f16_E32", by its base's)."""
    name = name.split("_f16")[0]
    if "attention" in name:
        return "attention"
    if name.startswith(("linear", "lora_", "swiglu_down")):
        return "linear (matmul)"
    if name in ("expert_ends", "expert_counts"):
        return "moe routing"
    if name.startswith("expert_"):
        return "moe experts (grouped matmul)"
    if name.startswith(("moe_", "sort_keys", "slot_tokens", "scatter_rows", "scatter_values")):
        return "moe routing"
    if name in ("xent_logits", "xent_dh", "xent_dE"):
        return "lm head (matmul)"
    if name.startswith("xent"):
        return "lm head (softmax)"
    if name in ("adamw", "sumsq_rows", "sum_rows", "sum_partials"):
        return "optimizer + grad norm"
    return "other (norms, conv, rope, pointwise, embedding)"


def checkpoint_layers_arg(value: str) -> int | str:
    """--checkpoint-layers all|N (0: off, the default), as Lfm2Model's checkpoint_layers takes it."""
    if value == "all":
        return value
    if not (value.isascii() and value.isdigit()):
        raise argparse.ArgumentTypeError(f"must be all or a number of decoder layers, got {value!r}")
    return int(value)


def lora_base_dtype(args) -> str:
    """The LoRA base dtype a bench command line asks for: --base-dtype, or f16 with --lora-f16-base."""
    return args.base_dtype or ("f16" if args.lora_f16_base else "f32")


def train_bench(ctx, cfg, shapes, steps: int = 3, warmup: int = 1, seed: int = 0, log=print,
                profile: bool = True, clip: float | None = 1.0, probe=None,
                activation_dtype: str = "f32", replay: int | None = None,
                recompute_mlp: bool = False, lora=None, lora_base_dtype: str = "f32",
                lm_head_keep_bytes: int | None = None, checkpoint_layers: int | str = 0) -> tuple[list[Line], dict]:
    """Trainer.train_sequences on a fresh random-init model, for each (batch, T) in ``shapes``, in order.

    batch > 1 means that many sequences of T with grad_accum_steps = batch: one optimizer step per
    window, the sequences packed into passes of up to Trainer.pack_tokens rows. Per shape: first-window wall time and compile stats (a new bucket compiles), that the
    second window compiles nothing, tokens/s over ``steps`` windows after ``warmup``, the host
    breakdown, GPU busy time per window from timestamps (one extra window), and peak memory.
    ``probe()``, if given, is called after each shape (model alive) and its dict added to the line.
    ``activation_dtype="f16"`` runs the mixed-precision path (with a GradScaler, as --f16 does).
    ``replay`` passes Trainer.with_replay (None: the trainer's default): from the third window on,
    a shape's steps replay their recorded programs. ``recompute_mlp`` and ``checkpoint_layers``
    (activation checkpointing: "all" or the first N layers) build the model with them; a line then
    also gives the FLOPs the backward's reruns of checkpointed layers add (``recompute_flops``, not
    in the line's model FLOPs; ``recompute_fraction`` of them), to read beside tokens/s and peak.
    ``lora`` (a LoraConfig) trains adapters alone, on a frozen base held as ``lora_base_dtype`` (f32,
    f16, or nf4 / int8 decoded in the GEMMs); FLOPs then count the forward and the input gradients
    only (4 per parameter and token).
    ``lm_head_keep_bytes`` sets Trainer.lm_head_keep_bytes (None: the trainer's default).
    """
    from trainer import AdamW, GradScaler, Trainer

    from lfm2jit.model import Lfm2Model
    from lfm2jit.model.checkpoint import parameter_shapes
    engine = ComputeEngine(ctx)
    t0 = time.perf_counter()
    model = Lfm2Model(cfg, ctx, engine, seed=seed, activation_dtype=activation_dtype, recompute_mlp=recompute_mlp,
                      base_dtype=lora_base_dtype if lora is not None else "f32",
                      checkpoint_layers=checkpoint_layers)
    if lora is not None:
        model.add_lora(lora, seed=seed)
    init_s = time.perf_counter() - t0
    params = model.lora_parameters() if lora is not None else model.parameters()
    n_params = sum(math.prod(p.shape) for p in model.parameters())
    # the checkpointed layers: their parameters and attention layers, whose forward the backward runs again
    rerun = [i for i in range(len(model.blocks)) if model.checkpointed(i)]
    rerun_params = sum(math.prod(p.shape) for n, p in model.named_parameters().items()
                       if n.startswith("model.layers.") and int(n.split(".")[2]) in rerun)
    rerun_attention = sum(1 for i in rerun if i in cfg.attention_layers)
    held = {id(p.buffer): p.buffer.size for p in model.parameters() if hasattr(p, "buffer")}   # arenas: buffers shared
    param_bytes = sum(held.values()) + sum(p.nbytes for p in model.parameters() if not hasattr(p, "buffer"))
    opt = AdamW(lr=1e-4, weight_decay=0.01)
    rng = np.random.default_rng(seed + 1)
    lines: list[Line] = []
    meta = {"adapter": ctx.name, "webgpu": ctx.implementation, "n_params": n_params, "param_bytes": param_bytes, "model_init_s": init_s,
            "config": cfg.to_dict(), "clip_grad_norm": clip, "activation_dtype": activation_dtype, "replay": replay,
            "recompute_mlp": recompute_mlp, "checkpoint_layers": checkpoint_layers,
            "checkpointed_layers": len(rerun), "trained_params": sum(p.size for p in params),
            "lora": asdict(lora) if lora is not None else None, "lora_base_dtype": lora_base_dtype,
            "lm_head_keep_bytes": lm_head_keep_bytes}
    log(f"# model: {n_params / 1e6:.1f}M parameters, host init + upload {init_s:.1f}s")

    for batch, t in shapes:
        name = f"{batch}x{t}"
        tokens = batch * t
        tr = Trainer(model, opt, ctx, engine).with_grad_accum_steps(batch).with_length_bucket(64)
        tr.with_clip_grad_norm(clip)
        if replay is not None:
            tr.with_replay(replay)
        if lm_head_keep_bytes is not None:
            tr.lm_head_keep_bytes = lm_head_keep_bytes
        if activation_dtype == "f16":
            tr.with_grad_scaler(GradScaler())
        losses: list[float] = []

        def window():           # the window's sequences, packed (Trainer.pack_tokens rows per pass)
            seqs = [(ids[:-1], ids[1:], np.ones(t, np.float32))
                    for ids in (rng.integers(0, cfg.vocab_size, t + 1) for _ in range(batch))]
            stats = tr.train_sequences(seqs, params)
            losses.extend(st.loss for st in stats)
            # an f16 window whose scaled gradients overflow ends skipped, as GradScaler has it
            assert stats[-1].stepped or stats[-1].skipped, "the window should end with an optimizer step"
            return stats[-1]

        try:
            engine.synchronize()
            engine.pool.peak_bytes = engine.pool.in_use_bytes
            pool_alloc0 = engine.pool.allocated_bytes
            s0 = engine.stats.as_dict()
            t_a = time.perf_counter()
            window()
            engine.synchronize()
            first_s = time.perf_counter() - t_a
            s1 = engine.stats.as_dict()
            d0 = engine.dispatches
            t_a = time.perf_counter()
            window()
            engine.synchronize()
            second_s = time.perf_counter() - t_a
            s2 = engine.stats.as_dict()
            dispatches = engine.dispatches - d0
            for _ in range(max(0, warmup - 1)):
                window()
            engine.synchronize()
            walls = []
            with host_breakdown(ctx, engine) as acc:
                for _ in range(steps):
                    t_a = time.perf_counter()
                    window()
                    engine.synchronize()
                    walls.append(time.perf_counter() - t_a)
            host = {k: v / steps for k, v in acc.items()}
            wall = statistics.median(walls)
            gpu_s, by_kernel, by_class = None, {}, {}
            profile_s = None
            if profile and ctx.has_timestamps:
                engine.synchronize()
                engine.timings.clear()
                engine.timing = True
                try:
                    t_a = time.perf_counter()
                    window()
                    engine.synchronize()
                    profile_s = time.perf_counter() - t_a
                finally:
                    engine.timing = False
                gpu_s = sum(s for _, s in engine.timings)
                for k, s in engine.timings:
                    by_kernel.setdefault(k, [0.0, 0])
                    by_kernel[k][0] += s
                    by_kernel[k][1] += 1
                    c = _kernel_class(k)
                    by_class[c] = by_class.get(c, 0.0) + s
                engine.timings.clear()
            peak_in_use = engine.pool.peak_bytes
            top = sorted(by_kernel.items(), key=lambda kv: -kv[1][0])[:40]
            extra = {
                "tokens": tokens, "tokens_per_s": tokens / wall, "window_wall_s": walls,
                "first_window_s": first_s, "first_window_compiles": s1["misses"] - s0["misses"],
                "first_window_compile_s": s1["compile_seconds"] - s0["compile_seconds"],
                "second_window_s": second_s, "second_window_compiles": s2["misses"] - s1["misses"],
                "dispatches_per_window": dispatches, "replayed_pieces": tr.recorded.replays,
                "host_flush_s": host["flush"], "host_wait_s": host["wait"],
                "host_python_s": wall - host["flush"] - host["wait"],
                "host_python_us_per_dispatch": 1e6 * (wall - host["flush"] - host["wait"]) / max(dispatches, 1),
                "gpu_busy_s": gpu_s, "gpu_busy_by_class_s": by_class, "profile_window_s": profile_s,
                "gpu_top_kernels": [{"kernel": k, "seconds": v[0], "dispatches": v[1]} for k, v in top],
                "peak_pool_in_use_bytes": peak_in_use, "param_bytes": param_bytes,
                "peak_bytes": peak_in_use + param_bytes,
                "pool_allocated_bytes": engine.pool.allocated_bytes,
                "pool_allocated_new_bytes": engine.pool.allocated_bytes - pool_alloc0,
                "losses_first_last": [losses[0], losses[-1]],
            }
            per_token = 4.0 if lora is not None else 6.0
            flops = per_token * n_params * tokens + per_token * 2 * len(cfg.attention_layers) * t * t * cfg.hidden_size * batch
            # a forward is 2 of those per_token FLOPs per parameter and token (and of the attention's)
            extra["recompute_flops"] = 2 * rerun_params * tokens + 2 * 2 * rerun_attention * t * t * cfg.hidden_size * batch
            extra["recompute_fraction"] = extra["recompute_flops"] / flops
            line = Line("train", f"train_step_{name}", name, wall, "wall", flops, bound="compute",
                        wall_seconds=wall, extra=extra)
            # of the profiled window's own wall time: timestamps slow a window down, so its GPU time
            # against the median untimed window could pass 100%
            line.extra["gpu_busy_fraction"] = gpu_s / profile_s if gpu_s else None
            if probe is not None:
                line.extra.update(probe())
        except Exception as e:   # noqa: BLE001
            traceback.print_exc(file=sys.stderr)
            line = Line("train", f"train_step_{name}", name, error=f"{type(e).__name__}: {e}".splitlines()[0][:300])
        tr.recorded.clear()      # this shape's recorded passes give their activations back before the next one
        lines.append(line)
        log(format_train(line))
    return lines, meta


def shipped_lengths() -> np.ndarray:
    """The token lengths of the shipped chat data's records (trainer/assets, its own tokenizer): the
    packing group's length histogram."""
    from trainer.data import Batch, default_dataset, default_tokenizer, load_tokenizer
    batch = Batch.from_jsonl(default_dataset(), load_tokenizer(default_tokenizer()), kind="chat")
    return np.array([len(ids) for ids, _, _ in batch.sequences()], np.int64)


def packing_bench(ctx, cfg, window: int = 16, windows: int = 4, pack_tokens: int = 4096, bucket: int = 64,
                  seed: int = 0, scale: int = 1, activation_dtype: str = "f32", repeats: int = 1,
                  log=print) -> list[Line]:
    """Trainer.train_sequences over ``windows`` windows of ``window`` sequences each, lengths drawn from
    the shipped data's histogram (times ``scale``), random ids: once with packing "pad", once with
    "concat", on one model. Each mode first runs every window once (its compiles), then is timed
    over the same windows ``repeats`` times. Reports real tokens (no padding) per second of wall time.
    ``activation_dtype="f16"`` trains with f16 activations and loss scaling (as --f16)."""
    from trainer import SGD, GradScaler, Trainer

    from lfm2jit.model import Lfm2Model
    engine = ComputeEngine(ctx)
    model = Lfm2Model(cfg, ctx, engine, seed=seed, activation_dtype=activation_dtype)
    params = model.parameters()
    rng = np.random.default_rng(seed + 1)
    hist = shipped_lengths() * scale
    lengths = [rng.choice(hist, window) for _ in range(windows)]
    data = [[(ids[:-1], ids[1:], np.ones(n, np.float32))
             for n, ids in ((n, rng.integers(1, cfg.vocab_size, n + 1)) for n in w)] for w in lengths]
    real = int(sum(int(w.sum()) for w in lengths))
    lines = []
    for mode in ("pad", "concat"):
        try:                                        # a mode that fails is a line with its error
            tr = (Trainer(model, SGD(lr=1e-4), ctx, engine).with_grad_accum_steps(window).with_length_bucket(bucket)
                  .with_packing(pack_tokens, mode))
            if activation_dtype == "f16":
                tr.with_grad_scaler(GradScaler())
            rows, passes = 0, 0
            for w in data:                              # the rows each pass computes (lengths rounded to buckets)
                rest = list(w)
                while rest:
                    n = tr._packable(rest)
                    group, rest = rest[:n], rest[n:]
                    size = [len(g[0]) for g in group]
                    unit = tr._pack_unit() if n > 1 else bucket
                    stacked = -(-max(size) // unit) * unit * n          # each as long as the longest
                    # concat: one row of them all, unless stacking them pads nothing (Trainer._pack)
                    rows += min(stacked, -(-sum(size) // bucket) * bucket) if mode == "concat" else stacked
                    passes += 1
            for w in data:                          # compiles (and the first recordings)
                tr.train_sequences(w, params)
            engine.synchronize()
            t0 = time.perf_counter()
            for _ in range(repeats):
                for w in data:
                    tr.train_sequences(w, params)
            engine.synchronize()
            wall = (time.perf_counter() - t0) / repeats
            extra = {"real_tokens": real, "rows": rows, "passes": passes, "real_tokens_per_s": real / wall,
                     "padding_fraction": 1 - real / rows, "window": window, "windows": windows,
                     "mean_length": real / (window * windows), "pack_tokens": pack_tokens,
                     "activation_dtype": activation_dtype, "repeats": repeats}
            line = Line("packing", f"mixed_{mode}", f"{windows}x{window} seqs, {cfg.hidden_size}d", wall / windows,
                        "wall", wall_seconds=wall / windows, extra=extra)
        except Exception as e:   # noqa: BLE001
            traceback.print_exc(file=sys.stderr)
            line = Line("packing", f"mixed_{mode}", "", error=f"{type(e).__name__}: {e}".splitlines()[0][:300])
        lines.append(line)
        log(format_packing(line))
    if not any(line.error for line in lines):
        lines[1].extra["speedup_over_pad"] = lines[1].extra["real_tokens_per_s"] / lines[0].extra["real_tokens_per_s"]
        log(f"packing   concat / pad: {lines[1].extra['speedup_over_pad']:.2f}x real tokens/s")
    return lines


def format_packing(line: Line) -> str:
    if line.error:
        return f"packing   {line.name:28s} ERROR {line.error}"
    x = line.extra
    return (f"packing   {line.name:28s} {x['real_tokens_per_s']:9.0f} real tok/s  window {line.seconds * 1e3:8.1f} ms  "
            f"{x['rows']} rows for {x['real_tokens']} tokens ({100 * x['padding_fraction']:.0f}% padding) in "
            f"{x['passes']} passes")


# ---------------------------------------------------------------- output

def _fmt_time(s):
    if s is None:
        return "-"
    return f"{s * 1e3:9.3f} ms" if s >= 1e-4 else f"{s * 1e6:9.2f} us"


def format_line(line: Line, ceil: Ceilings) -> str:
    if line.error:
        return f"{line.group:9s} {line.name:28s} {line.shape:26s} ERROR {line.error}"
    tf, gb, frac = line.tflops(), line.gbs(), ceil.fraction(line)
    if line.bound in ("compute", "matrix") and tf:
        rate = f"{tf:7.2f} TFLOP/s" if tf >= 0.1 else f"{tf * 1e3:7.2f} GFLOP/s"
    else:
        rate = f"{gb:8.1f} GB/s  " if gb else " " * 15
    frac_s = f"{100 * frac:5.1f}%" if frac is not None else "    -"
    wall = f" (wall {_fmt_time(line.wall_seconds).strip()})" if line.wall_seconds and line.timer == "gpu" else ""
    return f"{line.group:9s} {line.name:28s} {line.shape:26s} {_fmt_time(line.seconds)} [{line.timer:4s}] {rate} {frac_s}{wall}"


def format_train(line: Line) -> str:
    if line.error:
        return f"train     {line.name:28s} ERROR {line.error}"
    x = line.extra
    gpu = f"{x['gpu_busy_s'] * 1e3:.0f} ms ({100 * x['gpu_busy_fraction']:.0f}%)" if x.get("gpu_busy_s") else "-"
    return (f"train     {line.name:28s} {x['tokens_per_s']:9.0f} tok/s  window {line.seconds * 1e3:8.1f} ms  "
            f"gpu busy {gpu}  peak {x['peak_bytes'] / GiB:6.2f} GiB  first {x['first_window_s']:.1f}s "
            f"({x['first_window_compiles']} compiles, {x['first_window_compile_s']:.1f}s)  "
            f"2nd-window compiles {x['second_window_compiles']}  {x['dispatches_per_window']} dispatches "
            f"({x['host_python_us_per_dispatch']:.1f} us host each)"
            + (f"  checkpoint reruns +{100 * x['recompute_fraction']:.0f}% flops" if x.get("recompute_flops") else ""))


HEADER = f"{'group':9s} {'name':28s} {'shape':26s} {'time':>12s} {'timer':6s} {'rate':>15s} {'ceil%':>6s}"


def footer(lines: list[Line], ceil: Ceilings) -> str:
    """What the end of a run adds to the lines printed as they were measured: each matmul line's
    rate against torch's on the same shape, and the ceilings."""
    torch_gemm = {l.shape: l.tflops() for l in lines if l.name == "torch_gemm" and l.seconds}
    out = [f"{line.group:9s} {line.name:28s} {line.shape:26s} {100 * line.tflops() / torch_gemm[line.shape]:.0f}% of torch"
           for line in lines if line.group in ("matmul", "tiles") and line.shape in torch_gemm and line.tflops()
           and not line.error]
    out.append(ceil.note())
    return "\n".join(out)


def table(lines: list[Line], ceil: Ceilings) -> str:
    out = [HEADER]
    torch_gemm = {l.shape: l.tflops() for l in lines if l.name == "torch_gemm" and l.seconds}
    for line in lines:
        if line.group == "train":
            out.append(format_train(line))
            continue
        s = format_line(line, ceil)
        if line.group in ("matmul", "tiles") and line.shape in torch_gemm and line.tflops():
            s += f"  {100 * line.tflops() / torch_gemm[line.shape]:.0f}% of torch"
        out.append(s)
    out.append(ceil.note())
    return "\n".join(out)


def environment(ctx) -> dict:
    return {"adapter": ctx.name, "webgpu": ctx.implementation, "dawn_robustness": settings().dawn_robustness,
            "adapter_info": {k: str(v) for k, v in ctx.info.items()}, "features": sorted(ctx.features),
            "subgroup_matrix_configs": [str(c) for c in ctx.subgroup_matrix_configs], "python": platform.python_version(),
            "time": time.strftime("%Y-%m-%d %H:%M:%S %Z")}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m lfm2jit.bench", description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="a tiny set that runs on lavapipe in under a minute")
    ap.add_argument("--json", metavar="PATH", help="write every line (and the environment) as JSON")
    ap.add_argument("--only", nargs="+", metavar="NAME", help=f"groups: {', '.join(GROUPS)}")
    ap.add_argument("--reps", type=int, default=None, help="timed calls per kernel line (default 10, quick 3)")
    ap.add_argument("--steps", type=int, default=None, help="timed train windows per shape (default 3, quick 2); packing: timed runs over its windows "
                    "(default 1)")
    ap.add_argument("--no-tiles", action="store_true", help="skip the tile-configuration sweep")
    ap.add_argument("--f16", action="store_true", help="train steps (and the packing group's) with f16 activations (mixed precision, "
                    "loss scaling on), as python -m trainer --f16 runs them")
    ap.add_argument("--replay", type=int, metavar="N", default=None,
                    help="train steps: Trainer.with_replay(N); 0 runs every step's Python (default: the trainer's)")
    ap.add_argument("--recompute-mlp", action="store_true", help="train steps: backward recomputes the MLP's "
                    "up-projections (less memory, two more matmuls per layer)")
    ap.add_argument("--checkpoint-layers", metavar="all|N", default=0, type=checkpoint_layers_arg,
                    help="train steps: activation checkpointing of the first N decoder layers, or all; 0: off "
                         "(default). Each line gives the FLOPs the reruns add: recompute_flops")
    ap.add_argument("--model-preset", default=None, metavar="NAME",
                    help="train steps: the model's shape (an Lfm2Config or Lfm2MoeConfig preset, e.g. 1.2B or "
                         "8B-A1B; default 350M, quick tiny)")
    ap.add_argument("--train-shapes", nargs="+", metavar="BxT", help="train steps: shapes (default 1x512 8x512 1x2048)")
    ap.add_argument("--lora", type=int, metavar="R", help="train steps: LoRA adapters of rank R (alpha 2R) on "
                    "every linear layer, the base frozen")
    ap.add_argument("--lora-f16-base", action="store_true", help="with --lora: the frozen base's linear weights as f16")
    ap.add_argument("--base-dtype", choices=("f32", "f16", "int8", "nf4"), default=None,
                    help="with --lora: how the frozen base's linear weights (and experts) are held; f16 is "
                         "--lora-f16-base, int8 / nf4 decoded in the GEMMs")
    ap.add_argument("--packing-window", type=int, default=16, metavar="N",
                    help="packing: sequences per window (default 16)")
    ap.add_argument("--length-scale", type=int, default=1, metavar="K",
                    help="packing: the shipped data's lengths times K (a longer chat set of the same shape)")
    ap.add_argument("--tile-shapes", nargs="+", metavar="MxNxK", help="shapes for the tiles group "
                    "(default 4096x4096x4096 2048x4608x1024 2048x1024x4608)")
    ap.add_argument("--tiles-matching", nargs="+", metavar="TEXT", help="mtiles: only the candidates whose label "
                    "contains one of these (e.g. noprefetch 128x128/sg2x2)")
    ap.add_argument("--products", nargs="+", choices=MTILE_PRODUCTS, help="mtiles: only these products")
    ap.add_argument("--grouped-dtypes", nargs="+", choices=("f32", "f16"), help="grouped: only these operand dtypes")
    ap.add_argument("--grouped-routing", choices=("random", "even"), default="random",
                    help="grouped: tokens routed at random (default) or the same count to every expert")
    ap.add_argument("--xent-chunks", nargs="+", type=int, default=[4096], metavar="ROWS",
                    help="xent: the vocabulary rows a chunk (default 4096, the trainer's)")
    ap.add_argument("--xent-dtypes", nargs="+", choices=("f32", "f16"), help="xent: only these hidden-state dtypes")
    args = ap.parse_args(argv)
    reps = args.reps or (3 if args.quick else 10)
    ctx = WgpuContext.create()
    print(f"# adapter: {ctx.name}; features: {', '.join(sorted(ctx.features))}", flush=True)
    print(HEADER, flush=True)       # the lines follow as they are measured, each once
    wanted = args.only or list(GROUPS if not args.quick else QUICK_GROUPS)
    if args.no_tiles:
        wanted = [w for w in wanted if w != "tiles"]

    def selected(group):
        return any(group == w or group.startswith(w) or w.startswith(group) for w in wanted)

    tile_shapes = [tuple(int(v) for v in t.lower().split("x")) for t in args.tile_shapes] if args.tile_shapes else None
    bench = Bench(ctx, args.quick, reps, log=lambda s: print(s, flush=True), tile_shapes=tile_shapes,
                  tiles_matching=args.tiles_matching, products=args.products,
                  grouped_dtypes=tuple(args.grouped_dtypes or ("f32", "f16")), grouped_routing=args.grouped_routing,
                  xent_chunks=tuple(args.xent_chunks), xent_dtypes=tuple(args.xent_dtypes or ("f32", "f16")))
    t_start = time.perf_counter()
    state = {"lines": [], "meta": {}}

    def write_json():
        if not args.json:
            return
        lines = state["lines"]
        doc = {"environment": environment(ctx), "ceilings": {"flops": bench.ceil.flops, "bytes_per_s": bench.ceil.bw,
                                                            "source": bench.ceil.source},
               "argv": sys.argv[1:] if argv is None else list(argv), "seconds": time.perf_counter() - t_start,
               "train_meta": state["meta"],
               "lines": [dict(asdict(l), tflops=l.tflops(), gbs=l.gbs(), ceiling_fraction=bench.ceil.fraction(l))
                         for l in lines]}
        with open(args.json, "w") as f:
            json.dump(doc, f, indent=1, default=str)

    for group in GROUPS:
        if group in ("train", "packing") or not selected(group):
            continue
        getattr(bench, group)()
        state["lines"] = list(bench.lines)
        write_json()                     # after every group, so a run cut short keeps what it measured
    if selected("train"):
        from lfm2jit.model.config import Lfm2Config
        from lfm2jit.model.lora import LoraConfig
        from lfm2jit.model.moe_config import MOE_PRESETS, Lfm2MoeConfig
        name = args.model_preset or ("tiny" if args.quick else "350M")
        cfg = Lfm2MoeConfig.preset(name) if name in MOE_PRESETS else Lfm2Config.preset(name)
        shapes = ([tuple(int(v) for v in s.split("x")) for s in args.train_shapes] if args.train_shapes else
                  [(1, 64), (4, 64), (1, 128)] if args.quick else [(1, 512), (8, 512), (1, 2048)])
        lora = LoraConfig(r=args.lora, alpha=2.0 * args.lora) if args.lora else None
        train_lines, state["meta"] = train_bench(ctx, cfg, shapes, steps=args.steps or (2 if args.quick else 3),
                                                 log=lambda s: print(s, flush=True), replay=args.replay,
                                                 recompute_mlp=args.recompute_mlp,
                                                 checkpoint_layers=args.checkpoint_layers,
                                                 activation_dtype="f16" if args.f16 else "f32", lora=lora,
                                                 lora_base_dtype=lora_base_dtype(args))
        state["lines"] = list(bench.lines) + train_lines
        write_json()
    if selected("packing") and "packing" in wanted:      # only when asked for: not part of the defaults' run
        from lfm2jit.model.config import Lfm2Config
        from lfm2jit.model.moe_config import MOE_PRESETS, Lfm2MoeConfig
        name = args.model_preset or ("tiny" if args.quick else "350M")
        cfg = Lfm2MoeConfig.preset(name) if name in MOE_PRESETS else Lfm2Config.preset(name)
        state["lines"] = list(state["lines"]) + packing_bench(
            ctx, cfg, window=4 if args.quick else args.packing_window, windows=2 if args.quick else 4,
            scale=args.length_scale, activation_dtype="f16" if args.f16 else "f32", repeats=args.steps or 1,
            log=lambda s: print(s, flush=True))
        write_json()
    lines = state["lines"]
    total = time.perf_counter() - t_start
    print(f"\n# {len(lines)} lines in {total:.1f}s on {ctx.name}")
    print(footer(lines, bench.ceil))
    if args.json:
        print(f"# wrote {args.json}")
    return 0 if not any(l.error for l in lines) else 1


if __name__ == "__main__":
    sys.exit(main())
