"""Files lfm2jit reads back on its own (the WGSL cache, autotune.json) cannot be steered by someone
else: edited entries are rendered again, a directory others may write is not used, and no write
follows a planted symlink (see lfm2jit/safefiles.py)."""
from __future__ import annotations

import json
import os

import numpy as np
import pytest

from lfm2jit import ComputeEngine
from lfm2jit.driver import WgslDiskCache
from lfm2jit.ops import library
from lfm2jit.safefiles import untrusted_reason, write_atomic
from lfm2jit.tune.autotune import Tuner


def _softmax(engine, rng):
    x = rng.standard_normal((4, 16)).astype(np.float32)
    got = engine.run("softmax", x=engine.tensor(x))["y"].numpy()
    want = np.exp(x - x.max(-1, keepdims=True))
    np.testing.assert_allclose(got, want / want.sum(-1, keepdims=True), rtol=1e-5)


def test_an_edited_cache_entry_is_rendered_again(ctx, tmp_path, monkeypatch, rng):
    monkeypatch.setenv("LFM2JIT_CACHE_DIR", str(tmp_path))
    _softmax(ComputeEngine(ctx), rng)
    [entry] = tmp_path.glob("*.wgsl")
    good = entry.read_text()
    for edit in (good.replace("exp(", "exp(2.0 * "), good[:len(good) // 2], "// lfm2jit\n@compute fn main() {}"):
        entry.write_text(edit)
        engine = ComputeEngine(ctx)
        _softmax(engine, rng)              # the right numbers: the edited WGSL was not run
        assert engine.stats.disk_hits == 0
        assert entry.read_text() == good   # and the entry is whole again
    engine = ComputeEngine(ctx)
    _softmax(engine, rng)
    assert engine.stats.disk_hits == 1


@pytest.mark.skipif(not hasattr(os, "getuid"), reason="POSIX permissions")
def test_a_directory_others_may_write_is_not_used(ctx, tmp_path, monkeypatch, rng):
    shared = tmp_path / "shared"
    shared.mkdir()
    os.chmod(shared, 0o777)
    monkeypatch.setenv("LFM2JIT_CACHE_DIR", str(shared))
    spec = library.get("softmax").specialize({"T": 4, "D": 16})
    planted = "// a well-formed entry another user wrote\n"
    with pytest.warns(UserWarning, match="other users may write to it"):
        probe = WgslDiskCache(shared)
    probe.files.refused = None
    probe.store(spec, planted)               # as if the other user had written a consistent entry
    with pytest.warns(UserWarning, match="is not used"):
        engine = ComputeEngine(ctx)
    _softmax(engine, rng)
    assert engine.stats.disk_hits == 0
    assert [p.read_text().endswith(planted) for p in shared.glob("*.wgsl")] == [True]   # nothing new written
    assert "other users may write" in untrusted_reason(shared)
    link = tmp_path / "link"
    link.symlink_to(tmp_path / "own")
    (tmp_path / "own").mkdir(mode=0o700)
    assert untrusted_reason(link) == "it is a symbolic link"
    assert untrusted_reason(tmp_path / "own") is None


def test_writes_never_follow_a_planted_symlink(tmp_path):
    victim = tmp_path / "victim"
    victim.write_text("precious")
    target = tmp_path / "cache" / "entry.wgsl"
    target.parent.mkdir()
    target.symlink_to(victim)                                    # at the name itself
    for pid in range(os.getpid() - 2, os.getpid() + 3):          # and at the old predictable temp names
        (target.parent / f"entry.tmp{pid}").symlink_to(victim)
    write_atomic(target, "new contents")
    assert victim.read_text() == "precious"
    assert not target.is_symlink() and target.read_text() == "new contents"
    assert not [p for p in target.parent.iterdir() if p.name.startswith(".entry.wgsl.")]   # no temp file left


@pytest.mark.skipif(not hasattr(os, "getuid"), reason="POSIX permissions")
def test_autotune_file_in_a_shared_directory_is_ignored(engine, tmp_path):
    shared = tmp_path / "shared"
    shared.mkdir()
    (shared / "autotune.json").write_text(json.dumps({"planted": {"kind": "matmul", "tiles": {}}}))
    assert Tuner(engine, shared / "autotune.json").best != {}        # a private directory: read
    os.chmod(shared, 0o777)
    tuner = Tuner(engine, shared / "autotune.json")
    assert tuner.best == {}
    tuner._save()
    assert json.loads((shared / "autotune.json").read_text()) == {"planted": {"kind": "matmul", "tiles": {}}}
    (tmp_path / "list").mkdir(mode=0o700)
    (tmp_path / "list" / "autotune.json").write_text("[1, 2]")      # well-formed JSON of the wrong shape
    assert Tuner(engine, tmp_path / "list" / "autotune.json").best == {}
