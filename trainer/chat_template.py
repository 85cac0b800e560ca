"""Chat templates: a conversation rendered as text by a tokenizer's own Jinja ``chat_template`` the way
transformers' ``apply_chat_template`` renders it, with the character spans of the assistant turns,
which become the supervised tokens.

Where a template comes from (:func:`find_chat_template`, as transformers loads it): the tokenizer's
directory's ``chat_template.jinja``, else the ``chat_template`` of its ``tokenizer_config.json`` (a
string, or a list of ``{"name", "template"}``: ``"tool_use"`` when tools are given, else
``"default"``). A tokenizer with neither gets :data:`BUILTIN_TEMPLATE`, which renders as Liquid AI's
published LFM2 template does::

    <|startoftext|><|im_start|>system
    {system}
    List of tools: <|tool_list_start|>[{tool}, {tool}]<|tool_list_end|><|im_end|>
    <|im_start|>user
    {content}<|im_end|>
    <|im_start|>assistant
    <|tool_call_start|>[name(arg="value", n=3)]<|tool_call_end|>{content}<|im_end|>
    <|im_start|>tool
    <|tool_response_start|>{content}<|tool_response_end|><|im_end|>

The system turn comes from a leading system message and the ``tools`` list (each tool as JSON); it is
left out when both are empty. A non-string content is written as JSON. An assistant message's
``tool_calls`` (``[{"function": {"name": ..., "arguments": {...}}}]``, as transformers passes them)
are written as one Pythonic call list before its content, which may then be null or absent. (Liquid's
first LFM2 template ignored ``tool_calls``, so such a record there needs the call text in ``content``;
the call format is the one its model cards and its later templates use.)

Rendering (as transformers does it): a sandboxed Jinja environment with ``trim_blocks`` and
``lstrip_blocks``, the loop controls, ``raise_exception``, ``strftime_now``, a ``tojson`` that keeps
non-ASCII text; the variables ``messages`` (message keys whose value is null dropped), ``tools``,
``documents`` (None), ``add_generation_prompt`` and the special tokens (``bos_token``, ``eos_token``,
``pad_token``, ``unk_token``).

Assistant spans (:meth:`ChatTemplate.render_spans`): the text a template writes inside
``{% generation %}...{% endgeneration %}`` where it has such blocks (the built-in one wraps each
assistant turn's tool calls, content and closing ``<|im_end|>``, not the newline after it). Without
them, each assistant turn is found by rendering the conversation up to it: the text the turn adds
after the generation prompt (``<|im_start|>assistant\\n``), up to and including its last
``<|im_end|>``. That needs a template that renders the start of a conversation the same whatever
follows; one that does not is reported, with the advice to add ``{% generation %}`` blocks.
"""
from __future__ import annotations

import contextvars
import functools
import json
import os
import re
import weakref
from datetime import datetime
from pathlib import Path
from typing import Union

import jinja2
import jinja2.ext
import jinja2.nodes
from jinja2.sandbox import ImmutableSandboxedEnvironment

__all__ = ["ChatTemplate", "ChatTemplateError", "BUILTIN_TEMPLATE", "find_chat_template", "template_for",
           "register_template"]

PathLike = Union[str, "os.PathLike[str]"]

IM_END = "<|im_end|>"
SPECIAL_TOKEN_KEYS = ("bos_token", "eos_token", "pad_token", "unk_token")

