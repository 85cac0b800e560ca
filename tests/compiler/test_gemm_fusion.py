"""GEMMs that carry more than one product: epilogues and sums of contractions.

The partitioner runs an elementwise expression of a contraction (``s * sum(x * w, K) + c``) as
one GEMM whose epilogue computes it at each output element, and a sum of contractions over the
same output (``sum(x * w, K) + sum(u * b, R)``: a layer with its LoRA up-projection) as one GEMM
whose K loop runs over each term in turn. What stays cut: a contraction another output also
reads, and expressions that read elsewhere than the output element. Results are checked against
float64 on many generated kernels, on the SIMT template and on the matrix template (the device's
subgroup matrices, or emulated where it has none)."""
from __future__ import annotations

import re

import numpy as np
import pytest

from numerics import rel_err
from lfm2jit import compile_source, grad
from lfm2jit.ir.partition import partition
from lfm2jit.tune.heuristics import narrow_matrix_tiles
from lfm2jit.tune.tiles import MatrixTiles, TileConfig


def _parts(src: str, name: str):
    return partition(compile_source(src)[name].ir).parts


def test_an_elementwise_expression_of_a_contraction_is_its_epilogue():
    parts = _parts("kernel k(x: f32[T, K], w: f32[N, K], c: f32[N], s: f32) -> (y: f32[T, N]) {\n"
                   "    y = tanh(s * sum(x * w, K) + c)\n}", "k")
    assert [(p.structure.kind, p.structure.reduced) for p in parts] == [("contraction", ("K",))]


def test_a_sum_of_contractions_over_one_output_is_one_gemm():
    parts = _parts("kernel k(x: f32[T, K], w: f32[N, K], u: f32[T, R], b: f32[N, R]) -> (y: f32[T, N]) {\n"
                   "    y = sum(x * w, K) + sum(u * b, R)\n}", "k")
    assert [(p.structure.kind, p.structure.reduced) for p in parts] == [("contraction", ("K", "R"))]


def test_the_epilogue_reads_other_tensors_at_moved_positions_but_not_the_sum():
    """c one row earlier is a read the epilogue makes; the sum one row earlier is not."""
    parts = _parts("kernel k(x: f32[T, K], w: f32[N, K], c: f32[T, N]) -> (y: f32[T, N]) {\n"
                   "    y = sum(x * w, K) + c[T - 1, :]\n}", "k")
    assert [p.structure.kind for p in parts] == ["contraction"]
    parts = _parts("kernel k(x: f32[T, K], w: f32[N, K]) -> (y: f32[T, N]) {\n"
                   "    g = sum(x * w, K)\n    y = g[T - 1, :]\n}", "k")
    assert sorted(p.structure.kind for p in parts) == ["contraction", "pointwise"]


def test_a_product_of_contractions_runs_each_as_its_own_gemm():
    parts = _parts("kernel k(x: f32[T, K], w: f32[N, K], v: f32[N, K]) -> (y: f32[T, N]) {\n"
                   "    y = sum(x * w, K) * sum(x * v, K)\n}", "k")
    assert sorted(p.structure.kind for p in parts) == ["contraction", "contraction", "pointwise"]


def test_a_reduction_in_the_expression_keeps_the_contraction_apart():
    parts = _parts("kernel k(x: f32[T, K], w: f32[N, K], z: f32[T, N, M]) -> (y: f32[T, N]) {\n"
                   "    y = sum(x * w, K) + sum(z, M)\n}", "k")
    assert sorted(p.structure.kind for p in parts) == ["contraction", "rowreduce"]   # the sum over M reads it


def test_outputs_computed_from_one_contraction_are_stored_by_its_gemm():
    """y = s * g and z = g + 1 of one g: one GEMM storing both, not one per output."""
    src = ("kernel k(x: f32[T, K], w: f32[N, K], s: f32) -> (y: f32[T, N], z: f32[T, N]) {\n"
           "    g = sum(x * w, K)\n    y = s * g\n    z = g + 1.0\n}")
    parts = partition(compile_source(src)["k"].ir).parts
    assert [(p.structure.kind, [o.name for o in p.outputs]) for p in parts] == [("contraction", ["y", "z"])]


