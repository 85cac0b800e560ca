"""Fault injection (issue 45 item 3): every writer, killed at random points or stopped by a full disk,
leaves the old complete file or the new complete one; every reader, given a damaged file, ends in the
project's one-line error and changes nothing.

Writers: ``Trainer.save_checkpoint``, ``model.save_pretrained`` (the model directory),
``model.save_adapter`` (PEFT adapter files), ``model.save_gguf`` (a GGUF file for llama.cpp), and the
CLI's run files (metrics.jsonl appended line by line, run.json, summary.json).
A child forked from one zygote (single-threaded, as in test_checkpoint_hardening) runs a writer over
an existing old version, alternating new and old versions, and is SIGKILLed after a seeded random
delay; or it runs one save with RLIMIT_FSIZE = n (SIGXFSZ ignored, so writes raise EFBIG).

Readers: ``Lfm2Model.from_pretrained`` (of a plain model directory, and of one transformers saved
4-bit with bitsandbytes), ``model.load_adapter``, ``Trainer.load_checkpoint``, each over
a sweep of mutations (truncations, bit flips, header lies about offsets, shapes and dtypes, tensors
stored in wrong dtypes, config files with wrong types). The mutation helpers are
test_checkpoint_hardening's. ``pytest -s`` prints the table of cases."""
from __future__ import annotations

import json
import os
import resource
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

from lfm2jit.model import CheckpointError, ConfigError, Lfm2Config, Lfm2Model, LoraConfig
from lfm2jit.model.checkpoint import EMBEDDING, check_tensors, load_checkpoint as read_model_dir
from lfm2jit.model.lora import AdapterError, read_adapter
from micro_model import make_data, micro
from test_checkpoint_hardening import cli, edit_header, run_dir, truncate  # noqa: F401 (run_dir: a fixture)
from trainer import AdamW, TrainError, Trainer
from trainer.cli.run_dir import read_metrics

ROOT = Path(__file__).resolve().parents[2]
ERRORS = (TrainError, CheckpointError, ConfigError, AdapterError)
LORA = LoraConfig(r=2, alpha=4.0, target_modules=("q_proj", "w1"))
TABLE: dict[str, dict] = {}          # printed at the end of the module (pytest -s)


def _env() -> dict:
    return dict(os.environ, PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""),
                OPENBLAS_NUM_THREADS="1", OMP_NUM_THREADS="1")


@pytest.fixture(scope="module")
def src(tmp_path_factory, ctx, engine):
    """A micro model trained one step: its checkpoint (data position {"v": 0}) and a LoRA adapter."""
    root = tmp_path_factory.mktemp("faults")
    model = Lfm2Model(micro(), ctx, engine, seed=0)
    tr = Trainer(model, AdamW(lr=1e-2), ctx, engine)
    ids, tgt, mask = make_data(model.cfg, [12])[0]
    tr.train_step_masked(ids, tgt, mask, model.parameters())
    tr.save_checkpoint(root / "ckpt", {"v": 0})
    lora = Lfm2Model.from_pretrained(root / "ckpt" / "model", ctx, engine)
    lora.add_lora(LORA, seed=0)
    lora.save_adapter(root / "adapter")
    # a character vocabulary of the micro model's size, which GGUF files carry
    from tokenizers import Tokenizer, models
    (root / "tok").mkdir()
    chars = {c: i for i, c in enumerate("<" + "abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789 ")}
    Tokenizer(models.BPE(vocab=chars, merges=[], unk_token="<")).save(str(root / "tok" / "tokenizer.json"))
    (root / "gguf").mkdir()
    model.save_gguf(root / "gguf" / "model.gguf", "f32", tokenizer=root / "tok")
    _bnb_4bit(root / "ckpt" / "model", root / "nf4")
    return root


def _bnb_4bit(model_dir: Path, out: Path) -> None:
    """``model_dir`` as transformers + bitsandbytes (CPU) save it 4-bit: NF4, double quantization."""
    torch = pytest.importorskip("torch")
    from transformers import AutoModelForCausalLM, BitsAndBytesConfig
    config = BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_use_double_quant=True,
                                bnb_4bit_compute_dtype=torch.float32)
    AutoModelForCausalLM.from_pretrained(model_dir, quantization_config=config, device_map="cpu").save_pretrained(out)


