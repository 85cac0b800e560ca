"""Training data: Batch/Sequence semantics, text and chat JSONL (assistant-only supervision), padding,
truncation, located errors, and the shipped assets (tokenizer round trip, deterministic generator)."""
from __future__ import annotations

import importlib.util
import json
import warnings
from pathlib import Path

import numpy as np
import pytest

from trainer.data import (BOS_TOKEN, DEFAULT_MAX_LEN, EOS_TOKEN, IM_END, IM_START, PAD_TOKEN, Batch, DataError,
                          Sequence, default_assets_dir, default_batches, default_dataset, default_text_dataset,
                          default_tokenizer, encode_chat, load_tokenizer, render_chat, train_eval_split)


@pytest.fixture(scope="module")
def tok():
    return load_tokenizer(default_tokenizer())


@pytest.fixture(scope="module")
def bpe_tok():
    """A tokenizer with merges and a byte-level pre-tokenizer (as real LFM2's), trained here on the
    shipped data, to show the masking does not rely on one character a token."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    t = Tokenizer(models.BPE())
    t.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    t.decoder = decoders.ByteLevel()
    specials = [PAD_TOKEN, BOS_TOKEN, EOS_TOKEN, IM_START, IM_END]
    texts = [render_chat(json.loads(line)["messages"], bos=False).replace(IM_START, "").replace(IM_END, "")
             for line in open(default_dataset())]
    t.train_from_iterator(texts, trainers.BpeTrainer(vocab_size=400, special_tokens=specials, show_progress=False,
                                                     initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    assert t.token_to_id(PAD_TOKEN) == 0
    return t


def write_jsonl(path: Path, lines: list) -> Path:
    path.write_text("".join((x if isinstance(x, str) else json.dumps(x)) + "\n" for x in lines), encoding="utf-8")
    return path


def decode(tok, ids) -> str:
    return tok.decode([int(i) for i in ids], skip_special_tokens=False)


CHAT = {"messages": [{"role": "system", "content": "Be brief."},
                     {"role": "user", "content": "reverse cat"}, {"role": "assistant", "content": "tac"},
                     {"role": "user", "content": "add 2 3"}, {"role": "assistant", "content": "5"}]}


# ---------------------------------------------------------------------------------------------
# token lists, sequences, padding
# ---------------------------------------------------------------------------------------------

def test_from_token_lists_shifts_targets():
    b = Batch.from_token_lists([[5, 6, 7, 8], np.array([9, 10]), [11], []])
    assert len(b) == 4
    s = b[0]
    assert s.input_ids.tolist() == [5, 6, 7] and s.target_ids.tolist() == [6, 7, 8]
    assert s.loss_mask.tolist() == [1, 1, 1]
    assert (s.input_ids.dtype, s.target_ids.dtype, s.loss_mask.dtype) == (np.int32, np.int32, np.float32)
    assert b[1].input_ids.tolist() == [9] and b[1].target_ids.tolist() == [10]
    assert b[2].length == 0 and b[3].length == 0 and b[2].is_empty
    triples = list(b.sequences())
    assert len(triples) == 2, "lists of < 2 tokens have no target and are skipped"
    assert [t[0].tolist() for t in triples] == [[5, 6, 7], [9]]
    assert b.num_tokens == 4 and b.num_supervised == 4


def test_from_token_lists_max_len():
    b = Batch.from_token_lists([list(range(1, 11)), [1, 2, 3]], max_len=4)
    assert b[0].input_ids.tolist() == [1, 2, 3, 4] and b[0].target_ids.tolist() == [2, 3, 4, 5]
    assert b[1].length == 2
    assert b.notes and "max_len=4" in b.notes[0]
    with pytest.raises(ValueError, match="max_len must be a positive integer"):
        Batch.from_token_lists([[1, 2]], max_len=0)


@pytest.mark.parametrize("make,words", [
    (lambda: Sequence([1, 2], [3]), "input_ids has 2 positions but target_ids has 1"),
    (lambda: Sequence([1, 2], [3, 4], [1, 0.5]), "only 0 and 1"),
    (lambda: Sequence([1, 2], [3, 4], [1]), r"loss_mask has shape \[1\]"),
    (lambda: Sequence([1, -2], [3, 4]), r"input_ids\[1\] = -2 is not a valid token id"),
    (lambda: Sequence([1.0, 2.0], [3, 4]), "integer token ids"),
    (lambda: Sequence([[1, 2]], [[3, 4]]), "must be 1-D"),
    (lambda: Sequence([1, 2], [3, 4], [1, 1], length=1), "padding positions .* must have loss_mask 0"),
    (lambda: Sequence([1, 2], [3, 4], length=3), "length must be an integer in 0..2"),
])
def test_sequence_validation(make, words):
    with pytest.raises(ValueError, match=words):
        make()


def test_bool_mask_accepted():
    s = Sequence([1, 2, 3], [2, 3, 4], np.array([True, False, True]))
    assert s.loss_mask.tolist() == [1, 0, 1] and s.loss_mask.dtype == np.float32 and s.num_supervised == 2


def test_padding_round_trip_and_stripping():
    b = Batch.from_token_lists([[1, 2, 3, 4, 5], [6, 7, 8], [9]], pad_id=0)
    p = b.pad_to(multiple_of=8)
    assert all(s.padded_length == 8 for s in p)
    assert p[1].input_ids.tolist() == [6, 7, 0, 0, 0, 0, 0, 0]
    assert p[1].target_ids.tolist() == [7, 8, 0, 0, 0, 0, 0, 0]
    assert p[1].loss_mask.tolist() == [1, 1, 0, 0, 0, 0, 0, 0]
    assert [s.length for s in p] == [4, 2, 0]
    got, want = list(p.sequences()), list(b.sequences())
    assert len(got) == len(want) == 2
    for g, w in zip(got, want):
        for x, y in zip(g, w):
            assert np.array_equal(x, y) and x.dtype == y.dtype
    assert p[0] == b[0] and p.unpadded is not None
    ids, tg, mask, lengths = b.padded_arrays(6)
    assert ids.shape == tg.shape == mask.shape == (3, 6) and lengths.tolist() == [4, 2, 0]
    assert ids.dtype == np.int32 and mask.dtype == np.float32
    back = Batch.from_padded(ids, tg, mask, lengths)
    assert [tuple(map(np.ndarray.tolist, t)) for t in back.sequences()] == \
        [tuple(map(np.ndarray.tolist, t)) for t in want]
    with pytest.raises(ValueError, match="cannot pad to 3"):
        b.pad_to(3)


def test_from_padded_without_lengths_uses_the_mask():
    ids = np.array([[5, 6, 7, 0, 0], [8, 9, 0, 0, 0], [0, 0, 0, 0, 0]])
    tg = np.array([[6, 7, 4, 0, 0], [9, 4, 0, 0, 0], [0, 0, 0, 0, 0]])
    mask = np.array([[0, 1, 1, 0, 0], [1, 0, 0, 0, 0], [0, 0, 0, 0, 0]])
    b = Batch.from_padded(ids, tg, mask, pad_id=0)
    triples = list(b.sequences())
    assert len(triples) == 2, "the all-masked row is empty and skipped"
    assert triples[0][0].tolist() == [5, 6, 7] and triples[0][2].tolist() == [0, 1, 1]
    assert triples[1][0].tolist() == [8] and triples[1][1].tolist() == [9]


def test_empty_sequences_skipped():
    b = Batch([Sequence([1, 2], [2, 3]), Sequence([], []), Sequence([4, 5], [5, 6], [0, 0]),
               Sequence([7], [8], [1]).padded(4)])
    triples = list(b.sequences())
    assert [t[0].tolist() for t in triples] == [[1, 2], [7]]


def test_split_is_deterministic_and_disjoint():
    b = Batch.from_token_lists([[i, i + 1, i + 2] for i in range(100)])
    tr, ev = b.split(0.1, seed=3)
    assert (len(tr), len(ev)) == (90, 10)
    firsts = lambda x: [s.input_ids[0] for s in x]
    assert sorted(firsts(tr) + firsts(ev)) == list(range(100))
    tr2, ev2 = train_eval_split(b, 0.1, seed=3)
    assert firsts(ev) == firsts(ev2) and firsts(tr) == firsts(tr2)
    assert firsts(ev) == sorted(firsts(ev)), "both parts keep the original order"
    assert firsts(b.split(0.1, seed=4)[1]) != firsts(ev)
    with pytest.raises(ValueError, match="eval_fraction"):
        b.split(1.0)
    with pytest.raises(ValueError, match="cannot split 1 sequence"):
        Batch.from_token_lists([[1, 2]]).split(0.5)
    assert firsts(b.shuffled(1)) == firsts(b.shuffled(1)) != firsts(b)


def test_slicing():
    b = Batch.from_token_lists([[1, 2], [3, 4], [5, 6]], pad_id=7)
    assert isinstance(b[1:], Batch) and len(b[1:]) == 2 and b[1:].pad_id == 7
    assert isinstance(b[0], Sequence) and [s.input_ids[0] for s in b] == [1, 3, 5]


# ---------------------------------------------------------------------------------------------
# JSONL
# ---------------------------------------------------------------------------------------------

def test_text_jsonl_supervises_every_token(tmp_path, tok):
    texts = ["hello world", "a\nb c", "x"]
    path = write_jsonl(tmp_path / "t.jsonl", [{"text": t, "id": i} for i, t in enumerate(texts)])
    b = Batch.from_jsonl(path, tok)
    assert len(b) == 3 and b.pad_id == 0
    for s, text in zip(b, texts):
        assert s.input_ids[0] == tok.token_to_id(BOS_TOKEN)
        assert np.array_equal(s.input_ids[1:], s.target_ids[:-1])
        assert s.loss_mask.tolist() == [1.0] * s.length
        assert decode(tok, s.target_ids) == text + EOS_TOKEN
        assert s.origin.endswith(f"t.jsonl:{texts.index(text) + 1}")


def test_text_kind_on_a_tokenizer_without_bos(tmp_path):
    """Without <|startoftext|>/<|endoftext|> in the vocabulary the text is used as is."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    t = Tokenizer(models.WordLevel({"[UNK]": 0, "a": 1, "b": 2, "c": 3}, unk_token="[UNK]"))
    t.pre_tokenizer = pre_tokenizers.Whitespace()
    b = Batch.from_jsonl(write_jsonl(tmp_path / "t.jsonl", [{"text": "a b c"}]), t, kind="text")
    assert b[0].input_ids.tolist() == [1, 2] and b[0].target_ids.tolist() == [2, 3]