BUILTIN_TEMPLATE = r"""{#- LFM2's chat template as lfm2jit renders it (trainer/chat_template.py says what it writes) -#}
{{- bos_token -}}
{%- macro as_text(value) -%}
    {%- if value is string -%}{{- value -}}{%- else -%}{{- value | tojson -}}{%- endif -%}
{%- endmacro -%}
{%- macro call_arg(value) -%}
    {%- if value is string -%}{{- '"' + value + '"' -}}
    {%- elif value is mapping or value is sequence -%}{{- value | tojson -}}
    {%- else -%}{{- value | string -}}
    {%- endif -%}
{%- endmacro -%}
{%- macro tool_call_list(tool_calls) -%}
    {%- set calls = namespace(parts=[]) -%}
    {%- for call in tool_calls -%}
        {%- set function = call.function if call.function is defined else call -%}
        {%- set args = namespace(parts=[]) -%}
        {%- if function.arguments is string -%}
            {{- raise_exception("tool call arguments must be a JSON object, not a JSON-encoded string") -}}
        {%- endif -%}
        {%- for name, value in (function.arguments or {}).items() -%}
            {%- set args.parts = args.parts + [name + "=" + call_arg(value)] -%}
        {%- endfor -%}
        {%- set calls.parts = calls.parts + [function.name + "(" + (args.parts | join(", ")) + ")"] -%}
    {%- endfor -%}
    {{- "<|tool_call_start|>[" + (calls.parts | join(", ")) + "]<|tool_call_end|>" -}}
{%- endmacro -%}
{%- set head = namespace(system="") -%}
{%- if messages and messages[0].role == "system" -%}
    {%- if messages[0].content is defined -%}{%- set head.system = as_text(messages[0].content) -%}{%- endif -%}
    {%- set messages = messages[1:] -%}
{%- endif -%}
{%- if tools -%}
    {%- set listed = namespace(parts=[]) -%}
    {%- for tool in tools -%}{%- set listed.parts = listed.parts + [as_text(tool)] -%}{%- endfor -%}
    {%- set head.system = head.system + ("\n" if head.system else "") + "List of tools: <|tool_list_start|>["
        + (listed.parts | join(", ")) + "]<|tool_list_end|>" -%}
{%- endif -%}
{%- if head.system -%}
    {{- "<|im_start|>system\n" + head.system + "<|im_end|>\n" -}}
{%- endif -%}
{%- for message in messages -%}
    {{- "<|im_start|>" + message.role + "\n" -}}
    {%- set content = as_text(message.content) if message.content is defined else "" -%}
    {%- if message.role == "assistant" -%}
        {%- generation -%}
        {%- if message.tool_calls -%}{{- tool_call_list(message.tool_calls) -}}{%- endif -%}
        {{- content + "<|im_end|>" -}}
        {%- endgeneration -%}
        {{- "\n" -}}
    {%- elif message.role == "tool" -%}
        {{- "<|tool_response_start|>" + content + "<|tool_response_end|><|im_end|>\n" -}}
    {%- else -%}
        {{- content + "<|im_end|>\n" -}}
    {%- endif -%}
{%- endfor -%}
{%- if add_generation_prompt -%}
    {{- "<|im_start|>assistant\n" -}}
{%- endif -%}
"""


class ChatTemplateError(ValueError):
    """A chat template that does not compile, fails on a conversation, or whose assistant turns
    cannot be found. The message names the template's source."""


# Generation blocks wrap their text in these two private-use characters while spans are tracked;
# the characters are removed from the text (and refused in the input, where they would be ambiguous).
_OPEN, _CLOSE = "\ue000", "\ue001"
_GENERATION_TAG = re.compile(r"\{%-?\s*generation\s*-?%\}")
_MARKING: contextvars.ContextVar[bool] = contextvars.ContextVar("lfm2jit_mark_generation", default=False)


def _environment():
    """The sandbox transformers renders chat templates in (``trim_blocks``, ``lstrip_blocks``, loop
    controls, ``raise_exception``, ``strftime_now``, a ``tojson`` that keeps non-ASCII text) and a
    ``{% generation %}`` tag that marks its text while ``_MARKING`` is set."""

    class Generation(jinja2.ext.Extension):
        tags = {"generation"}

        def parse(self, parser):
            lineno = next(parser.stream).lineno
            body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
            return jinja2.nodes.CallBlock(self.call_method("_mark"), [], [], body).set_lineno(lineno)

        def _mark(self, caller):
            text = caller()
            return _OPEN + text + _CLOSE if _MARKING.get() else text

    def raise_exception(message):
        raise jinja2.exceptions.TemplateError(message)

    def tojson(value, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
        return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=[Generation, jinja2.ext.loopcontrols])
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    return env


def _plain_messages(messages: list) -> list:
    """What transformers hands a template: each message without its null-valued keys, and a message's
    reasoning also under ``thinking`` and ``reasoning_content``."""
    out = []
    for m in messages:
        m = {k: v for k, v in m.items() if v is not None} if isinstance(m, dict) else m
        if isinstance(m, dict):
            reasoning = next((m[k] for k in ("reasoning_content", "thinking", "reasoning") if k in m), None)
            if reasoning is not None:
                m = {"thinking": reasoning, **m, "reasoning_content": reasoning}
        out.append(m)
    return out


def _has_marker(value) -> bool:
    if isinstance(value, str):
        return _OPEN in value or _CLOSE in value
    if isinstance(value, dict):
        return any(_has_marker(v) for v in value.values())
    if isinstance(value, (list, tuple)):
        return any(_has_marker(v) for v in value)
    return False


