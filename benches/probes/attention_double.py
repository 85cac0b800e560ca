"""Why the matrix forward with MatrixAttentionTiles.double (o kept in fragments, k and v double-buffered)
gives wrong results on an H100 under Dawn while it passes under the emulated matrix units
(benches/results/h100_attention_double_tests_dawn.log). Each variant edits the forward template's text
in a copy of templates/, runs on a fresh engine (the planner's refusal of that forward on real devices
lifted) and is checked against float64:
  as_is                  the template as it is
  no_rescale_body        the rescale of o (result stores and loads under the uniform flag) removed:
                         random scores never need it, so a pass here points at that branch
  always_rescale         the flag's workgroupUniformLoad replaced by a barrier, every step rescaled
  barrier_after_product  a barrier closing each step (the next step's S stored only after every P v)
  barrier_before_spill   a barrier between the last step and o's spill through workgroup memory
Shapes: T from one key tile to several blocks, E = 64 (o spilled in two rounds through a 32-key tile)
and E = 32 (one round). Prints one table; the columns where o is wrong, and the rows.
Usage: python benches/probes/attention_double.py [--quick]"""
from __future__ import annotations

import shutil
import sys
import tempfile
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[2]
sys.path[:0] = [str(ROOT / "tests"), str(ROOT / "tests" / "compiler")]

from lfm2jit import ComputeEngine, WgpuContext               # noqa: E402
from lfm2jit.codegen import render                           # noqa: E402
from lfm2jit.schedule import attention                       # noqa: E402
from lfm2jit.tune.tiles import MatrixAttentionTiles          # noqa: E402
from numerics import rel_err                                 # noqa: E402
from test_attention import _inputs, attention_kernel, reference   # noqa: E402

TEMPLATE = "attention_fwd_matrix.wgsl.j2"
FLAG = "        if (workgroupUniformLoad(&rescale_any[step % 2u]) != 0u) {"
VARIANTS = {
    "as_is": [],
    "no_rescale_body": [("{{- rescale_o() }}", "")],
    "always_rescale": [(FLAG, "        workgroupBarrier();\n        if (true) {")],
    "barrier_after_product": [("        // no barrier here: the next step's S and maxima go to tile_x and tile_m",
                               "        workgroupBarrier();\n        //")],
    "barrier_before_spill": [('{{ am.spill("o_frag"', '    workgroupBarrier();\n{{ am.spill("o_frag"')],
}
TILES = (MatrixAttentionTiles(64, 32, double=True), MatrixAttentionTiles(32, 16, double=True),
         MatrixAttentionTiles(16, 16, double=True), MatrixAttentionTiles(64, 32))


def lift_refusal():
    """The planner refuses the double forward on real devices; this probe is what decides that rule."""
    rule = attention.matrix_tiles_problem

    def problem(*args, **kwargs):
        why = rule(*args, **kwargs)
        return None if why and why.startswith("double (o kept") else why
    attention.matrix_tiles_problem = problem


def use_templates(text: str) -> None:
    """Point the renderer at a copy of templates/ whose forward template is ``text``."""
    copy = Path(tempfile.mkdtemp()) / "templates"
    shutil.copytree(render.templates_dir(), copy)
    (copy / TEMPLATE).write_text(text)
    render.templates_dir = lambda: copy
    render.environment.cache_clear()


def where_wrong(got, want) -> str:
    bad = np.abs(got - want) > 4e-3 * np.abs(want).max()
    if not bad.any():
        return ""
    cols, rows = np.flatnonzero(bad.any((0, 1))), np.flatnonzero(bad.any((1, 2)))
    return f"cols {cols.min()}-{cols.max()} ({len(cols)}), rows {rows.min()}-{rows.max()} ({len(rows)})"


def main(argv: list[str]) -> int:
    quick = "--quick" in argv
    shapes = ((32, 64), (150, 32)) if quick else ((16, 64), (32, 64), (64, 64), (150, 64), (64, 32), (150, 32))
    lift_refusal()
    base = (render.templates_dir() / TEMPLATE).read_text()
    ctx = WgpuContext.create()
    fwd = attention_kernel().variant("f16")
    rng = np.random.default_rng(0)
    rows = []
    for name, edits in VARIANTS.items():
        text = base
        for old, new in edits:
            assert old in text, (name, old)
            text = text.replace(old, new)
        use_templates(text)
        engine = ComputeEngine(ctx)
        for t_len, e in shapes:
            q, k, v, _ = _inputs(rng, t_len, 2, e, np.float16)
            want = reference(q, k, v, np.zeros_like(q))
            args = {n: engine.tensor(x) for n, x in (("q", q), ("k", k), ("v", v))}
            for tiles in TILES:
                label = f"{tiles.rows}x{tiles.tile}{'/x2' if tiles.double else ''}"
                try:
                    out = engine.run(fwd, bucket=16, tiles=tiles, **args)
                except ValueError as err:               # tiles that do not fit this device
                    rows.append((name, t_len, e, label, "-", "-", "-", str(err).split(": ")[-1][:60]))
                    continue
                o = out["o"].numpy().astype(np.float64)
                rows.append((name, t_len, e, label, f"{rel_err(o, want[0]):.1e}",
                             f"{rel_err(out['lse'].numpy(), want[1]):.1e}", int(np.isnan(o).sum()),
                             where_wrong(o, want[0])))
    print(f"# {ctx.name}")
    print(f"{'variant':22} {'T':>4} {'E':>3} {'tiles':8} {'o err':>8} {'lse err':>8} {'nan':>5} where o is wrong")
    for r in rows:
        print(f"{r[0]:22} {r[1]:4} {r[2]:3} {r[3]:8} {r[4]:>8} {r[5]:>8} {r[6]!s:>5} {r[7]}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
