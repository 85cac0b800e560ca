"""Chat records through the tokenizer's own chat template: the built-in LFM2 template renders as
Liquid AI's published one (an independent Python rendering of its rules, and hand-written strings
from Liquid's documented examples) and as transformers' apply_chat_template renders it; the ids and
the assistant-only mask equal transformers' (``return_assistant_tokens_mask``) on many random
conversations; a template without ``{% generation %}`` blocks gives the same mask; a tokenizer's
own template is used, one without falls back to the built-in one; bad records name file and line."""
from __future__ import annotations

import json
import random
import shutil
from pathlib import Path

import numpy as np
import pytest

from trainer.chat_template import BUILTIN_TEMPLATE, ChatTemplate, ChatTemplateError, find_chat_template, template_for
from trainer.data import (BOS_TOKEN, IM_END, IM_START, Batch, DataError, default_assets_dir, default_tokenizer,
                          encode_chat, load_tokenizer, render_chat)

N_RANDOM = 300


@pytest.fixture(scope="module")
def tok():
    return load_tokenizer(default_tokenizer())


@pytest.fixture(scope="module")
def hf():
    transformers = pytest.importorskip("transformers")
    return transformers.AutoTokenizer.from_pretrained(str(default_assets_dir()))


def write_jsonl(path: Path, lines: list) -> Path:
    path.write_text("".join((x if isinstance(x, str) else json.dumps(x)) + "\n" for x in lines), encoding="utf-8")
    return path


# ---------------------------------------------------------------------------------------------
# Liquid's LFM2 template, as rules: what its chat_template.jinja renders, written out in Python
# ---------------------------------------------------------------------------------------------

def _as_text(value) -> str:
    return value if isinstance(value, str) else json.dumps(value, ensure_ascii=False)


def _call_arg(value) -> str:
    if isinstance(value, str):
        return f'"{value}"'
    if isinstance(value, (dict, list)):
        return json.dumps(value, ensure_ascii=False)
    return str(value)                       # Python spelling: True, False, None, 3, 1.5


def liquid_tool_calls(calls) -> str:
    """The Pythonic call list LFM2 writes: ``<|tool_call_start|>[f(a="x", n=3)]<|tool_call_end|>``."""
    parts = []
    for call in calls:
        f = call.get("function", call)
        args = ", ".join(f"{k}={_call_arg(v)}" for k, v in (f.get("arguments") or {}).items())
        parts.append(f"{f['name']}({args})")
    return "<|tool_call_start|>[" + ", ".join(parts) + "]<|tool_call_end|>"


def liquid_turn(m) -> str:
    """An assistant message's supervised text: its tool calls, content and ``<|im_end|>``."""
    calls = liquid_tool_calls(m["tool_calls"]) if m.get("tool_calls") else ""
    return calls + (_as_text(m["content"]) if m.get("content") is not None else "") + IM_END


def liquid_lfm2(messages, tools=None, add_generation_prompt=False, bos=BOS_TOKEN) -> str:
    """The system turn holds a leading system message and the tool list, and is dropped when both are
    empty; tool results are wrapped in <|tool_response_start|>...<|tool_response_end|>."""
    system = ""
    if messages and messages[0]["role"] == "system":
        system = _as_text(messages[0]["content"]) if messages[0].get("content") is not None else ""
        messages = messages[1:]
    if tools:
        listed = ", ".join(_as_text(t) for t in tools)
        system += ("\n" if system else "") + f"List of tools: <|tool_list_start|>[{listed}]<|tool_list_end|>"
    out = bos + (f"{IM_START}system\n{system}{IM_END}\n" if system else "")
    for m in messages:
        content = _as_text(m["content"]) if m.get("content") is not None else ""
        if m["role"] == "assistant":
            body = liquid_turn(m) + "\n"
        elif m["role"] == "tool":
            body = f"<|tool_response_start|>{content}<|tool_response_end|>{IM_END}\n"
        else:
            body = f"{content}{IM_END}\n"
        out += f"{IM_START}{m['role']}\n" + body
    return out + (f"{IM_START}assistant\n" if add_generation_prompt else "")


# ---------------------------------------------------------------------------------------------
# random conversations
# ---------------------------------------------------------------------------------------------

WORDS = ["cat", "Paris", "reverse", "2 + 3", "héllo", "naïve café", "\"quoted\"", "it's", "a\nb", "{x}", "<b>", "  ",
         "日本", "", "5", "tac", "null", "What is the weather?", "List of tools:", "</think>"]
