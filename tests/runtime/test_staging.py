"""StagedReadback and StagedWrite (lfm2jit/runtime/staging.py): groups of f32 tensors read back
through persistent staging buffers equal the tensors' contents exactly, and groups written through
them hold exactly the values given, in order with recorded work, across calls that grow and shrink
the groups and reuse slots (large groups copied out by threads); bad input is refused before any GPU work."""
from __future__ import annotations

import numpy as np
import pytest

from lfm2jit.runtime.staging import WRITE_USAGE, StagedReadback, StagedWrite


def test_random_groups_read_back_exactly_and_in_order_with_recorded_work(engine):
    rng = np.random.default_rng(7)
    staged = StagedReadback(engine)
    for trial in range(12):
        groups, want = [], []
        for _ in range(int(rng.integers(1, 4))):
            arrays = [rng.standard_normal(tuple(int(d) for d in rng.integers(1, 40, int(rng.integers(1, 3)))))
                      .astype(np.float32) for _ in range(int(rng.integers(1, 6)))]
            tensors = [engine.tensor(a) for a in arrays]
            # a rows view (an offset into its buffer) stands for a gradient that is a slice of a larger one
            big = rng.standard_normal((8, 64)).astype(np.float32)
            tensors.append(engine.tensor(big).rows(4, 8))
            arrays.append(big[4:8])
            groups.append(tensors)
            want.append(np.concatenate([a.reshape(-1) for a in arrays]).astype(np.float64))
        engine.zero_(groups[0][0])                    # recorded before the reads: they must see it
        want[0][:groups[0][0].size] = 0.0
        sizes = staged.submit(groups)
        assert sizes == [w.size for w in want]
        for i, w in enumerate(want):
            out = staged.read(i, np.empty(w.size, np.float64 if trial % 2 else np.float32))
            np.testing.assert_array_equal(out, w.astype(out.dtype), err_msg=f"trial {trial} group {i}")
    staged.release()


def test_a_large_group_is_copied_out_by_threads_exactly(engine, monkeypatch):
    """Groups above a few MiB are copied out of the mapped memory in ranges by several threads."""
    monkeypatch.setenv("LFM2JIT_HOST_COPY_THREADS", "3")
    rng = np.random.default_rng(11)
    arrays = [rng.standard_normal(n).astype(np.float32) for n in (3 << 20, 5, (1 << 20) + 3)]
    staged = StagedReadback(engine)
    (n,) = staged.submit([[engine.tensor(a) for a in arrays]])
    out = staged.read(0, np.full(n, np.nan, np.float64))
    np.testing.assert_array_equal(out, np.concatenate(arrays).astype(np.float64))
    staged.release()


def test_bad_input_is_refused(engine):
    staged = StagedReadback(engine)
    with pytest.raises(ValueError, match="StagedReadback moves f32 tensors"):
        staged.submit([[engine.tensor(np.zeros(4, np.float16), "f16")]])
    t = engine.tensor(np.arange(6, dtype=np.float32))
    assert staged.submit([[t]]) == [6]
    with pytest.raises(ValueError, match="slot 0 holds 6 elements; out has shape"):
        staged.read(0, np.empty(5))
    with engine.capture():
        with pytest.raises(RuntimeError, match="submit inside engine.capture"):
            staged.submit([[t]])
    np.testing.assert_array_equal(staged.read(0, np.empty(6, np.float32)), np.arange(6))   # nothing changed
    with engine.capture():
        with pytest.raises(RuntimeError, match="copy_into_buffer inside engine.capture"):
            engine.copy_into_buffer(t, staged._slots[0], 0)


