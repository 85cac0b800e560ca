"""bucket_sort(ids, V): order grouped by key (stable) and offsets [V + 1], against numpy's stable
argsort and bincount; keys outside [0, V) go last, in position order."""
from __future__ import annotations

import numpy as np
import pytest

from lfm2jit import compile_source
from lfm2jit.ir import intrinsics
from lfm2jit.ir.nodes import TensorArg

SOURCE = """
kernel sort(ids: i32[N]) -> (order: i32[N], offsets: i32[V + 1]) {
    order, offsets = bucket_sort(ids, V)
}
kernel sort_slots(ids: i32[T, K]) -> (order: i32[T, K], offsets: i32[E + 1]) {
    order, offsets = bucket_sort(ids, E)
}
kernel sort_u32(ids: u32[T]) -> (order: i32[T], offsets: i32[5]) {
    order, offsets = bucket_sort(ids, 4)
}
"""


@pytest.fixture(scope="module")
def mod():
    return compile_source(SOURCE, "sort.lk")


def reference(ids: np.ndarray, v: int) -> tuple[np.ndarray, np.ndarray]:
    flat = ids.reshape(-1).astype(np.int64)
    bucket = np.where((flat >= 0) & (flat < v), flat, v)
    counts = np.bincount(bucket, minlength=v + 1)
    return np.argsort(bucket, kind="stable"), np.concatenate([[0], np.cumsum(counts)])[:v + 1]


def check(got_order, got_offsets, ids, v):
    order, offsets = reference(ids, v)
    assert np.array_equal(got_offsets, offsets)
    assert np.array_equal(got_order.reshape(-1), order)


def test_random_keys_against_a_stable_argsort(engine, mod):
    rng = np.random.default_rng(0)
    for case in range(14):
        n = int(rng.choice([1, 7, 255, 256, 257, 1000, 3001]))
        v = int(rng.choice([1, 2, 3, 8, 64, 255, 256, 300, 1100]))
        ids = rng.integers(0, v, n).astype(np.int32)
        out = engine.run(mod.sort, ids=engine.tensor(ids), dims={"V": v})
        check(out["order"].numpy(), out["offsets"].numpy(), ids, v)


def test_empty_buckets_all_equal_keys_and_out_of_range(engine, mod):
    rng = np.random.default_rng(1)
    cases = [np.full(700, 3, np.int32),                                    # one bucket holds everything
             np.array([5, 5, 0, 5, 0], np.int32),                          # buckets 1..4 empty
             rng.integers(-5, 12, 900).astype(np.int32),                   # about half out of range
             np.array([-1, 2**31 - 1, -2**31, 7, 8], np.int32)]            # only out of range
    for ids in cases:
        out = engine.run(mod.sort, ids=engine.tensor(ids), dims={"V": 7})
        check(out["order"].numpy(), out["offsets"].numpy(), ids, 7)
    out = engine.run(mod.sort, ids=engine.tensor(cases[2]), dims={"V": 7})
    order, offsets = out["order"].numpy(), out["offsets"].numpy()
    tail = order[offsets[7]:]                       # the keys out of range, in position order
    assert np.array_equal(tail, np.flatnonzero((cases[2] < 0) | (cases[2] >= 7)))


def test_token_slots_by_expert_with_a_bucketed_length(engine, mod):
    """ids [T, K] as MoE routing has them: only the real T rows' slots are sorted, in flat order t*K + k."""
    rng = np.random.default_rng(2)
    for t, k, e, bucket in ((37, 2, 8, 16), (300, 4, 32, 64), (1, 1, 4, 64), (129, 3, 5, 128)):
        ids = rng.integers(0, e, (t, k)).astype(np.int32)
        out = engine.run(mod.sort_slots, ids=engine.tensor(ids), dims={"E": e}, bucket=bucket)
        assert out["order"].shape == (t, k) and out["offsets"].shape == (e + 1,)
        check(out["order"].numpy(), out["offsets"].numpy(), ids, e)