@pytest.mark.parametrize("which", ["char", "bpe"])
def test_chat_jsonl_supervises_exactly_the_assistant_tokens(tmp_path, tok, bpe_tok, which):
    t = tok if which == "char" else bpe_tok
    records = [CHAT, {"messages": [{"role": "user", "content": "capital of Peru"},
                                   {"role": "assistant", "content": "Lima"}]},
               {"messages": [{"role": "user", "content": "empty answer"}, {"role": "assistant", "content": ""},
                             {"role": "user", "content": "trailing question"}]}]
    b = Batch.from_jsonl(write_jsonl(tmp_path / "c.jsonl", records), t, kind="chat")
    for s, r in zip(b, records):
        answers = [m["content"] for m in r["messages"] if m["role"] == "assistant"]
        sup = s.target_ids[s.loss_mask == 1]
        assert decode(t, sup) == "".join(a + IM_END for a in answers)
        assert s.num_supervised == sum(len(t.encode(a, add_special_tokens=False).ids) + 1 for a in answers)
        # each supervised run is exactly one answer and its end marker, in order
        runs, cur = [], []
        for tid, m in zip(s.target_ids, s.loss_mask):
            if m:
                cur.append(tid)
            elif cur:
                runs.append(cur)
                cur = []
        runs += [cur] if cur else []
        assert [decode(t, x) for x in runs] == [a + IM_END for a in answers]
        # the full token stream is the chat template; trailing all-masked positions are dropped
        full = decode(t, list(s.input_ids) + [s.target_ids[-1]])
        rendered = render_chat(r["messages"])
        assert full.endswith(IM_END) and rendered.startswith(full)
        assert rendered[len(full):] == ("\n" if r["messages"][-1]["role"] == "assistant"
                                        else f"\n{IM_START}user\ntrailing question{IM_END}\n")
        # the input at each run's first supervised target is the end of "<|im_start|>assistant\n"
        first = int(np.flatnonzero(s.loss_mask)[0])
        assert decode(t, s.input_ids[:first + 1]).endswith(f"{IM_START}assistant\n")