TOOLS = [{"name": "get_weather", "description": "Weather of a city",
          "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}},
         {"type": "function", "function": {"name": "add", "parameters": {"type": "object",
                                                                          "properties": {"a": {"type": "number"}}}}},
         {"name": "lookup", "description": "Ünïcode ✓", "parameters": {}}]


def _text(rng: random.Random) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(rng.randrange(0, 4)))


def _tool_call(rng: random.Random) -> dict:
    args = {}
    for name in rng.sample(["city", "n", "flag", "items", "opts", "x", "none"], rng.randrange(0, 4)):
        args[name] = {"city": _text(rng), "n": rng.randrange(-5, 100), "flag": rng.random() < 0.5,
                      "items": [1, "two", 3.5], "opts": {"k": _text(rng)}, "x": 1.25, "none": None}[name]
    f = {"name": rng.choice(["get_weather", "add", "lookup"]), "arguments": args}
    return {"type": "function", "function": f} if rng.random() < 0.8 else f


def random_conversation(rng: random.Random) -> tuple[list[dict], list | None, bool]:
    """``(messages, tools, add_generation_prompt)``: an optional (possibly empty) system message, user,
    assistant and tool turns, assistant tool calls with string, null or absent content."""
    messages = []
    r = rng.random()
    if r < 0.2:
        messages.append({"role": "system", "content": ""})
    elif r < 0.5:
        messages.append({"role": "system", "content": _text(rng) or "Be brief."})
    for _ in range(rng.randrange(1, 4)):
        messages.append({"role": "user", "content": _text(rng)})
        if rng.random() < 0.4:
            call = {"role": "assistant", "tool_calls": [_tool_call(rng) for _ in range(rng.randrange(1, 3))]}
            c = rng.random()
            if c < 0.4:
                call["content"] = None
            elif c < 0.7:
                call["content"] = _text(rng)
            messages.append(call)
            for _ in range(rng.randrange(1, 3)):
                messages.append({"role": "tool", "content": rng.choice([_text(rng), '{"temp": 21, "sky": "clear"}'])})
        messages.append({"role": "assistant", "content": _text(rng)})
    if rng.random() < 0.3:
        messages.append({"role": "user", "content": _text(rng)})
    t = rng.random()
    tools = None if t < 0.5 else ([] if t < 0.6 else rng.sample(TOOLS, rng.randrange(1, 4)))
    return messages, tools, rng.random() < 0.3


def cases(n: int = N_RANDOM, seed: int = 0):
    rng = random.Random(seed)
    return [random_conversation(rng) for _ in range(n)]


# ---------------------------------------------------------------------------------------------
# rendering
# ---------------------------------------------------------------------------------------------

def test_builtin_template_renders_as_liquids_lfm2_template_and_as_transformers(hf):
    builtin = ChatTemplate.builtin()
    assert hf.chat_template == BUILTIN_TEMPLATE            # the shipped tokenizer_config.json carries it
    for messages, tools, gen in cases():
        want = liquid_lfm2(messages, tools, gen)
        assert builtin.render(messages, tools=tools, add_generation_prompt=gen) == want, (messages, tools)
        assert hf.apply_chat_template(messages, tools=tools, add_generation_prompt=gen, tokenize=False) == want