def version(base: dict, v: int, step: float) -> dict:
    return {n: (a + np.float32(step * v)).astype(np.float32) for n, a in base.items()}


@pytest.fixture(scope="module")
def zygote(src):
    z = subprocess.Popen([sys.executable, "-c", ZYGOTE, str(src)], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                         text=True, env=_env(), cwd=ROOT)
    lines: list[str] = []
    threading.Thread(target=lambda: lines.extend(iter(z.stdout.readline, "")), daemon=True).start()

    def send(cmd: dict) -> tuple[int, list[str], int]:
        seen = len(lines)
        z.stdin.write(json.dumps(cmd) + "\n")
        z.stdin.flush()
        deadline = time.monotonic() + 60
        while not any(x.startswith("ready") for x in lines[seen:]):
            assert time.monotonic() < deadline and z.poll() is None, lines[seen:]
            time.sleep(0.005)
        return int(next(x for x in lines[seen:] if x.startswith("ready")).split()[1]), lines, seen
    yield send
    z.stdin.close()
    z.kill()
    z.wait()


ZYGOTE = r"""
import faulthandler, json, os, resource, signal, sys
from pathlib import Path
import numpy as np
from safetensors.numpy import load_file
from lfm2jit import ComputeEngine, WgpuContext
from lfm2jit.model import Lfm2Model, LoraConfig
from trainer import AdamW, Trainer
src = Path(sys.argv[1])
signal.signal(signal.SIGCHLD, signal.SIG_IGN)
assert len(os.listdir("/proc/self/task")) == 1, "the zygote must be single-threaded to fork"
W0 = load_file(str(src / "ckpt" / "model" / "model.safetensors"))
A0 = load_file(str(src / "adapter" / "adapter_model.safetensors"))
def say(text):
    os.write(1, (text + "\n").encode())
def child(cmd):
    faulthandler.dump_traceback_later(45, exit=True)
    ctx = WgpuContext.create()
    engine = ComputeEngine(ctx)
    model = Lfm2Model.from_pretrained(src / "ckpt" / "model", ctx, engine)
    tr = Trainer(model, AdamW(lr=1e-2), ctx, engine)
    writer, dest = cmd["writer"], Path(cmd["dest"])
    if writer == "checkpoint":
        tr.load_checkpoint(src / "ckpt")
    if writer == "adapter":
        model.load_adapter(src / "adapter")
    def save(v):
        if writer == "adapter":
            for n, t in model.lora.named.items():
                t.write(A0[n] + np.float32(0.25 * v))
            model.save_adapter(dest)
            return
        model.load_state({n: a + np.float32(0.5 * v) for n, a in W0.items()})
        if writer == "checkpoint":
            tr.save_checkpoint(dest, {"v": v})
        elif writer == "gguf":
            model.save_gguf(dest / "model.gguf", "f32", tokenizer=src / "tok")
        else:
            model.save_pretrained(dest)
    say(f"ready {os.getpid()}")
    faulthandler.cancel_dump_traceback_later()
    if cmd["mode"] == "kill":
        v = 1
        while True:
            save(v)
            say(f"saved {v}")
            v ^= 1
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    resource.setrlimit(resource.RLIMIT_FSIZE, (cmd["limit"], cmd["limit"]))
    try:
        save(1)
        say("result " + json.dumps(None))
    except BaseException as e:
        say("result " + json.dumps([type(e).__name__, str(e)]))
for line in sys.stdin:
    if os.fork():
        continue
    try:
        child(json.loads(line))
    finally:
        os._exit(0)
"""


