"""``python -m trainer export-gguf``: a model directory (a run's ``model/``, or any Hugging Face LFM2
or LFM2-MoE directory) as one GGUF file for llama.cpp, Ollama and LM Studio; with ``--adapter`` a
LoRA adapter GGUF for ``llama-cli --lora``, or with ``--merge`` the model with the adapter folded in.

    python -m trainer export-gguf --model runs/x/model --outtype q8_0 --out model.gguf
    python -m trainer export-gguf --model BASE --adapter runs/x/adapter --out adapter.gguf
    python -m trainer export-gguf --model BASE --adapter runs/x/adapter --merge --out merged.gguf

Everything is checked before anything is written (the flags, the output path, the config, the
tokenizer, the adapter against the model); the file is written beside its destination and renamed
into place. Exit status: 0 written, 2 bad usage or input (one line, no traceback).
"""
from __future__ import annotations

import argparse
import os
from pathlib import Path

from .usage import UsageError, report


def build_parser() -> argparse.ArgumentParser:
    from lfm2jit.model.gguf_export import OUTTYPES
    p = argparse.ArgumentParser(prog="python -m trainer export-gguf", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", required=True, metavar="DIR", help="a Hugging Face LFM2 directory (config.json, "
                   "*.safetensors, tokenizer.json): a run's OUT/model, a checkpoint's model/, or the base of --adapter")
    p.add_argument("--adapter", metavar="DIR", help="a LoRA adapter (PEFT's adapter_config.json + "
                   "adapter_model.safetensors) of --model: written as a LoRA GGUF, or merged with --merge")
    p.add_argument("--merge", action="store_true", help="with --adapter: fold the adapter into the model "
                   "(Lfm2Model.merge_lora) and write the whole model")
    p.add_argument("--outtype", default="f16", metavar="TYPE", help=f"{' | '.join(OUTTYPES)} (default f16): "
                   "the matrices' type; norms, 1-D tensors, the conv weight and MoE routers stay f32")
    p.add_argument("--out", required=True, metavar="FILE.gguf", help="the file to write")
    p.add_argument("--force", action="store_true", help="replace --out if it exists")
    p.add_argument("--tokenizer", metavar="PATH", help="tokenizer.json or its directory (default: --model's)")
    p.add_argument("--name", help="general.name in the file (default: --model's directory name)")
    p.add_argument("--gpu", metavar="SUBSTRING", help="with --merge: the GPU adapter whose name contains this "
                   "(as LFM2JIT_ADAPTER)")
    return p


def main(argv: list[str]) -> int:
    args = build_parser().parse_args(argv)
    try:
        out = export(args)
    except UsageError as e:
        return report(e)
    print(f"wrote {out}")
    return 0


def _check_out(path: Path, force: bool) -> None:
    """The output path: not an existing file without --force, never a directory, in a directory
    that exists or can be made, and can be written."""
    if path.is_dir():
        raise UsageError(f"--out {path}: is a directory; give a file name such as {path / 'model.gguf'}")
    if path.exists() and not force:
        raise UsageError(f"--out {path}: exists; pass --force to replace it")
    parent = path.parent
    while not parent.exists():
        parent = parent.parent
    if not parent.is_dir() or not os.access(parent, os.W_OK | os.X_OK):
        raise UsageError(f"--out {path}: {parent} is not a writable directory")


def export(args) -> Path:
    """Check everything, then write the file; its path."""
    from lfm2jit.model import AdapterError, CheckpointError, ConfigError
    from lfm2jit.model import gguf_export as ge
    from lfm2jit.model.checkpoint import load_checkpoint
    from lfm2jit.model.lora import check_weights, read_adapter
    from lfm2jit.model.moe_config import read_model_config

    if args.outtype not in ge.OUTTYPES:
        raise UsageError(f"--outtype {args.outtype!r}: expected one of {', '.join(ge.OUTTYPES)}")
    if args.merge and not args.adapter:
        raise UsageError("--merge goes with --adapter DIR (the adapter to fold into --model)")
    out = Path(args.out)
    _check_out(out, args.force)
    model_dir = Path(args.model)
    if not (model_dir / "config.json").is_file():
        raise UsageError(f"--model {model_dir}: not a model directory (no config.json)")
    name = args.name or model_dir.resolve().name
    try:
        cfg = read_model_config(model_dir)
        ge.check_supported(cfg)
        tokenizer = Path(args.tokenizer) if args.tokenizer else model_dir
        if not args.adapter or args.merge:
            try:
                ge.read_vocab(tokenizer, cfg.vocab_size)
            except ge.GgufError as e:
                raise UsageError(f"tokenizer: {e}" + ("" if args.tokenizer else " (give --tokenizer PATH)")) from None
        lora = None
        if args.adapter:
            lora, weights = read_adapter(Path(args.adapter))
            weights = check_weights(lora, lora.modules(cfg), weights, f"--adapter {args.adapter}", lora.parameters(cfg))
            if not args.merge:
                ge.adapter_tensors(cfg, lora, weights)            # what a LoRA GGUF cannot hold, said now
        if args.adapter and not args.merge:
            return ge.write_adapter(out, cfg, lora, weights, args.outtype, args.name or Path(args.adapter).resolve().name)
        tensors = _merged(model_dir, args) if args.merge else load_checkpoint(model_dir)
        return ge.write_model(out, cfg, tensors, tokenizer, args.outtype, name)
    except (ConfigError, CheckpointError, AdapterError, ge.GgufError) as e:
        raise UsageError(str(e)) from None
    except OSError as e:
        raise UsageError(f"--out {out}: {e.strerror or e}") from None


def _merged(model_dir: Path, args) -> dict:
    """The model's tensors with the adapter merged: the model and adapter loaded as ``generate``
    loads them, then ``merge_lora`` (W += s B A in float64, the project's one merge)."""
    from ..data import load_tokenizer
    from ..open_model import load_model
    try:
        tok = load_tokenizer(args.tokenizer or model_dir)
    except (ValueError, FileNotFoundError) as e:
        raise UsageError(f"tokenizer: {e}") from None
    model = load_model(model_dir, tok, args.adapter, args.gpu)
    model.merge_lora()
    return model.state_dict()