class ChatTemplate:
    """One tokenizer's chat template: ``templates`` maps a name to Jinja source (``"default"``, and
    ``"tool_use"`` for conversations with tools if the tokenizer has one); ``special_tokens`` are the
    ``bos_token``/``eos_token``/... variables it sees; ``source`` says where it came from."""

    def __init__(self, templates: str | dict[str, str], *, special_tokens: dict[str, str] | None = None,
                 source: str = "built-in"):
        self.templates = {"default": templates} if isinstance(templates, str) else dict(templates)
        if not self.templates or not all(isinstance(t, str) for t in self.templates.values()):
            raise ChatTemplateError(f"{source}: a chat template must be Jinja text (or named texts)")
        self.special_tokens = {k: v for k, v in (special_tokens or {}).items() if v is not None}
        self.source = source
        self._env = _environment()
        self._compiled = {}
        for name, text in self.templates.items():
            try:
                self._compiled[name] = self._env.from_string(text)
            except Exception as e:     # jinja2.TemplateSyntaxError, with the template's line
                line = f" (template line {e.lineno})" if getattr(e, "lineno", None) else ""
                raise ChatTemplateError(f"{source}: the chat template does not compile{line}: {e}") from None

    @classmethod
    def builtin(cls, tokenizer=None) -> "ChatTemplate":
        """:data:`BUILTIN_TEMPLATE`; ``bos_token`` is ``<|startoftext|>`` if ``tokenizer`` (a
        ``tokenizers.Tokenizer``) has it or none is given, else empty."""
        present = tuple(tokenizer is None or tokenizer.token_to_id(t) is not None
                        for t in ("<|startoftext|>", IM_END, "<|pad|>"))
        return _builtin(present)

    @property
    def is_builtin(self) -> bool:
        return self.templates == {"default": BUILTIN_TEMPLATE}

    def text(self, tools=None) -> str:
        """The Jinja source used for a conversation with (or without) ``tools``."""
        return self.templates[self._pick(tools)]

    def has_generation_blocks(self, tools=None) -> bool:
        return bool(_GENERATION_TAG.search(self.text(tools)))

    def _pick(self, tools) -> str:
        if tools is not None and "tool_use" in self.templates:
            return "tool_use"
        if "default" in self.templates:
            return "default"
        if len(self.templates) == 1:
            return next(iter(self.templates))
        raise ChatTemplateError(f"{self.source}: several chat templates ({', '.join(sorted(self.templates))}) "
                                "and none is named 'default'")

    def _render(self, messages, tools, add_generation_prompt: bool, mark: bool, **kwargs) -> str:
        template = self._compiled[self._pick(tools)]
        variables = {**self.special_tokens, **kwargs}
        marking = _MARKING.set(mark)
        try:
            return template.render(messages=_plain_messages(messages), tools=tools, documents=None,
                                   add_generation_prompt=add_generation_prompt, **variables)
        except jinja2.TemplateError as e:
            raise ChatTemplateError(f"{self.source}: {e}") from None
        except (TypeError, ValueError, KeyError, AttributeError, IndexError) as e:
            raise ChatTemplateError(f"{self.source} failed on this conversation: {type(e).__name__}: {e}") from None
        finally:
            _MARKING.reset(marking)

    def render(self, messages: list[dict], *, tools: list | None = None, add_generation_prompt: bool = False,
               **kwargs) -> str:
        """The conversation as text, as ``apply_chat_template(..., tokenize=False)`` gives it.
        ``kwargs`` are extra template variables (they override the special tokens)."""
        text = self._render(messages, tools, add_generation_prompt, False, **kwargs)
        return text.replace(_OPEN, "").replace(_CLOSE, "")

    def render_spans(self, messages: list[dict], *, tools: list | None = None,
                     add_generation_prompt: bool = False, **kwargs) -> tuple[str, list[tuple[int, int]]]:
        """``(text, spans)``: :meth:`render`'s text and the ``[start, end)`` character ranges of the
        assistant turns the loss supervises (see the module docstring), in order, not overlapping."""
        if self.has_generation_blocks(tools):
            if _has_marker((messages, tools, kwargs)):
                raise ChatTemplateError("the conversation contains U+E000 or U+E001, which mark the chat "
                                        "template's generation blocks while they are tracked")
            marked = self._render(messages, tools, add_generation_prompt, True, **kwargs)
            return _strip_marks(marked, self.source)
        return self._turn_spans(messages, tools, add_generation_prompt, **kwargs)

    def _turn_spans(self, messages, tools, add_generation_prompt, **kwargs):
        full = self.render(messages, tools=tools, add_generation_prompt=add_generation_prompt, **kwargs)
        spans = []
        for i, m in enumerate(messages):
            if not (isinstance(m, dict) and m.get("role") == "assistant"):
                continue
            prompt = self.render(messages[:i], tools=tools, add_generation_prompt=True, **kwargs)
            upto = self.render(messages[:i + 1], tools=tools, add_generation_prompt=False, **kwargs)
            if not (full.startswith(upto) and upto.startswith(prompt)):
                raise ChatTemplateError(
                    f"{self.source}: cannot find assistant message {i} in the rendered text: the template "
                    "renders the start of a conversation differently when more messages follow, or the "
                    "generation prompt is not how an assistant turn starts; mark the assistant turns "
                    "with {% generation %}...{% endgeneration %} in the template")
            end = _turn_end(upto[len(prompt):], self.special_tokens.get("eos_token"))
            if end > 0:
                spans.append((len(prompt), len(prompt) + end))
        return full, spans

    def __repr__(self) -> str:
        return f"ChatTemplate({self.source}, {'with' if self.has_generation_blocks() else 'no'} generation blocks)"


