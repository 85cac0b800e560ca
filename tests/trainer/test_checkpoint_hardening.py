"""Checkpoints read from disk are checked in full before anything changes, and saves killed at any
point never leave an incomplete newest checkpoint.

The corruption sweep mutates copies of a real checkpoint written by ``python -m trainer`` (weights,
config.json, trainer.json, optimizer state: truncations, byte flips, header and field edits, files
of another model, deleted files): every copy must be refused with a TrainError, CheckpointError or
ConfigError naming the file, in one line, and the trainer that tried to load it must keep its
weights, optimizer state and counters bit for bit. The kill test SIGKILLs a process at random
points of its saves, 20 times over."""
from __future__ import annotations

import json
import os
import shutil
import signal
import struct
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np
import pytest
from safetensors.numpy import load_file, save_file

from lfm2jit.model import CheckpointError, ConfigError, Lfm2Config, Lfm2Model
from lfm2jit.model.checkpoint import parameter_shapes
from lfm2jit.model.config import PRESETS
from trainer import AdamW, TrainError, Trainer
from trainer.checkpoint import clean_stale
from trainer.cli.resume import find_checkpoint, read_checkpoint_meta
from trainer.cli.run_dir import copy_model_files
from trainer.cli.usage import UsageError

ROOT = Path(__file__).resolve().parents[2]
ERRORS = (TrainError, CheckpointError, ConfigError)
RUN = ["--preset", "tiny", "--grad-accum", "1", "--schedule", "warmup", "--warmup-steps", "4", "--lr", "3e-3",
       "--eval-max", "4", "--no-progress"]


def cli(*args, timeout: float = 120) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    return subprocess.run([sys.executable, "-m", "trainer", *map(str, args)], cwd=ROOT, capture_output=True,
                          text=True, timeout=timeout, env=env)


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory):
    """A real run: two steps, a checkpoint after each (step-000001, step-000002)."""
    out = tmp_path_factory.mktemp("hardening") / "run"
    r = cli(*RUN, "--steps", 2, "--checkpoint-every", 1, "--out", out)
    assert r.returncode == 0, r.stderr
    return out


def fresh_trainer(ckpt: Path, ctx, engine) -> Trainer:
    model = Lfm2Model.from_pretrained(ckpt / "model", ctx, engine)
    tr = Trainer(model, AdamW(lr=3e-3), ctx, engine)
    tr.load_checkpoint(ckpt)
    return tr


def snapshot(tr: Trainer) -> dict:
    names = {id(t): n for n, t in tr.model.named_parameters().items()}
    return {"weights": {n: t.numpy().tobytes() for n, t in tr.model.named_parameters().items()},
            "optimizer": {k: np.asarray(v).tobytes() for k, v in tr.optimizer.state_arrays(names).items()},
            "steps": tr.optimizer_steps(), "step_in_accum": tr.step_in_accum,
            "schedule": tr.lr_scheduler.to_dict() if tr.lr_scheduler is not None else None}


# ---- mutations: each edits a copy of the checkpoint in place ----
W, O, C, T = "model/model.safetensors", "optimizer.safetensors", "model/config.json", "trainer.json"


def _header(path: Path) -> tuple[dict, bytes]:
    raw = path.read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    return json.loads(raw[8:8 + n]), raw[8 + n:]


def _write_header(path: Path, header, data: bytes) -> None:
    h = json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", len(h)) + h + data)


def truncate(rel, frac=None, keep=None):
    def go(d: Path):
        raw = (d / rel).read_bytes()
        (d / rel).write_bytes(raw[:keep if keep is not None else int(len(raw) * frac)])
    return go


def one_byte_short(rel):
    return lambda d: (d / rel).write_bytes((d / rel).read_bytes()[:-1])


def flip(rel, where: str, seed: int):
    """XOR one byte (in the header's JSON or in the tensor data) with a random nonzero value."""
    def go(d: Path):
        raw = bytearray((d / rel).read_bytes())
        (n,) = struct.unpack("<Q", raw[:8])
        r = np.random.default_rng(seed)
        i = int(r.integers(8, 8 + n)) if where == "header" else int(r.integers(8 + n, len(raw)))
        raw[i] ^= int(r.integers(1, 256))
        (d / rel).write_bytes(bytes(raw))
    return go