def test_builtin_template_on_liquids_documented_examples():
    """The conversations of Liquid's docs and model cards (LFM2 chat template page, LFM2-1.2B-Tool)."""
    plain = [{"role": "user", "content": "What is C. elegans?"},
             {"role": "assistant", "content": "It's a tiny nematode that lives in temperate soil environments."}]
    assert render_chat(plain) == ("<|startoftext|><|im_start|>user\nWhat is C. elegans?<|im_end|>\n"
                                  "<|im_start|>assistant\nIt's a tiny nematode that lives in temperate soil "
                                  "environments.<|im_end|>\n")
    system = [{"role": "system", "content": "You are a helpful assistant."},
              {"role": "user", "content": "What is machine learning?"}]
    assert render_chat(system, add_generation_prompt=True) == (
        "<|startoftext|><|im_start|>system\nYou are a helpful assistant.<|im_end|>\n"
        "<|im_start|>user\nWhat is machine learning?<|im_end|>\n<|im_start|>assistant\n")
    # an empty system message is dropped
    assert render_chat([{"role": "system", "content": ""}] + plain) == render_chat(plain)
    tool = {"name": "get_candidate_status", "description": "Retrieves the current status of a candidate",
            "parameters": {"type": "object", "properties": {"candidate_id": {"type": "string"}},
                           "required": ["candidate_id"]}}
    chat = [{"role": "user", "content": "What is the current status of candidate ID 12345?"},
            {"role": "assistant", "content": "Checking the current status of candidate ID 12345.",
             "tool_calls": [{"type": "function", "function": {"name": "get_candidate_status",
                                                              "arguments": {"candidate_id": "12345"}}}]},
            {"role": "tool", "content": '[{"candidate_id": "12345", "status": "Interview Scheduled"}]'},
            {"role": "assistant", "content": "The candidate's interview is scheduled."}]
    assert render_chat(chat, tools=[tool]) == (
        '<|startoftext|><|im_start|>system\nList of tools: <|tool_list_start|>[{"name": "get_candidate_status", '
        '"description": "Retrieves the current status of a candidate", "parameters": {"type": "object", '
        '"properties": {"candidate_id": {"type": "string"}}, "required": ["candidate_id"]}}]<|tool_list_end|>'
        '<|im_end|>\n<|im_start|>user\nWhat is the current status of candidate ID 12345?<|im_end|>\n'
        '<|im_start|>assistant\n<|tool_call_start|>[get_candidate_status(candidate_id="12345")]<|tool_call_end|>'
        'Checking the current status of candidate ID 12345.<|im_end|>\n<|im_start|>tool\n<|tool_response_start|>'
        '[{"candidate_id": "12345", "status": "Interview Scheduled"}]<|tool_response_end|><|im_end|>\n'
        "<|im_start|>assistant\nThe candidate's interview is scheduled.<|im_end|>\n")
    # the same call with content null (an OpenAI-style tool call), and a system prompt before the tools
    chat[1] = {**chat[1], "content": None}
    text = render_chat([{"role": "system", "content": "Be brief."}] + chat, tools=[tool])
    assert text.startswith("<|startoftext|><|im_start|>system\nBe brief.\nList of tools: <|tool_list_start|>[")
    assert ('<|im_start|>assistant\n<|tool_call_start|>[get_candidate_status(candidate_id="12345")]'
            '<|tool_call_end|><|im_end|>\n<|im_start|>tool\n') in text


# ---------------------------------------------------------------------------------------------
# ids and the assistant-only mask
# ---------------------------------------------------------------------------------------------

def as_tokens(tok, text: str) -> str:
    """``text`` as the character-level tokenizer gives it back (non-ASCII letters become <unk>)."""
    return tok.decode(tok.encode(text, add_special_tokens=False).ids, skip_special_tokens=False)


def _runs(ids, flags) -> list[list[int]]:
    runs, cur = [], []
    for i, f in zip(ids, flags):
        if f:
            cur.append(int(i))
        elif cur:
            runs.append(cur)
            cur = []
    return runs + ([cur] if cur else [])


def test_ids_and_assistant_mask_equal_transformers(tok, hf):
    for messages, tools, gen in cases():
        ids, sup = encode_chat(messages, tok, add_generation_prompt=gen, tools=tools)
        out = hf.apply_chat_template(messages, tools=tools, add_generation_prompt=gen, tokenize=True,
                                     return_dict=True, return_assistant_tokens_mask=True)
        assert ids.tolist() == list(out["input_ids"])
        assert sup.astype(int).tolist() == list(out["assistant_masks"])


def test_supervised_tokens_are_exactly_the_assistant_turns(tok):
    """Each run of supervised tokens is one assistant message's tool calls, content and <|im_end|>,
    in order; everything else (headers, system, user and tool turns, the newline after) is masked."""
    for messages, tools, gen in cases():
        ids, sup = encode_chat(messages, tok, add_generation_prompt=gen, tools=tools)
        want = [as_tokens(tok, liquid_turn(m)) for m in messages if m["role"] == "assistant"]
        assert [tok.decode(r, skip_special_tokens=False) for r in _runs(ids, sup)] == want
        assert tok.decode(ids.tolist(), skip_special_tokens=False) == as_tokens(tok, liquid_lfm2(messages, tools, gen))


