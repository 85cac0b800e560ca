"""``python -m trainer eval``: score a model alone (a run's ``model/``, a checkpoint's, any Hugging Face
LFM2 directory; optionally with a LoRA adapter) on a JSONL file of chat or text records.

    python -m trainer eval --model runs/x/model --data held_out.jsonl [--adapter runs/x/adapter]

Prints the loss and perplexity over every next token and over the assistant answers, and the
exact match of the greedy answers (each chat record's last assistant turn; see
trainer/evaluation.py) with a few samples; ``--json PATH`` writes all of it, every answer included.
Exit status: 0 done, 2 bad usage or input (one line, no traceback).
"""
from __future__ import annotations

import argparse
import json
import sys
import warnings
from pathlib import Path

from lfm2jit.safefiles import write_atomic

from ..open_model import load_model, open_tokenizer
from ..packing import PACKING_CHOICES, resolve_mode
from .held_out import print_samples
from .splits import count
from .options import DEFAULT_MAX_LEN, DEFAULT_SAMPLES
from .usage import UsageError, report


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m trainer eval", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", required=True, metavar="DIR", help="a Hugging Face LFM2 directory")
    p.add_argument("--data", required=True, metavar="FILE", help="JSONL records (chat or text, as python -m "
                   "trainer --data takes them)")
    p.add_argument("--adapter", metavar="DIR", help="a LoRA adapter applied to the model")
    p.add_argument("--tokenizer", metavar="PATH", help="tokenizer.json or its directory (default: the model's)")
    p.add_argument("--max-records", type=int, metavar="N", help="score the first N records only")
    p.add_argument("--max-len", type=int, default=DEFAULT_MAX_LEN, metavar="N",
                   help=f"positions per record; longer ones are cut (default {DEFAULT_MAX_LEN})")
    p.add_argument("--no-answers", action="store_true", help="the losses only (no greedy decoding)")
    p.add_argument("--samples", type=int, default=DEFAULT_SAMPLES, metavar="K", help="sample answers to print")
    p.add_argument("--bucket", type=int, default=64, metavar="N", help="length bucket (default 64)")
    p.add_argument("--packing", choices=PACKING_CHOICES, default="auto",
                   help="how the loss passes pack the records: pad (padded to the longest and stacked) or concat "
                        "(concatenated into one row, as python -m trainer --packing concat); auto (default): concat "
                        "on a GPU, pad on a CPU adapter; the same losses up to f32 rounding")
    p.add_argument("--json", metavar="PATH", help="write the metrics and every scored answer here")
    p.add_argument("--gpu", metavar="SUBSTRING", help="use the GPU adapter whose name contains this")
    return p


def main(argv: list[str]) -> int:
    args = build_parser().parse_args(argv)
    try:
        return _run(args)
    except UsageError as e:
        return report(e)


def _run(args) -> int:
    from ..data import Batch, DataError
    from ..evaluation import answer_cases, exact_match, greedy_answers, held_out_loss, perplexity
    for flag, value in (("--max-records", args.max_records), ("--max-len", args.max_len), ("--bucket", args.bucket)):
        if value is not None and value < 1:
            raise UsageError(f"{flag} must be at least 1, got {value}")
    model_dir, tok = open_tokenizer(args.model, args.tokenizer)
    if not Path(args.data).is_file():
        raise UsageError(f"--data {args.data}: no such file")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            batch = Batch.from_jsonl(args.data, tok, max_len=args.max_len)
        except (DataError, UnicodeDecodeError) as e:
            raise UsageError(str(e)) from None
    for w in caught:
        print(f"note: {w.message}", file=sys.stderr)
    items = []
    for seq in list(batch)[:args.max_records]:
        ids, targets, mask = seq.triple()
        if ids.size:
            full = mask * 0 + 1
            items.append((ids, targets, full, None if (mask == full).all() else mask))
    if not items:
        raise UsageError(f"--data {args.data}: no record with a target to score")

    model = load_model(model_dir, tok, args.adapter, args.gpu)
    engine = model.engine
    args.packing = resolve_mode(args.packing, model.ctx)
    loss, answer_loss = held_out_loss(model, engine, items, args.bucket, packing=args.packing)
    result = {"model": str(model_dir), "adapter": args.adapter, "data": args.data, "records": len(items),
              "packing": args.packing,
              "loss": loss, "perplexity": perplexity(loss), "answer_loss": answer_loss,
              "answer_perplexity": perplexity(answer_loss), "exact_match": None, "answers": []}
    print(f"{args.data}: {count(len(items), 'record')}")
    print(f"  loss over every next token: {loss:.4f} (perplexity {perplexity(loss):.2f})")
    cases = [] if args.no_answers else answer_cases(items, answers_are_the_loss=False)
    if answer_loss == answer_loss:      # not NaN: some records have answers
        print(f"  loss over the answers: {answer_loss:.4f} (perplexity {perplexity(answer_loss):.2f})")
    if cases:
        end = tok.token_to_id("<|im_end|>")
        samples = greedy_answers(model, tok, cases, set(model.generation_eos) | ({end} - {None}))
        result.update(exact_match=exact_match(samples), answers=samples)
        print(f"  answers exactly right (greedy): {exact_match(samples):.1%} of {len(samples)}")
        print_samples(samples, args.samples, print)
    if args.json:
        write_atomic(Path(args.json), json.dumps(result, indent=1) + "\n")
        print(f"  written: {Path(args.json).resolve()}")
    return 0
