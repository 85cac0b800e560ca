"""Attention on the matrix units (templates attention_fwd_matrix, attention_dq_matrix and
attention_dkdv_matrix): f16 q, k, v on a device with f16 subgroup matrices (emulated in plain WGSL where it has
none), against numpy float64 on the same f16 values, over generated shapes: ragged lengths, grouped
heads, several query and key blocks, packed sequences, every tile candidate that fits.

Tolerance: q k^T and P v take f16 inputs and accumulate in f32; P is rounded to f16 (2**-11
relative) before P v, and o is stored as f16: errors of a few u = 4.9e-4 (seen: ~1e-3); 4e-3 as the
SIMT f16 test allows.
"""
from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest

from numerics import rel_err
from lfm2jit import library
from lfm2jit.codegen.render import render
from lfm2jit.driver import grad
from lfm2jit.ir.intrinsics import IntrinsicError
from lfm2jit.schedule.attention import matrix_tiles_problem
from lfm2jit.tune.heuristics import MATRIX_ATTENTION_CANDIDATES
from lfm2jit.tune.tiles import MatrixAttentionTiles
from test_attention import H, _check, _inputs, _run, attention_kernel, attention_parts, reference

TOL = 4e-3


@pytest.fixture(scope="module")
def fwd16():
    return attention_kernel().variant("f16")


def _fitting(engine, e, mode="fwd"):
    t = engine.target
    return [c for c in MATRIX_ATTENTION_CANDIDATES if not matrix_tiles_problem(mode, c, e, t)]


def test_f16_attention_goes_to_the_matrix_units_and_f32_stays_simt(matrix_engine, engine, fwd16):
    dims = {"T": 100, "H": H, "G": 2, "E": 64}
    spec = fwd16.specialize(dims, 16, target=matrix_engine.target)
    assert spec.template == "attention_fwd_matrix"
    wgsl = render(spec)
    assert ("subgroupMatrixMultiplyAccumulate" in wgsl) != matrix_engine.target.emulated
    assert attention_kernel().specialize(dims, 16, target=matrix_engine.target).template == "attention_fwd"
    assert fwd16.specialize(dims, 16, target=engine.target).template == (
        "attention_fwd_matrix" if engine.target.matrix_configs else "attention_fwd")
    dq, _, dkdv = grad(fwd16, cotangents=["o"]).kernels   # dq, stats, dk/dv
    assert dq.specialize(dims, 16, target=matrix_engine.target).template == "attention_dq_matrix"
    assert dkdv.specialize(dims, 16, target=matrix_engine.target).template == "attention_dkdv_matrix"


def test_random_shapes_match_float64(matrix_engine, rng, fwd16):
    """10 generated cases, forward and backward: T from 1 to 128 (mostly off their bucket of 64),
    G in 1, 2, 4, E in 16..128."""
    bwd = grad(fwd16, cotangents=["o"])
    for case in range(10):
        T = int(rng.integers(1, 129))
        G = int(rng.choice([1, 2, 4]))
        E = int(rng.choice([16, 32, 64, 128]))
        q, k, v, do = _inputs(rng, T, G, E, np.float16)
        got = _run(matrix_engine, fwd16, bwd, q, k, v, do, bucket=64)
        want = reference(q, k, v, do)
        _check(got, want, TOL)


def test_every_fitting_tile_candidate(matrix_engine, rng, fwd16):
    T, G, E = 150, 2, 64
    q, k, v, do = _inputs(rng, T, G, E, np.float16)
    want = reference(q, k, v, do)
    e = matrix_engine
    args = {n: e.tensor(x) for n, x in (("q", q), ("k", k), ("v", v), ("d_o", do))}
    assert _fitting(e, E) and _fitting(e, E, "dq")
    for t in _fitting(e, E):
        out = e.run(fwd16, bucket=16, tiles=t, q=args["q"], k=args["k"], v=args["v"])
        assert rel_err(out["o"].numpy(), want[0]) < TOL, t
        assert rel_err(out["lse"].numpy(), want[1]) < TOL, t
    dq, stats, dkdv = grad(fwd16, cotangents=["o"]).kernels
    assert _fitting(e, E, "dkdv")
    (st,) = e.run(stats, bucket=16, o=out["o"], lse=out["lse"], d_o=args["d_o"]).values()
    for t in _fitting(e, E, "dq"):
        got = e.run(dq, bucket=16, tiles=t, o=out["o"], lse=out["lse"], **args)["d_q"]
        assert rel_err(got.numpy(), want[2]) < TOL, t
    for t in _fitting(e, E, "dkdv"):
        got = e.run(dkdv, bucket=16, tiles=t, **{stats.ir.outputs[0].name: st}, **args)
        assert rel_err(got["d_k"].numpy(), want[3]) < TOL and rel_err(got["d_v"].numpy(), want[4]) < TOL, t


