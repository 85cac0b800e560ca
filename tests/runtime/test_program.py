"""Recorded programs (engine.capture / Program.replay): the same dispatches again, with new input
data and patched scalars, checked against numpy; buffers reserved while a program lives; misuse
raises before anything is submitted."""
from __future__ import annotations

import numpy as np
import pytest

from lfm2jit.runtime.program import ReplayError


def record_chain(engine, x, z):
    """y = scale_add(x, z, alpha, beta) then w = scale(y, 0.5): two kernels, one intermediate."""
    y = engine.run("scale_add", x=x, z=z, alpha=2.0, beta=-1.0)["y"]
    return engine.run("scale", x=y, alpha=0.5)["y"]


def test_replay_reads_new_inputs_and_patched_scalars(engine, rng):
    a, b = rng.standard_normal((2, 8, 32)).astype(np.float32)
    x, z = engine.tensor(a), engine.tensor(b)
    with engine.capture() as program:
        w = record_chain(engine, x, z)
    np.testing.assert_allclose(w.numpy(), 0.5 * (2 * a - b), rtol=1e-6)   # the capture ran as usual

    a2, b2 = rng.standard_normal((2, 8, 32)).astype(np.float32)
    x.write(a2)
    z.write(b2)
    before = engine.dispatches
    program.replay({"beta": 3.0})
    assert engine.dispatches - before == 2
    np.testing.assert_allclose(w.numpy(), 0.5 * (2 * a2 + 3 * b2), rtol=1e-6)
    program.replay()                      # a patch stays until patched again
    np.testing.assert_allclose(w.numpy(), 0.5 * (2 * a2 + 3 * b2), rtol=1e-6)
    program.close()


def test_a_long_replay_is_submitted_in_growing_pieces_in_order(engine, rng, monkeypatch):
    """300 dispatches, each reading the last one's output (ping-pong between two tensors, every
    tenth doubling): the first submit is small so the GPU starts early, each next one twice the
    last up to COMMANDS_PER_SUBMIT, and the result shows every command ran once, in order."""
    from lfm2jit.runtime.program import COMMANDS_PER_SUBMIT, FIRST_SUBMIT
    a = rng.standard_normal(64).astype(np.float32)
    ping, pong = engine.tensor(a.reshape(2, 32)), engine.empty((2, 32))
    with engine.capture() as program:
        for i in range(300):
            src, dst = (ping, pong) if i % 2 == 0 else (pong, ping)
            engine.run("scale_add", x=src, z=src, alpha=1.0, beta=1.0 if i % 10 == 0 else 0.0, out={"y": dst})
    np.testing.assert_array_equal(ping.numpy(), a.reshape(2, 32) * 2.0 ** 30)
    sizes = []
    submit = engine._submit
    monkeypatch.setattr(engine, "_submit", lambda commands: (sizes.append(len(commands)), submit(commands))[1])
    b = rng.standard_normal(64).astype(np.float32)
    ping.write(b.reshape(2, 32))
    program.replay()
    np.testing.assert_array_equal(ping.numpy(), b.reshape(2, 32) * 2.0 ** 30)
    want, size, left = [], FIRST_SUBMIT, 300
    while left > 0:
        want.append(min(size, left))
        left, size = left - size, min(2 * size, COMMANDS_PER_SUBMIT)
    assert sizes == want and sizes[0] < 300
    program.close()


def test_a_programs_buffers_are_not_handed_out_until_it_closes(engine, rng):
    x, z = (engine.tensor(v) for v in rng.standard_normal((2, 4, 64)).astype(np.float32))
    with engine.capture() as program:
        y = engine.run("scale_add", x=x, z=z, alpha=1.0, beta=1.0)["y"]
        w = engine.run("scale", x=y, alpha=3.0)["y"]
        del y                              # freed inside the capture: the program still writes it
    expected = w.numpy()
    bound = {id(b) for b in program._buffers.values()}
    del w                                  # freed after: the program still writes it too
    grabbed = [engine.empty((4, 64)) for _ in range(4)]      # same size class as y and w
    assert not bound & {id(t.buffer) for t in grabbed}
    for t in grabbed:
        t.write(np.full((4, 64), 7.0, np.float32))
    program.replay()
    assert all((t.numpy() == 7.0).all() for t in grabbed)    # nothing of theirs was overwritten
    in_use = engine.pool.in_use_bytes
    program.close()
    assert engine.pool.in_use_bytes < in_use                 # y's and w's buffers are free again
    again = [engine.empty((4, 64)) for _ in range(8)]
    assert bound & {id(t.buffer) for t in again}
    assert expected.shape == (4, 64)


def test_host_reads_and_writes_inside_a_capture_raise(engine, rng):
    x = engine.tensor(rng.standard_normal((4, 16)).astype(np.float32))
    with pytest.raises(RuntimeError, match="inside engine.capture"):
        with engine.capture():
            engine.run("scale", x=x, alpha=2.0)["y"].numpy()
    with pytest.raises(RuntimeError, match="inside engine.capture"):
        with engine.capture():
            x.write(np.zeros((4, 16), np.float32))
    assert engine.capturing is None
    assert np.isfinite(x.numpy()).all()   # the engine works normally afterwards
    with pytest.raises(RuntimeError, match="do not nest"):
        with engine.capture():
            with engine.capture():
                pass
    assert engine.capturing is None


def test_failed_capture_leaves_a_closed_program(engine, rng):
    x = engine.tensor(rng.standard_normal((4, 16)).astype(np.float32))
    program = None
    with pytest.raises(ValueError):
        with engine.capture() as program:
            engine.run("scale", x=x, alpha=float("nan"))
    assert program.closed
    with pytest.raises(ReplayError, match="closed"):
        program.replay()


def test_replay_rejects_unknown_ambiguous_and_bad_scalars(engine, rng):
    x = engine.tensor(rng.standard_normal((4, 16)).astype(np.float32))
    with engine.capture() as program:
        y = engine.run("scale", x=x, alpha=2.0)["y"]
        engine.run("scale", x=y, alpha=3.0)                      # alpha: two values
        engine.run("scale_add", x=x, z=y, alpha=1.0, beta=5.0)   # beta: one value
    assert program.scalar_names() == ["beta"]
    with pytest.raises(ReplayError, match="'gamma' is not taken"):
        program.replay({"gamma": 1.0})
    with pytest.raises(ReplayError, match="'alpha' had 3 different values"):
        program.replay({"alpha": 1.0})
    with pytest.raises(ValueError, match="'beta' must be a finite number"):
        program.replay({"beta": float("inf")})
    program.replay({"beta": 1.0})
    program.close()
    with pytest.raises(ReplayError, match="closed"):
        program.replay({"beta": 1.0})
