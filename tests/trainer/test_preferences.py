"""Preference records (trainer/preferences.py) in TRL's three formats, held to the chat template and
the tokenizer directly, and every bad record refused with its file and line."""
from __future__ import annotations

import json

import numpy as np
import pytest

from trainer.data import DataError, default_tokenizer, encode_chat, load_tokenizer
from trainer.preferences import read_preferences

PROMPT = [{"role": "user", "content": "What is 2 + 3?"}]
CHOSEN = [{"role": "assistant", "content": "5"}]
REJECTED = [{"role": "assistant", "content": "six, I think"}]


@pytest.fixture(scope="module")
def tok():
    return load_tokenizer(default_tokenizer())


def write(tmp_path, *records):
    path = tmp_path / "prefs.jsonl"
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in records))
    return path


def test_conversational_records_score_the_answers_the_template_renders(tmp_path, tok):
    pair, = read_preferences(write(tmp_path, {"prompt": PROMPT, "chosen": CHOSEN, "rejected": REJECTED}), tok)
    head, _ = encode_chat(PROMPT, tok, add_generation_prompt=True)
    np.testing.assert_array_equal(pair.prompt, head)
    assert tok.decode(pair.prompt.tolist(), skip_special_tokens=False).endswith("<|im_start|>assistant\n")
    for completion, answer in ((pair.chosen, "5"), (pair.rejected, "six, I think")):
        full, sup = encode_chat(PROMPT + [{"role": "assistant", "content": answer}], tok)
        np.testing.assert_array_equal(np.concatenate([pair.prompt, completion]), full[:pair.prompt.size + completion.size])
        assert sup[pair.prompt.size:pair.prompt.size + completion.size].all()       # the supervised answer, whole
        assert tok.decode(completion.tolist(), skip_special_tokens=False) == answer + "<|im_end|>"
    for (ids, targets, mask), completion in zip(pair.sequences(), (pair.chosen, pair.rejected)):
        np.testing.assert_array_equal(targets[mask == 1], completion)
        np.testing.assert_array_equal(ids[1:], targets[:-1])


def test_an_implicit_prompt_is_the_conversations_shared_start(tmp_path, tok):
    explicit, implicit = read_preferences(write(
        tmp_path, {"prompt": PROMPT, "chosen": CHOSEN, "rejected": REJECTED},
        {"chosen": PROMPT + CHOSEN, "rejected": PROMPT + REJECTED}), tok)
    for a, b in ((explicit.prompt, implicit.prompt), (explicit.chosen, implicit.chosen),
                 (explicit.rejected, implicit.rejected)):
        np.testing.assert_array_equal(a, b)


def test_standard_records_are_text_with_the_special_tokens(tmp_path, tok):
    pair, = read_preferences(write(tmp_path, {"prompt": "The sky is", "chosen": " blue.", "rejected": " green."}), tok)
    bos, eos = tok.token_to_id("<|startoftext|>"), tok.token_to_id("<|endoftext|>")
    assert pair.prompt[0] == bos and pair.chosen[-1] == eos and pair.rejected[-1] == eos
    assert tok.decode(pair.chosen[:-1].tolist()) == tok.decode(tok.encode(" blue.", add_special_tokens=False).ids)


def test_a_long_record_keeps_its_completions_start_and_says_so(tmp_path, tok):
    long = {"prompt": "Count:", "chosen": " one two three four five six seven eight", "rejected": " 1 2 3 4 5 6 7 8 9"}
    full, = read_preferences(write(tmp_path, long), tok)
    max_len = full.prompt.size + 2
    with pytest.warns(UserWarning, match=f"1 of 1 preference record were longer than max_len={max_len}"):
        pair, = read_preferences(write(tmp_path, long), tok, max_len=max_len)
    assert pair.prompt.size + max(pair.chosen.size, pair.rejected.size) == max_len + 1
    np.testing.assert_array_equal(pair.chosen, full.chosen[:pair.chosen.size])


@pytest.mark.parametrize("record,message", [
    ({"prompt": "a", "chosen": "b"}, "jsonl:2: no 'rejected' answer"),
    ({"prompt": "a", "rejected": "b"}, "jsonl:2: no 'chosen' answer"),
    ({"prompt": "a", "chosen": "", "rejected": "b"}, "jsonl:2: 'chosen' is empty"),
    ({"prompt": "", "chosen": "a", "rejected": "b"}, "jsonl:2: 'prompt' is empty"),
    ({"prompt": "a", "chosen": CHOSEN, "rejected": "b"}, "jsonl:2: 'prompt', 'chosen' and 'rejected' must all be"),
    ({"prompt": PROMPT, "chosen": [], "rejected": REJECTED}, "jsonl:2: 'chosen' has no messages"),
    ({"prompt": PROMPT, "chosen": CHOSEN, "rejected": [{"role": "user", "content": "x"}]},
     "jsonl:2: 'rejected' has no assistant message"),
    ({"prompt": [], "chosen": CHOSEN, "rejected": REJECTED}, "jsonl:2: 'prompt' has no messages"),
    ({"chosen": "a", "rejected": "b"}, "jsonl:2: no 'prompt'"),
    ('{"prompt": [{"role": "user", "content": "q"}], "chosen": [{"role": "robot", "content": "x"}, '
     '{"role": "assistant", "content": "y"}], "rejected": [{"role": "assistant", "content": "y"}]}', "jsonl:2: .*robot"),
    ("{not json", "jsonl:2: "),
])
def test_a_bad_record_is_named_by_its_line(tmp_path, tok, record, message):
    good = {"prompt": "q", "chosen": "a", "rejected": "b"}
    with pytest.raises(DataError, match=message):
        read_preferences(write(tmp_path, good, record), tok)


def test_no_room_for_a_completion_and_an_empty_file_are_refused(tmp_path, tok):
    with pytest.raises(DataError, match="leaves no room for a completion within max_len=2"):
        read_preferences(write(tmp_path, {"prompt": "a long prompt here", "chosen": "a", "rejected": "b"}), tok, max_len=2)
    (tmp_path / "empty.jsonl").write_text("\n")
    with pytest.raises(DataError, match="no records"):
        read_preferences(tmp_path / "empty.jsonl", tok)