def test_a_contraction_another_output_reduces_is_computed_once():
    """y = s * g and z = sum(g, N): z cannot be stored from the GEMM, so g is a temporary the GEMM
    writes once and both read."""
    src = ("kernel k(x: f32[T, K], w: f32[N, K], s: f32) -> (y: f32[T, N], z: f32[T]) {\n"
           "    g = sum(x * w, K)\n    y = s * g\n    z = sum(g, N)\n}")
    parts = partition(compile_source(src)["k"].ir).parts
    assert sorted(p.structure.kind for p in parts) == ["contraction", "pointwise", "rowreduce"]


def test_an_output_broadcasting_its_contraction_reads_the_gemms_temporary():
    """Fuzz seed 251, case 857: y0 = sum(x1 * x2, M) stored over [T, M, H] is the contraction's
    node itself, read through the temporary the GEMM writes; planning it as a second reader of the
    sum re-planned the kernel without end."""
    src = ("kernel k(s0: f32, x0: f32[M], x1: f32[T, M], x2: f32[M, H]) -> (y0: f32[T, M, H]) {\n"
           "    y0 = sum(x1 * x2, M)\n}")
    parts = partition(compile_source(src)["k"].ir).parts
    assert [p.structure.kind for p in parts] == ["contraction", "pointwise"]


def test_a_tensor_the_epilogue_reads_is_read_element_by_element_as_an_operand_too(engine, matrix_engine):
    """Emulated-matrix fuzz seed 253, case 1423: a backward GEMM with two outputs whose epilogue
    reads the temporary that is also one of its operands; the operand was bound as vec4s and the
    epilogue's element read of it did not compile. Every part now compiles on both templates."""
    src = ("kernel k(x0: f32[T], x1: f32[T, D], x7: f16[T, 4], x8: f16[T, D]) -> (y1: f16[4, D]) {\n"
           "    y1 = sum(where(x0 > 3, 0.75, -x7) * max(f16(x1), x8 * x8), T)\n}")
    back = grad(compile_source(src)["k"])
    shared = [p for p in back.kernels if p.ir.structure.kind == "contraction" and len(p.ir.outputs) > 1]
    assert shared, [p.ir.structure.kind for p in back.kernels]
    for e in (engine, matrix_engine):
        for part in back.kernels:
            e.compile(part, {"T": 7, "D": 5}, 8)


def test_contractions_another_part_computes_are_read_not_summed_again():
    """Fuzz seed 223, case 600: the backward recomputes sum(x1 * x2, T) + sum(x3 * x4, D) where a
    minimum's gradient compares with it, and the part that reads those sums (cut into
    temporaries) was planned as a sum of contractions of them; its planner then failed."""
    src = ("kernel k(x0: f32[K, N], x1: f32[T, K], x2: f32[T, N], x3: f32[D, K], x4: f32[D, N]) -> "
           "(y0: f32[T, K, N], y1: f32[T, K, N]) {\n"
           "    y0 = min(sin(x0), sum(x1 * x2, T) + sum(x3 * x4, D))[:, N + 1]\n"
           "    y1 = abs(log(f32(index(K)) + 0.25))\n}")
    back = grad(compile_source(src)["k"])
    for part in back.kernels:
        part.specialize({"T": 13, "D": 6, "K": 5, "N": 4}, 4)      # every part plans
    reader = next(p for p in back.kernels if "d_x0" in {o.name for o in p.ir.outputs})
    assert reader.ir.structure.kind == "pointwise"


# ---- generated kernels against float64 ----

EPILOGUES = {   # the expression stored, of the sum `acc` (a DSL expression) and tensors at the output element
    "none": "{acc}",
    "scale": "s * {acc}",
    "residual": "c + {acc}",
    "bias_row": "{acc} + bn",
    "gate": "{acc} * sigmoid(c) - 0.5 * bn",
    "where": "where({acc} > 0.0, {acc}, 0.1 * {acc}) + s",
    "shifted": "{acc} - c[{lead}{t} - 2, :]",
}


