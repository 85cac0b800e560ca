"""Round-by-round GPU times of the matrix-unit products, chosen tiles against the same tiles given
explicitly, with and without preallocated outputs: shows whether a product's time is steady or has
slow rounds that a best-of-N hides. Usage: python benches/probes/matrix_rounds.py [MxNxK ...]"""
from __future__ import annotations

import sys

import numpy as np

from lfm2jit import ComputeEngine, WgpuContext, grad, library

sys.path.insert(0, __file__.rsplit("/", 2)[0])   # benches/, where bench.py is
from bench import time_engine  # noqa: E402


def main(shapes):
    e = ComputeEngine(WgpuContext.create())
    lin = library.get("linear").without({"r"})
    fwd, dx = lin.variant("f16", {"w"}), grad(lin, ["x"]).variant("f16", {"w"})
    rng = np.random.default_rng(0)
    for shape in shapes:
        m, n, k = map(int, shape.split("x"))
        x = e.tensor(rng.standard_normal((m, k), dtype=np.float32), "f16")
        w = e.tensor(rng.standard_normal((n, k), dtype=np.float32))
        dy = e.tensor(rng.standard_normal((m, n), dtype=np.float32), "f16")
        y = e.empty((m, n), "f16")
        tiles = fwd.kernels[0].specialize({"T": m, "K": k, "N": n}, 1, target=e.target).params.tiles
        cases = {"fwd chosen": lambda: e.run(fwd, x=x, w=w), "fwd chosen out=": lambda: e.run(fwd, x=x, w=w, out={"y": y}),
                 "fwd given": lambda: e.run(fwd, x=x, w=w, tiles=tiles),
                 "dx chosen": lambda: e.run(dx, x=x, w=w, d_y=dy)}
        for name, fn in cases.items():
            fn()
            rounds = [time_engine(e, fn, 10)[0] for _ in range(4)]
            print(f"{shape} {name:16s} {tiles.label:28s} " + " ".join(f"{2 * m * n * k / s / 1e12:6.1f}" for s in rounds)
                  + " TFLOP/s by round", flush=True)


if __name__ == "__main__":
    main(sys.argv[1:] or ["4096x4096x4096", "2048x3072x1024"])
