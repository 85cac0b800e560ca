"""The benchmark tools run as a user runs them (their --quick sets work on lavapipe) and report
what they claim: times, train-step compile counts, a GPU profile that adds up, and ratios."""
from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def load_script(name: str):
    """A benches/ script as a module, imported the way running it imports it."""
    spec = importlib.util.spec_from_file_location(name, ROOT / "benches" / f"{name}.py")
    script = importlib.util.module_from_spec(spec)
    sys.modules[name] = script          # dataclasses look their module up while it executes
    spec.loader.exec_module(script)
    return script


bench = load_script("bench")


def test_quick_benchmarks_report_every_group(tmp_path):
    """Every group of --quick times its lines without an error (the grouped GEMMs in f16 only: their f32
    form differs by the dtype alone, and each line is new pipelines to compile)."""
    out = tmp_path / "quick.json"
    assert bench.main(["--quick", "--grouped-dtypes", "f16", "--json", str(out)]) == 0
    lines = json.loads(out.read_text())["lines"]
    assert {line["group"] for line in lines} >= {"matmul", "attention", "conv", "rmsnorm", "pointwise", "xent",
                                                 "adamw", "train"}
    for line in lines:
        assert line["error"] is None and line["seconds"] > 0, line
    for line in (x for x in lines if x["group"] == "train"):
        extra = line["extra"]
        assert extra["first_window_compiles"] > 0 and extra["second_window_compiles"] == 0, line["name"]
        assert extra["tokens_per_s"] > 0
        # the per-class GPU profile is a split of the window's GPU time, nothing lost or counted twice
        assert sum(extra["gpu_busy_by_class_s"].values()) == pytest.approx(extra["gpu_busy_s"], rel=1e-6)


def test_matrix_tiles_lines_only_for_the_candidates_asked_for(tmp_path, monkeypatch):
    """--tiles-matching: mtiles times the candidates whose label holds one of the texts, and the
    planner's pick (what benches/probes/best_tiles.py compares them against), no others."""
    monkeypatch.setenv("LFM2JIT_MATRIX_UNITS", "emulate")
    out = tmp_path / "mtiles.json"

    def timed(products, matching):
        assert bench.main(["--only", "mtiles", "--tile-shapes", "64x48x32", "--reps", "1", "--tiles-matching",
                           matching, "--products", *products, "--json", str(out)]) == 0
        lines = json.loads(out.read_text())["lines"]
        assert all(line["error"] is None and line["seconds"] > 0 for line in lines)
        picks = [line["name"].split("[")[0] for line in lines if line["extra"]["default"]]
        assert sorted(picks) == sorted(products)            # each product's pick, once
        return sorted(line["name"] for line in lines if not line["extra"]["default"] or matching in line["name"])

    assert timed(("fwd", "dx", "dw"), "64x64/sg2x2/bk32/split2") == sorted(
        f"{p}[64x64/sg2x2/bk32/split2/s1/g8{t}]" for p in ("fwd", "dx", "dw") for t in ("", "/noprefetch", "/v4"))
    assert timed(("dw",), "64x64/sg2x2/bk32/split2/s1/g8/") == [
        "dw[64x64/sg2x2/bk32/split2/s1/g8/noprefetch]", "dw[64x64/sg2x2/bk32/split2/s1/g8/v4]"]


def test_attention_backward_kernels_alone_give_the_whole_backwards_gradients(engine):
    """atiles and staging time dQ and dK/dV one at a time: dK/dV reads the D pass's output, which the
    helper runs first; each alone gives what the whole backward gives."""
    import numpy as np
    from lfm2jit import grad
    from lfm2jit.ops import library
    rng = np.random.default_rng(3)
    att = library.get("attention")
    q, k, v, do = (engine.tensor(rng.standard_normal(s, dtype=np.float32)) for s in ((8, 2, 16), (8, 1, 16),
                                                                                    (8, 1, 16), (8, 2, 16)))
    r = engine.run(att, q=q, k=k, v=v)
    args = {"q": q, "k": k, "v": v, "o": r["o"], "lse": r["lse"], "d_o": do}
    whole = engine.run(grad(att, ["q", "k", "v"], ["o"]), **args)
    dq, dkdv = bench._attention_backward_kernels(engine, att, args)
    alone = {**engine.run(dq, **{n: args[n] for n in dq.inputs}), **engine.run(dkdv, **{n: args[n] for n in dkdv.inputs})}
    for name in ("d_q", "d_k", "d_v"):
        assert np.abs(whole[name].numpy()).max() > 0
        np.testing.assert_array_equal(alone[name].numpy().reshape(whole[name].shape), whole[name].numpy())