OUTPUTS = ("y", "z")


def _kernel(c: dict):
    """The kernel of case ``c`` (only the tensors its expressions read are parameters), as the
    variant of its dtypes: output y of the case's epilogue and, with a second one, z of that (both
    stored from one GEMM). Batched cases run over rows M (a GEMM's batch axis is never the sequence)."""
    b, t = ("B, ", "M") if c["batch"] else ("", "T")
    bodies = [EPILOGUES[e].format(acc="acc", t=t, lead=":, " if c["batch"] else "") for e in c["epilogues"]]
    text = " ".join(bodies)
    params = {"x": f"f32[{b}{t}, K]", "w": f"f32[{b}N, K]", "u": f"f32[{b}{t}, R]",
              "v": f"f32[{b}N, R]", "c": f"f32[{b}{t}, N]", "bn": "f32[N]"}
    used = ["x", "w"] + (["u", "v"] if c["terms"] > 1 else []) + [n for n in ("c", "bn") if re.search(rf"\b{n}\b", text)]
    sig = ", ".join([f"{n}: {params[n]}" for n in used] + (["s: f32"] if re.search(r"\bs\b", text) else []))
    acc = " + ".join(["sum(x * w, K)", "sum(u * v, R)"][:c["terms"]])
    outs = ", ".join(f"{o}: f32[{b}{t}, N]" for o in OUTPUTS[:len(bodies)])
    lines = "".join(f"    {o} = {body}\n" for o, body in zip(OUTPUTS, bodies))
    kern = compile_source(f"kernel k({sig}) -> ({outs}) {{\n    acc = {acc}\n{lines}}}")["k"]
    halves = {"x", "u"} & set(used) if c["in_dtype"] == "f16" else set()
    halves |= {o for o, dtype in zip(OUTPUTS, c["out_dtypes"]) if dtype == "f16"}
    return kern.variant("f16", kern.tensor_names - halves) if halves else kern


def _reference(epilogue: str, terms: int, a: dict, s: float) -> np.ndarray:
    f = {k: v.astype(np.float64) for k, v in a.items()}
    acc = f["x"] @ np.swapaxes(f["w"], -1, -2)
    if terms > 1:
        acc = acc + f["u"] @ np.swapaxes(f["v"], -1, -2)
    return {"none": lambda: acc, "scale": lambda: s * acc, "residual": lambda: f["c"] + acc,
            "bias_row": lambda: acc + f["bn"],
            "gate": lambda: acc / (1 + np.exp(-f["c"])) - 0.5 * f["bn"],
            "where": lambda: np.where(acc > 0, acc, 0.1 * acc) + s,
            "shifted": lambda: acc - np.concatenate([np.zeros_like(f["c"][..., :2, :]), f["c"][..., :-2, :]], -2)
            }[epilogue]()


def _case(seed: int, matrix: bool):
    rng = np.random.default_rng(seed)
    outputs = 2 if rng.random() < 0.35 else 1
    case = dict(epilogues=[str(e) for e in rng.choice(list(EPILOGUES), outputs)], terms=int(rng.integers(1, 3)),
                batch=bool(rng.random() < 0.25), accumulate=[bool(a) for a in rng.random(outputs) < 0.3],
                T=int(rng.choice([1, 7, 33, 100, 130])), K=int(rng.choice([8, 24, 64, 200])),
                N=int(rng.choice([8, 12, 48, 136])), R=int(rng.choice([4, 8, 16])), Bn=int(rng.integers(1, 4)),
                bucket=int(rng.choice([1, 16, 64])))
    if matrix:      # an f16 operand or result sends the product to the matrix template
        case.update(in_dtype="f16", out_dtypes=[str(d) for d in rng.choice(["f16", "f32"], outputs)],
                    tiles=[None, MatrixTiles(64, 64, 2, 2, 32, split=2), narrow_matrix_tiles("n", 2),
                           MatrixTiles(64, 64, 2, 2, 32, stages=2), MatrixTiles(128, 64, 2, 2, 32, prefetch=False)]
                    [int(rng.integers(5))])
    else:
        case.update(in_dtype="f32", out_dtypes=["f32"] * outputs,
                    tiles=[None, TileConfig(32, 32, 8, 4, 4), TileConfig(64, 64, 16, 4, 4, split=2),
                           TileConfig(64, 64, 8, 4, 4, double=True)][int(rng.integers(4))])
    return case


