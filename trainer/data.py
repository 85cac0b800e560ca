"""Training data: token sequences with next-token targets and loss masks, built from token lists or
from JSONL files through a ``tokenizer.json`` (the Hugging Face ``tokenizers`` library).

A :class:`Sequence` is three aligned 1-D arrays: ``input_ids`` (int32), ``target_ids`` (int32) and
``loss_mask`` (float32, 1 = this target is supervised, 0 = ignored), plus ``length``: positions at
and after ``length`` are padding. A :class:`Batch` is a list of sequences and a pad id. Padding is
always on the right (pad id as input and target, mask 0) and never changes a result: the model is
causal, so positions after the last real one cannot influence the loss. ``Batch.sequences()`` yields
the ``(input_ids, target_ids, loss_mask)`` triples with the padding stripped, skipping sequences with
no supervised target; this is what ``Trainer.train_batch`` trains on, one micro-batch per triple.

JSONL records (one JSON object a line; blank lines are skipped; other keys are ignored):

- text: ``{"text": "..."}``. Tokens: ``<|startoftext|>`` (if the tokenizer has it), the text,
  ``<|endoftext|>`` (if the tokenizer has it). Every target is supervised.
- chat: ``{"messages": [{"role": "system"|"user"|"assistant"|"tool", "content": "..."}, ...]}`` and
  optionally ``"tools": [{...}, ...]`` (tool schemas); an assistant message may carry ``"tool_calls":
  [{"type": "function", "function": {"name": ..., "arguments": {...}}}]`` and then a null or absent
  content. Rendered with the tokenizer's own chat template (``chat_template.jinja`` or
  ``tokenizer_config.json`` beside its tokenizer.json, rendered as transformers'
  ``apply_chat_template`` renders it), else with the built-in LFM2 template (Liquid AI's)::

      <|startoftext|><|im_start|>user\\n{content}<|im_end|>\\n<|im_start|>assistant\\n{content}<|im_end|>\\n

  (``trainer/chat_template.py`` has the rest: system prompt, tools, tool calls, tool responses.)
  Only the assistant turns are supervised: the text in the template's ``{% generation %}`` blocks
  where it has them (the built-in template's hold each assistant message's tool calls, content and
  closing ``<|im_end|>``), else each assistant turn after the template's generation prompt
  (``<|im_start|>assistant\\n``) up to and including its ``<|im_end|>``. Role headers, system/user/tool
  messages and the newline after ``<|im_end|>`` are masked. Supervised and masked parts are tokenized
  separately (so a token never straddles the boundary and the assistant tokens are exactly those the
  model would generate after the prompt). Trailing positions whose targets are all masked are dropped
  (being causal, they change nothing).

``max_len`` caps the number of positions of a sequence: a longer record keeps its first
``max_len + 1`` tokens (so ``max_len`` input/target pairs); the cut is reported with a warning and
listed in ``Batch.notes``. A chat record cut before its first assistant token has nothing to train
on and is skipped by ``sequences()``.

Malformed input raises :class:`DataError` (a ``ValueError``) naming the file and line.
"""
from __future__ import annotations

import importlib.resources
import json
import os
import random
import warnings
from pathlib import Path
from typing import Iterable, Iterator, Union

import numpy as np

from .chat_template import ChatTemplate, find_chat_template, register_template, template_for

__all__ = ["Sequence", "Batch", "DataError", "load_tokenizer", "encode_chat", "render_chat", "encode_text",
           "ChatTemplate", "find_chat_template",
           "default_dataset", "default_text_dataset", "default_tokenizer", "default_assets_dir",
           "default_batches", "train_eval_split", "CHAT_ROLES", "PAD_TOKEN", "BOS_TOKEN", "EOS_TOKEN",
           "IM_START", "IM_END", "UNK_TOKEN", "DEFAULT_MAX_LEN"]

PAD_TOKEN = "<|pad|>"
BOS_TOKEN = "<|startoftext|>"
EOS_TOKEN = "<|endoftext|>"
IM_START = "<|im_start|>"
IM_END = "<|im_end|>"
UNK_TOKEN = "<unk>"
CHAT_ROLES = ("system", "user", "assistant", "tool")
DEFAULT_MAX_LEN = 128          # every record of the shipped dataset fits

PathLike = Union[str, "os.PathLike[str]"]
Triple = tuple[np.ndarray, np.ndarray, np.ndarray]