def test_side_by_side_quick_against_torch_on_cpu(tmp_path):
    pytest.importorskip("torch")
    script = load_script("side_by_side")
    out = tmp_path / "sbs.json"
    assert script.main(["--quick", "--torch-device", "cpu", "--steps", "1", "--shapes", "1x64", "2x64",
                        "--ours", "fp32", "f16", "--torch", "fp32", "bf16", "--json", str(out)]) == 0
    table = json.loads(out.read_text())["table"]
    assert [row["shape"] for row in table] == ["1x64", "2x64"]
    for row in table:
        assert set(row["lfm2jit"]) == {"fp32", "f16"} and set(row["torch"]) == {"fp32", "bf16"}
        assert all(r["tok_s"] > 0 and r["second_compiles"] == 0 for r in row["lfm2jit"].values())
        assert set(row["speed_ratio"]) == {"fp32/fp32", "fp32/bf16", "f16/fp32", "f16/bf16"}
        assert row["speed_ratio"]["f16/bf16"] == pytest.approx(
            row["lfm2jit"]["f16"]["tok_s"] / row["torch"]["bf16"]["tok_s"])


def test_side_by_side_lora_on_an_moe_preset_trains_the_same_adapters_as_peft(tmp_path):
    """--preset tiny-moe --lora 2: transformers' Lfm2MoeForCausalLM under PEFT on the PyTorch side,
    with as many trained parameters as lfm2jit's adapters (the same linears targeted)."""
    pytest.importorskip("peft")
    script = load_script("side_by_side")
    out = tmp_path / "sbs.json"
    assert script.main(["--quick", "--preset", "tiny-moe", "--lora", "2", "--lora-f16-base", "--torch-device", "cpu",
                        "--steps", "1", "--shapes", "1x64", "--ours", "fp32", "--torch", "bf16",
                        "--json", str(out)]) == 0
    doc = json.loads(out.read_text())
    ours, theirs = doc["lfm2jit"]["fp32"]["meta"], doc["torch"]["bf16"]["meta"]
    assert doc["preset"] == "tiny-moe" and ours["lora_base_dtype"] == "f16" and theirs["base_dtype"] == "torch.bfloat16"
    assert theirs["n_params"] == ours["trained_params"] > 0
    assert doc["table"][0]["speed_ratio"]["fp32/bf16"] > 0
    # --base-dtype nf4 (QLoRA): the same adapters on a base held in 4 bits, experts included
    assert script.main(["--quick", "--preset", "tiny-moe", "--lora", "2", "--base-dtype", "nf4", "--steps", "1",
                        "--shapes", "1x64", "--ours", "fp32", "--torch", "--json", str(tmp_path / "nf4.json")]) == 0
    nf4 = json.loads((tmp_path / "nf4.json").read_text())["lfm2jit"]["fp32"]
    assert nf4["meta"]["lora_base_dtype"] == "nf4" and nf4["meta"]["trained_params"] == ours["trained_params"]
    assert nf4["meta"]["param_bytes"] < ours["param_bytes"] and nf4["lines"][0]["error"] is None


@pytest.mark.parametrize("kernel,cls", [
    ("expert_gate_up_bwd_f16_d_h32_d_x32_ends32", "moe experts (grouped matmul)"), ("sort_keys", "moe routing"),
    ("expert_ends", "moe routing"), ("moe_topk", "moe routing"),
    ("linear_bwd", "linear (matmul)"), ("linear_f16_w32", "linear (matmul)"),
    ("xent_dh", "lm head (matmul)"), ("xent_dE_f16_dE32_h32", "lm head (matmul)"),
    ("xent_lse_next", "lm head (softmax)"), ("attention_bwd_d_k_d_v", "attention"),
    ("adamw", "optimizer + grad norm"), ("rmsnorm_f16_inv32", "other (norms, conv, rope, pointwise, embedding)"),
])
def test_profile_classes_see_through_f16_variants(kernel, cls):
    assert bench._kernel_class(kernel) == cls


