"""Bad settings and bad data are refused at once, with a message naming what was wrong, and change
nothing: Trainer builders and public attributes, optimizer and GradScaler arguments and attributes,
JSONL records (lone surrogates, deep nesting, error columns, bad bytes), and the CLI's guard against
a run whose loss scale underflowed (steps of all-zero gradients are not progress)."""
from __future__ import annotations

import json
import math
import re
from functools import partial

import numpy as np
import pytest

import trainer
import trainer.cli.train as cli_module
from lfm2jit.model import Lfm2Config, Lfm2Model
from trainer import SGD, AdamW, ConstantLR, CosineWithWarmup, GradScaler, Trainer
from trainer.data import MAX_JSON_DEPTH, Batch, DataError, default_tokenizer, encode_chat, encode_text, load_tokenizer

NAN, INF = math.nan, math.inf
MICRO = dict(vocab_size=64, hidden_size=32, intermediate_size=96, num_hidden_layers=2, num_attention_heads=2,
             num_key_value_heads=1, layer_types=["conv", "full_attention"], block_multiple_of=16)

# values that are never a count: the wrong kind (bools, floats, strings, None) and out of range
NOT_COUNTS = [True, False, np.bool_(True), 0, -1, -64, 1.5, 2.0, NAN, INF, -INF, "2", None, [2], np.float32(2)]
NOT_POSITIVE_REALS = [True, False, 0, 0.0, -1.0, -1, -1e-9, NAN, INF, -INF, "1.0", [1.0], 1j]


def assert_refused(err: pytest.ExceptionInfo, name: str, value) -> None:
    """The message names the setting, the value and what was expected."""
    msg = str(err.value)
    assert name in msg, msg
    assert "must" in msg, msg
    shown = repr(float(value)) if isinstance(value, float) and math.isnan(value) else repr(value)
    assert shown in msg or str(value) in msg, msg


@pytest.fixture(scope="module")
def model(ctx, engine):
    return Lfm2Model(Lfm2Config(**MICRO), ctx, engine, seed=5)


@pytest.fixture
def tr(model, ctx, engine):
    """A trainer with a non-default value in every checked attribute."""
    return (Trainer(model, AdamW(lr=1e-2), ctx, engine).with_grad_accum_steps(2).with_length_bucket(16)
            .with_clip_grad_norm(0.5).with_grad_scaler(GradScaler(init_scale=8.0))
            .with_lr_scheduler(ConstantLR(1e-3)).with_packing(256))


def snapshot(t: Trainer) -> dict:
    return {k: getattr(t, k) for k in ("optimizer", "clip_grad_norm", "grad_accum_steps", "step_in_accum", "scaler",
                                       "distributed_grad_sync", "lr_scheduler", "length_bucket", "lm_head_chunk",
                                       "lm_head_keep_bytes", "pack_tokens")}


# (attribute, builder or None, bad values)
TRAINER_CASES = [
    ("grad_accum_steps", "with_grad_accum_steps", NOT_COUNTS),
    ("length_bucket", "with_length_bucket", NOT_COUNTS),
    ("clip_grad_norm", "with_clip_grad_norm", NOT_POSITIVE_REALS),
    ("lm_head_chunk", None, [True, 0, -64, 63, 65, 100, 64.0, NAN, INF, "64"]),
    ("lm_head_keep_bytes", None, [True, -1, 1.5, NAN, INF, "1024", None]),
    ("pack_tokens", "with_packing", [True, -1, 1.5, NAN, INF, "8", [8]]),
    ("step_in_accum", None, [True, -1, 2, 3, 0.5, NAN, "0", None]),      # the window has 2 sequences
    ("scaler", "with_grad_scaler", ["on", 1, True, GradScaler, {"init_scale": 8.0}, NAN]),
    ("lr_scheduler", "with_lr_scheduler", ["cosine", 0.1, True, lambda k: 0.1, CosineWithWarmup]),
    ("optimizer", None, [None, "adamw", object(), AdamW, 0.1]),
    ("distributed_grad_sync", None, ["dir", object(), True, 2]),
]


@pytest.mark.parametrize("attr,builder,value",
                         [(a, b, v) for a, b, vs in TRAINER_CASES for v in vs],
                         ids=[f"{a}={re.sub(' at 0x[0-9a-f]+', '', repr(v))}"[:40]   # no addresses: the
                              for a, _, vs in TRAINER_CASES for v in vs])                 # same ids in every process