def edit_header(rel, change):
    def go(d: Path):
        header, data = _header(d / rel)
        _write_header(d / rel, change(header), data)
    return go


def _first(header) -> str:
    return next(k for k in header if k != "__metadata__")


def _without_dtype(h):
    del h[_first(h)]["dtype"]
    return h


def _dtype(h, value):
    h[_first(h)]["dtype"] = value
    return h


def _overlap(h):
    names = sorted((k for k in h if k != "__metadata__"), key=lambda k: h[k]["data_offsets"][0])
    a, b = h[names[0]], h[names[1]]
    b["data_offsets"] = [a["data_offsets"][0], a["data_offsets"][0] + b["data_offsets"][1] - b["data_offsets"][0]]
    return h


def _past_end(h):
    e = h[_first(h)]
    size = e["data_offsets"][1] - e["data_offsets"][0]
    e["data_offsets"] = [10 ** 9, 10 ** 9 + size]
    return h


def _reshape(h):
    e = h["model.embed_tokens.weight"]
    e["shape"] = list(reversed(e["shape"]))            # same bytes, another shape
    return h


def _rename(h):
    h["model.layers.0.ffn_norm.weightX"] = h.pop("model.layers.0.ffn_norm.weight")
    return h


def random_bytes(rel, n=4096):
    return lambda d: (d / rel).write_bytes(np.random.default_rng(n).bytes(n))


def delete(rel):
    def go(d: Path):
        p = d / rel
        shutil.rmtree(p) if p.is_dir() else p.unlink()
    return go


def edit_json(rel, change):
    def go(d: Path):
        value = json.loads((d / rel).read_text())
        (d / rel).write_text(json.dumps(change(value)))
    return go


def setkey(rel, key, value):
    def change(obj):
        target = obj
        *path, last = key.split(".")
        for k in path:
            target = target[k]
        target[last] = value
        return obj
    return edit_json(rel, change)


def dropkey(rel, key):
    return edit_json(rel, lambda obj: {k: v for k, v in obj.items() if k != key})


def other_model_optimizer(cfg_name: str, **overrides):
    """An optimizer file of another model: AdamW state for every parameter of ``cfg_name``."""
    def go(d: Path):
        cfg = Lfm2Config(**{**PRESETS[cfg_name], **overrides})
        state = {}
        for n, shape in parameter_shapes(cfg).items():
            state[f"{n}::step"] = np.array(2, np.int64)
            state[f"{n}::m"] = np.zeros(shape, np.float32)
            state[f"{n}::v"] = np.zeros(shape, np.float32)
        save_file(state, str(d / O))
    return go


def partial_optimizer(d: Path):
    """Half the parameters' state renamed to parameters this model does not have."""
    state = load_file(str(d / O))
    names = sorted({k.rpartition("::")[0] for k in state})
    moved = set(names[::2])
    out = {}
    for k, v in state.items():
        name, _, buf = k.rpartition("::")
        out[f"{name.replace('model.layers.', 'model.layers.9')}::{buf}" if name in moved else k] = v
    save_file(out, str(d / O))


def float_steps(d: Path):
    state = load_file(str(d / O))
    save_file({k: (v.astype(np.float32) if k.endswith("::step") else v) for k, v in state.items()}, str(d / O))


