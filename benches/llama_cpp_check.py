"""GGUF export checked in llama.cpp itself (issue 50): files lfm2jit writes are loaded by llama.cpp
through llama-cpp-python, which builds it from source (too long for CI, so a script with its log
committed: benches/results/llama_cpp_check.log).

    .venv/bin/pip install llama-cpp-python       # builds llama.cpp (minutes)
    .venv/bin/python benches/llama_cpp_check.py [--model DIR [--adapter DIR] [--samples FILE]] [--outtypes ...]

For a random-init LFM2 and LFM2-MoE with the shipped tokenizer (and, given ``--model``, a trained
model directory, e.g. the main job's OUT/model): each outtype's GGUF is loaded in llama.cpp; its
tokenization of a few strings is compared with ``tokenizers``', its logits for a prompt with
lfm2jit's (relative to the largest logit), and 32 greedy tokens after each of five chat prompts with
lfm2jit's; with ``--samples`` (the run's samples.jsonl), its held-out greedy answers with llama.cpp's
chat completions (the GGUF's own chat template). With ``--adapter``, the LoRA GGUF applied with llama.cpp's lora support is compared with
the merged model's logits. Prints a table.
"""
from __future__ import annotations

import argparse
import json
import re
import shutil
import sys
import tempfile
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

STRINGS = ["Capital of India?", "the opposite of low", "What comes after 51?", "  two  spaces", "x"]
QUESTIONS = ["Capital of India?", "What comes after 51?", "opposite of slow", "length of moth",
             "What month follows November?"]
TURN = re.compile(r"<\|im_start\|>(\w+)\n(.*?)<\|im_end\|>", re.S)     # a rendered prompt's turns
PROMPTS = [f"<|im_start|>user\n{q}<|im_end|>\n<|im_start|>assistant\n" for q in QUESTIONS]


def random_model(ctx, engine, where: Path, moe: bool = False) -> Path:
    """A random-init LFM2 of the tiny preset's shape (``moe``: an LFM2-MoE of the tiny-moe preset's,
    its expert biases random too, so llama.cpp's biased routing is compared) with the shipped
    tokenizer, saved where."""
    from lfm2jit.model import Lfm2Config, Lfm2Model, Lfm2MoeConfig
    from lfm2jit.model.config import PRESETS
    from lfm2jit.model.moe_checkpoint import init_moe_tensors, save_moe_pretrained
    from lfm2jit.model.moe_config import MOE_PRESETS
    from trainer.data import default_tokenizer
    assets = Path(default_tokenizer()).parent
    if moe:
        cfg = Lfm2MoeConfig(**{**MOE_PRESETS["tiny-moe"], "vocab_size": 102})
        tensors = init_moe_tensors(cfg, seed=3)
        rng = np.random.default_rng(3)
        for name in [n for n in tensors if n.endswith("expert_bias")]:
            tensors[name] = rng.normal(0, 0.5, tensors[name].shape).astype(np.float32)
        save_moe_pretrained(where, cfg, tensors, "f32", None)
    else:
        cfg = Lfm2Config(**{**PRESETS["tiny"], "vocab_size": 102})
        Lfm2Model(cfg, ctx, engine, seed=3).save_pretrained(where)
    for f in ("tokenizer.json", "tokenizer_config.json"):
        if (assets / f).exists():
            shutil.copyfile(assets / f, where / f)
    return where


def held_out_agreement(llm, samples_path: Path) -> str:
    """How many of a run's held-out greedy answers (its samples.jsonl, the trainer's evaluation) llama.cpp's
    chat completion gives too, each conversation rendered by the chat template inside the GGUF file."""
    samples = [json.loads(line) for line in samples_path.read_text().splitlines() if line.strip()]
    same = 0
    for x in samples:
        turns = [{"role": r, "content": c} for r, c in TURN.findall(x["prompt"])]
        out = llm.create_chat_completion(turns, temperature=0.0, max_tokens=32)
        same += out["choices"][0]["message"]["content"].strip() == x["answer"].strip()
    return f"{same}/{len(samples)}"


def check(name: str, model_dir: Path, outtypes, adapter: Path | None, ctx, engine, tmp: Path,
          samples: Path | None = None) -> list[dict]:
    import llama_cpp
    from tokenizers import Tokenizer
    from lfm2jit.model import Lfm2Model
    tok = Tokenizer.from_file(str(model_dir / "tokenizer.json"))
    model = Lfm2Model.from_pretrained(model_dir, ctx, engine)
    prompts = [tok.encode(p, add_special_tokens=False).ids for p in PROMPTS]
    ids = prompts[0]
    want_logits = model.logits(np.array(ids), bucket=64)
    want_greedy = [list(model.generate(p, max_new_tokens=32, eos_token_id=[])) for p in prompts]
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
        same_greedy = sum(_greedy(llm, p, 32) == w for p, w in zip(prompts, want_greedy))
        rows.append({"model": name, "outtype": outtype, "tokenization equal": same_tokens,
                     "logits max rel err": err, "greedy 32 equal": f"{same_greedy}/{len(prompts)}",
                     "held-out answers equal": held_out_agreement(llm, samples) if samples else None})
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
                     "greedy 32 equal": None, "held-out answers equal": None})
    return rows


def _greedy(llm, prompt: list[int], n: int) -> list[int]:
    """n tokens by llama.cpp's argmax after the prompt (end-of-sequence not stopping it)."""
    llm.reset()
    llm.eval(prompt)
    out = []
    for _ in range(n):
        out.append(int(np.argmax(llm.scores[llm.n_tokens - 1])))
        llm.eval([out[-1]])
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", type=Path, help="a trained model directory to check too (e.g. runs/main/model)")
    ap.add_argument("--adapter", type=Path, help="a LoRA adapter of --model: its LoRA GGUF checked too")
    ap.add_argument("--outtypes", nargs="*", default=["f32", "f16", "q8_0"])
    ap.add_argument("--samples", type=Path, help="the --model run's samples.jsonl: its held-out greedy answers "
                                                 "compared with llama.cpp's chat completions")
    args = ap.parse_args()
    from lfm2jit import ComputeEngine, WgpuContext
    ctx = WgpuContext.create()
    engine = ComputeEngine(ctx)
    with tempfile.TemporaryDirectory() as d:
        tmp = Path(d)
        rows = check("random-init", random_model(ctx, engine, tmp / "random"), args.outtypes, None, ctx, engine, tmp)
        rows += check("random-moe", random_model(ctx, engine, tmp / "moe", moe=True), args.outtypes, None,
                      ctx, engine, tmp)
        if args.model is not None:
            rows += check("trained", args.model, args.outtypes, args.adapter, ctx, engine, tmp, args.samples)
    print(f"{'model':12s} {'outtype':16s} {'tokens equal':>12s} {'logits rel err':>15s} {'greedy equal':>13s} "
          f"{'held-out answers':>17s}")
    for r in rows:
        print(f"{r['model']:12s} {r['outtype']:16s} {str(r['tokenization equal']):>12s} "
              f"{r['logits max rel err']:15.2e} {str(r['greedy 32 equal']):>13s} {str(r['held-out answers equal']):>17s}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