def test_trainer_attribute_and_builder_refuse_bad_values_and_keep_the_old_one(tr, attr, builder, value):
    before = snapshot(tr)
    with pytest.raises((TypeError, ValueError)) as err:
        setattr(tr, attr, value)
    assert_refused(err, attr, value)
    assert snapshot(tr) == before
    if builder is not None:
        with pytest.raises((TypeError, ValueError)) as err:
            getattr(tr, builder)(value)
        assert_refused(err, attr, value)
        assert snapshot(tr) == before


def test_wrong_kinds_are_type_errors_and_bad_numbers_value_errors(tr):
    for value in (True, "2", None, 2.0):
        with pytest.raises(TypeError):
            tr.grad_accum_steps = value
    for value in (0, -3):
        with pytest.raises(ValueError, match=rf"grad_accum_steps must be an integer >= 1, got {value}"):
            tr.grad_accum_steps = value
    with pytest.raises(ValueError, match=r"clip_grad_norm must be a finite number > 0, got nan \(or None"):
        tr.clip_grad_norm = NAN
    with pytest.raises(ValueError, match=r"clip_grad_norm must be a finite number > 0, got -1.0"):
        tr.clip_grad_norm = -1.0       # a negative max_norm would flip the gradient: the step would ascend
    with pytest.raises(TypeError, match=r"with_file_grad_sync: config must be a FileGradSyncConfig or None, got str"):
        tr.with_file_grad_sync("/tmp/sync")
    assert tr.grad_accum_steps == 2 and tr.clip_grad_norm == 0.5 and tr.distributed_grad_sync is None


def test_good_values_are_taken_and_normalized(tr, model, ctx, engine):
    tr.grad_accum_steps = np.int64(3)
    assert tr.grad_accum_steps == 3 and type(tr.grad_accum_steps) is int
    tr.clip_grad_norm = 2
    assert tr.clip_grad_norm == 2.0 and type(tr.clip_grad_norm) is float
    tr.clip_grad_norm = None
    tr.length_bucket, tr.lm_head_chunk, tr.pack_tokens = 1, 128, 0
    tr.step_in_accum = 2                       # < grad_accum_steps
    tr.step_in_accum = 0
    tr.with_packing(None)
    assert (tr.clip_grad_norm, tr.length_bucket, tr.lm_head_chunk, tr.pack_tokens) == (None, 1, 128, 0)
    tr.scaler = tr.lr_scheduler = None
    assert tr.loss_scale == 1.0 and tr.lr_at(1) == tr.optimizer.lr
    with pytest.raises(TypeError, match="optimizer must be an Optimizer"):
        Trainer(model, "adamw", ctx, engine)
    with pytest.raises(TypeError, match="Trainer: model must not be None"):
        Trainer(None, AdamW(), ctx, engine)


# ---------------------------------------------------------------------------------------------
# optimizers and the GradScaler
# ---------------------------------------------------------------------------------------------

BAD_RATES = [True, NAN, INF, -INF, -1e-3, "1e-3", None, [1e-3]]
BAD_NONNEG = [True, False, NAN, INF, -INF, -0.1, "0.1", None]
OPTIMIZER_CASES = [
    (AdamW, "lr", BAD_RATES),
    (AdamW, "eps", BAD_NONNEG),
    (AdamW, "weight_decay", BAD_NONNEG),
    (AdamW, "betas", [(0.9,), (0.9, 0.99, 0.999), (0.9, 1.0), (1.0, 0.9), (-0.1, 0.9), (NAN, 0.9), (0.9, INF),
                      (True, 0.9), ("0.9", 0.99), "ab", 0.9, None]),
    (SGD, "lr", BAD_RATES),
    (SGD, "momentum", BAD_NONNEG),
    (SGD, "weight_decay", BAD_NONNEG),
    (SGD, "dampening", [True, NAN, INF, -INF, "0", None]),
    (SGD, "nesterov", ["yes", 1, 0, None, NAN]),
]


@pytest.mark.parametrize("cls,arg,value", [(c, a, v) for c, a, vs in OPTIMIZER_CASES for v in vs],
                         ids=[f"{c.__name__}.{a}={v!r}"[:40] for c, a, vs in OPTIMIZER_CASES for v in vs])