MUTATIONS = {
    # the weights
    "weights cut at 3%": (truncate(W, 0.03), W), "weights cut at 41%": (truncate(W, 0.41), W),
    "weights cut at 77%": (truncate(W, 0.77), W), "weights one byte short": (one_byte_short(W), W),
    "weights 7 bytes": (truncate(W, keep=7), W), "weights 8 bytes": (truncate(W, keep=8), W),
    "weights empty": (truncate(W, keep=0), W),
    **{f"weights header flip {i}": (flip(W, "header", i), W) for i in range(5)},
    **{f"weights data flip {i}": (flip(W, "data", 100 + i), W) for i in range(4)},
    "weights header a list": (edit_header(W, lambda h: [h]), W),
    "weights entry without dtype": (edit_header(W, _without_dtype), W),
    "weights unknown dtype": (edit_header(W, lambda h: _dtype(h, "F8_E4M3")), W),
    "weights dtype a number": (edit_header(W, lambda h: _dtype(h, 32)), W),
    "weights overlapping offsets": (edit_header(W, _overlap), W),
    "weights offsets past the end": (edit_header(W, _past_end), W),
    "weights transposed shape": (edit_header(W, _reshape), W),
    "weights renamed tensor": (edit_header(W, _rename), W),
    "weights random bytes": (random_bytes(W), W),
    "weights deleted": (delete(W), W),
    "model directory deleted": (delete("model"), "model"),
    # the model's config
    "rope_theta 'abc'": (edit_json(C, lambda c: {**c, "rope_theta": "abc",
                                                 "rope_parameters": {"rope_type": "default", "rope_theta": "abc"}}),
                         C),
    "rope_theta contradicts rope_parameters": (setkey(C, "rope_theta", "abc"), C),
    "layer_types 5": (setkey(C, "layer_types", 5), C),
    "block_ffn_dim_multiplier '1.0'": (setkey(C, "block_ffn_dim_multiplier", "1.0"), C),
    "norm_eps 'x'": (setkey(C, "norm_eps", "x"), C),
    "pad_token_id outside the vocabulary": (setkey(C, "pad_token_id", 100000), C),
    "hidden_size not divisible": (setkey(C, "hidden_size", 66), C),
    "num_hidden_layers '4'": (setkey(C, "num_hidden_layers", "4"), C),
    "another vocab_size": (setkey(C, "vocab_size", 512), C),
    "config a list": (edit_json(C, lambda c: [c]), C),
    "config cut short": (truncate(C, 0.5), C),
    "config deleted": (delete(C), C),
    # trainer.json
    "optimizer_steps 'abc'": (setkey(T, "optimizer_steps", "abc"), T),
    "optimizer_steps -3": (setkey(T, "optimizer_steps", -3), T),
    "optimizer_steps missing": (dropkey(T, "optimizer_steps"), T),
    "lr_scheduler missing": (dropkey(T, "lr_scheduler"), T),
    "trainer.json a list": (edit_json(T, lambda m: [m]), T),
    "unknown scheduler type": (setkey(T, "lr_scheduler.type", "Bogus"), T),
    "scheduler warmup 'x'": (setkey(T, "lr_scheduler.warmup_steps", "x"), T),
    "scheduler a string": (setkey(T, "lr_scheduler", "cosine"), T),
    "format 7": (setkey(T, "format", 7), T),
    "optimizer type SGD": (setkey(T, "optimizer.type", "SGD"), T),
    "optimizer not an object": (setkey(T, "optimizer", "AdamW"), T),
    "scaler state bogus": (setkey(T, "scaler", {"scale": "big", "growth_tracker": 0}), T),
    "scaler without growth_tracker": (setkey(T, "scaler", {"scale": 1024.0}), T),
    "grad_accum_steps 0": (setkey(T, "grad_accum_steps", 0), T),
    "clip_grad_norm -1": (setkey(T, "clip_grad_norm", -1.0), T),
    "unknown key": (setkey(T, "extra", 1), T),
    "data_position a list": (setkey(T, "data_position", [1]), T),
    "checksum entry malformed": (setkey(T, "files", {W: "deadbeef"}), T),
    "trainer.json cut short": (truncate(T, 0.6), T),
    "trainer.json deleted": (delete(T), T),
    # the optimizer state
    "optimizer cut at 50%": (truncate(O, 0.5), O), "optimizer cut at 2%": (truncate(O, 0.02), O),
    "optimizer one byte short": (one_byte_short(O), O),
    "optimizer header flip": (flip(O, "header", 7), O), "optimizer data flip": (flip(O, "data", 8), O),
    "optimizer random bytes": (random_bytes(O, 999), O),
    "optimizer deleted": (delete(O), O),
    "optimizer of another model": (other_model_optimizer("tiny-untied"), O),
    "optimizer of a model with another vocabulary": (other_model_optimizer("tiny", vocab_size=512), O),
    "optimizer names partly overlapping": (partial_optimizer, O),
    "optimizer step counts as floats": (float_steps, O),
}