def test_vec4_staging_matches_float64(matrix_engine, rng, fwd16):
    """q, k, v and dO in vec4<f16> tiles (MatrixAttentionTiles.vec4: a fetched vec4 in one store, fragments
    loaded in vec4 units, as the emulation indexes them too; P and dS stay f16): each kernel at its
    planner's tiles restaged, a ragged length, grouped heads."""
    T, G, E = 77, 2, 32
    q, k, v, do = _inputs(rng, T, G, E, np.float16)
    want = reference(q, k, v, do)
    e = matrix_engine
    args = {n: e.tensor(x) for n, x in (("q", q), ("k", k), ("v", v), ("d_o", do))}
    dims = {"T": T, "H": H, "G": G, "E": E}

    def restaged(kernel):
        return replace(kernel.specialize(dims, 16, target=e.target).params.tiles, vec4=True)
    out = e.run(fwd16, bucket=16, tiles=restaged(fwd16), q=args["q"], k=args["k"], v=args["v"])
    assert rel_err(out["o"].numpy(), want[0]) < TOL and rel_err(out["lse"].numpy(), want[1]) < TOL
    dq, stats, dkdv = grad(fwd16, cotangents=["o"]).kernels
    got = e.run(dq, bucket=16, tiles=restaged(dq), o=out["o"], lse=out["lse"], **args)["d_q"]
    assert rel_err(got.numpy(), want[2]) < TOL
    (st,) = e.run(stats, bucket=16, o=out["o"], lse=out["lse"], d_o=args["d_o"]).values()
    got = e.run(dkdv, bucket=16, tiles=restaged(dkdv), **{stats.ir.outputs[0].name: st}, **args)
    assert rel_err(got["d_k"].numpy(), want[3]) < TOL and rel_err(got["d_v"].numpy(), want[4]) < TOL


def _forward_at(e, fwd16, rng, random, growing, shrinking=(), packed=()):
    """The forward against float64 at each tiles of `random` on random scores, of `growing` and
    `shrinking` on scores that grow (a rescale every key tile: P would overflow f16 without them) or
    shrink (none after the first) by about 100 along the keys, of `packed` on packed sequences: a
    ragged length, grouped heads."""
    T, G, E = 150, 2, 64
    q, k, v, _ = _inputs(rng, T, G, E, np.float16)
    u = np.sign(rng.standard_normal(E))              # scores along u: q . k_t grows (or shrinks) with t
    grow = np.linspace(0.0, 6.0, T)[:, None, None] * u       # scores from 0 to about 100
    along = (2 * u + 0.1 * q).astype(np.float16)
    cases = [((q, k, v), random), ((along, (grow + 0.1 * k).astype(np.float16), v), growing),
             ((along, (grow[::-1] + 0.1 * k).astype(np.float16), v), shrinking)]
    for (qq, kk, vv), tiles in cases:
        want = reference(qq, kk, vv, np.zeros_like(qq))
        args = {n: e.tensor(x) for n, x in (("q", qq), ("k", kk), ("v", vv))}
        for t in tiles:
            out = e.run(fwd16, bucket=16, tiles=t, **args)
            assert rel_err(out["o"].numpy(), want[0]) < TOL, t
            assert rel_err(out["lse"].numpy(), want[1]) < TOL, t
    B, S = 3, 48                                      # packed sequences: each row sees its own only
    seqs = [_inputs(rng, S, G, E, np.float16) for _ in range(B)]
    qp, kp, vp, _ = (np.stack(x) for x in zip(*seqs))
    for t in packed:
        out = e.run(library.get("attention").variant("f16"), bucket=16, tiles=t,
                    q=e.tensor(qp), k=e.tensor(kp), v=e.tensor(vp))
        for b in range(B):
            o, lse = reference(*seqs[b])[:2]
            assert rel_err(out["o"].numpy()[b], o) < TOL and rel_err(out["lse"].numpy()[b], lse) < TOL, t


