"""Preference records (DPO's data) as tokens, in TRL's preference formats, one JSON object a line:

- standard: ``{"prompt": "...", "chosen": "...", "rejected": "..."}``. The prompt is
  ``<|startoftext|>`` + its text; each completion is its text + ``<|endoftext|>`` (each special token
  only if the tokenizer has it).
- conversational: ``{"prompt": [messages], "chosen": [messages], "rejected": [messages]}``, the
  completions usually one assistant message each. The prompt is rendered with the chat template and
  its generation prompt (``<|im_start|>assistant\\n``); a completion is what the conversation
  prompt + completion adds after that, up to and including its last assistant token (the newline
  after ``<|im_end|>`` is left out, as in supervised fine-tuning).
- implicit prompt: ``{"chosen": [messages], "rejected": [messages]}``: the prompt is the messages the
  two conversations share at their start (TRL's ``extract_prompt``).

Only completion tokens are scored. Bad records raise DataError naming the file and line, before any
weight changes: a missing or empty prompt, chosen or rejected, mixed formats, a prompt that leaves
no room for a completion within ``max_len``.
"""
from __future__ import annotations

import os
import warnings
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from .data import (BOS_TOKEN, EOS_TOKEN, DataError, _chat_template, _check_messages, _lines, encode_chat,
                   jsonl_records, load_tokenizer)


@dataclass(frozen=True)
class PreferencePair:
    """A preference record as token ids: the prompt, then the preferred and the other completion."""
    prompt: np.ndarray          # int32, at least one token
    chosen: np.ndarray          # int32, at least one token
    rejected: np.ndarray        # int32, at least one token
    origin: str = ""            # file:line, for messages

    def sequences(self) -> list[tuple[np.ndarray, np.ndarray, np.ndarray]]:
        """(input_ids, target_ids, loss_mask) of prompt + chosen, then of prompt + rejected; the mask
        selects the targets that are completion tokens."""
        out = []
        for completion in (self.chosen, self.rejected):
            ids = np.concatenate([self.prompt, completion]).astype(np.int32)
            mask = np.zeros(ids.size - 1, np.float32)
            mask[self.prompt.size - 1:] = 1.0
            out.append((ids[:-1], ids[1:], mask))
        return out

    @property
    def lengths(self) -> tuple[int, int]:
        """Completion tokens of chosen and rejected."""
        return int(self.chosen.size), int(self.rejected.size)


def read_preferences(path, tokenizer, max_len: int | None = None, *, chat_template=None) -> list[PreferencePair]:
    """The preference records of a JSONL file (see the module docstring). ``max_len`` caps prompt +
    completion positions: a longer completion keeps its start (reported in a warning)."""
    tok = tokenizer if not isinstance(tokenizer, (str, os.PathLike)) else load_tokenizer(tokenizer)
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"no such preference file: {path}")
    if max_len is not None and (isinstance(max_len, bool) or not isinstance(max_len, int) or max_len < 1):
        raise ValueError(f"max_len must be a positive integer or None, got {max_len!r}")
    template = _chat_template(chat_template, tok)
    pairs, cut = [], []
    for lineno, record in jsonl_records(path):
        prompt, chosen, rejected = _tokens(record, tok, template, path, lineno)
        if max_len is not None and prompt.size + max(chosen.size, rejected.size) > max_len + 1:
            room = max_len + 1 - prompt.size
            if room < 1:
                raise DataError(f"the prompt has {prompt.size} tokens, which leaves no room for a completion "
                                f"within max_len={max_len}; raise max_len or shorten the prompt", path, lineno)
            chosen, rejected, _ = chosen[:room], rejected[:room], cut.append(lineno)
        pairs.append(PreferencePair(prompt, chosen, rejected, f"{path}:{lineno}"))
    if not pairs:
        raise DataError("no records (the file is empty)", path)
    if cut:
        warnings.warn(f"{path}: {len(cut)} of {len(pairs)} preference record{'s' if len(pairs) != 1 else ''} were "
                      f"longer than max_len={max_len} positions; their completions keep their start "
                      f"(lines {_lines(cut)})", stacklevel=2)
    return pairs


