"""`python -m trainer` on an LFM2-MoE checkpoint as a user runs it (issue 47): a tiny random-init
Lfm2MoeForCausalLM made by transformers is fine-tuned with LoRA on its linears and its experts
(--lora-target-parameters, PEFT's target_parameters), `generate` answers with the result, and PEFT
loads the adapter onto transformers' model with logits equal to lfm2jit's."""
from __future__ import annotations

import json
import shutil

import numpy as np
import pytest

from lfm2jit import ComputeEngine
from lfm2jit.model import Lfm2Model, Lfm2MoeConfig
from numerics import rel_err
from test_cli_lora import assert_same_adapters
from test_cli_trainer import ROOT, assert_same_steps, cli, metrics
from trainer.cli import main
from trainer.data import encode_chat, load_tokenizer

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
peft = pytest.importorskip("peft")

ASSETS = ROOT / "trainer" / "assets"
RUN = ["--lora-r", 8, "--lora-alpha", 16, "--lora-target-parameters", "experts.gate_up_proj", "experts.down_proj",
       "--lr", "3e-3", "--schedule", "warmup", "--warmup-steps", 4, "--max-len", 48, "--eval-max", 4, "--no-progress"]


@pytest.fixture(scope="module")
def moe_run(tmp_path_factory):
    """transformers' tiny MoE (the shipped tokenizer's vocabulary, expert_bias non-zero) and a LoRA
    run on it."""
    base = tmp_path_factory.mktemp("moe") / "base"
    tok = load_tokenizer(ASSETS)
    cfg = Lfm2MoeConfig.preset("tiny-moe")
    hf_cfg = transformers.Lfm2MoeConfig(**{**cfg.to_dict(), "vocab_size": tok.get_vocab_size(with_added_tokens=True),
                                            "eos_token_id": tok.token_to_id("<|im_end|>")})
    torch.manual_seed(0)
    hf = transformers.Lfm2MoeForCausalLM(hf_cfg)
    with torch.no_grad():
        for m in hf.modules():
            if getattr(m, "expert_bias", None) is not None:
                m.expert_bias.normal_(0.0, 0.1)
    hf.save_pretrained(base)
    for f in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(ASSETS / f, base / f)
    out = base.parent / "run"
    r = cli("--model", base, *RUN, "--steps", 6, "--checkpoint-every", 3, "--eval-answers", 2, "--out", out)
    assert r.returncode == 0, r.stderr
    return base, out, r


def test_lora_fine_tunes_the_moe_checkpoint(moe_run):
    base, out, r = moe_run
    assert "LoRA r 8" in r.stdout and (out / "adapter" / "adapter_model.safetensors").is_file()
    assert "and experts.gate_up_proj, experts.down_proj" in r.stdout
    config = json.loads((out / "adapter" / "adapter_config.json").read_text())
    assert config["target_parameters"] == ["experts.gate_up_proj", "experts.down_proj"]
    losses = [m["loss"] for m in metrics(out)]
    assert len(losses) == 6 and all(np.isfinite(losses))
    # each step's tokens per expert, per sparse layer: every token routed to top-k experts
    top_k = Lfm2MoeConfig.from_json(base).num_experts_per_tok
    for m in metrics(out):
        assert sorted(m["expert_tokens"]) == ["1", "2", "3"]
        sums = {sum(n) for n in m["expert_tokens"].values()}
        assert len(sums) == 1 and sums.pop() == m["tokens"] * top_k, m


def test_peft_loads_the_adapter_with_equal_logits(moe_run, ctx, engine):
    base, out, _ = moe_run
    hf = transformers.Lfm2MoeForCausalLM.from_pretrained(base).float().eval()
    theirs = peft.PeftModel.from_pretrained(hf, out / "adapter").eval()
    ours = Lfm2Model.from_pretrained(base, ctx, engine)
    ours.load_adapter(out / "adapter")
    ids = np.random.default_rng(0).integers(1, ours.cfg.vocab_size, 21)
    with torch.no_grad():
        want = theirs(input_ids=torch.as_tensor(ids)[None]).logits[0].numpy()
    assert rel_err(ours.logits(ids, bucket=16), want) < 1e-4
    plain = Lfm2Model.from_pretrained(base, ctx, engine).logits(ids, bucket=16)
    assert rel_err(plain, want) > 1e-3             # the adapter trained: it changes the logits
    # the experts' adapters trained too: PEFT's B for them moved from zero
    experts = {n: p for n, p in theirs.named_parameters() if ".experts." in n and "lora_B" in n}
    assert experts and all(float(p.abs().max()) > 0 for p in experts.values())