def test_u32_keys_and_a_fixed_number_of_keys(engine, mod):
    ids = np.array([3, 9, 0, 3, 1, 4, 0, 2, 3], np.uint32)
    out = engine.run(mod.sort_u32, ids=engine.tensor(ids), bucket=4)
    check(out["order"].numpy(), out["offsets"].numpy(), ids, 4)


def test_repeated_runs_agree(engine, mod):
    ids = np.random.default_rng(3).integers(0, 16, 5000).astype(np.int32)
    runs = [engine.run(mod.sort, ids=engine.tensor(ids), dims={"V": 16}) for _ in range(3)]
    for r in runs[1:]:
        assert np.array_equal(r["order"].numpy(), runs[0]["order"].numpy())


def test_offsets_axis_must_be_one_longer(engine):
    """An input over V + 1 is checked against V, and gives V + 1 its size when V has none."""
    k = compile_source("kernel k(offsets: i32[V + 1], w: f32[V]) -> (n: f32[V + 1]) { n = f32(offsets) * 2 }")
    offsets = engine.tensor(np.arange(6, dtype=np.int32))
    with pytest.raises(ValueError, match=r"input 'offsets' has V\+1=6, expected 5"):
        engine.run(k.k, offsets=offsets, w=engine.tensor(np.zeros(4, np.float32)))
    assert engine.run(k.k, offsets=offsets, w=engine.tensor(np.zeros(5, np.float32)))["n"].numpy().tolist() == \
        [0, 2, 4, 6, 8, 10]


def test_type_errors():
    with pytest.raises(intrinsics.IntrinsicError, match=r"ids must be an i32 or u32 tensor, got f32\[N\]"):
        intrinsics.kernel_ir("k", "bucket_sort", [TensorArg("ids", "f32", ("N",))], ["o", "f"], ("V",))
    with pytest.raises(intrinsics.IntrinsicError, match=r"V = T is the sequence axis"):
        intrinsics.kernel_ir("k", "bucket_sort", [TensorArg("ids", "i32", ("N",))], ["o", "f"], ("T",))
    with pytest.raises(intrinsics.IntrinsicError, match=r"offsets must be i32\[V \+ 1\]"):
        intrinsics.kernel_ir("k", "segment_sum", [TensorArg("g", "f32", ("N", "D")), TensorArg("o", "i32", ("N",)),
                                                  TensorArg("f", "i32", ("V",))], ["r"])


def test_either_result_alone(engine):
    """A kernel may keep only the offsets (counts by key) or only the order."""
    k = compile_source("""
kernel counts(ids: i32[T]) -> (offsets: i32[V + 1]) {
    order, offsets = bucket_sort(ids, V)
}
kernel grouped(ids: i32[T]) -> (order: i32[T]) {
    order, offsets = bucket_sort(ids, V)
}
""")
    ids = np.random.default_rng(5).integers(-1, 9, 600).astype(np.int32)
    order, offsets = reference(ids, 9)
    got = engine.run(k.counts, ids=engine.tensor(ids), dims={"V": 9}, bucket=64)["offsets"].numpy()
    assert np.array_equal(got, offsets)
    got = engine.run(k.grouped, ids=engine.tensor(ids), dims={"V": 9}, bucket=64)["order"].numpy()
    assert np.array_equal(got, order)


def test_dsl_errors_name_what_was_expected():
    from dsl_errors import assert_dsl_error
    assert_dsl_error("kernel bad(ids: f32[T]) -> (o: i32[T]) {\n    o, f = bucket_sort(ids, V)\n}\n", 2, 12,
                     "bucket_sort", "ids must be an i32 or u32 tensor, got f32[T]", "ids, V")
    assert_dsl_error("kernel bad(ids: i32[T]) -> (f: i32[V + 2]) {\n    o, f = bucket_sort(ids, V)\n}\n", 1, 40,
                     "2", "only one past an axis can be named", "V + 1")