@pytest.mark.parametrize("seed", range(16))
@pytest.mark.parametrize("template", ["simt", "matrix"])
def test_generated_epilogues_and_sums_match_float64(engine, matrix_engine, seed, template):
    """Random epilogues, one or two outputs stored from the same sum, one or two terms, a batch
    axis, ragged T in a length bucket, accumulation and the tiles' variants (split-K, two stages,
    no prefetch, thin tiles)."""
    matrix = template == "matrix"
    e = matrix_engine if matrix else engine
    c = _case(seed, matrix)
    kern = _kernel(c)
    assert [p.ir.structure.kind for p in kern.kernels] == ["contraction"]     # one GEMM, nothing beside it
    rng = np.random.default_rng(seed + 1000)
    lead = (c["Bn"],) if c["batch"] else ()
    shapes = {"x": lead + (c["T"], c["K"]), "w": lead + (c["N"], c["K"]), "u": lead + (c["T"], c["R"]),
              "v": lead + (c["N"], c["R"]), "c": lead + (c["T"], c["N"]), "bn": (c["N"],)}
    host = {k: rng.standard_normal(shape).astype(np.float32) for k, shape in shapes.items()}
    for k in ("x", "u"):        # f16 operands: the reference sees the same rounded values
        host[k] = host[k].astype(c["in_dtype"].replace("f", "float")).astype(np.float32)
    s = float(rng.uniform(-2, 2))
    names = {t.name for t in kern.ir.inputs}
    args = {k: e.tensor(v, c["in_dtype"] if k in ("x", "u") else "f32") for k, v in host.items() if k in names}
    if "s" in kern.ir.scalars:
        args["s"] = s
    out, want = {}, {}
    for o, epilogue, dtype, acc in zip(OUTPUTS, c["epilogues"], c["out_dtypes"], c["accumulate"]):
        want[o] = _reference(epilogue, c["terms"], host, s)
        if acc:
            old = rng.standard_normal(lead + (c["T"], c["N"])).astype(dtype.replace("f", "float"))
            out[o] = e.tensor(old.astype(np.float32), dtype)
            want[o] = want[o] + old.astype(np.float64)
    got = e.run(kern, bucket=c["bucket"], dims={"R": c["R"], "M": c["T"]}, out=out, accumulate=set(out),
                tiles=c["tiles"], **args)
    for o, dtype in zip(want, c["out_dtypes"]):
        tol = 3e-3 if "f16" in (dtype, c["in_dtype"]) else 2e-5
        assert rel_err(got[o].numpy(), want[o]) < tol, (o, c)


# ---- the shipped kernels' residual ----

