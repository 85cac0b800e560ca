"""Generate the data files shipped in ``trainer/assets/`` (deterministically: same bytes every run).

    python scripts/make_assets.py              # rewrite trainer/assets/
    python scripts/make_assets.py --out DIR    # write somewhere else
    python scripts/make_assets.py --check      # exit 1 if trainer/assets/ differs from a fresh run

Files:

- ``chat.jsonl``: the built-in dataset of ``python -m trainer``: short synthetic chat questions that
  the tiny demo LFM2 learns in its 2500 steps: capitals, opposites, the length of a word, the
  letter or number after one, the day or month after one. Each task has several phrasings; most
  records start with a short system message (a draw retries phrasings and system prompts until it
  finds a record not drawn before, and a task's plain records run out first) and a few have two
  user/assistant turns. Each record is
  ``{"task": ..., "messages": [...]}``; every record is distinct. A one-turn record is at most
  ONE_TURN_POSITIONS (64) positions long, so a default step (4 sequences packed, length bucket 64)
  is 4 x 64 rows; a two-turn one at most DEFAULT_MAX_LEN (128). String manipulation and arithmetic
  (reverse, uppercase, first/last letter, one-digit sums, counting) are left out: that model does
  not learn them in its short run, and even a 7% share of them (first/last letter) slowed the
  other tasks enough to cost about 20 points of held-out exact match (measured with PyTorch).
- ``text.jsonl``: a small ``{"text": ...}`` sample (short factual sentences about the same tables).
- ``tokenizer.json``: a character-level tokenizer (a ``tokenizers`` BPE model with no merges) over
  printable ASCII and newline, plus the special tokens ``<|pad|>`` (id 0, the model's padding_idx),
  ``<|startoftext|>``, ``<|endoftext|>``, ``<|im_start|>``, ``<|im_end|>`` and ``<unk>``. One
  character a token keeps the vocabulary tiny and every string spellable.
- ``tokenizer_config.json``: the same special tokens and the built-in LFM2 chat template
  (``trainer.chat_template.BUILTIN_TEMPLATE``), so that the assets directory also loads with
  ``transformers.AutoTokenizer`` (``apply_chat_template`` gives the ids that
  ``trainer.data.encode_chat`` gives).
- ``README.md``: what is in the directory and how it was made.

Nothing here uses the network; the only randomness is ``random.Random(SEED)``.
"""
from __future__ import annotations

import argparse
import filecmp
import json
import random
import sys
import tempfile
from pathlib import Path

from trainer.chat_template import BUILTIN_TEMPLATE
from trainer.data import DEFAULT_MAX_LEN, BOS_TOKEN, EOS_TOKEN, IM_END, IM_START, PAD_TOKEN, UNK_TOKEN

SEED = 20240531
NUM_CHAT = 3000
TWO_TURNS = 0.02               # fraction of draws that are two-turn conversations
WITH_SYSTEM = 0.2              # fraction of draws that start with a system message
ONE_TURN_POSITIONS = 64        # a one-turn record fits one length bucket of the demo run (two-turn: DEFAULT_MAX_LEN)
ATTEMPTS = 50                  # draws of a chosen task (new phrasing, system prompt, ...) before giving it up
NUM_TEXT = 300
SPECIAL_TOKENS = [PAD_TOKEN, BOS_TOKEN, EOS_TOKEN, IM_START, IM_END, UNK_TOKEN]   # ids 0..5, in this order
ALPHABET = ["\n"] + [chr(c) for c in range(0x20, 0x7F)]                        # newline + printable ASCII
ASSET_FILES = ["chat.jsonl", "text.jsonl", "tokenizer.json", "tokenizer_config.json", "README.md"]

CHAT_TEMPLATE = BUILTIN_TEMPLATE     # written to tokenizer_config.json; trainer/chat_template.py says what it renders

