"""Dawn's robustness modes (LFM2JIT_DAWN_ROBUSTNESS) change no result: the f16 GEMM products at
ragged shapes (edge tiles, split tails) and causal attention forward and backward give the same
bits on a device with every access clamped and on one with none. A kernel
that read or wrote out of bounds would differ where clamping moved its access. Needs a GPU that
Dawn lists (Dawn does not list lavapipe); `bash benches/h200.sh robust` runs it."""
from __future__ import annotations

import numpy as np
import pytest

from lfm2jit import ComputeEngine, WgpuContext, grad, library
from lfm2jit.runtime.context import dawn_has_gpu
from lfm2jit.settings import DAWN_ROBUSTNESS_TOGGLES

pytestmark = pytest.mark.skipif(not dawn_has_gpu(), reason="Dawn lists no GPU here (benches/h200.sh robust runs it)")


def _results(engine: ComputeEngine) -> dict[str, np.ndarray]:
    """Every product's outputs on this engine's device, from one seed."""
    rng = np.random.default_rng(3)
    out = {}
    linear = library.get("linear").without({"r"})
    for m, n, k in ((200, 320, 96), (2048, 2304, 256), (37, 1024, 4608)):
        x = engine.tensor(rng.standard_normal((m, k)).astype(np.float32), "f16")
        w = engine.tensor(rng.standard_normal((n, k)).astype(np.float32) * 0.05)
        dy = engine.tensor(rng.standard_normal((m, n)).astype(np.float32), "f16")
        out[f"y {m}x{n}x{k}"] = engine.run(linear.variant("f16", {"w"}), x=x, w=w)["y"].numpy()
        out[f"dx {m}x{n}x{k}"] = engine.run(grad(linear, ["x"]).variant("f16", {"w"}), x=x, w=w, d_y=dy)["d_x"].numpy()
        out[f"dw {m}x{n}x{k}"] = engine.run(grad(linear, ["w"]).variant("f16", {"d_w"}), x=x, w=w, d_y=dy)["d_w"].numpy()
    attention = library.get("attention").variant("f16")
    t, h, g, e = 300, 4, 2, 64
    q, kk, v, do = (engine.tensor(rng.standard_normal(s).astype(np.float32), "f16")
                    for s in ((t, h, e), (t, g, e), (t, g, e), (t, h, e)))
    fwd = engine.run(attention, bucket=64, q=q, k=kk, v=v)
    out["attention o"] = fwd["o"].numpy()
    back = engine.run(grad(attention, cotangents=["o"]), bucket=64, q=q, k=kk, v=v, o=fwd["o"], lse=fwd["lse"], d_o=do)
    out.update({f"attention {name}": x.numpy() for name, x in back.items()})
    return out


def test_every_robustness_mode_gives_the_same_bits(monkeypatch):
    monkeypatch.setenv("LFM2JIT_WEBGPU", "dawn")
    results = {}
    for mode in DAWN_ROBUSTNESS_TOGGLES:
        monkeypatch.setenv("LFM2JIT_DAWN_ROBUSTNESS", mode)
        results[mode] = _results(ComputeEngine(WgpuContext.create()))
    for mode, got in results.items():
        for name, want in results["on"].items():
            assert np.array_equal(got[name], want, equal_nan=True), (mode, name)