def test_every_corrupted_checkpoint_is_refused_and_changes_nothing(run_dir, ctx, engine, tmp_path):
    src = run_dir / "checkpoints" / "step-000002"
    victim = fresh_trainer(run_dir / "checkpoints" / "step-000001", ctx, engine)   # not the mutated one's state
    before = snapshot(victim)
    assert len(MUTATIONS) >= 50
    refused, changed = [], []
    for i, (name, (mutate, file)) in enumerate(MUTATIONS.items()):
        d = tmp_path / f"m{i:02d}"
        shutil.copytree(src, d)
        mutate(d)
        with pytest.raises(ERRORS) as info:       # any other exception type fails the test here
            victim.load_checkpoint(d)
        msg = str(info.value)
        assert Path(file).name in msg, (name, msg)
        assert "\n" not in msg, (name, msg)
        refused.append(name)
        if snapshot(victim) != before:
            changed.append(name)
        shutil.rmtree(d)
    assert changed == [] and len(refused) == len(MUTATIONS)

    # the untouched checkpoint still loads, and then the state is step 2's
    victim.load_checkpoint(src)
    assert victim.optimizer_steps() == 2
    want = load_file(str(src / W))
    for n, t in victim.model.named_parameters().items():
        assert np.array_equal(t.numpy(), want[n]), n


def test_the_cli_reports_a_bad_checkpoint_in_one_line_and_exits_2(run_dir, tmp_path):
    for k, (mutate, file) in enumerate([(setkey(T, "optimizer_steps", "abc"), T),
                                        (setkey(C, "block_ffn_dim_multiplier", "1.0"), C),
                                        (truncate(O, 0.5), O)]):
        run = tmp_path / f"r{k}"
        shutil.copytree(run_dir / "checkpoints", run / "checkpoints")
        mutate(run / "checkpoints" / "step-000002")
        r = cli("--resume", run, "--steps", 3)
        assert r.returncode == 2, (r.stdout, r.stderr)
        lines = r.stderr.strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith("error: ") and file.split("/")[-1] in lines[0], r.stderr
        assert "Traceback" not in r.stderr


def test_config_token_ids_must_be_inside_the_vocabulary():
    with pytest.raises(ConfigError, match=r"pad_token_id must be an id in 0\.\.63 \(vocab_size 64\)"):
        Lfm2Config(pad_token_id=100, vocab_size=64)
    with pytest.raises(ConfigError, match=r"eos_token_id"):
        Lfm2Config(eos_token_id=[2, 64], vocab_size=64)


def test_the_cli_finds_a_checkpoint_that_only_exists_moved_aside(run_dir, tmp_path):
    """A save killed between its two renames leaves only step-N.old-<pid>: --resume uses it."""
    root = tmp_path / "run" / "checkpoints"
    shutil.copytree(run_dir / "checkpoints", root)
    (root / "step-000002").rename(root / "step-000002.old-999999")
    assert find_checkpoint(str(root.parent)) == root / "step-000002.old-999999"
    assert find_checkpoint(str(root / "step-000002")) == root / "step-000002.old-999999"
    assert read_checkpoint_meta(root / "step-000002.old-999999")["optimizer_steps"] == 2
    # the next save puts it back in place (its process is gone)
    assert clean_stale(root) == [f"restored {root / 'step-000002'} from step-000002.old-999999"]
    assert find_checkpoint(str(root.parent)) == root / "step-000002"
    with pytest.raises(UsageError, match="no such directory"):
        find_checkpoint(str(tmp_path / "nothing"))


# ---- kill -9 during saves ----
ZYGOTE = r"""
import faulthandler, os, signal, sys
from pathlib import Path
from lfm2jit import ComputeEngine, WgpuContext
from lfm2jit.model import Lfm2Model
from trainer import AdamW, Trainer
from trainer.cli.checkpoints import prune_checkpoints
from trainer.cli.run_dir import copy_model_files
src, root, tok = Path(sys.argv[1]), Path(sys.argv[2]), sys.argv[3]
signal.signal(signal.SIGCHLD, signal.SIG_IGN)        # killed children are reaped at once
# fork copies only the calling thread: a lock another thread held (OpenBLAS's pool, which the
# environment below keeps from starting) would never be released in the child
assert len(os.listdir("/proc/self/task")) == 1, "the zygote must be single-threaded to fork"
def say(text):          # one write per line: print may write a line and its newline apart
    os.write(1, (text + "\n").encode())            # (PYTHONUNBUFFERED), and a kill between tears it
for line in sys.stdin:                               # one line per round: the first save's number
    k = int(line)
    if os.fork():
        continue
    faulthandler.dump_traceback_later(45, exit=True) # a child that hangs says where, before the test gives up
    ctx = WgpuContext.create()                       # the child alone touches the device
    engine = ComputeEngine(ctx)
    tr = Trainer(Lfm2Model.from_pretrained(src / "model", ctx, engine), AdamW(lr=3e-3), ctx, engine)
    tr.load_checkpoint(src)
    say(f"ready {os.getpid()}")
    faulthandler.cancel_dump_traceback_later()
    while True:                                      # each name saved twice: half the saves replace one
        tr.save_checkpoint(root / f"step-{k // 2:06d}", {"save": k},
                           fill=lambda d: copy_model_files(tok, d / "model"))
        prune_checkpoints(root, 3)
        say(f"saved {k}")
        k += 1
"""


