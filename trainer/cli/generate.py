"""``python -m trainer generate``: talk to a model (a run's ``model/``, a checkpoint's, or any Hugging
Face LFM2 directory), optionally with a LoRA adapter, the answer printed as it is produced.

    python -m trainer generate --model runs/x/model --prompt "What is 3 + 4?"
    python -m trainer generate --model DIR --adapter runs/x/adapter --chat     # a conversation on stdin

The prompt is rendered with the tokenizer's chat template (the built-in LFM2 template where the
tokenizer has none) as one user turn and the assistant's header; ``--raw`` feeds the text as it
is. Decoding stops at the model's end ids (generation_config.json's, and ``<|im_end|>`` in chat).
Exit status: 0 done, 2 bad usage or input (one line, no traceback).
"""
from __future__ import annotations

import argparse
import sys

from ..open_model import load_model, open_tokenizer
from .usage import UsageError, report

IM_END = "<|im_end|>"


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m trainer generate", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", required=True, metavar="DIR", help="a Hugging Face LFM2 directory (config.json, "
                   "*.safetensors, tokenizer.json): a run's OUT/model or a checkpoint's model/")
    p.add_argument("--adapter", metavar="DIR", help="a LoRA adapter (PEFT's adapter_config.json + "
                   "adapter_model.safetensors, e.g. a LoRA run's OUT/adapter) applied to the model")
    p.add_argument("--tokenizer", metavar="PATH", help="tokenizer.json or its directory (default: the model's)")
    what = p.add_mutually_exclusive_group()     # one of them: checked in main, reported in one line
    what.add_argument("--prompt", metavar="TEXT", help="one user message; prints the answer and exits")
    what.add_argument("--chat", action="store_true", help="a conversation: one user message per line on "
                      "stdin, each answer printed as it comes; an empty line or end of input ends it")
    p.add_argument("--system", metavar="TEXT", help="a system message before the conversation")
    p.add_argument("--raw", action="store_true", help="with --prompt: feed the text as it is (no chat template)")
    p.add_argument("--max-new-tokens", type=int, default=256, metavar="N", help="per answer (default 256)")
    p.add_argument("--sample", action="store_true", help="sample instead of greedy decoding")
    p.add_argument("--temperature", type=float, default=1.0, help="with --sample (default 1.0)")
    p.add_argument("--top-k", type=int, default=0, help="with --sample: keep the K likeliest tokens (0: all)")
    p.add_argument("--top-p", type=float, default=1.0, help="with --sample: nucleus mass (1.0: all)")
    p.add_argument("--seed", type=int, default=0, help="sampling seed (default 0): the same seed, the same answer")
    p.add_argument("--f16", action="store_true", help="f16 activations (needs shader-f16)")
    p.add_argument("--gpu", metavar="SUBSTRING", help="use the GPU adapter whose name contains this "
                   "(as LFM2JIT_ADAPTER; --adapter is the LoRA adapter here)")
    return p


def main(argv: list[str]) -> int:
    args = build_parser().parse_args(argv)
    try:
        if args.prompt is None and not args.chat:
            raise UsageError("give --prompt TEXT (one answer) or --chat (a conversation on stdin)")
        session = _open(args)
    except UsageError as e:
        return report(e)
    if args.prompt is not None:
        session.answer(args.prompt)
        return 0
    for line in sys.stdin:
        if not line.strip():
            break
        session.answer(line.rstrip("\n"))
    return 0


class Session:
    """A model, its tokenizer and the conversation so far; ``answer`` streams one reply to stdout."""

    def __init__(self, model, tok, args):
        self.model, self.tok, self.args = model, tok, args
        self.messages = [{"role": "system", "content": args.system}] if args.system else []
        end = tok.token_to_id(IM_END)
        self.eos = sorted(set(model.generation_eos) | ({end} if end is not None and not args.raw else set()))

    def prompt_ids(self, text: str) -> list[int]:
        from ..data import encode_chat, encode_text
        if self.args.raw:
            return encode_text(text, self.tok)[:-1].tolist()          # without the closing <|endoftext|>
        self.messages.append({"role": "user", "content": text})
        ids, _ = encode_chat(self.messages, self.tok, add_generation_prompt=True)
        return ids.tolist()

    def answer(self, text: str) -> str:
        args, out, shown = self.args, [], ""

        def on_token(_, token: int) -> None:     # print the text's new characters (a token may end mid-character)
            nonlocal shown
            out.append(token)
            now = self.tok.decode(out, skip_special_tokens=True)
            if not now.endswith("\ufffd"):
                sys.stdout.write(now[len(shown):])
                sys.stdout.flush()
                shown = now

        self.model.generate(self.prompt_ids(text), max_new_tokens=args.max_new_tokens, do_sample=args.sample,
                            temperature=args.temperature, top_k=args.top_k, top_p=args.top_p,
                            eos_token_id=self.eos, seed=args.seed, on_token=on_token)
        reply = self.tok.decode(out, skip_special_tokens=True)
        sys.stdout.write(reply[len(shown):] + "\n")
        sys.stdout.flush()
        if not args.raw:
            self.messages.append({"role": "assistant", "content": reply})
        return reply


def _open(args) -> Session:
    """Check the flags and files, then load the model (and adapter) onto the GPU."""
    if args.max_new_tokens < 1:
        raise UsageError(f"--max-new-tokens must be at least 1, got {args.max_new_tokens}")
    if args.raw and args.chat:
        raise UsageError("--raw goes with --prompt (a conversation is always rendered with the chat template)")
    from lfm2jit.model.generate import Sampling
    try:
        Sampling(args.sample, args.temperature, args.top_k, args.top_p)
    except (ValueError, TypeError) as e:
        raise UsageError(f"sampling: {e}") from None
    model_dir, tok = open_tokenizer(args.model, args.tokenizer)
    model = load_model(model_dir, tok, args.adapter, args.gpu, args.f16)
    return Session(model, tok, args)