def _tokens(record: dict, tok, template, path: Path, lineno: int):
    for key in ("chosen", "rejected"):
        if key not in record:
            raise DataError(f"no '{key}' answer: a preference record needs 'chosen' and 'rejected' "
                            f"(and a 'prompt', or conversations that share one); keys: {sorted(record)}", path, lineno)
    prompt, chosen, rejected = record.get("prompt"), record["chosen"], record["rejected"]
    if prompt is None:
        if not (isinstance(chosen, list) and isinstance(rejected, list)):
            raise DataError("no 'prompt': only conversations (lists of messages) can share an implicit prompt",
                            path, lineno)
        shared = 0
        while shared < min(len(chosen), len(rejected)) and chosen[shared] == rejected[shared]:
            shared += 1
        prompt, chosen, rejected = chosen[:shared], chosen[shared:], rejected[shared:]
    if isinstance(prompt, str) and isinstance(chosen, str) and isinstance(rejected, str):
        return _text(prompt, chosen, rejected, tok, path, lineno)
    if all(isinstance(x, list) for x in (prompt, chosen, rejected)):
        return _chat(prompt, chosen, rejected, tok, template, path, lineno)
    kinds = {k: type(v).__name__ for k, v in (("prompt", prompt), ("chosen", chosen), ("rejected", rejected))}
    raise DataError(f"'prompt', 'chosen' and 'rejected' must all be strings or all be lists of messages, "
                    f"got {kinds}", path, lineno)


def _text(prompt: str, chosen: str, rejected: str, tok, path, lineno):
    for key, value in (("prompt", prompt), ("chosen", chosen), ("rejected", rejected)):
        if not value:
            raise DataError(f"'{key}' is empty", path, lineno)
    bos, eos = tok.token_to_id(BOS_TOKEN), tok.token_to_id(EOS_TOKEN)
    encode = lambda text: tok.encode(text, add_special_tokens=False).ids     # noqa: E731
    head = np.array(([bos] if bos is not None else []) + encode(prompt), np.int32)
    tail = [eos] if eos is not None else []
    return head, np.array(encode(chosen) + tail, np.int32), np.array(encode(rejected) + tail, np.int32)


def _chat(prompt: list, chosen: list, rejected: list, tok, template, path, lineno):
    if not prompt:
        raise DataError("'prompt' has no messages", path, lineno)
    for key, value in (("chosen", chosen), ("rejected", rejected)):
        if not value:
            raise DataError(f"'{key}' has no messages (an empty completion)", path, lineno)
        if not any(isinstance(m, dict) and m.get("role") == "assistant" for m in value):
            raise DataError(f"'{key}' has no assistant message: the completion is what the model says", path, lineno)
    try:
        _check_messages(prompt + chosen, path, lineno)
        _check_messages(prompt + rejected, path, lineno)
        head, _ = encode_chat(prompt, tok, add_generation_prompt=True, chat_template=template)
        completions = []
        for key, value in (("chosen", chosen), ("rejected", rejected)):
            ids, sup = encode_chat(prompt + value, tok, chat_template=template)
            if ids.size <= head.size or not np.array_equal(ids[:head.size], head):
                raise DataError(f"the chat template does not render prompt + '{key}' as the prompt (with its "
                                "generation prompt) followed by the answer", path, lineno)
            end = int(np.flatnonzero(sup)[-1]) + 1 if sup[head.size:].any() else 0
            if end <= head.size:
                raise DataError(f"'{key}' renders to no answer tokens (an empty completion)", path, lineno)
            completions.append(ids[head.size:end])
    except DataError:
        raise
    except ValueError as e:          # ChatTemplateError, a missing special token
        raise DataError(str(e), path, lineno) from None
    return head, completions[0], completions[1]