def test_saves_killed_at_random_points_leave_a_complete_newest_checkpoint(run_dir, ctx, engine, tmp_path):
    src = run_dir / "checkpoints" / "step-000002"
    root = tmp_path / "kill" / "checkpoints"
    root.mkdir(parents=True)
    env = dict(os.environ, PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""),
               OPENBLAS_NUM_THREADS="1", OMP_NUM_THREADS="1")
    zygote = subprocess.Popen([sys.executable, "-c", ZYGOTE, str(src), str(root), str(src / "model" / "tokenizer.json")],
                              stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env, cwd=ROOT)
    lines: list[str] = []
    threading.Thread(target=lambda: lines.extend(iter(zygote.stdout.readline, "")), daemon=True).start()
    loader = Trainer(Lfm2Model.from_pretrained(src / "model", ctx, engine), AdamW(lr=3e-3), ctx, engine)
    want = load_file(str(src / W))
    rng = np.random.default_rng(17)
    k, kills, saved_any = 0, 0, False
    try:
        for _ in range(20):
            seen = len(lines)
            zygote.stdin.write(f"{k}\n")
            zygote.stdin.flush()
            deadline = time.monotonic() + 60
            while not any(x.startswith("ready") for x in lines[seen:]):
                assert time.monotonic() < deadline and zygote.poll() is None, lines
                time.sleep(0.005)
            pid = int(next(x for x in lines[seen:] if x.startswith("ready")).split()[1])
            time.sleep(float(rng.uniform(0.0, 0.25)))
            os.kill(pid, signal.SIGKILL)
            kills += 1
            while True:                               # wait until it is gone (reaped by the zygote)
                try:
                    os.kill(pid, 0)
                except ProcessLookupError:
                    break
                time.sleep(0.002)
            done = [int(x.split()[1]) for x in lines[seen:] if x.startswith("saved")]
            saved_any = saved_any or bool(done)
            # the newest checkpoint is complete (tokenizer included) and no finished save is lost;
            # before any save has finished (a kill during the first one leaves only its temp dir)
            # there may be none, which find_checkpoint says in its UsageError
            try:
                newest = find_checkpoint(str(root.parent))
            except UsageError:
                assert not saved_any, "a finished save is lost"
                newest = None
            # each save starts by removing what killed ones left: at most the last one's temp dir is there
            assert len([p for p in root.iterdir() if ".tmp-" in p.name]) <= 1, sorted(root.iterdir())
            if newest is not None:
                assert (newest / "model" / "tokenizer.json").is_file(), newest
                pos = loader.load_checkpoint(newest)
                assert not done or pos["save"] >= done[-1], (pos, done)
                assert int(newest.name.split(".")[0].split("-")[1]) == pos["save"] // 2
                for n, t in loader.model.named_parameters().items():
                    assert np.array_equal(t.numpy(), want[n]), n
            k = (max(done) + 1 if done else k) + 1
    finally:
        zygote.stdin.close()
        zygote.kill()
        zygote.wait()
    assert kills == 20 and k >= 20
    # the next save removes what the killed ones left behind
    loader.save_checkpoint(root / "step-999999", {"save": -1},
                           fill=lambda d: copy_model_files(str(src / "model" / "tokenizer.json"), d / "model"))
    left = sorted(p.name for p in root.iterdir() if ".tmp-" in p.name or ".old-" in p.name)
    assert left == [], left
    assert (root / "step-999999" / "model" / "tokenizer.json").is_file()