class DataError(ValueError):
    """Bad training data. ``path`` and ``line`` (1-based) say where, when it came from a file."""

    def __init__(self, message: str, path: PathLike | None = None, line: int | None = None):
        self.path = None if path is None else str(path)
        self.line = line
        where = f"{self.path}:{line}: " if path is not None and line is not None else \
            (f"{self.path}: " if path is not None else "")
        super().__init__(where + message)


# ---------------------------------------------------------------------------------------------
# sequences and batches
# ---------------------------------------------------------------------------------------------

def _as_ids(values, what: str) -> np.ndarray:
    arr = np.asarray(values)
    if arr.size == 0:
        return np.zeros(0, np.int32)
    if arr.ndim != 1:
        raise ValueError(f"{what} must be 1-D, got shape {list(arr.shape)}")
    if arr.dtype == bool or not np.issubdtype(arr.dtype, np.integer):
        raise ValueError(f"{what} must hold integer token ids, got dtype {arr.dtype}")
    bad = np.flatnonzero((arr < 0) | (arr > np.iinfo(np.int32).max))
    if bad.size:
        raise ValueError(f"{what}[{bad[0]}] = {int(arr[bad[0]])} is not a valid token id (0 .. 2**31-1)")
    return np.ascontiguousarray(arr, dtype=np.int32)


def _as_mask(values, n: int) -> np.ndarray:
    if values is None:
        return np.ones(n, np.float32)
    arr = np.asarray(values)
    if arr.size == 0 and n == 0:
        return np.zeros(0, np.float32)
    if arr.ndim != 1 or arr.size != n:
        raise ValueError(f"loss_mask has shape {list(arr.shape)}; expected [{n}] like target_ids")
    if arr.dtype != bool and not np.issubdtype(arr.dtype, np.number):
        raise ValueError(f"loss_mask must be numeric 0/1, got dtype {arr.dtype}")
    arr = arr.astype(np.float32)
    if not np.all((arr == 0) | (arr == 1)):
        raise ValueError(f"loss_mask must hold only 0 and 1; found {np.unique(arr[(arr != 0) & (arr != 1)])[:5].tolist()}")
    return np.ascontiguousarray(arr)


class Sequence:
    """One training sequence: ``input_ids[t]`` predicts ``target_ids[t]``, counted iff ``loss_mask[t] == 1``.

    ``length`` (default: all positions) is the number of real positions; the rest is right padding,
    which must carry mask 0. ``origin`` says where the sequence came from (e.g. ``"data.jsonl:12"``).
    """

    __slots__ = ("input_ids", "target_ids", "loss_mask", "length", "origin")

    def __init__(self, input_ids, target_ids, loss_mask=None, *, length: int | None = None,
                 origin: str | None = None):
        ids = _as_ids(input_ids, "input_ids")
        targets = _as_ids(target_ids, "target_ids")
        if ids.size != targets.size:
            raise ValueError(f"input_ids has {ids.size} positions but target_ids has {targets.size}")
        mask = _as_mask(loss_mask, ids.size)
        if length is None:
            length = ids.size
        if isinstance(length, bool) or not isinstance(length, (int, np.integer)) or not 0 <= length <= ids.size:
            raise ValueError(f"length must be an integer in 0..{ids.size}, got {length!r}")
        if mask[int(length):].any():
            raise ValueError(f"padding positions (from {int(length)} on) must have loss_mask 0")
        self.input_ids, self.target_ids, self.loss_mask = ids, targets, mask
        self.length = int(length)
        self.origin = origin

    @property
    def padded_length(self) -> int:
        return int(self.input_ids.size)

    @property
    def num_supervised(self) -> int:
        """How many targets the loss counts."""
        return int(self.loss_mask.sum())

    @property
    def is_empty(self) -> bool:
        """No supervised target (this includes a sequence of length 0): nothing to train on."""
        return self.num_supervised == 0

    def unpadded(self) -> "Sequence":
        n = self.length
        return Sequence(self.input_ids[:n], self.target_ids[:n], self.loss_mask[:n], origin=self.origin)

    def triple(self) -> Triple:
        """``(input_ids, target_ids, loss_mask)`` with the padding stripped."""
        n = self.length
        return self.input_ids[:n], self.target_ids[:n], self.loss_mask[:n]

    def padded(self, to: int, pad_id: int = 0) -> "Sequence":
        """This sequence right-padded to ``to`` positions with ``pad_id`` and mask 0."""
        n = self.length
        if to < n:
            raise ValueError(f"cannot pad a sequence of length {n} to {to}")
        extra = to - n

        def pad(a, value, dtype):
            return np.concatenate([a[:n], np.full(extra, value, dtype)])
        return Sequence(pad(self.input_ids, pad_id, np.int32), pad(self.target_ids, pad_id, np.int32),
                        pad(self.loss_mask, 0, np.float32), length=n, origin=self.origin)

    def __len__(self) -> int:
        return self.length

    def __eq__(self, other) -> bool:
        if not isinstance(other, Sequence):
            return NotImplemented
        a, b = self.triple(), other.triple()
        return all(np.array_equal(x, y) for x, y in zip(a, b))

    __hash__ = None

    def __repr__(self) -> str:
        pad = f", padded to {self.padded_length}" if self.padded_length != self.length else ""
        src = f", from {self.origin}" if self.origin else ""
        return f"Sequence(length={self.length}{pad}, supervised={self.num_supervised}{src})"