def test_o_kept_in_fragments_matches_float64(matrix_engine, rng, fwd16):
    """MatrixAttentionTiles.double (o accumulated in fragments, rescaled through workgroup memory only
    where a row's maximum outgrew its sums' by RESCALE_SLACK; k and v double-buffered): every fitting
    candidate on random scores (rescales in the first key tiles only), growing and shrinking scores,
    vec4 staging, packed sequences."""
    e = matrix_engine
    E = 64
    fitting = [replace(t, double=True) for t in _fitting(e, E)]
    fitting = [t for t in fitting if not matrix_tiles_problem("fwd", t, E, e.target)]
    assert fitting
    _forward_at(e, fwd16, rng, fitting, fitting[:2] + [replace(fitting[0], vec4=True)], fitting[:1], fitting[:1])


def test_backward_with_double_buffered_tiles_matches_float64(matrix_engine, rng, fwd16):
    """The backward with its streamed tiles double-buffered (MatrixAttentionTiles.double: dq's k and v,
    dkdv's q, dO, lse and D; the next step's stored after a step's first barrier, no barrier closing a
    step) at every fitting candidate: a ragged length over several tiles, grouped heads; dkdv also with
    a group's heads walked one after another in one workgroup (split 1: the walk crosses from one head's
    query tiles to the next's) and on packed sequences."""
    from lfm2jit import ComputeEngine
    e = matrix_engine

    def fitting(mode):
        tiles = [t for t in (replace(c, double=True) for c in MATRIX_ATTENTION_CANDIDATES)
                 if not matrix_tiles_problem(mode, t, E, e.target)]
        assert tiles, mode
        return tiles

    def backward(engine, q, k, v, do, tiles_dq, tiles_dkdv, fwd=fwd16):
        dq, stats, dkdv = grad(fwd, cotangents=["o"]).kernels
        args = {n: engine.tensor(x) for n, x in (("q", q), ("k", k), ("v", v), ("d_o", do))}
        out = engine.run(fwd, bucket=16, q=args["q"], k=args["k"], v=args["v"])
        (st,) = engine.run(stats, bucket=16, o=out["o"], lse=out["lse"], d_o=args["d_o"]).values()
        got = {}
        for t in tiles_dq:
            got[t, "dq"] = engine.run(dq, bucket=16, tiles=t, o=out["o"], lse=out["lse"], **args)["d_q"].numpy()
        for t in tiles_dkdv:
            r = engine.run(dkdv, bucket=16, tiles=t, **{stats.ir.outputs[0].name: st}, **args)
            got[t, "dkdv"] = (r["d_k"].numpy(), r["d_v"].numpy())
        return got

    dkdv = grad(fwd16, cotangents=["o"]).kernels[2]
    T, G, E = 150, 2, 64
    q, k, v, do = _inputs(rng, T, G, E, np.float16)
    want = reference(q, k, v, do)
    for (t, mode), g in backward(e, q, k, v, do, fitting("dq"), fitting("dkdv")).items():
        if mode == "dq":
            assert rel_err(g, want[2]) < TOL, t
        else:
            assert rel_err(g[0], want[3]) < TOL and rel_err(g[1], want[4]) < TOL, t
    walked = ComputeEngine(e.ctx)                     # too few bindings for the split's workspace
    walked.target = replace(e.target, storage_buffers=7)
    dims = {"T": T, "H": H, "G": 1, "E": E}
    assert dkdv.specialize(dims, 16, frozenset(), fitting("dkdv")[0], walked.target).params.split == 1
    q, k, v, do = _inputs(rng, T, 1, E, np.float16)
    want = reference(q, k, v, do)
    for (t, _), (dk, dv) in backward(walked, q, k, v, do, (), fitting("dkdv")[:2]).items():
        assert rel_err(dk, want[3]) < TOL and rel_err(dv, want[4]) < TOL, t
    B, S = 3, 48                                      # packed sequences: each key sees its own queries only
    seqs = [_inputs(rng, S, G, E, np.float16) for _ in range(B)]
    qp, kp, vp, dop = (np.stack(x) for x in zip(*seqs))
    (dk, dv), = backward(e, qp, kp, vp, dop, (), fitting("dkdv")[:1], library.get("attention").variant("f16")).values()
    for b in range(B):
        want = reference(*seqs[b])
        assert rel_err(dk[b], want[3]) < TOL and rel_err(dv[b], want[4]) < TOL


