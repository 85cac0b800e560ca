"""GGUF export checked in llama.cpp itself (issue 50): files lfm2jit writes are loaded by llama.cpp
through llama-cpp-python, which builds it from source (too long for CI, so a script with its log
committed: benches/results/llama_cpp_check.log).

    .venv/bin/pip install llama-cpp-python       # builds llama.cpp (minutes)
    .venv/bin/python benches/llama_cpp_check.py [--model DIR [--adapter DIR]] [--outtypes f32 f16 q8_0]

For a random-init LFM2 with the shipped tokenizer (and, given ``--model``, a trained model directory,
e.g. the main job's OUT/model): each outtype's GGUF is loaded in llama.cpp; its tokenization of a few
strings is compared with ``tokenizers``', its logits for a prompt with lfm2jit's (relative to the
largest logit), and 32 greedy tokens with lfm2jit's. With ``--adapter``, the LoRA GGUF applied with
llama.cpp's lora support is compared with the merged model's logits. Prints a table.
"""
from __future__ import annotations

import argparse
import shutil
import sys
import tempfile
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

STRINGS = ["Capital of India?", "the opposite of low", "What comes after 51?", "  two  spaces", "x"]
PROMPT = "<|im_start|>user\nCapital of India?<|im_end|>\n<|im_start|>assistant\n"


def random_model(ctx, engine, where: Path) -> Path:
    """A random-init LFM2 of the tiny preset's shape with the shipped tokenizer, saved where."""
    from lfm2jit.model import Lfm2Config, Lfm2Model
    from lfm2jit.model.config import PRESETS
    from trainer.data import default_tokenizer
    assets = Path(default_tokenizer()).parent
    cfg = Lfm2Config(**{**PRESETS["tiny"], "vocab_size": 102})
    Lfm2Model(cfg, ctx, engine, seed=3).save_pretrained(where)
    for f in ("tokenizer.json", "tokenizer_config.json"):
        if (assets / f).exists():
            shutil.copyfile(assets / f, where / f)
    return where


def check(name: str, model_dir: Path, outtypes, adapter: Path | None, ctx, engine, tmp: Path) -> list[dict]:
    import llama_cpp
    from tokenizers import Tokenizer
    from lfm2jit.model import Lfm2Model
    tok = Tokenizer.from_file(str(model_dir / "tokenizer.json"))
    model = Lfm2Model.from_pretrained(model_dir, ctx, engine)
    ids = tok.encode(PROMPT, add_special_tokens=False).ids
    want_logits = model.logits(np.array(ids), bucket=64)
    want_greedy = model.generate(ids, max_new_tokens=32, eos_token_id=[])
    rows = []
    for outtype in outtypes:
        path = model.save_gguf(tmp / f"{name}-{outtype}.gguf", outtype, tokenizer=model_dir)
        llm = llama_cpp.Llama(str(path), n_ctx=256, logits_all=True, verbose=False, n_threads=2)
        same_tokens = all(llm.tokenize(s.encode(), add_bos=False, special=True)
                          == tok.encode(s, add_special_tokens=False).ids for s in STRINGS)
        llm.reset()
        llm.eval(ids)
        got = np.array(llm.scores[:len(ids)], np.float32)
        err = float(np.abs(got - want_logits).max() / np.abs(want_logits).max())
        greedy = []
        llm.reset()
        llm.eval(ids)
        for _ in range(32):
            nxt = int(np.argmax(llm.scores[llm.n_tokens - 1]))
            greedy.append(nxt)
            llm.eval([nxt])
        rows.append({"model": name, "outtype": outtype, "tokenization equal": same_tokens,
                     "logits max rel err": err, "greedy 32 equal": greedy == list(want_greedy)})
    if adapter is not None:
        from lfm2jit.model.lora import read_adapter
        from lfm2jit.model.gguf_export import write_adapter
        config, peft = read_adapter(adapter)
        lora_path = write_adapter(tmp / f"{name}-lora.gguf", model.cfg, config, peft, "f32")
        base_path = model.save_gguf(tmp / f"{name}-base-f32.gguf", "f32", tokenizer=model_dir)
        model.load_adapter(adapter)
        model.merge_lora()
        merged = model.logits(np.array(ids), bucket=64)
        llm = llama_cpp.Llama(str(base_path), lora_path=str(lora_path), n_ctx=256, logits_all=True,
                              verbose=False, n_threads=2)
        llm.eval(ids)
        got = np.array(llm.scores[:len(ids)], np.float32)
        rows.append({"model": name, "outtype": "f32 + LoRA GGUF", "tokenization equal": None,
                     "logits max rel err": float(np.abs(got - merged).max() / np.abs(merged).max()),
                     "greedy 32 equal": None})
    return rows


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", type=Path, help="a trained model directory to check too (e.g. runs/main/model)")
    ap.add_argument("--adapter", type=Path, help="a LoRA adapter of --model: its LoRA GGUF checked too")
    ap.add_argument("--outtypes", nargs="*", default=["f32", "f16", "q8_0"])
    args = ap.parse_args()
    from lfm2jit import ComputeEngine, WgpuContext
    ctx = WgpuContext.create()
    engine = ComputeEngine(ctx)
    with tempfile.TemporaryDirectory() as d:
        tmp = Path(d)
        rows = check("random-init", random_model(ctx, engine, tmp / "random"), args.outtypes, None, ctx, engine, tmp)
        if args.model is not None:
            rows += check("trained", args.model, args.outtypes, args.adapter, ctx, engine, tmp)
    print(f"{'model':12s} {'outtype':16s} {'tokens equal':>12s} {'logits rel err':>15s} {'greedy equal':>13s}")
    for r in rows:
        print(f"{r['model']:12s} {r['outtype']:16s} {str(r['tokenization equal']):>12s} "
              f"{r['logits max rel err']:15.2e} {str(r['greedy 32 equal']):>13s}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