def test_a_template_without_generation_blocks_gives_the_same_mask(tok):
    """Without {% generation %} the assistant turns are found by rendering the conversation up to
    each one: the same spans as the built-in template's generation blocks."""
    plain = BUILTIN_TEMPLATE.replace("{%- generation -%}", "").replace("{%- endgeneration -%}", "")
    no_blocks = ChatTemplate(plain, special_tokens=ChatTemplate.builtin(tok).special_tokens, source="test")
    assert not no_blocks.has_generation_blocks()
    for messages, tools, gen in cases(100, seed=1):
        a = encode_chat(messages, tok, add_generation_prompt=gen, tools=tools)
        b = encode_chat(messages, tok, add_generation_prompt=gen, tools=tools, chat_template=no_blocks)
        assert a[0].tolist() == b[0].tolist() and a[1].tolist() == b[1].tolist()


def test_a_template_with_no_generation_prompt_supervises_content_and_im_end(tok):
    """A minimal ChatML template (no bos, no add_generation_prompt branch): the assistant turn starts
    after its header only if the generation prompt renders it, else the header is supervised too."""
    chatml = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
              "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
    messages = [{"role": "user", "content": "reverse cat"}, {"role": "assistant", "content": "tac"},
                {"role": "user", "content": "add 2 3"}, {"role": "assistant", "content": "5"}]
    ids, sup = encode_chat(messages, tok, chat_template=chatml)
    assert tok.decode(ids.tolist(), skip_special_tokens=False) == (
        "<|im_start|>user\nreverse cat<|im_end|>\n<|im_start|>assistant\ntac<|im_end|>\n"
        "<|im_start|>user\nadd 2 3<|im_end|>\n<|im_start|>assistant\n5<|im_end|>\n")
    assert [tok.decode(r, skip_special_tokens=False) for r in _runs(ids, sup)] == ["tac<|im_end|>", "5<|im_end|>"]
    no_prompt = chatml.split("{% if")[0]
    ids, sup = encode_chat(messages, tok, chat_template=no_prompt)
    assert [tok.decode(r, skip_special_tokens=False) for r in _runs(ids, sup)] == \
        ["<|im_start|>assistant\ntac<|im_end|>", "<|im_start|>assistant\n5<|im_end|>"]


def test_a_template_that_renders_history_by_what_follows_is_reported(tok):
    counting = "{{ messages | length }}{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}<|im_end|>{% endfor %}"
    with pytest.raises(ChatTemplateError, match=r"cannot find assistant message 1 .*\{% generation %\}"):
        encode_chat([{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}], tok,
                    chat_template=counting)


def test_generation_blocks_inside_macros_are_found(tok):
    """Spans come from the rendered text, so a generation block inside a macro counts where it lands."""
    t = ("{% macro turn(m) %}<|im_start|>{{ m.role }}\n{% if m.role == 'assistant' %}{% generation %}"
         "{{ m.content }}<|im_end|>{% endgeneration %}{% else %}{{ m.content }}<|im_end|>{% endif %}\n{% endmacro %}"
         "{% for m in messages %}{{ turn(m) }}{% endfor %}")
    ids, sup = encode_chat([{"role": "user", "content": "hello"}, {"role": "assistant", "content": "olleh"}], tok,
                           chat_template=t)
    assert [tok.decode(r, skip_special_tokens=False) for r in _runs(ids, sup)] == ["olleh<|im_end|>"]


# ---------------------------------------------------------------------------------------------
# where the template comes from
# ---------------------------------------------------------------------------------------------

def _tokenizer_dir(tmp_path: Path, name: str, config_template=None, jinja: str | None = None) -> Path:
    d = tmp_path / name
    d.mkdir()
    shutil.copyfile(default_tokenizer(), d / "tokenizer.json")
    config = json.loads((default_assets_dir() / "tokenizer_config.json").read_text())
    config.pop("chat_template")
    if config_template is not None:
        config["chat_template"] = config_template
    (d / "tokenizer_config.json").write_text(json.dumps(config))
    if jinja is not None:
        (d / "chat_template.jinja").write_text(jinja)
    return d


OWN = ("{{ bos_token }}{% for m in messages %}### {{ m['role'] }}: {% if m['role'] == 'assistant' %}"
       "{% generation %}{{ m['content'] }}<|im_end|>{% endgeneration %}{% else %}{{ m['content'] }}{% endif %}\n"
       "{% endfor %}{% if add_generation_prompt %}### assistant: {% endif %}")
RECORD = {"messages": [{"role": "system", "content": ""}, {"role": "user", "content": "reverse cat"},
                       {"role": "assistant", "content": "tac"}]}