def test_generate_answers_with_the_fine_tuned_adapter(moe_run, ctx, capsys):
    base, out, _ = moe_run
    rc = main(["generate", "--model", str(base), "--adapter", str(out / "adapter"), "--prompt", "Capital of India?",
               "--max-new-tokens", "8"])
    printed = capsys.readouterr().out
    assert rc == 0
    tok = load_tokenizer(base)
    model = Lfm2Model.from_pretrained(base, ctx, ComputeEngine(ctx))
    model.load_adapter(out / "adapter")
    ids, _ = encode_chat([{"role": "user", "content": "Capital of India?"}], tok, add_generation_prompt=True)
    end = sorted(set(model.generation_eos) | {tok.token_to_id("<|im_end|>")})
    want = tok.decode(model.generate(ids.tolist(), max_new_tokens=8, eos_token_id=end), skip_special_tokens=True)
    assert printed == want + "\n"


def test_f16_activations_train_the_moe_checkpoint_as_f32_does(moe_run, tmp_path):
    """--f16 on an MoE model: the same run's losses within f16 rounding of the f32 run's."""
    base, out, _ = moe_run
    r = cli("--model", base, *RUN, "--f16", "--steps", 3, "--eval-answers", 0, "--out", tmp_path / "f16")
    assert r.returncode == 0, r.stderr
    got, want = [m["loss"] for m in metrics(tmp_path / "f16")], [m["loss"] for m in metrics(out)][:3]
    assert len(got) == 3 and np.allclose(got, want, rtol=1e-2), (got, want)


def test_a_4bit_base_fine_tunes_the_moe_checkpoint_and_merges(moe_run, tmp_path, ctx, engine):
    """--base-dtype nf4 on an MoE checkpoint (experts held 4-bit): the run's first loss is the f32
    run's within the weights' 4-bit rounding, it trains, and --merge-lora writes a plain model whose
    logits equal the 4-bit base plus the adapter (what the run ended with)."""
    base, out, _ = moe_run
    q = tmp_path / "nf4"
    r = cli("--model", base, *RUN, "--base-dtype", "nf4", "--merge-lora", "--steps", 3, "--eval-answers", 0,
            "--out", q)
    assert r.returncode == 0, r.stderr
    got, want = [m["loss"] for m in metrics(q)], [m["loss"] for m in metrics(out)][:3]
    assert len(got) == 3 and abs(got[0] - want[0]) < 0.05 * want[0] and got[0] != want[0], (got, want)
    assert got[-1] < got[0]
    merged = Lfm2Model.from_pretrained(q / "model", ctx, ComputeEngine(ctx))
    adapted = Lfm2Model.from_pretrained(base, ctx, ComputeEngine(ctx), base_dtype="nf4")
    adapted.load_adapter(q / "checkpoints" / "step-000003" / "adapter")      # the final checkpoint's
    ids = np.arange(3, 40, dtype=np.int32) % merged.cfg.vocab_size
    assert rel_err(merged.logits(ids), adapted.logits(ids)) < 1e-4


def test_the_balance_loss_is_logged_and_refused_on_a_dense_model(moe_run, tmp_path):
    base, _, _ = moe_run
    out = tmp_path / "aux"
    r = cli("--model", base, "--router-aux-loss-coef", 0.01, "--lr", "3e-3", "--steps", 3, "--max-len", 48,
            "--eval-max", 2, "--eval-answers", 0, "--no-progress", "--out", out)
    assert r.returncode == 0, r.stderr
    aux = [m["router_aux_loss"] for m in metrics(out)]
    # C times about one per sparse layer: 0.01 * 3 layers, above it as uneven routing costs more
    assert len(aux) == 3 and all(0.01 * 3 * 0.9 < a < 0.01 * 3 * 4 for a in aux), aux
    r = cli("--preset", "tiny", "--router-aux-loss-coef", 0.01, "--steps", 1, "--out", tmp_path / "dense")
    assert r.returncode == 2 and "no router to balance" in r.stderr


def test_a_resumed_run_with_expert_adapters_equals_the_unbroken_one(moe_run, tmp_path):
    """The checkpoint's adapter (PEFT's layout) and optimizer state (lfm2jit's) come back as they were."""
    base, long_out, _ = moe_run
    short = tmp_path / "short"
    r = cli("--model", base, *RUN, "--steps", 3, "--out", short)
    assert r.returncode == 0, r.stderr
    r = cli("--resume", short, "--steps", 6, "--no-progress")
    assert r.returncode == 0, r.stderr
    assert_same_steps(metrics(short)[3:], metrics(long_out)[3:])
    assert_same_adapters(short, long_out)