def test_optimizer_arguments_and_attributes_refuse_bad_values(cls, arg, value):
    with pytest.raises((TypeError, ValueError)) as err:
        cls(**{arg: value})
    assert f"{cls.__name__}: {arg}" in str(err.value), str(err.value)
    opt = cls(lr=0.5, momentum=0.9) if cls is SGD else cls(lr=0.5)
    before = opt.hyperparameters()
    with pytest.raises((TypeError, ValueError)) as err:
        setattr(opt, arg, value)
    assert f"{cls.__name__}: {arg}" in str(err.value), str(err.value)
    assert opt.hyperparameters() == before


def test_the_issue_cases_fail_at_construction_with_the_argument_named():
    for make, words in [(lambda: SGD(momentum=NAN), "SGD: momentum must be a finite number >= 0, got nan"),
                        (lambda: SGD(momentum=INF), "SGD: momentum must be a finite number >= 0, got inf"),
                        (lambda: SGD(weight_decay=NAN), "SGD: weight_decay must be a finite number >= 0, got nan"),
                        (lambda: AdamW(weight_decay=INF), "AdamW: weight_decay must be a finite number >= 0, got inf"),
                        (lambda: AdamW(eps=INF), "AdamW: eps must be a finite number >= 0, got inf"),
                        (lambda: AdamW(betas=(0.9, NAN)), r"AdamW: betas\[1\] must be a finite number in \[0, 1\)"),
                        (lambda: SGD(nesterov=True), "Nesterov momentum requires a momentum > 0")]:
        with pytest.raises(ValueError, match=words):
            make()


def test_sgd_momentum_cannot_appear_or_vanish_once_there_is_state():
    opt = SGD(lr=0.1, momentum=0.9)
    opt.momentum = 0.5                          # a new coefficient is fine
    opt.state[1] = {"step": 1}
    with pytest.raises(ValueError, match="SGD: momentum cannot change from 0.5 to 0.0 once parameters have state"):
        opt.momentum = 0.0
    assert opt.momentum == 0.5 and opt.state_names == ("momentum",)
    nest = SGD(momentum=0.9, nesterov=True)
    with pytest.raises(ValueError, match="Nesterov"):
        nest.dampening = 0.1
    assert nest.dampening == 0.0


SCALER_CASES = [
    ("init_scale", [True, 0, 0.0, -1.0, NAN, INF, "65536", None]),
    ("growth_factor", [True, 1.0, 0.5, NAN, INF, "2"]),
    ("backoff_factor", [True, 0.0, 1.0, 1.5, -0.5, NAN, "0.5"]),
    ("growth_interval", [True, 0, -1, 1.5, 2000.0, NAN, "2000"]),
    ("enabled", ["yes", 1, 0, None]),
]


@pytest.mark.parametrize("field,value", [(f, v) for f, vs in SCALER_CASES for v in vs],
                         ids=[f"{f}={v!r}" for f, vs in SCALER_CASES for v in vs])
def test_grad_scaler_arguments_and_attributes_refuse_bad_values(field, value):
    with pytest.raises((TypeError, ValueError)) as err:
        GradScaler(**{field: value})
    assert_refused(err, f"GradScaler: {field}", value)
    s = GradScaler(init_scale=4.0)
    before = s.state_dict()
    with pytest.raises((TypeError, ValueError)) as err:
        setattr(s, field, value)
    assert_refused(err, f"GradScaler: {field}", value)
    assert s.state_dict() == before


@pytest.mark.parametrize("state,words", [
    ({"scale": "abc", "growth_tracker": 0}, "GradScaler state: scale must be a finite number >= 0, got str 'abc'"),
    ({"scale": NAN, "growth_tracker": 0}, "scale must be a finite number >= 0, got nan"),
    ({"scale": -2.0, "growth_tracker": 0}, "scale must be a finite number >= 0, got -2.0"),
    ({"scale": 8.0, "growth_tracker": -1}, "growth_tracker must be an integer >= 0, got -1"),
    ({"scale": 8.0, "growth_tracker": 1.5}, "growth_tracker must be an integer >= 0, got float 1.5"),
    ({"scale": 8.0}, "GradScaler state lacks 'growth_tracker'"),
    ([8.0, 0], "GradScaler state must be a dict, got list"),
])
def test_grad_scaler_state_is_checked_before_anything_changes(state, words):
    s = GradScaler(init_scale=4.0)
    s.update(found_inf=False)
    before = s.state_dict()
    with pytest.raises((TypeError, ValueError), match=words):
        s.load_state_dict(state)
    assert s.state_dict() == before
    s.load_state_dict({"scale": 2.0, "growth_tracker": 3})
    assert (s.scale, s.growth_tracker) == (2.0, 3)