def test_paired_blocks_give_the_same_bits(matrix_engine, rng, fwd16):
    """MatrixAttentionTiles.pair (a workgroup takes block j and its mirror n - 1 - j) computes each block
    as before, so the forward, dq and dk/dv equal the unpaired kernels' bit for bit: odd and even counts
    of live blocks (the middle block of an odd count taken once), lengths off the bucket, with the tiles
    double-buffered and not, packed sequences; and one case against float64."""
    e = matrix_engine
    lib = library.get("attention").variant("f16")
    cases = [(150, 1, fwd16, (MatrixAttentionTiles(64, 16), MatrixAttentionTiles(32, 16, double=True))),
             (128, 1, fwd16, (MatrixAttentionTiles(32, 32),)),
             (48, 3, lib, (MatrixAttentionTiles(16, 16, double=True),))]
    for T, B, fwd, tiles in cases:
        dq, stats, dkdv = grad(fwd, cotangents=["o"]).kernels
        x = [_inputs(rng, T, 2, 32, np.float16) for _ in range(B)]
        q, k, v, do = (np.stack(a) if B > 1 else a[0] for a in zip(*x))
        args = {n: e.tensor(a) for n, a in (("q", q), ("k", k), ("v", v), ("d_o", do))}
        for t in tiles:
            assert not matrix_tiles_problem("dkdv", t, 32, e.target)
            got = []
            for pair in (False, True):
                tt = replace(t, pair=pair)
                out = e.run(fwd, bucket=16, tiles=tt, q=args["q"], k=args["k"], v=args["v"])
                (st,) = e.run(stats, bucket=16, o=out["o"], lse=out["lse"], d_o=args["d_o"]).values()
                d_q = e.run(dq, bucket=16, tiles=tt, o=out["o"], lse=out["lse"], **args)["d_q"]
                r = e.run(dkdv, bucket=16, tiles=tt, **{stats.ir.outputs[0].name: st}, **args)
                got.append([a.numpy() for a in (out["o"], out["lse"], d_q, r["d_k"], r["d_v"])])
            for name, a, b in zip(("o", "lse", "dq", "dk", "dv"), *got):
                np.testing.assert_array_equal(a, b, err_msg=f"{name} {t} T={T}")
            if B == 1 and t.double:
                _check(got[1], reference(q, k, v, do), TOL)


def test_rows_meeting_by_subgroup_shuffles_match_float64(matrix_engine, rng, fwd16):
    """MatrixAttentionTiles.shuffle (a row's maximum and sum met by subgroup shuffles, no tile_m and
    its barrier), alone and with double, at every fitting tile shape: random and growing scores (a
    rescale every tile), packed sequences."""
    e = matrix_engine
    if not e.target.subgroups:
        pytest.skip(f"{e.ctx.name} has no subgroups")
    E = 64
    fitting = [t for t in (replace(c, shuffle=True, double=d) for c in MATRIX_ATTENTION_CANDIDATES for d in (False, True))
               if not matrix_tiles_problem("fwd", t, E, e.target)]
    assert {t.double for t in fitting} == {False, True}
    wgsl = render(fwd16.specialize({"T": 150, "H": H, "G": 2, "E": E}, 16, frozenset(), fitting[0], e.target))
    assert "subgroupShuffleXor" in wgsl and "var<workgroup> tile_m" not in wgsl
    # every shape, each with or without double
    _forward_at(e, fwd16, rng, fitting[::2] + fitting[1::4], fitting[:4], packed=fitting[:2])


def test_packed_sequences(matrix_engine, rng):
    fwd = library.get("attention").variant("f16")
    B, S, G, E = 3, 48, 2, 64
    seqs = [_inputs(rng, S, G, E, np.float16) for _ in range(B)]
    q, k, v, _ = (np.stack(x) for x in zip(*seqs))
    e = matrix_engine
    out = e.run(fwd, bucket=16, q=e.tensor(q), k=e.tensor(k), v=e.tensor(v))
    for b in range(B):
        o, lse = reference(*seqs[b])[:2]
        assert rel_err(out["o"].numpy()[b], o) < TOL and rel_err(out["lse"].numpy()[b], lse) < TOL


