"""gather's adjoint in its table: bucket_sort + segment_sum, a scatter-add in a fixed order.

Checked against np.add.at in float64, and bit for bit against float32 sums taken in position
order (the order the kernel promises), so repeated runs are bit-identical."""
from __future__ import annotations

import numpy as np
import pytest

from lfm2jit import compile_source, grad, library
from lfm2jit.ops.embedding import slots

SOURCE = """
kernel mix(table: f32[V, D], ids: i32[T, K], w: f32[T, K, D]) -> (y: f32[T, D]) {
    y = sum(gather(table, ids) * w, K)
}
kernel scale(table: f32[V], ids: i32[T]) -> (y: f32[T]) {
    y = gather(table, ids) * 2
}
kernel rows(table: f32[V, D], ids: i32[N], s: f32[N]) -> (y: f32[N, D]) {
    y = exp(gather(table, ids) * 0.5) * s + table[3, :]
}
"""


@pytest.fixture(scope="module")
def mod():
    return compile_source(SOURCE, "gather.lk")


def ordered_sum(ids: np.ndarray, g: np.ndarray, v: int) -> np.ndarray:
    """Row r: float32 0 + g[p0] + g[p1] + ... over the positions p holding id r, in position order."""
    out = np.zeros((v,) + g.shape[1:], np.float32)
    for p, r in enumerate(ids):
        if 0 <= r < v:
            out[r] = out[r] + g[p]
    return out


def test_mix_against_add_at_and_bitwise_against_ordered_sums(engine, mod):
    rng = np.random.default_rng(0)
    bwd = grad(mod.mix, ["table", "w"])
    for v, d, t, k, bucket in ((11, 5, 37, 3, 16), (300, 70, 20, 2, 64), (4, 1, 90, 4, 32)):
        table = rng.standard_normal((v, d)).astype(np.float32)
        ids = rng.integers(0, v, (t, k)).astype(np.int32)
        w = rng.standard_normal((t, k, d)).astype(np.float32)
        dy = rng.standard_normal((t, d)).astype(np.float32)
        args = dict(table=engine.tensor(table), ids=engine.tensor(ids), w=engine.tensor(w), d_y=engine.tensor(dy))
        out = engine.run(bwd, bucket=bucket, **args)
        g = (dy[:, None, :] * w).reshape(-1, d)
        want = np.zeros((v, d))
        np.add.at(want, ids.reshape(-1), g.astype(np.float64))
        got = out["d_table"].numpy()
        assert np.abs(got - want).max() <= 1e-5 * np.abs(want).max()
        assert np.array_equal(got, ordered_sum(ids.reshape(-1), g, v))    # rows no id reaches are zero
        assert np.array_equal(out["d_w"].numpy(), table[ids] * dy[:, None, :])
        again = engine.run(bwd, bucket=bucket, **args)["d_table"].numpy()
        assert got.tobytes() == again.tobytes()


def test_one_axis_table_repeated_ids_and_accumulation(engine, mod):
    rng = np.random.default_rng(1)
    bwd = grad(mod.scale, ["table"])
    ids = np.array([2, 2, 2, 0, 2, 5, 0], np.int32)        # rows 1, 3, 4 unused
    dy = rng.standard_normal(7).astype(np.float32)
    table = engine.tensor(np.zeros(6, np.float32))
    got = engine.run(bwd, table=table, ids=engine.tensor(ids), d_y=engine.tensor(dy), bucket=4)["d_table"].numpy()
    assert np.array_equal(got, ordered_sum(ids, (2 * dy).astype(np.float32), 6))
    into = engine.tensor(np.arange(6, dtype=np.float32))
    engine.run(bwd, table=table, ids=engine.tensor(ids), d_y=engine.tensor(dy), bucket=4,
               out={"d_table": into}, accumulate={"d_table"})
    assert np.array_equal(into.numpy(), np.arange(6, dtype=np.float32) + got)


def test_chain_rule_through_an_expression_of_the_rows(engine, mod):
    """y = exp(gather(table, ids) / 2) * s + table[3, :]: the table's gradient sums the scatter and
    the direct read of row 3 (ids without a T axis: every position is real)."""
    rng = np.random.default_rng(2)
    v, d, n = 9, 6, 40
    table = rng.standard_normal((v, d)).astype(np.float32)
    ids = rng.integers(0, v, n).astype(np.int32)
    s = rng.standard_normal(n).astype(np.float32)
    dy = rng.standard_normal((n, d)).astype(np.float32)
    out = engine.run(grad(mod.rows, ["table", "s"]), table=engine.tensor(table), ids=engine.tensor(ids),
                     s=engine.tensor(s), d_y=engine.tensor(dy))
    t64, dy64 = table.astype(np.float64), dy.astype(np.float64)
    e = np.exp(t64[ids] * 0.5)
    want = np.zeros((v, d))
    np.add.at(want, ids, dy64 * e * 0.5 * s[:, None])
    want[3] += dy64.sum(0)
    assert np.abs(out["d_table"].numpy() - want).max() <= 2e-5 * np.abs(want).max()
    assert np.abs(out["d_s"].numpy() - (dy64 * e).sum(1)).max() <= 2e-5 * np.abs((dy64 * e).sum(1)).max()


def test_the_embedding_kernel_differentiated_equals_its_host_sorted_scatter(engine):
    """grad(embedding) (sorted on the GPU) and the shipped embedding_backward (slots sorted on the
    host) sum in the same order: the same bits."""
    rng = np.random.default_rng(3)
    v, d, t = 50, 24, 45
    table = rng.standard_normal((v, d)).astype(np.float32)
    ids = rng.integers(0, 12, t).astype(np.int32)
    dy = rng.standard_normal((t, d)).astype(np.float32)
    emb = library.get("embedding")
    got = engine.run(grad(emb, ["table"]), bucket=16, table=engine.tensor(table), ids=engine.tensor(ids),
                     d_y=engine.tensor(dy))["d_table"].numpy()
    order, bounds, rows = slots(ids)
    host = engine.tensor(np.zeros((v, d), np.float32))
    bk = library.get("embedding_backward")
    engine.run(bk, bucket=16, g=engine.tensor(dy), order=engine.tensor(order), bounds=engine.tensor(bounds),
               rows=engine.tensor(rows), dims={"V": v}, out={bk.outputs[0]: host}, accumulate={bk.outputs[0]})
    assert got.tobytes() == host.numpy().tobytes()


def test_f16_table(engine):
    """An f16 table: its rows summed in f32, in position order, stored as f16 (within its rounding)."""
    k = compile_source("kernel half(table: f16[V, D], ids: i32[T]) -> (y: f16[T, D]) { y = gather(table, ids) }")
    rng = np.random.default_rng(4)
    v, d, t = 7, 9, 50
    table = rng.standard_normal((v, d)).astype(np.float16)
    ids = rng.integers(0, v - 1, t).astype(np.int32)                   # the last row unused: zero
    dy = rng.standard_normal((t, d)).astype(np.float16)
    assert np.array_equal(engine.run(k.half, table=engine.tensor(table), ids=engine.tensor(ids), bucket=16)["y"].numpy(),
                          table[ids])
    got = engine.run(grad(k.half), table=engine.tensor(table), ids=engine.tensor(ids), d_y=engine.tensor(dy),
                     bucket=16)["d_table"].numpy()
    want = ordered_sum(ids, dy.astype(np.float32), v)
    assert got.dtype == np.float16 and not got[v - 1].any()
    assert np.abs(got.astype(np.float32) - want).max() <= 2.0**-10 * np.abs(want).max()