# ---------------------------------------------------------------------------------------------
# attributes in the middle of a window, a scale that underflowed
# ---------------------------------------------------------------------------------------------

def snap_weights(model) -> dict[str, np.ndarray]:
    return {n: t.numpy().copy() for n, t in model.named_parameters().items()}


def test_mid_window_changes_that_would_corrupt_the_window_are_refused(tr, model):
    ids = np.arange(1, 9)
    tr.train_step(ids[:-1], ids[1:], model.parameters())
    assert tr.step_in_accum == 1
    before = snapshot(tr)
    for attr, value in [("grad_accum_steps", 3), ("scaler", GradScaler()), ("scaler", None), ("optimizer", SGD())]:
        with pytest.raises(ValueError, match=rf"cannot change {attr} in the middle of an accumulation window "
                                             r"\(1 of 2 sequences done\)"):
            setattr(tr, attr, value)
        assert snapshot(tr) == before
    tr.grad_accum_steps, tr.scaler = 2, before["scaler"]       # the same values: nothing changes
    tr.length_bucket, tr.clip_grad_norm = 32, 1.0              # these do not touch the window's gradients
    stats = tr.train_step(ids[:-1], ids[1:], model.parameters())
    assert stats.stepped and tr.step_in_accum == 0 and tr.optimizer_steps() == 1


def test_a_loss_scale_that_underflowed_takes_zero_norm_steps_and_a_tinier_one_skips(model, ctx, engine):
    """The situation the CLI's guard catches: under a scale this small the squares of the scaled
    gradients are f32 zeros, so "successful" steps report grad_norm 0.0 (and clipping is off). A
    scale whose 1/scale is no f32 (one backed off to 0, say) would unscale by inf: that window is
    skipped, as torch skips it, and no weight becomes NaN."""
    tr = Trainer(model, SGD(lr=0.5), ctx, engine).with_length_bucket(16).with_grad_scaler(GradScaler(init_scale=1e-30))
    ids = np.arange(1, 9)
    stats = tr.train_step(ids[:-1], ids[1:], model.parameters())
    assert stats.stepped and not stats.skipped and stats.grad_norm == 0.0 and math.isfinite(stats.loss)
    w = snap_weights(model)
    assert all(np.isfinite(a).all() for a in w.values())
    for scale in (1e-45, 0.0):
        tr.scaler.scale = scale
        stats = tr.train_step(ids[:-1], ids[1:], model.parameters())
        assert stats.skipped and not stats.stepped and tr.optimizer_steps() == 1, scale
        assert all(np.array_equal(w[n], a) for n, a in snap_weights(model).items()), scale


@pytest.mark.parametrize("init_scale,zero_norm", [(1e-30, True), (1e-45, False)])
def test_cli_run_whose_scale_underflowed_ends_with_a_clear_error(tmp_path, monkeypatch, capsys, init_scale, zero_norm):
    """Steps with a gradient norm of 0 (scale 1e-30) count toward the give-up guard as skipped
    windows do (scale 1e-45: 1/scale is no f32, so every window is skipped), so the run stops after
    MAX_SKIPPED_IN_A_ROW of them instead of carrying on with a flat loss."""
    monkeypatch.setattr(trainer, "GradScaler", partial(GradScaler, init_scale=init_scale))
    monkeypatch.setattr(cli_module, "MAX_SKIPPED_IN_A_ROW", 4)
    out = tmp_path / "run"
    rc = cli_module.main(["--preset", "tiny", "--grad-accum", "1", "--steps", "20", "--scaler", "--eval-max", "4",
                          "--no-progress", "--out", str(out)])
    err = capsys.readouterr().err
    assert rc == 1, err
    zeros = 4 if zero_norm else 0
    assert (f"training failed at step {5 if zero_norm else 1}: 4 windows in a row took no finite, nonzero step: "
            f"{4 - zeros} overflowed (inf/NaN gradients) and were skipped, {zeros} had a gradient norm of 0 "
            "(all-zero gradients, the loss scale underflowed)") in err, err
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    want = [(k, 0.0, False) for k in (1, 2, 3, 4)] if zero_norm else [(1, None, True)] * 4
    assert [(r["step"], r["grad_norm"], r["skipped"]) for r in rows] == want