def test_chat_masks_system_and_user_text(tmp_path, tok):
    b = Batch.from_jsonl(write_jsonl(tmp_path / "c.jsonl", [CHAT]), tok)
    s = b[0]
    masked = decode(tok, s.target_ids[s.loss_mask == 0])
    for text in ("Be brief.", "reverse cat", "add 2 3", "system\n", "user\n", "assistant\n"):
        assert text in masked
    assert "tac" not in masked and masked.count(IM_END) == 3     # system + two user turns


def test_encode_chat_matches_transformers_apply_chat_template(tok):
    transformers = pytest.importorskip("transformers")
    hf = transformers.AutoTokenizer.from_pretrained(str(default_assets_dir()))
    assert hf.pad_token_id == 0
    for gen in (False, True):
        ids, sup = encode_chat(CHAT["messages"], tok, add_generation_prompt=gen)
        want = hf.apply_chat_template(CHAT["messages"], tokenize=True, add_generation_prompt=gen)
        want = want["input_ids"] if hasattr(want, "keys") else want
        assert ids.tolist() == list(want)
        assert ids.size == sup.size
    ids, _ = encode_chat(CHAT["messages"][:2], tok, add_generation_prompt=True)
    assert decode(tok, ids).endswith(f"reverse cat{IM_END}\n{IM_START}assistant\n")


