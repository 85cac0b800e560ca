"""topk, bucket_sort and gather's adjoint over tensors bound in pieces: a device whose binding limit
is lowered to 4 KiB (as tests/compiler/test_binding_limits.py does) gives exactly what the same
kernels give bound whole. (T-leading tensors fill their buckets: a pieced binding spans the bucketed length.)"""
from __future__ import annotations

import numpy as np

from lfm2jit import ComputeEngine, compile_source, grad

LIMIT = 4096
SOURCE = """
kernel route(x: f32[T, E]) -> (v: f32[T, K], i: i32[T, K]) {
    v, i = topk(x, K)
}
kernel sort(ids: i32[N]) -> (order: i32[N], offsets: i32[V + 1]) {
    order, offsets = bucket_sort(ids, V)
}
kernel rows(table: f32[V, D], ids: i32[T]) -> (y: f32[T, D]) {
    y = gather(table, ids) * 3
}
"""


def run_all(eng, mod, x, ids, table, tids, dy):
    out = {}
    r = eng.run(mod.route, x=eng.tensor(x), dims={"K": 9}, bucket=16)
    out["v"], out["i"] = r["v"].numpy(), r["i"].numpy()
    s = eng.run(mod.sort, ids=eng.tensor(ids), dims={"V": 40})
    out["order"], out["offsets"] = s["order"].numpy(), s["offsets"].numpy()
    out["d_table"] = eng.run(grad(mod.rows), table=eng.tensor(table), ids=eng.tensor(tids), d_y=eng.tensor(dy),
                             bucket=16)["d_table"].numpy()
    return out


def test_routing_kernels_over_pieces_match_whole_bindings(ctx, engine, monkeypatch):
    mod = compile_source(SOURCE, "pieces.lk")
    rng = np.random.default_rng(0)
    x = rng.integers(0, 5, (96, 33)).astype(np.float32)               # 12672 bytes: 4 pieces
    ids = rng.integers(-2, 42, 2500).astype(np.int32)                 # 10000 bytes: 3 pieces
    table = rng.standard_normal((300, 6)).astype(np.float32)          # 7200 bytes: 2 pieces
    tids = rng.integers(0, 300, 224).astype(np.int32)
    dy = rng.standard_normal((224, 6)).astype(np.float32)             # 5376 bytes: 2 pieces
    whole = run_all(engine, mod, x, ids, table, tids, dy)
    monkeypatch.setitem(ctx.limits, "max-storage-buffer-binding-size", LIMIT)
    small = ComputeEngine(ctx)
    assert small.target.binding_bytes == LIMIT
    (part,) = compile_source(SOURCE, "pieces.lk").route.kernels
    assert {b.tensor: b.pieces for b in part.specialize({"T": 96, "E": 33, "K": 9}, 16, target=small.target).bindings
            if b.pieces > 1} == {"x": 4}
    pieced = run_all(small, mod, x, ids, table, tids, dy)
    for name, want in whole.items():
        assert np.array_equal(pieced[name], want), name
    assert np.array_equal(whole["i"], np.argsort(-x, axis=1, kind="stable")[:, :9])
    key = np.where((ids >= 0) & (ids < 40), ids, 40)
    assert np.array_equal(whole["order"], np.argsort(key, kind="stable"))
    ref = np.zeros((300, 6))
    np.add.at(ref, tids, 3 * dy.astype(np.float64))
    assert np.abs(whole["d_table"] - ref).max() < 1e-5