def test_tiles_that_do_not_fit_are_refused_by_name(matrix_engine, fwd16):
    dims = {"T": 64, "H": H, "G": 2, "E": 64}
    target = matrix_engine.target
    with pytest.raises(IntrinsicError, match="must be multiples of the fragment height"):
        fwd16.specialize(dims, 16, frozenset(), MatrixAttentionTiles(24, 32), target)
    with pytest.raises(IntrinsicError, match="bytes of workgroup memory, the device allows"):
        fwd16.specialize(dims, 16, frozenset(), MatrixAttentionTiles(64, 256), target)
    with pytest.raises(IntrinsicError, match="need a device with f16 subgroup matrices"):
        fwd16.specialize(dims, 16, frozenset(), MatrixAttentionTiles(32, 32))
    dkdv = grad(fwd16, cotangents=["o"]).kernels[2]
    with pytest.raises(IntrinsicError, match="shuffle .* is the forward's"):
        dkdv.specialize(dims, 16, frozenset(), MatrixAttentionTiles(32, 16, shuffle=True), target)
    with pytest.raises(IntrinsicError, match="shuffle needs a device with subgroups"):
        fwd16.specialize(dims, 16, frozenset(), MatrixAttentionTiles(64, 32, shuffle=True), replace(target, subgroups=""))
    with pytest.raises(IntrinsicError, match="double .* gave wrong forward results on an H100"):
        fwd16.specialize(dims, 16, frozenset(), MatrixAttentionTiles(32, 16, double=True), replace(target, emulated=False))
    assert fwd16.specialize(dims, 16, frozenset(), MatrixAttentionTiles(32, 16, double=True), replace(target, emulated=True))


@pytest.mark.parametrize("E", [16, 64, 128])
def test_declared_workgroup_memory_is_what_the_planner_counts(E):
    """The planner keeps tiles within the device's workgroup memory by its own count; the arrays each
    matrix template declares must add up to exactly that (else the device refuses the pipeline)."""
    import re
    from lfm2jit.schedule import EMULATED_MATRIX_CONFIGS, Target
    kernels = dict(zip(("fwd", "dq", "dkdv"), attention_parts(attention_kernel().variant("f16"))))
    for emulated in (False, True):
        target = Target(EMULATED_MATRIX_CONFIGS, 32, 1 << 20, emulated=emulated, storage_buffers=16,
                        subgroups="subgroups")
        for mode, kernel in kernels.items():
            runs_double = mode != "fwd" or emulated        # the forward's is refused on a real device
            double = (replace(MATRIX_ATTENTION_CANDIDATES[1], double=True),) if runs_double else ()
            shuffle = tuple(replace(MATRIX_ATTENTION_CANDIDATES[1], shuffle=True, double=d)
                            for d in (False, True) if runs_double or not d) if mode == "fwd" else ()
            for tiles in (*MATRIX_ATTENTION_CANDIDATES, replace(MATRIX_ATTENTION_CANDIDATES[0], vec4=True),
                          *double, *shuffle):
                spec = kernel.specialize({"T": 100, "H": H, "G": 2, "E": E}, 16, frozenset(), tiles, target)
                wgsl = render(spec)
                declared = sum(int(n) * {"f16": 2, "f32": 4, "vec4<f16>": 8}[t] for t, n in
                               re.findall(r"var<workgroup> \w+: array<(f16|f32|vec4<f16>), (\d+)>", wgsl))
                declared += 4 * len(re.findall(r"var<workgroup> \w+: atomic<u32>;", wgsl))
                declared += 4 * sum(int(n) for n in re.findall(r"var<workgroup> \w+: array<atomic<u32>, (\d+)>", wgsl))
                assert declared == spec.params.smem_bytes, (mode, tiles, E)