def test_auto_kind_mixes_records_and_skips_blank_lines(tmp_path, tok):
    path = write_jsonl(tmp_path / "m.jsonl", [{"text": "abc"}, "", "   ", CHAT])
    b = Batch.from_jsonl(path, tok)
    assert len(b) == 2 and b[1].origin.endswith(":4")
    assert b[0].num_supervised == b[0].length and b[1].num_supervised < b[1].length


def test_max_len_truncation(tmp_path, tok):
    long_text = "x" * 50
    path = write_jsonl(tmp_path / "long.jsonl", [{"text": "short"}, {"text": long_text}, CHAT])
    with pytest.warns(UserWarning) as caught:
        b = Batch.from_jsonl(path, tok, max_len=10)
    messages = [str(w.message) for w in caught]
    assert len(messages) == 2 and messages == b.notes
    assert "long.jsonl: 2 of 3 records were longer than max_len=10 positions" in messages[0]
    assert "truncated to their first 11 tokens (lines 2, 3)" in messages[0]
    assert [s.length for s in b] == [6, 10, 10]
    full = Batch.from_jsonl(path, tok)
    for cut, whole in zip(b, full):
        n = cut.length
        assert np.array_equal(cut.input_ids, whole.input_ids[:n]) and np.array_equal(cut.target_ids, whole.target_ids[:n])
    assert b[2].is_empty and len(list(b.sequences())) == 2, "a chat cut before its answer is skipped"
    assert any("lost every assistant token" in n and "lines 3" in n for n in b.notes)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        Batch.from_jsonl(path, tok, max_len=200)               # nothing cut, no warning


BAD = [
    ('{"text": "ok"', "malformed JSON"),
    ("[1, 2]", "expected a JSON object, got list"),
    ('{"txt": "a"}', "record has neither 'text' nor 'messages'"),
    ('{"text": "a", "messages": []}', "both 'text' and 'messages'"),
    ('{"text": 5}', "'text' must be a string, got int"),
    ('{"text": ""}', "'text' is empty"),
    ('{"messages": []}', r"empty conversation"),
    ('{"messages": "hi"}', "'messages' must be a list"),
    ('{"messages": ["hi"]}', r"messages\[0\] must be an object"),
    ('{"messages": [{"role": "user"}]}', r"messages\[0\] \(user\) has no 'content' key"),
    ('{"messages": [{"content": "x"}]}', r"messages\[0\] has no 'role' key"),
    ('{"messages": [{"role": "user", "content": "q"}, {"role": "robot", "content": "a"}]}',
     r"messages\[1\] has unknown role 'robot'; expected one of system, user, assistant"),
    ('{"messages": [{"role": "assistant", "content": 3}]}',
     r"messages\[0\] \(assistant\) content must be a string, got int"),
    ('{"messages": [{"role": "user", "content": "q"}]}', "no assistant message"),
]


@pytest.mark.parametrize("bad,words", BAD, ids=[w.split()[0].strip("'\\") + str(i) for i, (_, w) in enumerate(BAD)])
def test_malformed_records_name_file_and_line(tmp_path, tok, bad, words):
    path = write_jsonl(tmp_path / "bad.jsonl", [{"text": "fine"}, "", CHAT, bad, {"text": "after"}])
    with pytest.raises(DataError, match=words) as info:
        Batch.from_jsonl(path, tok)
    assert str(info.value).startswith(f"{path}:4: "), str(info.value)
    assert info.value.line == 4 and info.value.path == str(path)


@pytest.mark.parametrize("kind,record,words", [("text", CHAT, "text record has no 'text' key"),
                                               ("chat", {"text": "a"}, "chat record has no 'messages' key")])
def test_kind_is_enforced(tmp_path, tok, kind, record, words):
    path = write_jsonl(tmp_path / "k.jsonl", [record])
    with pytest.raises(DataError, match=f"k.jsonl:1: {words}"):
        Batch.from_jsonl(path, tok, kind=kind)
    with pytest.raises(ValueError, match="kind must be"):
        Batch.from_jsonl(path, tok, kind="json")


