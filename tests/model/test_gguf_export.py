"""GGUF export (lfm2jit/model/gguf_export.py), read back with the gguf package's own reader: every
tensor equal to the model's under llama.cpp's name and layout (f32 exactly, f16 / bf16 rounded to
nearest even, q8_0 equal to a numpy implementation of llama.cpp's quantize_row_q8_0_ref), the types
llama.cpp's converter gives each tensor, the metadata complete, the tokenizer's tokens, types,
merges, special ids and chat template; LFM2-MoE and LoRA adapter files; bad input refused with
nothing written. The names, shapes and values expected here are spelt out independently of the
exporter (no gguf.TensorNameMap, no gguf.quants)."""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import gguf
import numpy as np
import pytest

from lfm2jit.model import Lfm2Config, Lfm2Model, Lfm2MoeConfig, LoraConfig
from lfm2jit.model import gguf_export as ge
from lfm2jit.model.checkpoint import init_tensors, save_checkpoint
from lfm2jit.model.lora import init_weights
from lfm2jit.model.moe_checkpoint import init_moe_tensors

ASSETS = Path(__file__).resolve().parents[2] / "trainer" / "assets"
SPECIAL = ["<|pad|>", "<|startoftext|>", "<|endoftext|>", "<|im_start|>", "<|im_end|>"]

# tiny shapes: conv and attention layers; vocab larger than the shipped tokenizer's 102 ids
TINY = dict(vocab_size=128, hidden_size=64, intermediate_size=192, num_hidden_layers=3, num_attention_heads=4,
            num_key_value_heads=2, layer_types=["conv", "full_attention", "conv"], block_multiple_of=16,
            rope_theta=50_000.0, norm_eps=1e-6, conv_L_cache=4, max_position_embeddings=4096)


def gpt2_bytes_to_unicode() -> dict[int, str]:
    """GPT-2's byte -> printable character table (bytes that print as themselves keep their character,
    the others take 256, 257, ... in byte order)."""
    keep = [*range(ord("!"), ord("~") + 1), *range(0xA1, 0xAC + 1), *range(0xAE, 0xFF + 1)]
    out, n = {}, 0
    for b in range(256):
        if b in keep:
            out[b] = chr(b)
        else:
            out[b] = chr(256 + n)
            n += 1
    return out


def expected_names(cfg) -> dict[str, str]:
    """transformers name -> llama.cpp name, for a dense LFM2 (llama.cpp's llama-arch.cpp table)."""
    out = {"model.embed_tokens.weight": "token_embd.weight"}
    for i, kind in enumerate(cfg.layer_types):
        hf, b = f"model.layers.{i}.", f"blk.{i}."
        out[hf + "operator_norm.weight"] = b + "attn_norm.weight"
        if kind == "conv":
            for x in ("in_proj", "conv", "out_proj"):
                out[hf + f"conv.{x}.weight"] = b + f"shortconv.{x}.weight"
        else:
            for x, y in (("q_proj", "attn_q"), ("k_proj", "attn_k"), ("v_proj", "attn_v"), ("out_proj", "attn_output"),
                         ("q_layernorm", "attn_q_norm"), ("k_layernorm", "attn_k_norm")):
                out[hf + f"self_attn.{x}.weight"] = b + f"{y}.weight"
        out[hf + "ffn_norm.weight"] = b + "ffn_norm.weight"
        for x, y in (("w1", "ffn_gate"), ("w3", "ffn_up"), ("w2", "ffn_down")):
            out[hf + f"feed_forward.{x}.weight"] = b + f"{y}.weight"
    out["model.embedding_norm.weight"] = "token_embd_norm.weight"
    if not cfg.tie_word_embeddings:
        out["lm_head.weight"] = "output.weight"
    return out


def llama_layout(name: str, a: np.ndarray) -> np.ndarray:
    return a[:, 0, :] if name.endswith("conv.conv.weight") else a        # [D, 1, L] -> [D, L]