def test_probes_compile():
    """The one-off probes in benches/probes/ stay valid Python where they moved (each imports bench.py from
    benches/ itself when run as ``python benches/probes/NAME.py``)."""
    probes = sorted((ROOT / "benches" / "probes").glob("*.py"))
    assert probes
    for probe in probes:
        compile(probe.read_text(), str(probe), "exec")


def test_bench_prints_each_line_once(capsys):
    """The lines print as they are measured; the end adds the totals, not the same lines again."""
    assert bench.main(["--quick", "--only", "pointwise", "rmsnorm"]) == 0
    out = capsys.readouterr().out
    rows = [l for l in out.splitlines() if l.startswith(("pointwise ", "rmsnorm "))]
    assert rows and len(rows) == len(set(rows)), out
    assert sum(l.startswith("group ") for l in out.splitlines()) == 1 and "# ceilings:" in out and " lines in " in out


def test_gpu_busy_fraction_is_of_the_profiled_window_itself():
    """GPU busy time is summed over one window run with timestamps on: its fraction is of that window's
    own wall time (not of the median untimed window's, which a slower timed window exceeded: 125%)."""
    from lfm2jit import WgpuContext
    from lfm2jit.model.config import Lfm2Config
    ctx = WgpuContext.create()
    if not ctx.has_timestamps:
        pytest.skip("no timestamp queries")
    lines, _ = bench.train_bench(ctx, Lfm2Config.preset("tiny"), [(1, 64)], steps=1, log=lambda s: None)
    x = lines[0].extra
    assert x["gpu_busy_fraction"] == pytest.approx(x["gpu_busy_s"] / x["profile_window_s"])
    assert 0 < x["gpu_busy_fraction"] <= 1.0


def test_packing_group_reports_pad_and_concat_real_tokens(tmp_path):
    """--only packing (quick: the tiny preset, 2 windows of 4 sequences with the shipped data's lengths):
    a line per mode with real tokens/s, the rows each computes, and concat's speedup over pad."""
    out = tmp_path / "packing.json"
    assert bench.main(["--quick", "--only", "packing", "--json", str(out)]) == 0
    lines = json.loads(out.read_text())["lines"]
    assert [line["name"] for line in lines] == ["mixed_pad", "mixed_concat"]
    pad, concat = (line["extra"] for line in lines)
    assert pad["real_tokens"] == concat["real_tokens"] > 0
    assert concat["rows"] <= pad["rows"] and concat["passes"] <= pad["passes"]
    assert concat["speedup_over_pad"] == pytest.approx(concat["real_tokens_per_s"] / pad["real_tokens_per_s"])
    assert 34 <= pad["mean_length"] <= 121       # the shipped chat records' token lengths


def test_checkpoint_layers_lowers_the_peak_and_reports_the_reruns_flops():
    """--checkpoint-layers: the same losses, a lower pool peak, and each line's recompute_flops, the
    forward of every checkpointed layer again (2 of the 6 FLOPs per parameter and token: under a
    third of a full step's, the embedding not being rerun)."""
    from lfm2jit import WgpuContext
    from lfm2jit.model.config import Lfm2Config
    ctx = WgpuContext.create()
    runs = {n: bench.train_bench(ctx, Lfm2Config.preset("tiny"), [(1, 128)], steps=1, profile=False,
                                 log=lambda s: None, checkpoint_layers=n) for n in (0, "all")}
    (plain,), meta0 = runs[0]
    (ckpt,), meta1 = runs["all"]
    assert (meta0["checkpointed_layers"], meta1["checkpointed_layers"]) == (0, 4)
    assert ckpt.extra["losses_first_last"] == plain.extra["losses_first_last"]
    assert ckpt.extra["peak_pool_in_use_bytes"] < plain.extra["peak_pool_in_use_bytes"]
    assert plain.extra["recompute_flops"] == 0
    assert 0.2 < ckpt.extra["recompute_fraction"] < 1 / 3