def test_chat_needs_template_tokens(tmp_path):
    from tokenizers import Tokenizer, models
    t = Tokenizer(models.BPE({"<unk>": 0, "a": 1}, [], unk_token="<unk>"))
    path = write_jsonl(tmp_path / "c.jsonl", [CHAT])
    with pytest.raises(DataError, match=r"c.jsonl:1: the tokenizer has no <\|im_start\|>, <\|im_end\|> token"):
        Batch.from_jsonl(path, t)


def test_file_errors(tmp_path, tok):
    with pytest.raises(FileNotFoundError, match="no such data file"):
        Batch.from_jsonl(tmp_path / "missing.jsonl", tok)
    (tmp_path / "empty.jsonl").write_text("\n\n")
    with pytest.raises(DataError, match="empty.jsonl: no records"):
        Batch.from_jsonl(tmp_path / "empty.jsonl", tok)


def test_load_tokenizer(tmp_path):
    t1 = load_tokenizer(default_tokenizer())
    t2 = load_tokenizer(default_assets_dir())                       # a directory holding tokenizer.json
    t3 = load_tokenizer(str(default_tokenizer()))
    assert t1.get_vocab() == t2.get_vocab() == t3.get_vocab()
    b = Batch.from_jsonl(write_jsonl(tmp_path / "c.jsonl", [CHAT]), default_assets_dir())   # tokenizer as a path
    assert b[0].num_supervised == 6
    with pytest.raises(FileNotFoundError, match="has no tokenizer.json"):
        load_tokenizer(tmp_path)
    with pytest.raises(FileNotFoundError, match="no such tokenizer"):
        load_tokenizer(tmp_path / "nope.json")
    (tmp_path / "tokenizer.json").write_text("{not json")
    with pytest.raises(ValueError, match="not a valid tokenizer.json"):
        load_tokenizer(tmp_path)


# ---------------------------------------------------------------------------------------------
# the shipped assets
# ---------------------------------------------------------------------------------------------

def test_assets_exist_and_are_small():
    for p in (default_dataset(), default_text_dataset(), default_tokenizer()):
        assert p.is_file(), p
    assert default_dataset().stat().st_size < 1_000_000


def test_shipped_tokenizer(tok):
    assert tok.token_to_id(PAD_TOKEN) == 0, "id 0 must be the pad token (the model's padding_idx)"
    for t in (BOS_TOKEN, EOS_TOKEN, IM_START, IM_END):
        assert tok.token_to_id(t) is not None
        assert tok.encode(f"a{t}b", add_special_tokens=False).tokens == ["a", t, "b"]
    assert 100 <= tok.get_vocab_size() <= 256


def test_tokenizer_round_trips_the_dataset(tok):
    unk = tok.token_to_id("<unk>")
    n = 0
    for line in open(default_dataset()):
        for m in json.loads(line)["messages"]:
            ids = tok.encode(m["content"], add_special_tokens=False).ids
            assert unk not in ids and tok.decode(ids) == m["content"]
            n += 1
    for line in open(default_text_dataset()):
        text = json.loads(line)["text"]
        ids = tok.encode(text, add_special_tokens=False).ids
        assert unk not in ids and tok.decode(ids) == text
    assert n > 3000


def test_default_dataset_loads_without_truncation():
    records = [json.loads(line) for line in open(default_dataset())]
    assert 2000 <= len(records) <= 10000
    assert len({json.dumps(r["messages"]) for r in records}) == len(records), "records are distinct"
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        train, evals = default_batches()
    assert len(train) + len(evals) == len(records) and len(evals) == round(0.05 * len(records))
    assert max(train.max_length, evals.max_length) <= DEFAULT_MAX_LEN
    assert all(not s.is_empty for s in train) and all(not s.is_empty for s in evals)
    again = default_batches()
    assert all(a == b for a, b in zip(evals, again[1]))
    text = Batch.from_jsonl(default_text_dataset(), default_tokenizer(), max_len=DEFAULT_MAX_LEN, kind="text")
    assert len(text) >= 100 and text.num_supervised == text.num_tokens


def test_generator_reproduces_the_shipped_files(tmp_path):
    spec = importlib.util.spec_from_file_location("make_assets", Path(__file__).resolve().parents[2] / "scripts" / "make_assets.py")
    make_assets = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(make_assets)
    written = make_assets.generate(tmp_path)
    assert sorted(p.name for p in written) == sorted(make_assets.ASSET_FILES)
    for name in make_assets.ASSET_FILES:
        fresh, shipped = (tmp_path / name).read_bytes(), (default_assets_dir() / name).read_bytes()
        assert fresh == shipped, (f"trainer/assets/{name} differs from a fresh `python scripts/make_assets.py` "
                                  "(regenerate and commit it if the generator or tokenizers changed)")
    assert make_assets.main(["--check"]) == 0