def bf16_bits(a: np.ndarray) -> np.ndarray:
    """f32 -> bf16 bit patterns, round to nearest even (finite values)."""
    bits = np.ascontiguousarray(a, np.float32).view(np.uint32).astype(np.uint64)
    return ((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16).astype(np.uint16)


def q8_0_reference(a: np.ndarray) -> np.ndarray:
    """llama.cpp's quantize_row_q8_0_ref per row of 32: d = amax / 127 (f32), id = 1/d (0 when d is 0),
    q = roundf(x * id) (half away from zero), stored as d in f16 then the 32 int8 values."""
    blocks = np.ascontiguousarray(a, np.float32).reshape(-1, 32)
    d = (np.abs(blocks).max(axis=1) / np.float32(127)).astype(np.float32)
    inv = np.zeros_like(d)
    inv[d != 0] = np.float32(1) / d[d != 0]
    x = (blocks * inv[:, None]).astype(np.float32)
    q = np.sign(x) * np.floor(np.abs(x).astype(np.float64) + 0.5)
    out = np.empty((len(blocks), 34), np.uint8)
    out[:, :2] = d.astype(np.float16).view(np.uint8).reshape(-1, 2)
    out[:, 2:] = q.astype(np.int8).view(np.uint8)
    return out.reshape(*a.shape[:-1], a.shape[-1] // 32 * 34)


def stored(t, outtype: str) -> str:
    """The type llama.cpp's converter gives a tensor: norms, 1-D tensors and the conv weight f32."""
    if len(t.shape) == 1 or t.name.endswith("_norm.weight") or ".shortconv.conv." in t.name or ".ffn_gate_inp." in t.name:
        return "F32"
    return outtype.upper()


def field(r: gguf.GGUFReader, key: str):
    return r.fields[key].contents()


def check_tensor(t, want: np.ndarray, kind: str) -> None:
    """A read-back tensor against the f32 array the model holds, stored as ``kind``."""
    assert list(t.shape) == list(reversed(want.shape)), t.name         # ggml's ne: the numpy shape reversed
    assert t.tensor_type.name == kind, t.name
    if kind == "F32":
        np.testing.assert_array_equal(t.data.reshape(want.shape), want)
    elif kind == "F16":
        np.testing.assert_array_equal(t.data.reshape(want.shape), want.astype(np.float16))
    elif kind == "BF16":
        np.testing.assert_array_equal(t.data.view(np.uint16).reshape(want.shape), bf16_bits(want))
    else:
        np.testing.assert_array_equal(t.data.reshape(q8_0_reference(want).shape), q8_0_reference(want))


@pytest.fixture
def tokenizer_dir(tmp_path) -> Path:
    d = tmp_path / "tok"
    d.mkdir()
    for f in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(ASSETS / f, d / f)
    return d


def tiny_tensors(cfg, seed=0) -> dict[str, np.ndarray]:
    t = init_tensors(cfg, seed)
    emb = t["model.embed_tokens.weight"]
    # rounding cases for q8_0: amax 127 gives d = 1, so x * id are these halves exactly; and a zero block
    emb[7, :32] = np.array([127, 2.5, -2.5, 0.5, -0.5, 1.5, -1.5, 126.5] + [0.25] * 24, np.float32)
    emb[8, :32] = 0.0
    return t


@pytest.mark.parametrize("outtype", ["f32", "f16", "bf16", "q8_0"])
def test_every_tensor_and_the_metadata(tmp_path, tokenizer_dir, outtype):
    cfg = Lfm2Config(**TINY)
    tensors = tiny_tensors(cfg)
    out = ge.write_model(tmp_path / "m.gguf", cfg, tensors, tokenizer_dir, outtype, name="tiny")
    assert out == tmp_path / "m.gguf" and sorted(p.name for p in tmp_path.iterdir()) == ["m.gguf", "tok"]
    r = gguf.GGUFReader(out)
    names = expected_names(cfg)
    assert [t.name for t in r.tensors] == list(names.values())      # tied: no output.weight
    by_name = {t.name: t for t in r.tensors}
    for hf, name in names.items():
        want = llama_layout(hf, tensors[hf])
        check_tensor(by_name[name], want, stored(by_name[name], outtype))
    assert list(by_name["blk.0.shortconv.conv.weight"].shape) == [4, 64]       # {d_conv, n_embd}
    assert field(r, "general.architecture") == "lfm2" and field(r, "general.type") == "model"
    assert field(r, "general.name") == "tiny"
    assert field(r, "general.file_type") == {"f32": 0, "f16": 1, "bf16": 32, "q8_0": 7}[outtype]
    assert field(r, "general.quantization_version") == 2
    assert field(r, "lfm2.block_count") == 3
    assert field(r, "lfm2.context_length") == 4096
    assert field(r, "lfm2.embedding_length") == 64
    # block_auto_adjust_ff_dim: int(2 * 192 / 3) = 128, a multiple of 16: the tensors' width
    assert field(r, "lfm2.feed_forward_length") == 128 == tensors["model.layers.0.feed_forward.w1.weight"].shape[0]
    assert field(r, "lfm2.attention.head_count") == 4
    assert field(r, "lfm2.attention.head_count_kv") == [0, 2, 0]       # 0: a conv (recurrent) layer
    assert field(r, "lfm2.rope.freq_base") == 50_000.0
    assert field(r, "lfm2.attention.layer_norm_rms_epsilon") == np.float32(1e-6)
    assert field(r, "lfm2.shortconv.l_cache") == 4
    assert field(r, "lfm2.vocab_size") == 128


def test_the_shipped_tokenizer(tmp_path, tokenizer_dir):
    """The character-level tokenizer: its tokens spelt in GPT-2's byte alphabet (what llama.cpp's BPE
    looks up), special tokens as they are and CONTROL, [PADi] UNUSED up to the model's vocabulary."""
    cfg = Lfm2Config(**TINY)
    r = gguf.GGUFReader(ge.write_model(tmp_path / "m.gguf", cfg, tiny_tensors(cfg), tokenizer_dir, "f32"))
    tj = json.loads((ASSETS / "tokenizer.json").read_text())
    enc = gpt2_bytes_to_unicode()
    by_id = {i: "".join(enc[b] for b in t.encode()) for t, i in tj["model"]["vocab"].items()}
    by_id.update({a["id"]: a["content"] for a in tj["added_tokens"]})
    want = [by_id.get(i, f"[PAD{i}]") for i in range(128)]
    assert field(r, "tokenizer.ggml.tokens") == want
    assert want[:8] == SPECIAL + ["<unk>", "\u010a", "\u0120"][:3] and want[8] == "!"   # "\n" -> Ċ, " " -> Ġ
    assert field(r, "tokenizer.ggml.token_type") == [3] * 6 + [1] * 96 + [5] * 26
    assert field(r, "tokenizer.ggml.merges") == []
    assert field(r, "tokenizer.ggml.model") == "gpt2" and field(r, "tokenizer.ggml.pre") == "lfm2"
    assert (field(r, "tokenizer.ggml.bos_token_id"), field(r, "tokenizer.ggml.eos_token_id"),
            field(r, "tokenizer.ggml.padding_token_id"), field(r, "tokenizer.ggml.unknown_token_id")) == (1, 4, 0, 5)
    assert field(r, "tokenizer.chat_template") == json.loads((ASSETS / "tokenizer_config.json").read_text())["chat_template"]


def test_a_byte_level_tokenizer_with_merges(tmp_path):
    """A byte-level BPE (as LFM2's own): tokens and merges as tokenizer.json has them, added tokens
    CONTROL (special) or USER_DEFINED, the chat template from chat_template.jinja."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, trainers
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    texts = ["the cat sat on the mat", "a dog and a cat", "caf\u00e9 na\u00efve \u00fcber", "the end"] * 20
    tok.train_from_iterator(texts, trainers.BpeTrainer(vocab_size=300, special_tokens=SPECIAL,
                                                       initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    tok.add_tokens([AddedToken("<tool>", special=False)])
    d = tmp_path / "bl"
    d.mkdir()
    tok.save(str(d / "tokenizer.json"))
    (d / "tokenizer_config.json").write_text(json.dumps({"bos_token": "<|startoftext|>", "eos_token": "<|im_end|>",
                                                         "pad_token": "<|pad|>", "add_bos_token": True}))
    (d / "chat_template.jinja").write_text("{% for m in messages %}{{ m.content }}{% endfor %}")
    tj = json.loads((d / "tokenizer.json").read_text())
    n = tok.get_vocab_size(with_added_tokens=True)
    cfg = Lfm2Config(**{**TINY, "vocab_size": n + 3})
    r = gguf.GGUFReader(ge.write_model(tmp_path / "m.gguf", cfg, init_tensors(cfg, 0), d, "f16"))
    vocab = tok.get_vocab(with_added_tokens=True)
    want = {i: t for t, i in vocab.items()}
    assert field(r, "tokenizer.ggml.tokens") == [want[i] for i in range(n)] + [f"[PAD{i}]" for i in range(n, n + 3)]
    types = field(r, "tokenizer.ggml.token_type")
    assert types[:5] == [3] * 5 and types[vocab["<tool>"]] == 4 and types[-3:] == [5] * 3
    assert set(types[5:n]) - {4} == {1}
    merges = [m if isinstance(m, str) else " ".join(m) for m in tj["model"]["merges"]]
    assert len(merges) > 20 and field(r, "tokenizer.ggml.merges") == merges
    assert field(r, "tokenizer.ggml.add_bos_token") is True
    assert (field(r, "tokenizer.ggml.bos_token_id"), field(r, "tokenizer.ggml.eos_token_id")) == (1, 4)
    assert field(r, "tokenizer.chat_template") == "{% for m in messages %}{{ m.content }}{% endfor %}"


def test_a_character_tokenizer_with_multibyte_characters(tmp_path):
    """A non-ASCII character of a character-level vocabulary is several byte symbols in llama.cpp:
    merges join exactly its bytes."""
    from tokenizers import Tokenizer, models
    vocab = {"<unk>": 0, "a": 1, "\u00e9": 2, "\u20ac": 3}
    d = tmp_path / "chars"
    d.mkdir()
    Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token="<unk>")).save(str(d / "tokenizer.json"))
    cfg = Lfm2Config(**{**TINY, "vocab_size": 4})
    r = gguf.GGUFReader(ge.write_model(tmp_path / "m.gguf", cfg, init_tensors(cfg, 0), d, "f32"))
    enc = gpt2_bytes_to_unicode()
    e_acute, euro = ("".join(enc[b] for b in c.encode()) for c in ("\u00e9", "\u20ac"))
    assert field(r, "tokenizer.ggml.tokens") == ["<unk>", "a", e_acute, euro]
    assert field(r, "tokenizer.ggml.merges") == [f"{e_acute[0]} {e_acute[1]}", f"{euro[0]} {euro[1]}",
                                                 f"{euro[:2]} {euro[2]}"]


def test_q8_0_falls_back_to_f16_where_a_row_is_not_whole_blocks(tmp_path, tokenizer_dir):
    cfg = Lfm2Config(**{**TINY, "intermediate_size": 72})        # MLP width 48: ffn_down's rows are 48 long
    tensors = tiny_tensors(cfg)
    r = gguf.GGUFReader(ge.write_model(tmp_path / "m.gguf", cfg, tensors, tokenizer_dir, "q8_0"))
    by_name = {t.name: t for t in r.tensors}
    check_tensor(by_name["blk.0.ffn_down.weight"], tensors["model.layers.0.feed_forward.w2.weight"], "F16")
    check_tensor(by_name["blk.0.ffn_up.weight"], tensors["model.layers.0.feed_forward.w3.weight"], "Q8_0")


def test_untied_model_has_an_output_tensor(tmp_path, tokenizer_dir):
    cfg = Lfm2Config(**{**TINY, "tie_word_embeddings": False})
    tensors = tiny_tensors(cfg)
    r = gguf.GGUFReader(ge.write_model(tmp_path / "m.gguf", cfg, tensors, tokenizer_dir, "f16"))
    out = {t.name: t for t in r.tensors}["output.weight"]
    check_tensor(out, tensors["lm_head.weight"], "F16")
    assert [t.name for t in r.tensors] == list(expected_names(cfg).values())


@pytest.mark.parametrize("outtype", ["f32", "q8_0"])
def test_moe_model(tmp_path, tokenizer_dir, outtype):
    """lfm2moe: each sparse layer's experts stacked per projection ([E, I, D] gate and up, [E, D, I]
    down), the router f32, the expert bias as exp_probs_b.bias, the expert metadata."""
    cfg = Lfm2MoeConfig.preset("tiny-moe")
    tensors = init_moe_tensors(cfg, seed=3)
    r = gguf.GGUFReader(ge.write_model(tmp_path / "moe.gguf", cfg, tensors, tokenizer_dir, outtype))
    by_name = {t.name: t for t in r.tensors}
    kind = outtype.upper()
    for i in cfg.moe_layers:
        hf, b = f"model.layers.{i}.feed_forward.", f"blk.{i}."
        for w, y in (("w1", "gate"), ("w3", "up"), ("w2", "down")):
            want = np.stack([tensors[hf + f"experts.{e}.{w}.weight"] for e in range(cfg.num_experts)])
            check_tensor(by_name[b + f"ffn_{y}_exps.weight"], want, kind)
        check_tensor(by_name[b + "ffn_gate_inp.weight"], tensors[hf + "gate.weight"], "F32")
        check_tensor(by_name[b + "exp_probs_b.bias"], tensors[hf + "expert_bias"], "F32")
        assert b + "ffn_gate.weight" not in by_name
    check_tensor(by_name["blk.0.ffn_gate.weight"], tensors["model.layers.0.feed_forward.w1.weight"], kind)
    assert field(r, "general.architecture") == "lfm2moe"
    assert field(r, "lfm2moe.expert_count") == 4 and field(r, "lfm2moe.expert_used_count") == 2
    assert field(r, "lfm2moe.expert_feed_forward_length") == 32
    assert field(r, "lfm2moe.feed_forward_length") == 128
    assert field(r, "lfm2moe.leading_dense_block_count") == 1
    assert field(r, "lfm2moe.expert_gating_func") == 2                   # sigmoid
    assert field(r, "lfm2moe.attention.head_count_kv") == [0, 2, 0, 2]
    assert field(r, "lfm2moe.shortconv.l_cache") == 3


def test_lora_adapter_file(tmp_path):
    """convert_lora_to_gguf.py's form: general.type adapter, adapter.type lora, adapter.lora.alpha,
    blk.N.<tensor>.weight.lora_a = A [r, in] (ne {in, r}) and .lora_b = B [out, r] (ne {r, out})."""
    cfg = Lfm2Config(**TINY)
    lora = LoraConfig(r=4, alpha=8.0, target_modules=("q_proj", "out_proj", "in_proj", "w2"))
    weights = init_weights(lora, lora.modules(cfg), seed=1)
    for n in weights:
        weights[n] = np.random.default_rng(len(n)).standard_normal(weights[n].shape).astype(np.float32)
    r = gguf.GGUFReader(ge.write_adapter(tmp_path / "a.gguf", cfg, lora, weights, "f32"))
    assert field(r, "general.architecture") == "lfm2" and field(r, "general.type") == "adapter"
    assert field(r, "adapter.type") == "lora" and field(r, "adapter.lora.alpha") == 8.0
    pairs = {"self_attn.q_proj": "attn_q", "self_attn.out_proj": "attn_output", "conv.in_proj": "shortconv.in_proj",
             "conv.out_proj": "shortconv.out_proj", "feed_forward.w2": "ffn_down"}
    want = {}
    for i, kind in enumerate(cfg.layer_types):
        for module, name in pairs.items():
            if module.startswith("conv.") != (kind == "conv") and not module.startswith("feed_forward"):
                continue
            hf = f"base_model.model.model.layers.{i}.{module}"
            want[f"blk.{i}.{name}.weight.lora_a"] = weights[hf + ".lora_A.weight"]
            want[f"blk.{i}.{name}.weight.lora_b"] = weights[hf + ".lora_B.weight"]
    assert sorted(t.name for t in r.tensors) == sorted(want)
    for t in r.tensors:
        check_tensor(t, want[t.name], "F32")
    rs = LoraConfig(r=4, alpha=8.0, use_rslora=True, target_modules=("q_proj",))
    r = gguf.GGUFReader(ge.write_adapter(tmp_path / "rs.gguf", cfg, rs, init_weights(rs, rs.modules(cfg), 0), "f16"))
    assert field(r, "adapter.lora.alpha") == 16.0           # alpha * sqrt(r): llama.cpp scales by alpha / r
    assert {t.tensor_type.name for t in r.tensors} == {"F16"}


def test_bad_input_writes_nothing(tmp_path, tokenizer_dir):
    cfg = Lfm2Config(**TINY)
    tensors = tiny_tensors(cfg)
    out = tmp_path / "out" / "m.gguf"
    with pytest.raises(ge.GgufError, match="outtype must be one of f32, f16, bf16, q8_0, got 'q4_0'"):
        ge.write_model(out, cfg, tensors, tokenizer_dir, "q4_0")
    with pytest.raises(ge.GgufError, match="conv_bias is true"):
        biased = Lfm2Config(**{**TINY, "conv_bias": True})
        ge.write_model(out, biased, init_tensors(biased, 0), tokenizer_dir, "f16")
    small = Lfm2Config(**{**TINY, "vocab_size": 64})
    with pytest.raises(ge.GgufError, match="ids up to 101 but the model's vocab_size is 64"):
        ge.write_model(out, small, init_tensors(small, 0), tokenizer_dir, "f16")
    with pytest.raises(ge.GgufError, match="no tokenizer.json"):
        ge.write_model(out, cfg, tensors, tmp_path, "f16")
    with pytest.raises(Exception, match="does not match the config"):
        ge.write_model(out, cfg, {**tensors, "model.layers.0.conv.conv.weight": np.zeros((64, 1, 3))},
                       tokenizer_dir, "f16")
    moe = Lfm2MoeConfig.preset("tiny-moe-top1")                  # no expert bias: not llama.cpp's routing
    with pytest.raises(ge.GgufError, match="use_expert_bias=False"):
        ge.write_model(out, moe, init_moe_tensors(moe, 0), tokenizer_dir, "f16")
    assert not out.parent.exists()


def test_a_failed_write_leaves_the_old_file(tmp_path, tokenizer_dir, monkeypatch):
    cfg = Lfm2Config(**TINY)
    out = ge.write_model(tmp_path / "m.gguf", cfg, tiny_tensors(cfg), tokenizer_dir, "f16")
    before = out.read_bytes()
    calls = []

    def failing(arr, qtype):
        calls.append(1)
        if len(calls) == 5:
            raise OSError(28, "No space left on device")
        return np.ascontiguousarray(arr, np.float32).astype(np.float16)

    monkeypatch.setattr(ge, "encoded", failing)
    with pytest.raises(OSError):
        ge.write_model(out, cfg, tiny_tensors(cfg, seed=1), tokenizer_dir, "f16")
    assert out.read_bytes() == before and sorted(p.name for p in tmp_path.iterdir()) == ["m.gguf", "tok"]


def test_save_gguf(ctx, engine, tmp_path):
    """Lfm2Model.save_gguf: the model's own tensors; the tokenizer of the directory it was loaded from."""
    cfg = Lfm2Config(**{**TINY, "vocab_size": 102})
    model = Lfm2Model(cfg, ctx, engine, seed=4)
    with pytest.raises(ge.GgufError, match="needs tokenizer="):
        model.save_gguf(tmp_path / "x.gguf")
    r = gguf.GGUFReader(model.save_gguf(tmp_path / "m.gguf", "f32", tokenizer=ASSETS))
    by_name = {t.name: t for t in r.tensors}
    state = model.state_dict()
    for hf, name in expected_names(cfg).items():
        check_tensor(by_name[name], llama_layout(hf, state[hf]), "F32")
    save_checkpoint(tmp_path / "dir", cfg, state)
    shutil.copy(ASSETS / "tokenizer.json", tmp_path / "dir" / "tokenizer.json")
    loaded = Lfm2Model.from_pretrained(tmp_path / "dir", ctx, engine)
    r2 = gguf.GGUFReader(loaded.save_gguf(tmp_path / "m2.gguf", "f32"))
    assert [t.data.tobytes() for t in r2.tensors] == [t.data.tobytes() for t in r.tensors]
    loaded.add_lora(LoraConfig(r=2, target_modules=("q_proj",)))
    with pytest.raises(ge.GgufError, match="merge_lora"):
        loaded.save_gguf(tmp_path / "m3.gguf")


def test_save_gguf_of_an_moe_model(ctx, engine, tmp_path, tokenizer_dir):
    """The model holds its experts fused and its expert bias as a buffer: the same file as from the
    per-expert checkpoint tensors it was initialised from."""
    cfg = Lfm2MoeConfig.preset("tiny-moe")
    tensors = init_moe_tensors(cfg, seed=6)
    model = Lfm2Model(cfg, ctx, engine, tensors=tensors)
    model.save_gguf(tmp_path / "model.gguf", "bf16", tokenizer=tokenizer_dir)
    ge.write_model(tmp_path / "tensors.gguf", cfg, tensors, tokenizer_dir, "bf16")
    assert (tmp_path / "model.gguf").read_bytes() == (tmp_path / "tensors.gguf").read_bytes()


def test_moe_adapters(tmp_path):
    """An LFM2-MoE adapter on its linear layers is an lfm2moe LoRA file; one on the expert tensors has
    no llama.cpp LoRA form and is refused (it can be merged instead)."""
    cfg = Lfm2MoeConfig.preset("tiny-moe")
    lora = LoraConfig(r=2, alpha=4.0, target_modules=("k_proj", "w1"))
    r = gguf.GGUFReader(ge.write_adapter(tmp_path / "a.gguf", cfg, lora, init_weights(lora, lora.modules(cfg), 0)))
    assert r.fields["general.architecture"].contents() == "lfm2moe"
    assert sorted(t.name for t in r.tensors) == sorted(f"blk.{i}.{n}.weight.lora_{ab}" for ab in "ab"
                                                       for i, n in ((0, "ffn_gate"), (1, "attn_k"), (3, "attn_k")))
    experts = LoraConfig(r=2, target_modules=("q_proj",), target_parameters=("experts.gate_up_proj",))
    weights = init_weights(experts, experts.modules(cfg), 0, experts.parameters(cfg))
    with pytest.raises(ge.GgufError, match="merge it into the model"):
        ge.write_adapter(tmp_path / "e.gguf", cfg, experts, weights)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a.gguf"]