WORDS = """
ant ape arm art axe bag bat bed bee big bin box boy bug bus cab cap car cat cow cup dog dot ear egg
elf elk fan fig fin fox fun gem hat hen hill hop hut ice ink jam jar jet kit lab leg lid log map mat
mix mud net nut oak owl pan pen pet pig pin pot rat red rod rug run sea sun tan tea tin toe top toy
van web wig yak zip able acid aunt baby band bark bell bird boat bone book cake calm card coat cold
corn crab deer desk dish door drum duck dust farm fish flag frog gate gift goat gold hand harp herb
home horn jade kite lake lamp leaf lion milk mint moon moth nest note pear pink plum pond rain ring
road rock roof rose salt sand seed ship shoe silk snow sock soup star swan tent tide tree wave wind
wolf wood yarn apple beach bread brick cloud crown grape horse house lemon mango melon mouse olive
onion pearl piano plant queen river robot shell smile snake stone storm sugar table tiger toast
train water whale
""".split()

CAPITALS = [("France", "Paris"), ("Spain", "Madrid"), ("Italy", "Rome"), ("Germany", "Berlin"),
            ("Japan", "Tokyo"), ("China", "Beijing"), ("India", "Delhi"), ("Egypt", "Cairo"),
            ("Kenya", "Nairobi"), ("Peru", "Lima"), ("Chile", "Santiago"), ("Cuba", "Havana"),
            ("Greece", "Athens"), ("Norway", "Oslo"), ("Sweden", "Stockholm"), ("Poland", "Warsaw"),
            ("Russia", "Moscow"), ("Canada", "Ottawa"), ("Mexico", "Mexico City"), ("Brazil", "Brasilia"),
            ("Ireland", "Dublin"), ("Portugal", "Lisbon"), ("Austria", "Vienna"), ("Turkey", "Ankara")]

OPPOSITES = [("hot", "cold"), ("big", "small"), ("up", "down"), ("fast", "slow"), ("happy", "sad"),
             ("light", "dark"), ("open", "closed"), ("old", "new"), ("early", "late"), ("full", "empty"),
             ("hard", "soft"), ("high", "low"), ("in", "out"), ("left", "right"), ("long", "short"),
             ("loud", "quiet"), ("rich", "poor"), ("wet", "dry"), ("win", "lose"), ("yes", "no"),
             ("day", "night"), ("near", "far"), ("push", "pull"), ("strong", "weak")]

DAYS = ["Monday", "Tuesday", "Wednesday", "Thursday", "Friday", "Saturday", "Sunday"]
MONTHS = ["January", "February", "March", "April", "May", "June", "July", "August", "September", "October",
          "November", "December"]

SYSTEM_PROMPTS = ["Be brief.", "Answer exactly.", "Be concise.", "Reply briefly.", "Answer.",
                  "You are a helpful assistant."]


# ---- tasks: each returns (user content, assistant content) ----
def _word(rng, lo=3, hi=5):
    return rng.choice([w for w in WORDS if lo <= len(w) <= hi])


def task_capital(rng):
    country, city = rng.choice(CAPITALS)
    return rng.choice([f"capital of {country}", f"What is the capital of {country}?", f"Capital of {country}?",
                       f"{country}'s capital?", f"capital city of {country}", f"Name the capital of {country}."]), city


def task_opposite(rng):
    a, b = rng.choice(OPPOSITES)
    if rng.random() < 0.5:
        a, b = b, a
    return rng.choice([f"opposite of {a}", f"What is the opposite of {a}?", f"Opposite of {a}?", f"antonym of {a}",
                       f"the opposite of {a}", f"Name the opposite of {a}."]), b


def task_length(rng):
    w = _word(rng, 2, 5)
    return rng.choice([f"length of {w}", f"How many letters are in {w}?"]), str(len(w))


def task_next(rng):
    if rng.random() < 0.5:
        c = chr(ord("a") + rng.randrange(25))
        return rng.choice([f"letter after {c}", f"Which letter comes after {c}?"]), chr(ord(c) + 1)
    n = rng.randrange(99)
    return rng.choice([f"number after {n}", f"What comes after {n}?"]), str(n + 1)


def task_calendar(rng):
    kind, names = ("day", DAYS) if rng.random() < 0.4 else ("month", MONTHS)
    i = rng.randrange(len(names))
    d = names[i]
    return rng.choice([f"{kind} after {d}", f"Which {kind} comes after {d}?", f"What {kind} follows {d}?",
                       f"the {kind} after {d}"]), names[(i + 1) % len(names)]


TASKS = {                      # name: (generator, relative weight)
    "capital": (task_capital, 2), "opposite": (task_opposite, 2), "length": (task_length, 2),
    "next": (task_next, 2), "calendar": (task_calendar, 0.5),
}