# ---- what a reader finds at a destination: version 0, version 1, or a clear error ----
def read_version(writer: str, dest: Path, src: Path, loader) -> int | str:
    """0 or 1 (the complete old or new version), or the text of the project's error; any other
    exception propagates (a traceback), and a mix of versions fails the assertion."""
    try:
        if writer == "checkpoint":
            pos = loader.load_checkpoint(dest)
            got = {n: t.numpy() for n, t in loader.model.named_parameters().items()}
            base = load_file(str(src / "ckpt" / "model" / "model.safetensors"))
            step, v = 0.5, pos["v"]
        elif writer == "pretrained":
            cfg = Lfm2Config.from_json(dest / "config.json")
            got = check_tensors(cfg, read_model_dir(dest))
            base, step, v = load_file(str(src / "ckpt" / "model" / "model.safetensors")), 0.5, None
        elif writer == "gguf":
            got = gguf_embedding(dest / "model.gguf")
            base = {EMBEDDING: load_file(str(src / "ckpt" / "model" / "model.safetensors"))[EMBEDDING]}
            step, v = 0.5, None
        else:
            _, got = read_adapter(dest)
            base, step, v = load_file(str(src / "adapter" / "adapter_model.safetensors")), 0.25, None
    except ERRORS as e:
        return str(e)
    matches = [k for k in (0, 1) if all(np.array_equal(got[n], version(base, k, step)[n]) for n in got)]
    assert matches, f"{dest}: a torn or mixed {writer} (neither the old nor the new version)"
    assert v is None or v == matches[0], (v, matches)
    return matches[0]


def gguf_embedding(path: Path) -> dict[str, np.ndarray]:
    """The embedding a GGUF file holds (gguf's own reader; a torn file is its error)."""
    import gguf
    tensors = {t.name: t for t in gguf.GGUFReader(path).tensors}
    return {EMBEDDING: np.array(tensors["token_embd.weight"].data).reshape(-1, micro().hidden_size)}


def old_version(writer: str, src: Path, dest: Path) -> None:
    if dest.exists():
        shutil.rmtree(dest)
    shutil.copytree(src / {"checkpoint": "ckpt", "pretrained": "ckpt/model", "adapter": "adapter",
                           "gguf": "gguf"}[writer], dest)


def _gone(pid: int) -> None:
    while True:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return
        time.sleep(0.002)


KILLS = {"checkpoint": 5, "pretrained": 6, "adapter": 6, "gguf": 4}
DELAY = {"checkpoint": 1.5, "pretrained": 1.0, "adapter": 0.6, "gguf": 1.2}     # seconds: a few saves on lavapipe


@pytest.mark.parametrize("writer", list(KILLS))
def test_a_writer_killed_at_random_points_leaves_the_old_or_the_new_version(writer, src, zygote, ctx, engine,
                                                                            tmp_path):
    loader = Trainer(Lfm2Model.from_pretrained(src / "ckpt" / "model", ctx, engine), AdamW(lr=1e-2), ctx, engine)
    dest = tmp_path / "dest"
    old_version(writer, src, dest)
    rng = np.random.default_rng({"checkpoint": 1, "pretrained": 2, "adapter": 3, "gguf": 4}[writer])
    seen_versions, errors, finished = [], [], 0
    for _ in range(KILLS[writer]):
        pid, lines, seen = zygote({"writer": writer, "mode": "kill", "dest": str(dest)})
        time.sleep(float(rng.uniform(0.0, DELAY[writer])))
        os.kill(pid, signal.SIGKILL)
        _gone(pid)
        got = read_version(writer, dest, src, loader)
        if isinstance(got, str):
            errors.append(got)
        seen_versions.append(got)
        saved = [int(x.split()[1]) for x in lines[seen:] if x.startswith("saved")]
        finished += len(saved)
        if saved and not isinstance(got, str):
            assert got in (saved[-1], saved[-1] ^ 1), (got, saved)   # the last finished save, or the one after it
    TABLE[f"writer {writer}: kill"] = {"cases": KILLS[writer], "torn": 0, "errors": len(errors),
                                       "saves finished": finished, "versions found": seen_versions}
    assert errors == [], errors