def test_copies_recorded_in_a_capture_read_back_after_every_replay(engine):
    """A recorded program that computes tensors and copies them into reserved slots (as a train
    step stages its gradients while its backward runs): each replay, after new inputs are written,
    leaves exactly the new values in the slots, the copy ordered after the work that computes them."""
    rng = np.random.default_rng(5)
    xs = [engine.tensor(rng.standard_normal((1, n)).astype(np.float32)) for n in (7, 33, 5)]
    staged = StagedReadback(engine)
    assert staged.reserve([7 + 33, 5]) == [40, 5]
    with engine.capture() as program:
        ys = [engine.run("scale", x=x, alpha=3.0)["y"] for x in xs]    # recorded work the copies follow
        staged.record(0, ys[:2], replayed=True)
        staged.record(1, ys[2:], replayed=True)
    for trial in range(3):
        new = [rng.standard_normal(x.shape).astype(np.float32) for x in xs]
        for x, a in zip(xs, new):
            x.write(a)
        program.replay()
        got = [staged.read(0, np.empty(40, np.float64)), staged.read(1, np.empty(5, np.float32))]
        np.testing.assert_array_equal(got[0], np.concatenate([3 * new[0][0], 3 * new[1][0]]).astype(np.float64))
        np.testing.assert_array_equal(got[1], 3 * new[2][0])
    with pytest.raises(ValueError, match="slot 1 is reserved for 5 elements; the group has 7"):
        staged.record(1, xs[:1])
    with pytest.raises(ValueError, match="slot 2 is reserved for no elements"):
        staged.record(2, xs[:1])
    with engine.capture():
        with pytest.raises(RuntimeError, match="copy_into_buffer inside engine.capture"):
            staged.record(0, xs[:2])                      # not marked as replayed: refused
    program.close()
    staged.release()


def _random_group(engine, rng):
    """Tensors of random shapes (one a rows view: a gradient that is a slice of a larger buffer)
    with their contents, and the view's whole buffer."""
    arrays = [rng.standard_normal(tuple(int(d) for d in rng.integers(1, 40, int(rng.integers(1, 3)))))
              .astype(np.float32) for _ in range(int(rng.integers(1, 5)))]
    tensors = [engine.tensor(a) for a in arrays]
    big = engine.tensor(rng.standard_normal((8, 64)).astype(np.float32))
    tensors.append(big.rows(2, 4))
    return tensors, big


def test_random_groups_are_written_exactly_in_order_with_recorded_work(engine):
    rng = np.random.default_rng(11)
    staged = StagedWrite(engine)
    for trial in range(12):
        tensors, big = _random_group(engine, rng)
        around = big.numpy()
        n = sum(t.size for t in tensors)
        values = rng.standard_normal(n).astype(np.float64 if trial % 2 else np.float32)
        engine.zero_(tensors[0])                      # recorded before the write: the write must win
        staged.write(trial % 2, tensors, values)      # two slots in turn, as the MPI sync uses them
        at = 0
        for t in tensors:
            np.testing.assert_array_equal(t.numpy().reshape(-1), values[at:at + t.size].astype(np.float32),
                                          err_msg=f"trial {trial}")
            at += t.size
        rows = big.numpy()
        np.testing.assert_array_equal(np.delete(rows, [2, 3, 4, 5], axis=0), np.delete(around, [2, 3, 4, 5], axis=0))
    staged.release()


def test_a_write_is_refused_whole_before_anything_changes(engine):
    staged = StagedWrite(engine)
    t = engine.tensor(np.arange(6, dtype=np.float32))
    with pytest.raises(ValueError, match="StagedWrite moves f32 tensors"):
        staged.write(0, [t, engine.tensor(np.zeros(4, np.float16), "f16")], np.zeros(10))
    with pytest.raises(ValueError, match="the tensors hold 6 elements; values have shape \\(5,\\)"):
        staged.write(0, [t], np.zeros(5))
    with engine.capture():
        with pytest.raises(RuntimeError, match="StagedWrite.write inside engine.capture"):
            staged.write(0, [t], np.zeros(6))
        with pytest.raises(RuntimeError, match="copy_from_buffer inside engine.capture"):
            engine.copy_from_buffer(engine.device.create_buffer(size=24, usage=WRITE_USAGE), 0, t)
    np.testing.assert_array_equal(t.numpy(), np.arange(6))   # nothing changed