def positions(messages: list[dict], tok) -> int:
    """Positions (input/target pairs) of a conversation as the trainer trains on it: its tokens up to
    the last supervised one, less one."""
    from trainer.data import encode_chat
    ids, sup = encode_chat(messages, tok)
    return int(sup.nonzero()[0][-1])


def make_chat(rng: random.Random, tok, n: int = NUM_CHAT) -> list[dict]:
    """``n`` distinct records: one-turn ones at most ONE_TURN_POSITIONS positions long, two-turn ones
    at most DEFAULT_MAX_LEN (so none is ever truncated). Each draw picks its tasks by weight, then
    tries up to ATTEMPTS phrasings (and system prompts) of them for a record not drawn before, so a
    task keeps its share until most of its records are taken."""
    names = list(TASKS)
    weights = [TASKS[t][1] for t in names]
    seen: set[str] = set()
    records: list[dict] = []
    draws = 0
    while len(records) < n:
        draws += 1
        if draws > 10 * n:
            raise RuntimeError(f"could not draw {n} distinct records")
        turns = 2 if rng.random() < TWO_TURNS else 1
        tasks = [rng.choices(names, weights)[0] for _ in range(turns)]
        limit = ONE_TURN_POSITIONS if turns == 1 else DEFAULT_MAX_LEN
        for _ in range(ATTEMPTS):
            messages = []
            if rng.random() < WITH_SYSTEM:
                messages.append({"role": "system", "content": rng.choice(SYSTEM_PROMPTS)})
            for t in tasks:
                q, a = TASKS[t][0](rng)
                messages += [{"role": "user", "content": q}, {"role": "assistant", "content": a}]
            key = json.dumps(messages)
            if key not in seen and positions(messages, tok) <= limit:
                seen.add(key)
                records.append({"task": "+".join(tasks), "messages": messages})
                break
    return records


def _sentence(rng: random.Random) -> str:
    kind = rng.randrange(6)
    if kind == 0:
        country, city = rng.choice(CAPITALS)
        return f"The capital of {country} is {city}."
    if kind == 1:
        a, b = rng.choice(OPPOSITES)
        return f"The opposite of {a} is {b}."
    if kind == 2:
        a, b = rng.randrange(10), rng.randrange(10)
        return f"{a} plus {b} is {a + b}."
    if kind == 3:
        w = _word(rng)
        return f"The word {w} backwards is {w[::-1]}."
    if kind == 4:
        w = _word(rng)
        return f"The word {w} has {len(w)} letters and starts with {w[0]}."
    a = rng.randrange(10)
    return f"Counting from {a}: " + ", ".join(str(i) for i in range(a, a + rng.randrange(3, 6))) + "."


def make_text(rng: random.Random, tok, n: int = NUM_TEXT) -> list[dict]:
    """``n`` records of one to three sentences, each at most DEFAULT_MAX_LEN + 1 tokens (never truncated)."""
    from trainer.data import encode_text
    records = []
    while len(records) < n:
        sentences = [_sentence(rng) for _ in range(rng.randrange(1, 4))]
        sep = "\n" if len(records) % 10 == 9 else " "          # a few records span several lines
        text = sep.join(sentences)
        if len(encode_text(text, tok)) <= DEFAULT_MAX_LEN + 1:
            records.append({"text": text})
    return records


def make_tokenizer():
    from tokenizers import AddedToken, Tokenizer, decoders, models
    vocab = {tok: i for i, tok in enumerate(SPECIAL_TOKENS + ALPHABET)}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token=UNK_TOKEN))
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in SPECIAL_TOKENS])
    tok.decoder = decoders.Fuse()
    assert tok.token_to_id(PAD_TOKEN) == 0
    return tok


def tokenizer_config() -> dict:
    return {"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": BOS_TOKEN, "eos_token": IM_END,
            "pad_token": PAD_TOKEN, "unk_token": UNK_TOKEN, "model_max_length": 2048,
            "clean_up_tokenization_spaces": False, "chat_template": CHAT_TEMPLATE}


def _jsonl(records: list[dict]) -> str:
    return "".join(json.dumps(r, ensure_ascii=True) + "\n" for r in records)


