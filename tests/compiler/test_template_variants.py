"""Every template variant the planners can choose renders, and the WebGPU implementation at hand
accepts it (create_shader_module: wgpu-native's naga on lavapipe in CI, Dawn's Tint on a GPU).

Variants: each GEMM product (f32 and f16 storage, split-K, epilogues, several outputs of one sum,
sums of two contractions, a batch axis, accumulating outputs) at the planner's tiles, and one
product per template at every tile the autotuner tries (tune/candidates.for_spec: SIMT and matrix
GEMM tiles, split tails, thin outputs, attention's tiles), so every branch of the templates is
rendered. Where the device has no subgroup matrices, the matrix templates are validated in the
emulated form that runs there, and their real form is rendered (StrictUndefined catches a missing
parameter) but not compiled.
"""
from __future__ import annotations

import pytest

from lfm2jit import compile_source, grad, library
from lfm2jit.cli import MATRIX_UNITS
from lfm2jit.codegen.offsets import index, plus, tile_at, times
from lfm2jit.codegen.render import render, templates_dir
from lfm2jit.codegen.wgsl import spell
from lfm2jit.schedule import PORTABLE
from lfm2jit.tune.candidates import for_spec

BMM = compile_source("kernel bmm(a: f32[H, M, E], b: f32[H, S, E]) -> (c: f32[H, M, S]) { c = sum(a * b, E) }")["bmm"]
ATTENTION = {"T": 200, "H": 4, "G": 2, "E": 64}


def _products():
    """(label, kernel, sizes, sweep): the GEMMs, attention and one kernel of each other template;
    `sweep` renders every tile the autotuner tries for it."""
    linear = library.get("linear").without({"r"})
    lora, swiglu, attention = library.get("linear_lora"), library.get("swiglu_down"), library.get("attention")
    sizes = {"T": 200, "K": 96, "N": 320, "D": 96, "F": 320, "R": 8}
    big = {"T": 2048, "K": 256, "N": 2304}          # a grid of 128x128 tiles ending in a partial wave: split tails
    out = [(name, library.get(name), {"T": 40, "D": 64, "V": 100, "N": 64, "E": 16, "K": 4}, False)
           for name in ("scale", "softmax", "bias_grad", "dropout", "embedding_backward", "moe_slots", "sort_keys",
                        "scatter_values")]
    out += [(f"moe_topk.{k.name}", k, {"T": 40, "E": 16, "K": 4}, False) for k in library.get("moe_topk").kernels]
    for storage in ("f32", "f16"):
        out += [(f"linear.y.{storage}", linear.variant(storage, {"w"}), big, True),
                (f"linear.d_x.{storage}", grad(linear, ["x"]).variant(storage, {"w"}).kernels[0], sizes, False),
                (f"linear.d_w.{storage}", grad(linear, ["w"]).variant(storage, {"d_w"}).kernels[0], sizes, False),
                (f"linear_lora.{storage}", lora.variant(storage), sizes, False),
                (f"bmm.{storage}", BMM.variant(storage), {"H": 3, "M": 40, "S": 48, "E": 64}, False),
                (f"attention.{storage}", attention.variant(storage), ATTENTION, True)]
        out += [(f"swiglu_down_bwd.{k.name}.{storage}", k, sizes, False)
                for k in grad(swiglu.variant(storage), cotangents=[swiglu.ir.outputs[-1].name]).kernels]
        out += [(f"attention_bwd.{k.name}.{storage}", k, ATTENTION, True)
                for k in grad(attention.variant(storage), cotangents=["o"]).kernels]
    thin = grad(library.get("lora_down"), cotangents=["u"]).variant("f16").kernels   # rank-8 outputs: narrow tiles
    return out + [(f"lora_down_bwd.{k.name}", k, {"T": 256, "D": 256, "R": 8}, True) for k in thin]


def _variants(matrix_target):
    """{label: WGSL} of every variant, deduplicated by text, for the portable and the matrix target."""
    shaders = {}
    for label, kernel, sizes, sweep in _products():
        dims = {a: sizes.get(a, 48) for a in kernel.ir.axes if a not in kernel.ir.fixed_dims and not a.endswith("+1")}
        for tname, target in (("portable", PORTABLE), ("matrix", matrix_target)):
            spec = kernel.specialize(dims, 16, target=target)
            outputs = frozenset(o.name for o in kernel.ir.outputs)
            cases = [(spec, ""), (kernel.specialize(dims, 16, outputs, None, target), ".accumulate")]
            for tiles in for_spec(spec) if sweep else ():
                try:
                    cases.append((kernel.specialize(dims, 16, frozenset(), tiles, target), f".{tiles}"))
                except ValueError:        # a candidate the planner refuses here (scores inf when tuning)
                    pass
            for s, suffix in cases:
                shaders.setdefault(render(s), f"{label}.{tname}.{s.template}{suffix}")
    return {label: wgsl for wgsl, label in shaders.items()}


@pytest.fixture(scope="module")
def variants(matrix_engine):
    return _variants(matrix_engine.target)


def test_offsets_spell_as_the_formula_reads():
    """Nothing folded; a sum inside a product or another sum parenthesised, a tile's minor sum flat."""
    assert spell(tile_at(16, plus("sm0", 16), 40, 640)) == "640u + 16u * 40u + sm0 + 16u"
    assert spell(tile_at(plus("sm0", 16), 0, "ROW_STRIDE")) == "(sm0 + 16u) * ROW_STRIDE + 0u"
    assert spell(plus(times("batch", 0), plus("n0", 16), minus=(64,))) == "batch * 0u + (n0 + 16u) - 64u"
    with pytest.raises(ValueError, match="not a WGSL name"):
        index("r0 + 1u")                    # expressions are built as typed values, never spliced in as text


def test_every_template_and_branch_is_rendered(variants):
    entry = {p.name.split(".")[0] for p in templates_dir().glob("*.wgsl.j2") if not p.name.startswith("_")}
    assert {w.split(", template ", 1)[1].split("\n", 1)[0] for w in variants.values()} == entry
    text = "\n".join(variants.values())
    for feature in ("in_tail", "var a_at", "old[q]", "let at1", "fn reduce", "// phase 2", "av0", "let band"):
        assert feature in text, f"no variant renders {feature!r}"


def test_every_variant_compiles(ctx, variants):
    """The device's shader compiler accepts each rendered variant."""
    for label, wgsl in variants.items():
        try:
            ctx.device.create_shader_module(code=wgsl)
        except Exception as e:   # noqa: BLE001 - name the variant that failed
            raise AssertionError(f"{label}: {e}") from e


def test_the_real_matrix_form_renders():
    """The subgroup-matrix form of each matrix variant renders (on a device with matrix units,
    test_every_variant_compiles compiles that form; lavapipe has none)."""
    real = _variants(MATRIX_UNITS)
    assert sum("subgroupMatrixMultiplyAccumulate" in w for w in real.values()) > 20