# ---------------------------------------------------------------------------------------------
# data
# ---------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def tok():
    return load_tokenizer(default_tokenizer())


def chat(content: str, **extra) -> dict:
    return {"messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": content, **extra}]}


DEEP = "[" * 50000 + "]" * 50000
DATA_CASES = [
    ('{"text": "a\\ud800b"}', r"'text' holds a lone surrogate '\\ud800' at character 1"),
    ('{"text": "\\udfff"}', r"'text' holds a lone surrogate '\\udfff' at character 0"),
    (json.dumps(chat("x\ud83dy")), r"messages\[1\].content holds a lone surrogate '\\ud83d' at character 1"),
    (json.dumps({"messages": [{"role": "user", "content": "\udc00"}, {"role": "assistant", "content": "a"}]}),
     r"messages\[0\].content holds a lone surrogate"),
    (json.dumps(chat(None, tool_calls=[{"type": "function", "function": {"name": "f", "arguments": {"k\ud800": 1}}}])),
     r"a key of messages\[1\].tool_calls\[0\].function.arguments holds a lone surrogate"),
    (json.dumps({**chat("a"), "tools": [{"name": "t\udbff"}]}), r"tools\[0\].name holds a lone surrogate"),
    ('{"text": ' + DEEP + '}', "malformed JSON: nested too deeply to parse"),
    ('{"messages": ' + DEEP + '}', "malformed JSON: nested too deeply to parse"),
    (json.dumps(chat(None, tool_calls=[{"function": {"name": "f", "arguments": {"a": json.loads("[" * 80 + "]" * 80)}}}])),
     rf"messages\[1\].tool_calls\[0\].function.arguments.a(\[0\])+ nests more than {MAX_JSON_DEPTH} levels deep"),
    ('{"text": "ok"', "malformed JSON: Expecting ',' delimiter at column 14"),      # the end of the line
    ('{"text": "ok"}}', "malformed JSON: Extra data at column 15"),
    ('{"text": "ok", }', "malformed JSON: Expecting property name enclosed in double quotes at column 16"),
]


@pytest.mark.parametrize("line,words", DATA_CASES, ids=[f"case{i}" for i in range(len(DATA_CASES))])
@pytest.mark.parametrize("newline", ["\n", "\r\n"])
def test_bad_records_are_data_errors_naming_file_line_and_column(tmp_path, tok, line, words, newline):
    path = tmp_path / "bad.jsonl"
    path.write_bytes(newline.join(['{"text": "fine"}', line, '{"text": "after"}', ""])
                     .encode("utf-8", "surrogatepass"))
    with pytest.raises(DataError, match=words) as err:
        Batch.from_jsonl(path, tok)
    assert str(err.value).startswith(f"{path}:2: "), str(err.value)
    assert (err.value.path, err.value.line) == (str(path), 2)


def test_a_byte_that_is_not_utf8_is_located(tmp_path, tok):
    path = tmp_path / "bytes.jsonl"
    path.write_bytes(b'{"text": "fine"}\n{"text": "fine"}\n{"text": "caf\xe9"}\n')
    with pytest.raises(DataError, match=r"bytes.jsonl:3: not UTF-8 text: invalid continuation byte at byte 14"):
        Batch.from_jsonl(path, tok)


def test_good_records_with_escapes_and_crlf_still_load(tmp_path, tok):
    path = tmp_path / "ok.jsonl"
    path.write_bytes(('{"text": "pair \\ud83d\\ude00 ok"}\r\n' + json.dumps(chat("fine")) + "\r\n\r\n").encode())
    b = Batch.from_jsonl(path, tok)
    assert len(b) == 2 and b.num_supervised > 0


def test_encode_functions_refuse_lone_surrogates(tok):
    with pytest.raises(DataError, match=r"^text holds a lone surrogate '\\ud800' at character 2"):
        encode_text("ab\ud800", tok)
    with pytest.raises(DataError, match=r"^messages\[1\].content holds a lone surrogate"):
        encode_chat(chat("\udfff")["messages"], tok)
    assert encode_text("ab", tok).size > 0