def test_a_tokenizer_without_a_chat_template_falls_back_to_the_builtin_one(tmp_path, tok):
    bare = tmp_path / "bare"
    bare.mkdir()
    shutil.copyfile(default_tokenizer(), bare / "tokenizer.json")
    t = load_tokenizer(bare)
    assert find_chat_template(bare) is None and template_for(t).is_builtin
    b = Batch.from_jsonl(write_jsonl(tmp_path / "c.jsonl", [RECORD]), t)
    ids, sup = encode_chat(RECORD["messages"], tok)
    assert b[0].input_ids.tolist() == ids[:-2].tolist()     # the trailing "\n" is dropped, never a target
    # a config without chat_template falls back too
    t2 = load_tokenizer(_tokenizer_dir(tmp_path, "config-only"))
    assert template_for(t2).is_builtin


@pytest.mark.parametrize("where", ["chat_template.jinja", "tokenizer_config.json", "named templates", "both"])
def test_the_tokenizers_own_template_is_used(tmp_path, where):
    transformers = pytest.importorskip("transformers")
    other = "{% for m in messages %}IGNORED{% endfor %}"
    config, jinja = {"chat_template.jinja": (None, OWN), "tokenizer_config.json": (OWN, None),
                     "named templates": ([{"name": "default", "template": OWN},
                                          {"name": "tool_use", "template": other}], None),
                     "both": (other, OWN)}[where]               # chat_template.jinja wins, as in transformers
    d = _tokenizer_dir(tmp_path, "own", config, jinja)
    t = load_tokenizer(d)
    assert not template_for(t).is_builtin
    b = Batch.from_jsonl(write_jsonl(tmp_path / "c.jsonl", [RECORD]), d / "tokenizer.json")
    s = b[0]
    full = t.decode(s.input_ids.tolist() + [int(s.target_ids[-1])], skip_special_tokens=False)
    assert full == "<|startoftext|>### system: ### user: reverse cat### assistant: tac<|im_end|>"   # trim_blocks
    assert t.decode(s.target_ids[s.loss_mask == 1].tolist(), skip_special_tokens=False) == "tac<|im_end|>"
    hf = transformers.AutoTokenizer.from_pretrained(str(d))
    ids, sup = encode_chat(RECORD["messages"], t, add_generation_prompt=True)
    out = hf.apply_chat_template(RECORD["messages"], add_generation_prompt=True, tokenize=True, return_dict=True,
                                 return_assistant_tokens_mask=True)
    assert ids.tolist() == list(out["input_ids"]) and sup.astype(int).tolist() == list(out["assistant_masks"])


def test_an_explicit_template_overrides_the_tokenizers(tmp_path, tok):
    b = Batch.from_jsonl(write_jsonl(tmp_path / "c.jsonl", [RECORD]), tok, chat_template=OWN)
    assert tok.decode(b[0].input_ids.tolist(), skip_special_tokens=False).startswith("<|startoftext|>### system: ")


def test_a_broken_template_is_reported_when_the_tokenizer_loads(tmp_path):
    d = _tokenizer_dir(tmp_path, "broken", jinja="{% for m in messages %}{{ m.content }")
    with pytest.raises(ValueError, match=r"chat_template.jinja: the chat template does not compile"):
        load_tokenizer(d)
    d2 = tmp_path / "badjson"
    d2.mkdir()
    shutil.copyfile(default_tokenizer(), d2 / "tokenizer.json")
    (d2 / "tokenizer_config.json").write_text("{not json")
    with pytest.raises(ValueError, match=r"tokenizer_config.json: not valid JSON"):
        load_tokenizer(d2)


# ---------------------------------------------------------------------------------------------
# records with tools, and bad records
# ---------------------------------------------------------------------------------------------

def test_tool_records_train_on_calls_and_answers(tmp_path, tok):
    records = []
    for messages, tools, _ in cases(40, seed=2):
        record = {"messages": messages}
        if tools is not None:
            record["tools"] = tools
        records.append(record)
    b = Batch.from_jsonl(write_jsonl(tmp_path / "tools.jsonl", records), tok)
    assert len(b) == len(records)
    for s, r in zip(b, records):
        want = "".join(liquid_turn(m) for m in r["messages"] if m["role"] == "assistant")
        assert tok.decode(s.target_ids[s.loss_mask == 1].tolist(), skip_special_tokens=False) == as_tokens(tok, want)
        rendered = as_tokens(tok, liquid_lfm2(r["messages"], r.get("tools")))
        full = tok.decode(s.input_ids.tolist() + [int(s.target_ids[-1])], skip_special_tokens=False)
        assert rendered.startswith(full) and full.endswith(IM_END)