def test_autotuned_matrix_attention_is_correct_and_cached(raised_ctx, matrix_engine, tmp_path, monkeypatch, rng):
    """LFM2JIT_AUTOTUNE=1: each of the three kernels tries the matrix candidates (those that do not
    fit score infinity), keeps the fastest in autotune.json, and a second engine reads them back."""
    import json
    from lfm2jit import ComputeEngine
    monkeypatch.setenv("LFM2JIT_AUTOTUNE", "1")
    monkeypatch.setenv("LFM2JIT_CACHE_DIR", str(tmp_path))
    if matrix_engine.target.emulated:
        monkeypatch.setenv("LFM2JIT_MATRIX_UNITS", "emulate")
    fwd = attention_kernel().variant("f16")
    bwd = grad(fwd, cotangents=["o"])
    q, k, v, do = _inputs(rng, 40, 2, 16, np.float16)
    tuned = ComputeEngine(raised_ctx)      # dk/dv's matrix form binds 9 tensors: more than the default 8
    got = _run(tuned, fwd, bwd, q, k, v, do, bucket=16)
    _check(got, reference(q, k, v, do), TOL)
    saved = json.loads((tmp_path / "autotune.json").read_text())
    assert sorted(e["kind"] for e in saved.values()) == ["MatrixAttentionTiles"] * 3
    tried = len(MATRIX_ATTENTION_CANDIDATES) + 1            # and the planner's pick with vec4 staging,
    # double-buffered, paired and double-buffered (the pick is paired: unpaired, it is a candidate); the
    # forward's also with shuffles, alone and double-buffered
    assert sorted(len(e["seconds"]) for e in saved.values()) == [tried + 2, tried + 2, tried + 4]
    again = ComputeEngine(raised_ctx)
    for a, g in zip(_run(again, fwd, bwd, q, k, v, do, bucket=16), got):
        np.testing.assert_array_equal(a, g)
    assert again.tuner.trials == 0


def test_picks_follow_the_h200_and_dkdv_takes_d_from_stats(fwd16):
    """On a device with 48 KiB of workgroup memory the forward takes 64x32 tiles, dq and dk/dv
    32x16, all with causal blocks paired; dk/dv reads each query's lse and D = dO . O from stats (a kernel before it), not from o."""
    from lfm2jit.cli import MATRIX_UNITS
    dims = {"T": 2048, "H": H, "G": 2, "E": 64}
    assert fwd16.specialize(dims, 64, target=MATRIX_UNITS).params.tiles == MatrixAttentionTiles(64, 32, pair=True)
    dq, _, dkdv = grad(fwd16, cotangents=["o"]).kernels   # dq, stats, dk/dv
    assert dq.specialize(dims, 64, target=MATRIX_UNITS).params.tiles == MatrixAttentionTiles(32, 16, pair=True)
    spec = dkdv.specialize(dims, 64, target=MATRIX_UNITS)
    assert spec.params.tiles == MatrixAttentionTiles(32, 16, pair=True)
    assert [e.name for e in spec.entry_points][:1] == ["main"] and not {s.tensor for s in spec.scratch} - {"ws"}
    assert "o" not in {b.tensor for b in spec.bindings} and "tile_d[i] = " in render(spec)


def test_tiles_are_padded_against_bank_conflicts_and_read_as_vectors(fwd16):
    """Every candidate's workgroup rows are padded so a fragment's rows fall in different banks: f16
    rows an odd number of 16-byte units apart (a fragment load reads 8 such rows at once), f32 columns
    4 words past a multiple of 16 (a fragment store's lanes, two columns apart, 8 banks apart); q, k, v
    (and the backward's dO, and dq's o) are bound as vec4s, the outputs as scalars."""
    from lfm2jit.cli import MATRIX_UNITS
    kernels = dict(zip(("fwd", "dq", "dkdv"), attention_parts(fwd16)))
    for mode, kernel in kernels.items():
        for tiles in MATRIX_ATTENTION_CANDIDATES:
            for E in (16, 64, 128):
                spec = kernel.specialize({"T": 256, "H": H, "G": 2, "E": E}, 64, frozenset(), tiles,
                                         replace(MATRIX_UNITS, workgroup_bytes=1 << 20))
                p = spec.params
                assert (2 * p.row_stride // 16) % 2 == 1 and 2 * p.row_stride % 16 == 0, (mode, tiles, E)
                assert (2 * p.col_stride // 16) % 2 == 1 and 2 * p.col_stride % 16 == 0, (mode, tiles, E)
                assert p.acc_stride % 16 == 4, (mode, tiles, E)
                vec = {b.tensor for b in spec.bindings if b.vector == 4}
                want = {"fwd": {"q", "k", "v"}, "dq": {"q", "k", "v", "d_o", "o"}, "dkdv": {"q", "k", "v", "d_o"}}
                assert vec == want[mode], (mode, vec)