def _sizes(writer: str, src: Path) -> list[int]:
    big = {"checkpoint": src / "ckpt" / "optimizer.safetensors", "pretrained": src / "ckpt" / "model" /
           "model.safetensors", "adapter": src / "adapter" / "adapter_model.safetensors",
           "gguf": src / "gguf" / "model.gguf"}[writer].stat().st_size
    return [0, 100, 1000, big // 3, big - 1, big * 4]


@pytest.mark.parametrize("writer", ["checkpoint", "pretrained", "adapter", "gguf"])
def test_a_full_disk_leaves_the_old_or_the_new_version_and_a_clear_error(writer, src, zygote, ctx, engine, tmp_path):
    loader = Trainer(Lfm2Model.from_pretrained(src / "ckpt" / "model", ctx, engine), AdamW(lr=1e-2), ctx, engine)
    dest = tmp_path / "dest"
    rows = []
    for n in _sizes(writer, src):
        old_version(writer, src, dest)
        pid, lines, seen = zygote({"writer": writer, "mode": "fsize", "limit": n, "dest": str(dest)})
        deadline = time.monotonic() + 60
        while not any(x.startswith("result") for x in lines[seen:]):
            assert time.monotonic() < deadline, lines[seen:]
            time.sleep(0.005)
        result = json.loads(next(x for x in lines[seen:] if x.startswith("result"))[len("result "):])
        got = read_version(writer, dest, src, loader)
        rows.append((n, result, got))
    TABLE[f"writer {writer}: full disk"] = {"cases": len(rows), "torn": 0,
                                            "raised": sum(r is not None for _, r, _ in rows)}
    for n, result, got in rows:
        assert got in (0, 1), (n, got)
        if result is None:
            assert got == 1, (n, got)
        else:
            assert got == 0, (n, result, got)
            kind, msg = result
            assert kind in ("OSError", "TrainError", "CheckpointError", "AdapterError", "GgufError"), (n, result)
            assert "\n" not in msg and "too large" in msg.lower(), (n, result)
    assert rows[-1][1] is None and rows[0][1] is not None        # the roomy disk saves; no room fails


# ---- the run files of the CLI: metrics.jsonl, run.json, summary.json (run_dir: the hardening tests' two-step run) ----


def whole_lines(path: Path) -> list[dict]:
    text = path.read_text()
    assert text == "" or text.endswith("\n"), f"{path}: its last line is cut"
    return [json.loads(line) for line in text.splitlines()]


def test_the_cli_killed_mid_run_leaves_whole_metrics_lines_and_resumes(run_dir, tmp_path):
    rng = np.random.default_rng(45)
    run = tmp_path / "run"
    shutil.copytree(run_dir, run)
    cases = 0
    for _ in range(2):
        p = subprocess.Popen([sys.executable, "-m", "trainer", "--resume", str(run), "--steps", "40",
                              "--checkpoint-every", "3"], cwd=ROOT, env=_env(), stdout=subprocess.DEVNULL,
                             stderr=subprocess.PIPE, text=True)
        start = len(whole_lines(run / "metrics.jsonl"))
        deadline = time.monotonic() + 90
        while len(read_metrics(run / "metrics.jsonl")) <= start:
            assert p.poll() is None and time.monotonic() < deadline, p.stderr.read() if p.poll() is not None else ""
            time.sleep(0.01)
        time.sleep(float(rng.uniform(0.0, 1.5)))
        p.kill()
        p.wait()
        cases += 1
        steps = [m["step"] for m in whole_lines(run / "metrics.jsonl")]
        assert steps == list(range(1, len(steps) + 1)), steps
        json.loads((run / "run.json").read_text())
    last = whole_lines(run / "metrics.jsonl")[-1]["step"]
    r = cli("--resume", run, "--steps", last + 1)
    assert r.returncode == 0, r.stderr
    steps = [m["step"] for m in whole_lines(run / "metrics.jsonl")]
    assert steps == list(range(1, last + 2)), steps
    json.loads((run / "summary.json").read_text())
    TABLE["writer metrics.jsonl/run.json: kill"] = {"cases": cases, "torn": 0}


def _limited(n: int):
    def pre():
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        resource.setrlimit(resource.RLIMIT_FSIZE, (n, n))
    return pre


def test_the_cli_on_a_full_disk_ends_in_one_line_and_a_nonzero_exit(run_dir, tmp_path):
    ckpt = run_dir / "checkpoints" / "step-000002"
    sizes = [(ckpt / f).stat().st_size for f in ("optimizer.safetensors", "model/model.safetensors")]
    rows = []
    for k, n in enumerate([min(sizes) // 2, max(sizes) - 1]):
        run = tmp_path / f"r{k}"
        shutil.copytree(run_dir, run)
        p = subprocess.run([sys.executable, "-m", "trainer", "--resume", str(run), "--steps", "4",
                            "--checkpoint-every", "1"], cwd=ROOT, env=_env(), capture_output=True, text=True,
                           timeout=120, preexec_fn=_limited(n))
        rows.append(n)
        assert p.returncode != 0, p.stderr
        err = [line for line in p.stderr.splitlines() if line.startswith("error: ")]
        assert "Traceback" not in p.stderr and len(err) == 1, p.stderr
        assert "too large" in err[0].lower() and ".safetensors" in err[0], p.stderr
        # what is there is whole: the old checkpoints load, the metrics lines parse
        steps = [m["step"] for m in whole_lines(run / "metrics.jsonl")]
        assert steps == list(range(1, len(steps) + 1)), steps
        r = cli("--resume", run, "--steps", 3)
        assert r.returncode == 0, r.stderr
    TABLE["writer CLI checkpoint: full disk"] = {"cases": len(rows), "torn": 0, "one-line errors": len(rows)}


# ---- readers: a sweep of mutations ----
def _flip_bit(rel: str, pos: int, bit: int):
    def go(d: Path):
        raw = bytearray((d / rel).read_bytes())
        raw[pos % len(raw)] ^= 1 << bit
        (d / rel).write_bytes(bytes(raw))
    return go


def _first(h):
    return next(k for k in h if k != "__metadata__" and h[k]["shape"])


def _lie(field: str, value):
    def change(h):
        e = h[_first(h)]
        e[field] = value(e[field]) if callable(value) else value
        return h
    return change


def _stored_as(rel: str, dtype):
    """A valid safetensors file whose first tensor is stored as ``dtype``."""
    def go(d: Path):
        tensors = load_file(str(d / rel))
        name = sorted(tensors)[0]
        tensors[name] = tensors[name].astype(dtype)
        save_file(tensors, str(d / rel))
    return go


def _json_key(rel: str, key: str, value):
    def go(d: Path):
        data = json.loads((d / rel).read_text())
        data[key] = value
        (d / rel).write_text(json.dumps(data))
    return go


def safetensors_mutations(rel: str, size: int, header_len: int, data_flips: bool, seed: int) -> dict:
    r = np.random.default_rng(seed)
    out = {}
    for keep in sorted({0, 4, 7, 8, 9, 8 + header_len // 2, 8 + header_len - 1, 8 + header_len,
                        *map(int, np.linspace(8 + header_len + 1, size - 1, 8))}):
        out[f"{rel} cut to {keep} bytes"] = truncate(rel, keep=keep)
    for pos in r.choice(np.arange(8, 8 + header_len), 12, replace=False):
        out[f"{rel} header bit flip at {pos}"] = _flip_bit(rel, int(pos), int(r.integers(0, 8)))
    for pos in (0, 1, 3, 7):
        out[f"{rel} length bit flip at {pos}"] = _flip_bit(rel, pos, int(r.integers(0, 8)))
    if data_flips:
        for pos in r.choice(np.arange(8 + header_len, size), 6, replace=False):
            out[f"{rel} data bit flip at {pos}"] = _flip_bit(rel, int(pos), int(r.integers(0, 8)))
    lies = {"offsets end +4": _lie("data_offsets", lambda o: [o[0], o[1] + 4]),
            "offsets begin +4": _lie("data_offsets", lambda o: [o[0] + 4, o[1]]),
            "offsets reversed": _lie("data_offsets", lambda o: [o[1], o[0]]),
            "offsets negative": _lie("data_offsets", lambda o: [-4, o[1]]),
            "offsets strings": _lie("data_offsets", lambda o: [str(o[0]), str(o[1])]),
            "offsets one number": _lie("data_offsets", lambda o: o[1]),
            "offsets huge": _lie("data_offsets", [2 ** 63, 2 ** 63 + 4]),
            "shape +1": _lie("shape", lambda s: [s[0] + 1, *s[1:]]),
            "shape a dim fewer": _lie("shape", lambda s: s[1:] or [1, 1]),
            "shape negative": _lie("shape", lambda s: [-s[0], *s[1:]]),
            "shape string": _lie("shape", "32"),
            "shape float": _lie("shape", lambda s: [float(x) for x in s]),
            "dtype F16": _lie("dtype", "F16"), "dtype I32": _lie("dtype", "I32"),
            "dtype F8_E4M3": _lie("dtype", "F8_E4M3"), "dtype lower-case": _lie("dtype", "f32"),
            "dtype null": _lie("dtype", None),
            "header length beyond the file": None}
    for name, change in lies.items():
        if change is None:
            def go(d: Path, rel=rel):
                raw = (d / rel).read_bytes()
                (d / rel).write_bytes(struct.pack("<Q", len(raw)) + raw[8:])
            out[f"{rel} {name}"] = go
        else:
            out[f"{rel} header lies: {name}"] = edit_header(rel, change)
    for dtype in (np.int32, np.int64, np.uint8, np.bool_):
        out[f"{rel} stored as {np.dtype(dtype).name}"] = _stored_as(rel, dtype)
    return out


CONFIG_LIES = {"hidden_size '32'": ("hidden_size", "32"), "vocab_size 64.5": ("vocab_size", 64.5),
               "vocab_size true": ("vocab_size", True), "layer_types 'conv'": ("layer_types", "conv"),
               "num_hidden_layers 3": ("num_hidden_layers", 3), "norm_eps null": ("norm_eps", None),
               "tie_word_embeddings 'no'": ("tie_word_embeddings", "no"), "rope_theta []": ("rope_theta", []),
               "intermediate_size -1": ("intermediate_size", -1), "model_type 'llama'": ("model_type", "llama"),
               "conv_L_cache 'x'": ("conv_L_cache", "x"), "num_attention_heads 0": ("num_attention_heads", 0)}
QUANT_LIES = {"quant_type fp4": ("bnb_4bit_quant_type", "fp4"), "quant_type 7": ("bnb_4bit_quant_type", 7),
              "load_in_4bit false": ("load_in_4bit", False), "quant_method gptq": ("quant_method", "gptq"),
              "a list": None, "missing": None}
ADAPTER_LIES = {"r '2'": ("r", "2"), "r 4": ("r", 4), "r 0": ("r", 0), "lora_alpha 'x'": ("lora_alpha", "x"),
                "target_modules 5": ("target_modules", 5), "target_modules o_proj": ("target_modules", ["o_proj"]),
                "peft_type PREFIX": ("peft_type", "PREFIX"), "lora_dropout 2": ("lora_dropout", 2.0),
                "use_dora true": ("use_dora", True), "bias 'all'": ("bias", "all")}


def _json_cut(rel: str):
    return truncate(rel, 0.5)


def _quant_config(key: str, value):
    def go(d: Path):
        data = json.loads((d / "config.json").read_text())
        if key == "a list":
            data["quantization_config"] = [1]
        elif key == "missing":
            data.pop("quantization_config")          # the 4-bit tensors then read as a plain model's
        else:
            data["quantization_config"][key] = value
        (d / "config.json").write_text(json.dumps(data))
    return go


def reader_cases(kind: str, d: Path) -> dict:
    if kind == "bnb_4bit":
        w = "model.safetensors"
        raw = (d / w).read_bytes()
        cases = safetensors_mutations(w, len(raw), struct.unpack("<Q", raw[:8])[0], False, 15)
        cases.update({f"config.json quantization_config {k}": _quant_config(k, v[1] if v else k)
                      for k, v in QUANT_LIES.items()})
        return cases
    if kind == "from_pretrained":
        w = "model.safetensors"
        raw = (d / w).read_bytes()
        cases = safetensors_mutations(w, len(raw), struct.unpack("<Q", raw[:8])[0], False, 11)
        cases.update({f"config.json {k}": _json_key("config.json", *v) for k, v in CONFIG_LIES.items()})
        cases["config.json cut short"] = _json_cut("config.json")
        cases["config.json a list"] = lambda d: (d / "config.json").write_text("[1]")
        return cases
    if kind == "load_adapter":
        w = "adapter_model.safetensors"
        raw = (d / w).read_bytes()
        cases = safetensors_mutations(w, len(raw), struct.unpack("<Q", raw[:8])[0], False, 12)
        cases.update({f"adapter_config.json {k}": _json_key("adapter_config.json", *v)
                      for k, v in ADAPTER_LIES.items()})
        cases["adapter_config.json cut short"] = _json_cut("adapter_config.json")
        cases["adapter_config.json a string"] = lambda d: (d / "adapter_config.json").write_text('"lora"')
        return cases
    cases = {}
    for i, w in enumerate(("model/model.safetensors", "optimizer.safetensors")):
        raw = (d / w).read_bytes()
        cases.update(safetensors_mutations(w, len(raw), struct.unpack("<Q", raw[:8])[0], True, 13 + i))
    cases.update({f"model/config.json {k}": _json_key("model/config.json", *v) for k, v in CONFIG_LIES.items()})
    cases["trainer.json cut short"] = _json_cut("trainer.json")
    cases["trainer.json optimizer_steps '1'"] = _json_key("trainer.json", "optimizer_steps", "1")
    cases["trainer.json files a list"] = _json_key("trainer.json", "files", [])
    return cases


@pytest.mark.parametrize("kind", ["from_pretrained", "bnb_4bit", "load_adapter", "load_checkpoint"])
def test_every_damaged_file_is_refused_in_one_line_and_changes_nothing(kind, src, ctx, engine, tmp_path):
    base = {"from_pretrained": src / "ckpt" / "model", "bnb_4bit": src / "nf4", "load_adapter": src / "adapter",
            "load_checkpoint": src / "ckpt"}[kind]
    victim = Trainer(Lfm2Model.from_pretrained(src / "ckpt" / "model", ctx, engine), AdamW(lr=1e-2), ctx, engine)
    victim.model.load_state(version(load_file(str(src / "ckpt" / "model" / "model.safetensors")), 1, 0.5))
    before = {n: t.numpy().tobytes() for n, t in victim.model.named_parameters().items()}
    steps_before = victim.optimizer_steps()
    cases = reader_cases(kind, base)
    clean, harmless, tracebacks, changed, unnamed = [], [], [], [], []
    for i, (name, mutate) in enumerate(cases.items()):
        d = tmp_path / f"m{i:03d}"
        shutil.copytree(base, d)
        mutate(d)
        file = name.split(" ")[0].split("/")[-1]
        try:
            if kind == "from_pretrained":
                Lfm2Model.from_pretrained(d, ctx, engine)
            elif kind == "bnb_4bit":
                Lfm2Model.from_pretrained(d, ctx, engine, base_dtype="nf4")
            elif kind == "load_adapter":
                victim.model.load_adapter(d)
            else:
                victim.load_checkpoint(d)
        except ERRORS as e:
            msg = str(e)
            clean.append(name)
            if "\n" in msg or (file not in msg and str(d) not in msg):
                unnamed.append((name, msg))
        except Exception as e:          # noqa: BLE001 - counted: a traceback a user would see
            tracebacks.append((name, f"{type(e).__name__}: {e}"))
        else:
            # a flip in bytes nothing reads (the header's __metadata__ or padding) changes nothing:
            # the load must then give exactly the original tensors
            if kind == "load_adapter":
                got = {n: t.numpy() for n, t in victim.model.lora.named.items()}
                want = load_file(str(base / "adapter_model.safetensors"))
                victim.model.lora = None
            elif kind in ("from_pretrained", "bnb_4bit"):
                got, want = read_model_dir(d), read_model_dir(base)
            else:
                got, want = {}, {"": None}      # a checkpoint is checksummed: nothing may load
            if set(got) == set(want) and all(np.array_equal(got[n], want[n]) for n in want):
                harmless.append(name)
            else:
                tracebacks.append((name, "loaded altered tensors without an error"))
        if kind not in ("from_pretrained", "bnb_4bit") and ({n: t.numpy().tobytes() for n, t in victim.model.named_parameters().items()}
                                          != before or victim.optimizer_steps() != steps_before
                                          or (kind == "load_adapter" and victim.model.lora is not None)):
            changed.append(name)
            victim.model.load_state({n: np.frombuffer(b, np.float32).reshape(t.shape) for (n, b), t in
                                     zip(before.items(), victim.model.named_parameters().values())})
        shutil.rmtree(d)
    TABLE[f"reader {kind}"] = {"cases": len(cases), "clean errors": len(clean), "harmless": len(harmless),
                               "tracebacks": len(tracebacks), "changed weights": len(changed),
                               "unnamed file": len(unnamed)}
    assert tracebacks == [], tracebacks
    assert changed == [], changed
    assert unnamed == [], "\n".join(map(str, unnamed))
    assert len(clean) + len(harmless) == len(cases) and len(cases) >= 50


def test_zz_print_the_table():
    """The counts of the cases above (pytest -s shows them)."""
    print("\nfault injection: cases per writer / reader")
    for k, v in TABLE.items():
        print(f"  {k:42s} " + ", ".join(f"{a} {b}" for a, b in v.items()))