CALL = {"type": "function", "function": {"name": "f", "arguments": {"a": 1}}}
BAD = [
    ({"messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": None}]},
     r"messages\[1\] \(assistant\) content must be a string, got null \(null is allowed only with 'tool_calls'\)"),
    ({"messages": [{"role": "user", "content": "q"}, {"role": "assistant"}]},
     r"messages\[1\] \(assistant\) has no 'content' key \(an assistant message may leave it out only with"),
    ({"messages": [{"role": "user", "content": "q", "tool_calls": [CALL]}, {"role": "assistant", "content": "a"}]},
     r"messages\[0\] \(user\) has 'tool_calls'; only assistant messages make tool calls"),
    ({"messages": [{"role": "user", "content": "q"}, {"role": "assistant", "tool_calls": CALL}]},
     r"messages\[1\] 'tool_calls' must be a list, got dict"),
    ({"messages": [{"role": "user", "content": "q"}, {"role": "assistant", "tool_calls": [{"function": {}}]}]},
     r"messages\[1\]\.tool_calls\[0\] must be \{\"type\": \"function\", \"function\": \{\"name\""),
    ({"messages": [{"role": "user", "content": "q"},
                   {"role": "assistant", "tool_calls": [{"function": {"name": "f", "arguments": 3}}]}]},
     r"messages\[1\]\.tool_calls\[0\] arguments must be an object, got int"),
    ({"messages": [{"role": "user", "content": "q"},
                   {"role": "assistant", "tool_calls": [{"function": {"name": "f", "arguments": '{"a": 1}'}}]}]},
     r"tokenizer_config.json \(chat_template\): tool call arguments must be a JSON object, not a JSON-encoded string"),
    ({"messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}], "tools": {"name": "f"}},
     r"'tools' must be a list of tool schemas \(JSON objects\), got \{\"name\": \"f\"\}"),
    ({"messages": [{"role": "tool", "content": None}, {"role": "assistant", "content": "a"}]},
     r"messages\[0\] \(tool\) content must be a string, got null$"),
]


@pytest.mark.parametrize("bad,words", BAD, ids=[f"bad{i}" for i in range(len(BAD))])
def test_bad_chat_records_name_file_line_and_what_was_expected(tmp_path, tok, bad, words):
    ok = {"messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": None, "tool_calls": [CALL]}]}
    path = write_jsonl(tmp_path / "bad.jsonl", [ok, "", bad])
    with pytest.raises(DataError, match=words) as info:
        Batch.from_jsonl(path, tok)
    assert str(info.value).startswith(f"{path}:3: ") and info.value.line == 3


def test_a_template_raising_on_a_record_names_the_record_and_the_template(tmp_path):
    strict = ("{% for m in messages %}{% if m['role'] == 'system' %}{{ raise_exception('no system prompts') }}"
              "{% endif %}{% generation %}{{ m['content'] }}{% endgeneration %}{% endfor %}")
    d = _tokenizer_dir(tmp_path, "strict", jinja=strict)
    path = write_jsonl(tmp_path / "c.jsonl", [{"messages": [{"role": "user", "content": "q"},
                                                            {"role": "assistant", "content": "a"}]}, RECORD])
    with pytest.raises(DataError, match=r"c.jsonl:2: .*strict/chat_template.jinja: no system prompts"):
        Batch.from_jsonl(path, d)


def test_rendering_and_masks_match_the_old_builtin_on_the_shipped_data(tok):
    """The shipped records (plain and system conversations) render as before this template: the
    default run's data is unchanged."""
    from trainer.data import default_dataset
    for line in open(default_dataset()).readlines()[:300]:
        messages = json.loads(line)["messages"]
        old = BOS_TOKEN + "".join(f"{IM_START}{m['role']}\n{m['content']}{IM_END}\n" for m in messages)
        ids, sup = encode_chat(messages, tok)
        assert tok.decode(ids.tolist(), skip_special_tokens=False) == old
        assert np.array_equal(ids[sup == 1], np.concatenate(
            [tok.encode(m["content"] + IM_END, add_special_tokens=False).ids
             for m in messages if m["role"] == "assistant"]).astype(np.int32))