@pytest.mark.parametrize("name", ["linear", "linear_lora"])
@pytest.mark.parametrize("dtype", ["f32", "f16"])
@pytest.mark.parametrize("template", ["simt", "matrix"])
def test_the_decoder_residual_is_added_in_the_layers_gemm(engine, matrix_engine, name, dtype, template):
    """y = x W^T (+ u B^T) + r as a decoder layer's out_proj and w2 run it (r the residual stream,
    f16 with f16 activations, the weights f32), one GEMM, against float64, on the SIMT template (a
    GPU without subgroup matrices) and the matrix one; left out, r leaves the plain GEMM."""
    from lfm2jit import library
    from lfm2jit.ops import precision
    kernel = library.get(name)
    assert [p.ir.structure.kind for p in kernel.kernels] == ["contraction"]
    assert kernel.without({"r"}).ir.results["y"].op.name in ("SUM", "ADD")
    assert "r" not in {t.name for t in kernel.without({"r"}).ir.inputs}
    e = matrix_engine if template == "matrix" else engine
    rng = np.random.default_rng(len(name) + (dtype == "f16"))
    T, K, N, R = 45, 72, 40, 8
    act = np.float16 if dtype == "f16" else np.float32
    host = {"x": rng.standard_normal((T, K)).astype(act), "w": rng.standard_normal((N, K)).astype(np.float32),
            "u": rng.standard_normal((T, R)).astype(act), "b": rng.standard_normal((N, R)).astype(np.float32),
            "r": rng.standard_normal((T, N)).astype(act)}
    used = {t.name for t in kernel.ir.inputs}
    args = {k: e.tensor(v.astype(np.float32), dtype if v.dtype == np.float16 else "f32") for k, v in host.items() if k in used}
    got = precision.run(e, kernel, dtype, bucket=16, **args)["y"]
    f = {k: v.astype(np.float64) for k, v in host.items()}
    want = f["x"] @ f["w"].T + f["r"] + (f["u"] @ f["b"].T if "u" in used else 0)
    assert got.dtype == dtype
    assert rel_err(got.numpy(), want) < (3e-3 if dtype == "f16" else 2e-5)


@pytest.mark.parametrize("adapter", [False, True], ids=["plain", "lora"])
@pytest.mark.parametrize("dtype", ["f32", "f16"])
@pytest.mark.parametrize("template", ["simt", "matrix"])
def test_swiglu_downs_gradient_is_one_gemm_storing_both_gates(engine, matrix_engine, dtype, template, adapter):
    """The gradient of y = (silu(a) * b) W2^T in a and b, as the decoder's backward runs it (with f16
    activations: a, b, dy and the results f16, W2 f32): dg = dy W2 (+ du A with a LoRA adapter on
    w2: swiglu_down_lora, z = g A^T, dz = du) is one GEMM whose epilogue stores
    d_a = dg * b * silu'(a) and d_b = dg * silu(a), against float64."""
    from lfm2jit import library
    from lfm2jit.ops import precision
    back = (grad(library.get("swiglu_down_lora"), ["a", "b"], ["y", "z"]) if adapter
            else grad(library.get("swiglu_down"), ["a", "b"]))
    assert [(p.ir.structure.kind, [o.name for o in p.ir.outputs]) for p in back.kernels] == [("contraction", ["d_a", "d_b"])]
    e = matrix_engine if template == "matrix" else engine
    rng = np.random.default_rng(3 + (dtype == "f16") + 2 * adapter)
    T, F, D, R = 37, 72, 40, 8
    act = np.float16 if dtype == "f16" else np.float32
    a, b, dy, du = (rng.standard_normal(shape).astype(act) for shape in ((T, F), (T, F), (T, D), (T, R)))
    w = rng.standard_normal((D, F)).astype(np.float32) * 0.3
    al = rng.standard_normal((R, F)).astype(np.float32) * 0.3
    lora = {"al": e.tensor(al), "d_z": e.tensor(du.astype(np.float32), dtype)} if adapter else {}
    got = precision.run(e, back, dtype, bucket=16, a=e.tensor(a.astype(np.float32), dtype),
                        b=e.tensor(b.astype(np.float32), dtype), w=e.tensor(w), d_y=e.tensor(dy.astype(np.float32), dtype),
                        **lora)
    a64, b64 = a.astype(np.float64), b.astype(np.float64)
    sig = 1 / (1 + np.exp(-a64))
    dg = dy.astype(np.float64) @ w.astype(np.float64)
    if adapter:
        dg = dg + du.astype(np.float64) @ al.astype(np.float64)
    tol = 3e-3 if dtype == "f16" else 2e-5
    assert got["d_a"].dtype == got["d_b"].dtype == dtype
    assert rel_err(got["d_a"].numpy(), dg * b64 * sig * (1 + a64 * (1 - sig))) < tol
    assert rel_err(got["d_b"].numpy(), dg * a64 * sig) < tol