class Batch:
    """A list of :class:`Sequence` (``batch.items``) and the ``pad_id`` used when padding them.

    ``len(batch)``, ``batch[i]`` (a Sequence), ``batch[i:j]`` (a Batch) and iteration (Sequences)
    work as on a list. ``batch.sequences()`` yields the unpadded training triples.
    ``batch.notes`` lists what loading did beyond the obvious (truncations, skipped records).
    """

    def __init__(self, sequences: Iterable[Sequence] = (), *, pad_id: int = 0, notes: Iterable[str] = ()):
        self.items: list[Sequence] = list(sequences)
        for i, s in enumerate(self.items):
            if not isinstance(s, Sequence):
                raise TypeError(f"Batch item {i} is a {type(s).__name__}, not a Sequence")
        if isinstance(pad_id, bool) or not isinstance(pad_id, (int, np.integer)) or pad_id < 0:
            raise ValueError(f"pad_id must be a non-negative integer, got {pad_id!r}")
        self.pad_id = int(pad_id)
        self.notes: list[str] = list(notes)

    # ---- constructors ----
    @classmethod
    def from_token_lists(cls, token_lists: Iterable[Iterable[int]], *, max_len: int | None = None,
                         pad_id: int = 0) -> "Batch":
        """Next-token sequences: ``input = toks[:-1]``, ``target = toks[1:]``, every target supervised.

        A list of fewer than 2 tokens gives an empty sequence (kept, skipped by ``sequences()``).
        ``max_len`` keeps the first ``max_len + 1`` tokens of a longer list.
        """
        _check_max_len(max_len)
        seqs, cut = [], 0
        for i, toks in enumerate(token_lists):
            arr = _as_ids(list(toks) if not isinstance(toks, np.ndarray) else toks, f"token list {i}")
            if max_len is not None and arr.size > max_len + 1:
                arr, cut = arr[:max_len + 1], cut + 1
            seqs.append(Sequence(arr[:-1], arr[1:], origin=f"token list {i}") if arr.size
                        else Sequence([], [], origin=f"token list {i}"))
        notes = [f"{cut} token list(s) longer than max_len={max_len} were cut to {max_len} positions"] if cut else []
        return cls(seqs, pad_id=pad_id, notes=notes)

    @classmethod
    def from_padded(cls, input_ids, target_ids, loss_mask=None, lengths=None, *, pad_id: int = 0) -> "Batch":
        """From right-padded 2-D arrays ``[B, L]``. Without ``lengths``, each row's length is one past
        its last supervised target (trailing masked positions are padding or change nothing)."""
        ids, tg = np.asarray(input_ids), np.asarray(target_ids)
        if ids.ndim != 2 or ids.shape != tg.shape:
            raise ValueError(f"input_ids {list(ids.shape)} and target_ids {list(tg.shape)} must be equal 2-D shapes")
        mask = np.ones(ids.shape, np.float32) if loss_mask is None else np.asarray(loss_mask)
        if mask.shape != ids.shape:
            raise ValueError(f"loss_mask has shape {list(mask.shape)}; expected {list(ids.shape)}")
        if lengths is None:
            lengths = [int(np.flatnonzero(row)[-1]) + 1 if np.any(row) else 0 for row in mask]
        elif len(lengths) != ids.shape[0]:
            raise ValueError(f"{len(lengths)} lengths for {ids.shape[0]} rows")
        seqs = [Sequence(ids[b], tg[b], mask[b], length=int(lengths[b]), origin=f"row {b}")
                for b in range(ids.shape[0])]
        return cls(seqs, pad_id=pad_id)

    @classmethod
    def from_jsonl(cls, path: PathLike, tokenizer, max_len: int | None = None, kind: str = "auto", *,
                   chat_template: "ChatTemplate | str | None" = None) -> "Batch":
        """Read ``{"text": ...}`` or chat ``{"messages": [...]}`` records (see the module docstring).

        ``tokenizer`` is a ``tokenizers.Tokenizer`` or a path accepted by :func:`load_tokenizer`.
        ``kind``: ``"auto"`` (each record by its key), ``"text"`` or ``"chat"`` (every record must be
        of that kind). ``chat_template`` (a :class:`ChatTemplate` or Jinja text) overrides the
        tokenizer's. Raises DataError naming the file and line for malformed records.
        """
        if kind not in ("auto", "text", "chat"):
            raise ValueError(f"kind must be 'auto', 'text' or 'chat', got {kind!r}")
        _check_max_len(max_len)
        tok = tokenizer if not isinstance(tokenizer, (str, os.PathLike)) else load_tokenizer(tokenizer)
        path = Path(path)
        if not path.is_file():
            raise FileNotFoundError(f"no such data file: {path}")
        pad_id = tok.token_to_id(PAD_TOKEN)
        template = _chat_template(chat_template, tok)
        seqs: list[Sequence] = []
        cut_lines: list[int] = []
        lost_lines: list[int] = []
        for lineno, record in jsonl_records(path):
            rkind = _record_kind(record, kind, path, lineno)
            if rkind == "text":
                ids, sup = _text_tokens(record["text"], tok, path, lineno)
            else:
                ids, sup = _chat_tokens(record, tok, template, path, lineno)
            seq, was_cut = _to_sequence(ids, sup, max_len, origin=f"{path}:{lineno}")
            if was_cut:
                cut_lines.append(lineno)
                if rkind == "chat" and seq.is_empty:
                    lost_lines.append(lineno)
            seqs.append(seq)
        if not seqs:
            raise DataError("no records (the file is empty)", path)
        notes = []
        if cut_lines:
            notes.append(f"{path}: {len(cut_lines)} of {len(seqs)} record{'s' if len(seqs) != 1 else ''} were longer than max_len={max_len} "
                         f"positions and were truncated to their first {max_len + 1} tokens "
                         f"(lines {_lines(cut_lines)})")
        if lost_lines:
            notes.append(f"{path}: {len(lost_lines)} truncated chat record{'s' if len(lost_lines) != 1 else ''} lost every assistant token (lines "
                         f"{_lines(lost_lines)}): a loss on the assistant tokens only has nothing to learn from "
                         "them (Batch.sequences() skips them); raise max_len to keep their answers")
        for note in notes:
            warnings.warn(note, stacklevel=2)
        return cls(seqs, pad_id=0 if pad_id is None else pad_id, notes=notes)

    # ---- access ----
    def __len__(self) -> int:
        return len(self.items)

    def __getitem__(self, index):
        if isinstance(index, slice):
            return Batch(self.items[index], pad_id=self.pad_id)
        return self.items[index]

    def __iter__(self) -> Iterator[Sequence]:
        return iter(self.items)

    def __repr__(self) -> str:
        return f"Batch({len(self)} sequences, {self.num_tokens} positions, {self.num_supervised} supervised)"

    @property
    def num_tokens(self) -> int:
        """Real (unpadded) positions over all sequences."""
        return sum(s.length for s in self.items)

    @property
    def num_supervised(self) -> int:
        return sum(s.num_supervised for s in self.items)

    @property
    def max_length(self) -> int:
        return max((s.length for s in self.items), default=0)

    def sequences(self) -> Iterator[Triple]:
        """``(input_ids, target_ids, loss_mask)`` per sequence, padding stripped; sequences with no
        supervised target (including length 0) are skipped. Arrays are int32, int32, float32."""
        for s in self.items:
            if not s.is_empty:
                yield s.triple()

    unpadded = sequences

    # ---- padding ----
    def _pad_length(self, length: int | None, multiple_of: int) -> int:
        if multiple_of < 1:
            raise ValueError(f"multiple_of must be >= 1, got {multiple_of}")
        need = self.max_length
        if length is None:
            length = need
        elif length < need:
            raise ValueError(f"cannot pad to {length}: the longest sequence has {need} positions")
        return -(-length // multiple_of) * multiple_of

    def pad_to(self, length: int | None = None, *, multiple_of: int = 1) -> "Batch":
        """Every sequence right-padded (``pad_id``, mask 0) to ``length`` (default: the longest),
        rounded up to a multiple of ``multiple_of``."""
        n = self._pad_length(length, multiple_of)
        return Batch([s.padded(n, self.pad_id) for s in self.items], pad_id=self.pad_id, notes=self.notes)

    def padded_arrays(self, length: int | None = None, *, multiple_of: int = 1):
        """``(input_ids [B, L], target_ids [B, L], loss_mask [B, L], lengths [B])`` numpy arrays."""
        n = self._pad_length(length, multiple_of)
        rows = [s.padded(n, self.pad_id) for s in self.items]
        if not rows:
            return (np.zeros((0, n), np.int32), np.zeros((0, n), np.int32), np.zeros((0, n), np.float32),
                    np.zeros(0, np.int32))
        return (np.stack([s.input_ids for s in rows]), np.stack([s.target_ids for s in rows]),
                np.stack([s.loss_mask for s in rows]), np.array([s.length for s in rows], np.int32))

    # ---- ordering and splitting ----
    def shuffled(self, seed: int = 0) -> "Batch":
        """The same sequences in a deterministic pseudo-random order (Python's ``random.Random(seed)``)."""
        order = list(range(len(self)))
        random.Random(seed).shuffle(order)
        return Batch([self.items[i] for i in order], pad_id=self.pad_id, notes=self.notes)

    def split(self, eval_fraction: float = 0.05, seed: int = 0) -> tuple["Batch", "Batch"]:
        """Deterministic ``(train, eval)`` split: ``round(len * eval_fraction)`` sequences (at least
        one) chosen with ``random.Random(seed)`` go to eval; both keep the original order."""
        if not 0 < eval_fraction < 1:
            raise ValueError(f"eval_fraction must be in (0, 1), got {eval_fraction}")
        n = len(self)
        n_eval = max(1, round(n * eval_fraction))
        if n_eval >= n:
            raise ValueError(f"cannot split {n} sequence(s) into non-empty train and eval sets "
                             f"with eval_fraction={eval_fraction}")
        order = list(range(n))
        random.Random(seed).shuffle(order)
        held = set(order[:n_eval])
        train = [s for i, s in enumerate(self.items) if i not in held]
        evals = [s for i, s in enumerate(self.items) if i in held]
        return Batch(train, pad_id=self.pad_id, notes=self.notes), Batch(evals, pad_id=self.pad_id, notes=self.notes)


def train_eval_split(batch: Batch, eval_fraction: float = 0.05, seed: int = 0) -> tuple[Batch, Batch]:
    """``batch.split(eval_fraction, seed)``."""
    return batch.split(eval_fraction, seed)


# ---------------------------------------------------------------------------------------------
# tokenizers and the chat template
# ---------------------------------------------------------------------------------------------

def load_tokenizer(path_or_dir: PathLike):
    """A ``tokenizers.Tokenizer`` from a ``tokenizer.json`` file, or from a directory holding one
    (as Hugging Face checkpoints do). The chat template beside it (``chat_template.jinja`` or
    ``tokenizer_config.json``'s) is remembered as the tokenizer's, for :func:`encode_chat` and
    :meth:`Batch.from_jsonl`."""
    from tokenizers import Tokenizer
    p = Path(path_or_dir)
    if p.is_dir():
        p = p / "tokenizer.json"
        if not p.is_file():
            raise FileNotFoundError(f"{path_or_dir}: directory has no tokenizer.json")
    elif not p.is_file():
        raise FileNotFoundError(f"no such tokenizer file or directory: {path_or_dir}")
    try:
        tok = Tokenizer.from_file(str(p))
    except Exception as e:  # the library raises a bare Exception for unreadable JSON
        raise ValueError(f"{p}: not a valid tokenizer.json ({e})") from e
    template = find_chat_template(p)
    if template is not None:
        register_template(tok, template)
    return tok


def _chat_template(chat_template, tokenizer) -> ChatTemplate:
    """``chat_template`` (a ChatTemplate, or Jinja text seeing the built-in template's special tokens),
    else the tokenizer's own (see :func:`load_tokenizer`), else the built-in one."""
    if isinstance(chat_template, ChatTemplate):
        return chat_template
    if isinstance(chat_template, str):
        specials = ChatTemplate.builtin(tokenizer).special_tokens
        return ChatTemplate(chat_template, special_tokens=specials, source="the given chat template")
    if chat_template is not None:
        raise TypeError(f"chat_template must be a ChatTemplate or Jinja text, got {type(chat_template).__name__}")
    return ChatTemplate.builtin() if tokenizer is None else template_for(tokenizer)


def render_chat(messages: list[dict], add_generation_prompt: bool = False, bos: bool = True, *,
                tools: list | None = None, tokenizer=None, chat_template=None) -> str:
    """A conversation as text through the chat template: ``chat_template``, else ``tokenizer``'s,
    else the built-in LFM2 one (``<|startoftext|>`` then, per message,
    ``<|im_start|>{role}\\n{content}<|im_end|>\\n``; see ``trainer/chat_template.py``). With
    ``add_generation_prompt`` it ends with ``<|im_start|>assistant\\n`` for the model to continue;
    ``bos=False`` renders an empty ``bos_token``."""
    template = _chat_template(chat_template, tokenizer)
    extra = {} if bos else {"bos_token": ""}
    return template.render(messages, tools=tools, add_generation_prompt=add_generation_prompt, **extra)


def _require_tokens(tok, names: Iterable[str], why: str) -> None:
    missing = [t for t in names if tok.token_to_id(t) is None]
    if missing:
        raise ValueError(f"the tokenizer has no {', '.join(missing)} token(s), which {why} needs; "
                         "add them as special tokens")


def encode_chat(messages: list[dict], tokenizer, add_generation_prompt: bool = False, *,
                tools: list | None = None, chat_template=None):
    """Token ids of a conversation and a per-token flag (float32, 1 = an assistant token the loss
    supervises), through ``chat_template`` or the tokenizer's (as :func:`render_chat`). With
    ``add_generation_prompt``, the ids end with the assistant header, ready for generation."""
    template = _chat_template(chat_template, tokenizer)
    if template.is_builtin:
        _require_tokens(tokenizer, (IM_START, IM_END), "the chat template")
    _check_messages(messages, None, None)
    _check_tools(tools, None, None)
    text, spans = template.render_spans(messages, tools=tools, add_generation_prompt=add_generation_prompt)
    ids: list[int] = []
    sup: list[float] = []
    cuts = [0] + [x for span in spans for x in span] + [len(text)]
    for k in range(len(cuts) - 1):
        piece = text[cuts[k]:cuts[k + 1]]
        if piece:
            piece_ids = tokenizer.encode(piece, add_special_tokens=False).ids
            ids.extend(piece_ids)
            sup.extend([float(k % 2)] * len(piece_ids))    # odd pieces are the spans
    return np.array(ids, np.int32), np.array(sup, np.float32)


def encode_text(text: str, tokenizer):
    """``<|startoftext|>`` + text + ``<|endoftext|>`` (each special token only if the tokenizer has it)."""
    bos, eos = tokenizer.token_to_id(BOS_TOKEN), tokenizer.token_to_id(EOS_TOKEN)
    _check_unicode(text, "text", None, None)
    ids = ([bos] if bos is not None else []) + tokenizer.encode(text, add_special_tokens=False).ids \
        + ([eos] if eos is not None else [])
    return np.array(ids, np.int32)


# ---------------------------------------------------------------------------------------------
# JSONL parsing
# ---------------------------------------------------------------------------------------------

def _check_max_len(max_len) -> None:
    if max_len is not None and (isinstance(max_len, bool) or not isinstance(max_len, (int, np.integer))
                                or max_len < 1):
        raise ValueError(f"max_len must be a positive integer or None, got {max_len!r}")


def _lines(lines: list[int], show: int = 8) -> str:
    head = ", ".join(map(str, lines[:show]))
    return head + (f", ... ({len(lines) - show} more)" if len(lines) > show else "")


MAX_JSON_DEPTH = 64          # nesting levels of a record's values (deeper: a DataError, not a RecursionError)


def jsonl_records(path: Path):
    """(line number, JSON object) of each non-blank line, decoded line by line so that a bad byte or a
    bad line is a DataError naming the file and line."""
    with open(path, "rb") as f:
        for lineno, raw in enumerate(f, 1):
            line = _decode_line(raw, path, lineno)
            if line.strip():
                yield lineno, _parse_line(line, path, lineno)


def _decode_line(raw: bytes, path: Path, lineno: int) -> str:
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise DataError(f"not UTF-8 text: {e.reason} at byte {e.start + 1} of the line "
                        f"({raw[e.start:e.start + 4]!r})", path, lineno) from None


def _parse_line(line: str, path: Path, lineno: int) -> dict:
    # Without its line break, so an error at the end of the line is at its last column + 1 (json
    # would count the break as the start of a second line and say column 1).
    line = line[:-1] if line.endswith("\n") else line
    line = line[:-1] if line.endswith("\r") else line
    try:
        record = json.loads(line)
    except json.JSONDecodeError as e:
        raise DataError(f"malformed JSON: {e.msg} at column {e.pos + 1}", path, lineno) from None
    except RecursionError:
        raise DataError(f"malformed JSON: nested too deeply to parse (records may nest at most "
                        f"{MAX_JSON_DEPTH} levels)", path, lineno) from None
    if not isinstance(record, dict):
        raise DataError(f"expected a JSON object, got {type(record).__name__}", path, lineno)
    return record


def _record_kind(record: dict, kind: str, path: Path, lineno: int) -> str:
    if kind == "text" and "text" not in record:
        raise DataError(f"text record has no 'text' key (keys: {sorted(record)})", path, lineno)
    if kind == "chat" and "messages" not in record:
        raise DataError(f"chat record has no 'messages' key (keys: {sorted(record)})", path, lineno)
    if kind != "auto":
        return kind
    has_text, has_msgs = "text" in record, "messages" in record
    if has_text and has_msgs:
        raise DataError("record has both 'text' and 'messages'; pass kind='text' or kind='chat'", path, lineno)
    if not (has_text or has_msgs):
        raise DataError(f"record has neither 'text' nor 'messages' (keys: {sorted(record)})", path, lineno)
    return "text" if has_text else "chat"


def _check_unicode(text: str, where: str, path, lineno) -> None:
    """A lone surrogate (JSON's "\\ud800" without its pair) is not text a tokenizer can take."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        raise DataError(f"{where} holds a lone surrogate {text[e.start]!r} at character {e.start} "
                        "(an unpaired \\uD800-\\uDFFF escape is not valid Unicode text)", path, lineno) from None


def _check_json_value(value, where: str, path, lineno) -> None:
    """Every string (keys included) of ``value`` is valid Unicode and it nests at most
    MAX_JSON_DEPTH levels; walked without recursion."""
    stack = [(value, where, 1)]
    while stack:
        v, at, depth = stack.pop()
        if isinstance(v, str):
            _check_unicode(v, at, path, lineno)
            continue
        if not isinstance(v, (dict, list)):
            continue
        if depth > MAX_JSON_DEPTH:
            raise DataError(f"{at} nests more than {MAX_JSON_DEPTH} levels deep", path, lineno)
        if isinstance(v, dict):
            for k, x in v.items():
                if isinstance(k, str):
                    _check_unicode(k, f"a key of {at}", path, lineno)
                stack.append((x, f"{at}.{k}" if isinstance(k, str) and k.isidentifier() else f"{at}[{k!r}]",
                              depth + 1))
        else:
            stack.extend((x, f"{at}[{i}]", depth + 1) for i, x in enumerate(v))


def _text_tokens(text, tok, path: Path, lineno: int):
    if not isinstance(text, str):
        raise DataError(f"'text' must be a string, got {type(text).__name__}", path, lineno)
    if not text:
        raise DataError("'text' is empty", path, lineno)
    _check_unicode(text, "'text'", path, lineno)
    ids = encode_text(text, tok)
    return ids, np.ones(ids.size, np.float32)


def _check_message(m, i: int, path, lineno) -> None:
    if not isinstance(m, dict):
        raise DataError(f"messages[{i}] must be an object with 'role' and 'content', got {type(m).__name__}",
                        path, lineno)
    if "role" not in m:
        raise DataError(f"messages[{i}] has no 'role' key", path, lineno)
    role = m["role"]
    if role not in CHAT_ROLES:
        raise DataError(f"messages[{i}] has unknown role {role!r}; expected one of {', '.join(CHAT_ROLES)}",
                        path, lineno)
    calls = m.get("tool_calls")
    if calls is not None:
        if role != "assistant":
            raise DataError(f"messages[{i}] ({role}) has 'tool_calls'; only assistant messages make tool calls",
                            path, lineno)
        _check_tool_calls(calls, i, path, lineno)
    content = m.get("content")
    if content is None and role == "assistant" and calls:
        return                      # a tool call with no text
    if "content" not in m:
        raise DataError(f"messages[{i}] ({role}) has no 'content' key" +
                        (" (an assistant message may leave it out only with 'tool_calls')"
                         if role == "assistant" else ""), path, lineno)
    if not isinstance(content, str):
        got = "null" if content is None else type(content).__name__
        raise DataError(f"messages[{i}] ({role}) content must be a string, got {got}" +
                        (" (null is allowed only with 'tool_calls')" if role == "assistant" else ""),
                        path, lineno)


def _check_tool_calls(calls, i: int, path, lineno) -> None:
    if not isinstance(calls, list):
        raise DataError(f"messages[{i}] 'tool_calls' must be a list, got {type(calls).__name__}", path, lineno)
    for j, call in enumerate(calls):
        where = f"messages[{i}].tool_calls[{j}]"
        function = call.get("function", call) if isinstance(call, dict) else None
        if not isinstance(function, dict) or not isinstance(function.get("name"), str):
            raise DataError(f"{where} must be {{\"type\": \"function\", \"function\": {{\"name\": ..., "
                            f"\"arguments\": {{...}}}}}}, got {json.dumps(call)[:80]}", path, lineno)
        args = function.get("arguments")
        if args is not None and not isinstance(args, (dict, str)):
            raise DataError(f"{where} arguments must be an object, got {type(args).__name__}", path, lineno)


def _check_messages(messages, path, lineno) -> None:
    if not isinstance(messages, list):
        raise DataError(f"'messages' must be a list, got {type(messages).__name__}", path, lineno)
    _check_json_value(messages, "messages", path, lineno)
    for i, m in enumerate(messages):
        _check_message(m, i, path, lineno)


def _check_tools(tools, path, lineno) -> None:
    if tools is None:
        return
    _check_json_value(tools, "tools", path, lineno)
    if not isinstance(tools, list) or not all(isinstance(t, (dict, str)) for t in tools):
        raise DataError("'tools' must be a list of tool schemas (JSON objects), got " + json.dumps(tools)[:80],
                        path, lineno)


def _chat_tokens(record: dict, tok, template: ChatTemplate, path: Path, lineno: int):
    messages, tools = record["messages"], record.get("tools")
    _check_messages(messages, path, lineno)
    if not messages:
        raise DataError("empty conversation: 'messages' is []", path, lineno)
    if not any(m["role"] == "assistant" for m in messages):
        raise DataError("conversation has no assistant message, so nothing to train on", path, lineno)
    _check_tools(tools, path, lineno)
    try:
        ids, sup = encode_chat(messages, tok, tools=tools, chat_template=template)
    except ValueError as e:          # ChatTemplateError, a missing special token
        raise DataError(str(e), path, lineno) from None
    # Drop trailing tokens that are never a supervised target (causal: they change nothing).
    keep = int(np.flatnonzero(sup)[-1]) + 1 if sup.any() else ids.size
    return ids[:keep], sup[:keep]


def _to_sequence(ids: np.ndarray, sup: np.ndarray, max_len: int | None, origin: str) -> tuple[Sequence, bool]:
    cut = max_len is not None and ids.size > max_len + 1
    if cut:
        ids, sup = ids[:max_len + 1], sup[:max_len + 1]
    if ids.size < 2:
        return Sequence([], [], origin=origin), cut
    return Sequence(ids[:-1], ids[1:], sup[1:], origin=origin), cut


# ---------------------------------------------------------------------------------------------
# the shipped dataset and tokenizer (generated by ``python scripts/make_assets.py``)
# ---------------------------------------------------------------------------------------------

def default_assets_dir() -> Path:
    """The package's ``assets`` directory (``importlib.resources``; a real directory on disk)."""
    package = __package__ or "trainer"
    try:
        res = importlib.resources.files(package) / "assets"
    except (ModuleNotFoundError, TypeError):
        res = None
    if isinstance(res, Path) and res.is_dir():
        return res
    here = Path(__file__).resolve().parent / "assets"
    if here.is_dir():
        return here
    raise FileNotFoundError(f"the trainer's assets directory is missing (looked in {res} and {here}); "
                            "regenerate it with `python scripts/make_assets.py`")


def default_dataset() -> Path:
    """The shipped synthetic chat dataset (``chat.jsonl``), see ``trainer/assets/README.md``."""
    return default_assets_dir() / "chat.jsonl"


def default_text_dataset() -> Path:
    """The shipped small ``{"text": ...}`` sample (``text.jsonl``)."""
    return default_assets_dir() / "text.jsonl"


def default_tokenizer() -> Path:
    """The shipped character-level ``tokenizer.json`` (``<|pad|>`` is id 0)."""
    return default_assets_dir() / "tokenizer.json"


def default_batches(max_len: int = DEFAULT_MAX_LEN, eval_fraction: float = 0.05, seed: int = 0,
                    tokenizer=None) -> tuple[Batch, Batch]:
    """``(train, eval)`` Batches of the shipped chat dataset, tokenized with the shipped tokenizer
    (or ``tokenizer``), split deterministically by :meth:`Batch.split`."""
    tok = load_tokenizer(default_tokenizer()) if tokenizer is None else tokenizer
    return Batch.from_jsonl(default_dataset(), tok, max_len=max_len, kind="chat").split(eval_fraction, seed)