@functools.lru_cache(maxsize=None)
def _builtin(present: tuple[bool, bool, bool]) -> ChatTemplate:
    bos, eos, pad = present
    specials = {"bos_token": "<|startoftext|>" if bos else "", "eos_token": IM_END if eos else None,
                "pad_token": "<|pad|>" if pad else None}
    return ChatTemplate(BUILTIN_TEMPLATE, special_tokens=specials, source="the built-in LFM2 chat template")


def _turn_end(turn: str, eos: str | None) -> int:
    """Where an assistant turn's supervised text ends: after its last ``<|im_end|>`` (else the eos
    token), else before its trailing whitespace."""
    for marker in (IM_END, eos):
        if marker and marker in turn:
            return turn.rfind(marker) + len(marker)
    return len(turn.rstrip())


def _strip_marks(marked: str, source: str) -> tuple[str, list[tuple[int, int]]]:
    text, spans, start, depth = [], [], 0, 0
    pos = 0
    for piece in re.split(f"([{_OPEN}{_CLOSE}])", marked):
        if piece == _OPEN:
            if depth == 0:
                start = pos
            depth += 1
        elif piece == _CLOSE:
            depth -= 1
            if depth < 0:
                raise ChatTemplateError(f"{source}: unbalanced generation blocks")
            if depth == 0 and pos > start:
                spans.append((start, pos))
        else:
            text.append(piece)
            pos += len(piece)
    if depth:
        raise ChatTemplateError(f"{source}: unbalanced generation blocks")
    return "".join(text), spans


# ---------------------------------------------------------------------------------------------
# where a tokenizer's template comes from
# ---------------------------------------------------------------------------------------------

def _token_text(value):
    """A special token as tokenizer_config.json writes it: a string or ``{"content": ...}``."""
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) else None


def _read_json(path: Path) -> dict:
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ChatTemplateError(f"{path}: not valid JSON ({e})") from None
    if not isinstance(data, dict):
        raise ChatTemplateError(f"{path}: expected a JSON object")
    return data


def find_chat_template(tokenizer_path: PathLike) -> ChatTemplate | None:
    """The chat template beside a ``tokenizer.json`` (or in a directory holding one), as transformers
    finds it, or None if there is none."""
    p = Path(tokenizer_path)
    d = p if p.is_dir() else p.parent
    config_path, jinja_path = d / "tokenizer_config.json", d / "chat_template.jinja"
    config = _read_json(config_path) if config_path.is_file() else {}
    specials = {}
    map_path = d / "special_tokens_map.json"
    if map_path.is_file():
        specials.update({k: _token_text(v) for k, v in _read_json(map_path).items() if k in SPECIAL_TOKEN_KEYS})
    specials.update({k: _token_text(config[k]) for k in SPECIAL_TOKEN_KEYS if _token_text(config.get(k))})
    if jinja_path.is_file():
        return ChatTemplate(jinja_path.read_text(encoding="utf-8"), special_tokens=specials, source=str(jinja_path))
    raw = config.get("chat_template")
    if raw is None:
        return None
    source = f"{config_path} (chat_template)"
    if isinstance(raw, list):
        try:
            raw = {entry["name"]: entry["template"] for entry in raw}
        except (TypeError, KeyError):
            raise ChatTemplateError(f"{source}: a list of chat templates must hold {{\"name\", \"template\"}} "
                                    "objects") from None
    if not isinstance(raw, (str, dict)):
        raise ChatTemplateError(f"{source}: expected a string, got {type(raw).__name__}")
    return ChatTemplate(raw, special_tokens=specials, source=source)


_REGISTERED: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()


def register_template(tokenizer, template: ChatTemplate) -> None:
    """Remember ``template`` as ``tokenizer``'s (``trainer.data.load_tokenizer`` does this with the
    template found beside the tokenizer.json it loads)."""
    _REGISTERED[tokenizer] = template


def template_for(tokenizer) -> ChatTemplate:
    """The template registered for ``tokenizer``, else the built-in one (with its special tokens)."""
    try:
        found = _REGISTERED.get(tokenizer)
    except TypeError:          # not weak-referenceable
        found = None
    return found if found is not None else ChatTemplate.builtin(tokenizer)