def _readme(chat: list[dict], text: list[dict], tok) -> str:
    from trainer.data import encode_chat
    counts: dict[str, int] = {}
    for r in chat:
        counts[r["task"]] = counts.get(r["task"], 0) + 1
    lengths = sorted(len(encode_chat(r["messages"], tok)[0]) for r in chat)
    single = ", ".join(f"{t} {counts.get(t, 0)}" for t in TASKS)
    examples = []
    for t in TASKS:
        r = next(r for r in chat if r["task"] == t and r["messages"][0]["role"] == "user")
        examples.append(f"    {r['messages'][0]['content']!r:40} -> {r['messages'][1]['content']!r}")
    return f"""# trainer/assets

Generated by `python scripts/make_assets.py` (seed {SEED}); do not edit by hand. Regenerating
reproduces these files byte for byte (tests/trainer/test_data.py checks it).

- `chat.jsonl`: {len(chat)} distinct synthetic chat records, the default data of `python -m trainer`.
  Each is `{{"task": ..., "messages": [...]}}`; {sum('+' in r['task'] for r in chat)} have two
  user/assistant turns and {sum(r['messages'][0]['role'] == 'system' for r in chat)} start with a system message.
  Single-turn records by task: {single}.
  Tokens per record (chat template, this tokenizer): min {lengths[0]}, median {lengths[len(lengths) // 2]},
  max {lengths[-1]}; a one-turn record trains on at most {ONE_TURN_POSITIONS} positions (one length bucket of
  `python -m trainer`), a two-turn one on at most {DEFAULT_MAX_LEN}. Examples:
{chr(10).join(examples)}
- `text.jsonl`: {len(text)} `{{"text": ...}}` records of short sentences about the same facts.
- `tokenizer.json`: character level (a BPE model with no merges), {tok.get_vocab_size()} ids:
  {", ".join(f"{t} = {i}" for i, t in enumerate(SPECIAL_TOKENS))}, then newline and printable ASCII
  (0x20-0x7E) in code-point order. Id 0 is the pad token (the model's padding_idx).
- `tokenizer_config.json`: the same special tokens and LFM2's chat template for `transformers`.

Only assistant tokens (each answer and its `<|im_end|>`) are supervised when training on chat
records; see `trainer/data.py`.
"""


def generate(out: Path) -> list[Path]:
    """Write every asset into ``out`` (created if needed); returns the paths written."""
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    rng = random.Random(SEED)
    tok = make_tokenizer()
    chat = make_chat(rng, tok)
    text = make_text(rng, tok)
    unk = tok.token_to_id(UNK_TOKEN)
    for r in chat:
        for m in r["messages"]:
            assert unk not in tok.encode(m["content"], add_special_tokens=False).ids, m
    files = {
        "chat.jsonl": _jsonl(chat),
        "text.jsonl": _jsonl(text),
        "tokenizer.json": tok.to_str(pretty=True) + "\n",
        "tokenizer_config.json": json.dumps(tokenizer_config(), indent=2) + "\n",
        "README.md": _readme(chat, text, tok),
    }
    assert list(files) == ASSET_FILES
    written = []
    for name, content in files.items():
        path = out / name
        with open(path, "w", encoding="utf-8", newline="\n") as f:
            f.write(content)
        written.append(path)
    return written


def shipped_dir() -> Path:
    return Path(__file__).resolve().parents[1] / "trainer" / "assets"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python scripts/make_assets.py",
                                 description="Generate trainer/assets/ (synthetic chat data, text sample, tokenizer).")
    ap.add_argument("--out", type=Path, default=None, help="output directory (default: trainer/assets/)")
    ap.add_argument("--check", action="store_true",
                    help="generate into a temporary directory and exit 1 if it differs from trainer/assets/")
    args = ap.parse_args(argv)
    if args.check:
        with tempfile.TemporaryDirectory() as tmp:
            generate(Path(tmp))
            differ = [n for n in ASSET_FILES
                      if not (shipped_dir() / n).is_file() or not filecmp.cmp(Path(tmp) / n, shipped_dir() / n, shallow=False)]
        if differ:
            print(f"trainer/assets differs from a fresh generation: {', '.join(differ)}", file=sys.stderr)
            return 1
        print("trainer/assets is up to date")
        return 0
    for p in generate(args.out or shipped_dir()):
        print(f"wrote {p} ({p.stat().st_size} bytes)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
