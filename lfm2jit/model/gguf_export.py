"""GGUF files for llama.cpp (and Ollama, LM Studio): an LFM2 model (llama.cpp's ``lfm2``, an
LFM2-MoE one ``lfm2moe``) or a LoRA adapter of one, written with the ``gguf`` package
(llama.cpp's own Python writer) as llama.cpp's convert_hf_to_gguf.py / convert_lora_to_gguf.py
write them:

- metadata: block count, context length (``max_position_embeddings``), embedding length, the MLP
  width the tensors have (LFM2's ``block_auto_adjust_ff_dim`` applied), head count, the KV head
  count per layer (0 marks a conv layer: llama.cpp's recurrent layers), RoPE base, RMS-norm eps,
  ``shortconv.l_cache``, vocabulary size; an MoE model adds its expert counts and widths, the
  leading dense layers and sigmoid gating.
- tensors by llama.cpp's names (``gguf.get_tensor_name_map``): the conv weight [D, 1, L] squeezed
  to [D, L], an MoE layer's experts stacked per projection, no ``output.weight`` when the
  embedding is tied (llama.cpp reuses ``token_embd``).
- the tokenizer from tokenizer.json: tokens and their types (CONTROL for special ones, UNUSED
  ``[PADi]`` up to the model's vocabulary), ``gpt2`` (byte-level BPE) with pre-tokenizer ``lfm2``,
  and what ``gguf.SpecialVocab`` reads (merges, bos/eos/pad/unk ids, add_bos, chat template).

Types per tensor follow the converter: 1-D tensors, norms, the conv weight and the MoE router stay
f32; the rest is the outtype (f32, f16, bf16, or q8_0: blocks of 32 with an f16 scale, llama.cpp's
quantize_row_q8_0_ref), q8_0 falling back to f16 where a row is not a multiple of 32 long.
Every file is written beside its destination and renamed into place.
"""
from __future__ import annotations

import errno
import json
import os
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from ..safefiles import replace_with
from .checkpoint import check_tensors
from .lora import LoraConfig, peft_names
from .moe_checkpoint import moe_model_tensors
from .moe_config import Lfm2MoeConfig

OUTTYPES = ("f32", "f16", "bf16", "q8_0")
PRE_TOKENIZER = "lfm2"          # tokenizer.ggml.pre of LiquidAI/LFM2-Tokenizer in llama.cpp's converter


class GgufError(ValueError):
    """A model, adapter, tokenizer or outtype that cannot be written as llama.cpp reads it."""


def check_outtype(outtype: str) -> str:
    if outtype not in OUTTYPES:
        raise GgufError(f"outtype must be one of {', '.join(OUTTYPES)}, got {outtype!r}")
    return outtype


def _gguf():
    import gguf          # a runtime dependency, imported where a GGUF file is made
    return gguf


def _types(outtype: str):
    g = _gguf()
    q, f = g.GGMLQuantizationType, g.LlamaFileType
    return {"f32": (q.F32, f.ALL_F32), "f16": (q.F16, f.MOSTLY_F16), "bf16": (q.BF16, f.MOSTLY_BF16),
            "q8_0": (q.Q8_0, f.MOSTLY_Q8_0)}[check_outtype(outtype)]


def arch_of(cfg) -> str:
    return "lfm2moe" if isinstance(cfg, Lfm2MoeConfig) else "lfm2"


def check_supported(cfg) -> None:
    """What llama.cpp's lfm2 / lfm2moe cannot represent, refused before anything is written."""
    if cfg.conv_bias:
        raise GgufError("conv_bias is true: llama.cpp's LFM2 has no conv or projection biases")
    if isinstance(cfg, Lfm2MoeConfig):
        if not cfg.use_expert_bias or not cfg.norm_topk_prob or cfg.routed_scaling_factor != 1.0:
            raise GgufError("llama.cpp's lfm2moe routes as LFM2-8B-A1B does (use_expert_bias, norm_topk_prob, "
                            "routed_scaling_factor 1.0); this config has use_expert_bias="
                            f"{cfg.use_expert_bias}, norm_topk_prob={cfg.norm_topk_prob}, "
                            f"routed_scaling_factor={cfg.routed_scaling_factor}")


# ---- tensors ----
def _converter_form(name: str, arr: np.ndarray) -> list[tuple[str, np.ndarray]]:
    """One of the model's tensors as the names llama.cpp's converter maps, in llama.cpp's layout:
    the conv weight squeezed, an MoE layer's fused experts back into the converter's stacked w1 / w3
    / w2 (its "layers.N.feed_forward.experts.wK.weight"), the expert bias renamed ".expert_bias.bias"."""
    if name.endswith("conv.conv.weight"):
        return [(name, arr[:, 0, :])]                       # [D, 1, L] -> [D, L]: ggml's ssm_conv weight
    if name.endswith((".experts.gate_up_proj", ".experts.down_proj")):
        stem = name.removeprefix("model.").rpartition(".")[0] + "."
        if name.endswith("down_proj"):
            return [(stem + "w2.weight", arr)]              # [E, D, I]
        i = arr.shape[1] // 2                               # [E, 2I, D]: w1 rows, then w3 rows
        return [(stem + "w1.weight", arr[:, :i]), (stem + "w3.weight", arr[:, i:])]
    if name.endswith(".expert_bias"):
        return [(name + ".bias", arr)]
    return [(name, arr)]


def model_tensors(cfg, tensors: dict[str, np.ndarray]) -> list[tuple[str, np.ndarray]]:
    """(GGUF name, f32 array in llama.cpp's layout) for every tensor of a model of ``cfg``, from
    transformers-named ``tensors`` (a checkpoint's, either expert form, or ``Lfm2Model.state_dict()``),
    checked against the config first."""
    g = _gguf()
    check_supported(cfg)
    if isinstance(cfg, Lfm2MoeConfig):
        params, buffers = moe_model_tensors(cfg, tensors)
        named = {**params, **buffers}
    else:
        named = check_tensors(cfg, tensors)
    names = g.get_tensor_name_map(g.MODEL_ARCH.LFM2MOE if isinstance(cfg, Lfm2MoeConfig) else g.MODEL_ARCH.LFM2,
                                  cfg.num_hidden_layers)
    out = []
    for name, arr in named.items():
        for converted, part in _converter_form(name, np.asarray(arr, np.float32)):
            mapped = names.get_name(converted, try_suffixes=(".weight", ".bias"))
            if mapped is None:
                raise GgufError(f"{name}: no llama.cpp tensor name for it")
            out.append((mapped, np.ascontiguousarray(part)))
    return out


def tensor_type(name: str, arr: np.ndarray, outtype: str):
    """The GGML type the converter gives this tensor in an ``outtype`` file."""
    g = _gguf()
    q = g.GGMLQuantizationType
    base = name.rsplit(".", 1)[0] if name.endswith((".lora_a", ".lora_b")) else name
    if arr.ndim <= 1 or base.endswith("_norm.weight") or not base.endswith(".weight"):
        return q.F32
    if ".shortconv.conv." in base or ".ffn_gate_inp." in base:
        return q.F32
    want = _types(outtype)[0]
    if want == q.Q8_0 and arr.shape[-1] % 32:
        return q.F16                                  # the converter's fallback (gguf.QuantError)
    return want


def encoded(arr: np.ndarray, qtype) -> np.ndarray:
    """``arr`` stored as ``qtype`` (gguf.quants: f16 / bf16 rounded to nearest even, q8_0 blocks)."""
    return _gguf().quants.quantize(np.ascontiguousarray(arr, np.float32), qtype)


# ---- tokenizer ----
@dataclass
class Vocab:
    tokens: list[str]
    types: list[int]
    byte_level: bool                  # tokenizer.json's tokens are byte-level already (LFM2's are)
    merges: list[str]                 # a tokenizer that is not byte-level: its multi-byte characters' merges


def _has_type(node, kind: str) -> bool:
    if isinstance(node, dict):
        return node.get("type") == kind or any(_has_type(v, kind) for v in node.values())
    if isinstance(node, list):
        return any(_has_type(v, kind) for v in node)
    return False


def _looks_special(token: str) -> bool:
    """The converter's test for added tokens that act as control tokens."""
    return token in ("<pad>", "<mask>") or (token.startswith("<|") and token.endswith("|>"))


def tokenizer_file(tokenizer) -> Path:
    p = Path(tokenizer)
    p = p / "tokenizer.json" if p.is_dir() else p
    if not p.is_file():
        raise GgufError(f"{tokenizer}: no tokenizer.json (llama.cpp reads the vocabulary from the GGUF file)")
    return p


def read_vocab(tokenizer, vocab_size: int) -> Vocab:
    """The token list llama.cpp's ``gpt2`` tokenizer reads, ``vocab_size`` long (the model's),
    from a tokenizer.json (or its directory). A tokenizer that is not byte-level (such as
    lfm2jit's shipped character-level one) has its ordinary tokens spelt in GPT-2's byte-to-unicode
    alphabet, which llama.cpp's BPE looks tokens up in (" " -> "Ġ"), and merges that join each of its
    multi-byte characters' bytes; one with merges of its own is refused (llama.cpp would split text
    into words first, which such a tokenizer does not)."""
    path = tokenizer_file(tokenizer)
    try:
        tj = json.loads(path.read_text(encoding="utf-8"))
        model = tj["model"]
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise GgufError(f"{path}: not a readable tokenizer.json ({e})") from None
    if model.get("type", "BPE") != "BPE":
        raise GgufError(f"{path}: a {model.get('type')} tokenizer; llama.cpp's LFM2 reads a BPE one")
    byte_level = _has_type(tj.get("pre_tokenizer"), "ByteLevel") or _has_type(tj.get("decoder"), "ByteLevel")
    if not byte_level and model.get("merges"):
        raise GgufError(f"{path}: a BPE tokenizer with merges that is not byte-level; llama.cpp's BPE is "
                        "byte-level and would split text differently")
    by_id: dict[int, str] = {i: t for t, i in model.get("vocab", {}).items()}
    merges: list[str] = []
    if not byte_level:
        enc = _gguf().vocab.bytes_to_unicode()
        by_id = {i: "".join(enc[b] for b in t.encode("utf-8")) for i, t in by_id.items()}
        # a character of several bytes is several byte-level symbols in llama.cpp: merges join them
        # (within one character: a UTF-8 lead byte and the continuation bytes after it)
        joined: dict[str, None] = {}
        for token, i in sorted(model.get("vocab", {}).items(), key=lambda kv: kv[1]):
            spelt = by_id[i]
            if len(token) == 1:
                joined.update((f"{spelt[:k]} {spelt[k]}", None) for k in range(1, len(spelt)))
        merges = list(joined)
    added = {a["id"]: a for a in tj.get("added_tokens", [])}
    for i, a in added.items():
        by_id[i] = a["content"]
    if by_id and max(by_id) >= vocab_size:
        raise GgufError(f"{path}: the tokenizer has ids up to {max(by_id)} but the model's vocab_size is {vocab_size}")
    tt = _gguf().TokenType
    tokens, types = [], []
    for i in range(vocab_size):
        if i not in by_id:
            tokens.append(f"[PAD{i}]")
            types.append(tt.UNUSED)
        elif i in added:
            token = by_id[i]
            if added[i].get("special") or _looks_special(token):
                types.append(tt.CONTROL)
            else:
                token = token.replace("\u2581", " ")   # llama.cpp expects user-defined tokens pre-normalized
                types.append(tt.USER_DEFINED)
            tokens.append(token)
        else:
            tokens.append(by_id[i])
            types.append(tt.NORMAL)
    return Vocab(tokens, [int(t) for t in types], byte_level, merges)


def _add_vocab(w, tokenizer, vocab_size: int) -> None:
    g = _gguf()
    vocab = read_vocab(tokenizer, vocab_size)
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre(PRE_TOKENIZER)
    w.add_token_list(vocab.tokens)
    w.add_token_types(vocab.types)
    # special ids, add_bos/add_eos, the chat template (tokenizer_config.json's or chat_template.jinja),
    # and a byte-level tokenizer's merges
    special = g.SpecialVocab(tokenizer_file(tokenizer).parent, load_merges=vocab.byte_level, n_vocab=vocab_size)
    merges = special.merges if vocab.byte_level else vocab.merges
    special.merges, special.load_merges = [], False
    special.add_to_gguf(w, quiet=True)
    # llama.cpp's BPE needs the key even with no merges (a character-level vocabulary of ASCII)
    w.add_key_value(g.Keys.Tokenizer.MERGES, merges, g.GGUFValueType.ARRAY, sub_type=g.GGUFValueType.STRING)


# ---- metadata ----
def _add_hparams(w, cfg, outtype: str) -> None:
    g = _gguf()
    moe = isinstance(cfg, Lfm2MoeConfig)
    w.add_block_count(cfg.num_hidden_layers)
    w.add_context_length(cfg.max_position_embeddings)
    w.add_embedding_length(cfg.hidden_size)
    w.add_feed_forward_length(cfg.intermediate_size if moe else cfg.ff_dim)
    w.add_head_count(cfg.num_attention_heads)
    w.add_head_count_kv([cfg.num_key_value_heads if t == "full_attention" else 0 for t in cfg.layer_types])
    w.add_rope_freq_base(float(cfg.rope_theta))
    w.add_layer_norm_rms_eps(float(cfg.norm_eps))
    if moe:
        w.add_expert_count(cfg.num_experts)
        w.add_expert_used_count(cfg.num_experts_per_tok)
        w.add_expert_feed_forward_length(cfg.moe_intermediate_size)
        w.add_leading_dense_block_count(cfg.num_dense_layers)
        w.add_expert_gating_func(g.ExpertGatingFuncType.SIGMOID)
    w.add_vocab_size(cfg.vocab_size)
    w.add_shortconv_l_cache(cfg.conv_L_cache)
    w.add_file_type(_types(outtype)[1])
    w.add_quantization_version(g.GGML_QUANT_VERSION)


def _writer_class():
    g = _gguf()

    class Writer(g.GGUFWriter):
        """gguf's writer, which also writes an empty array whose element type is given (GGUF allows
        it; the package infers the type from the first element and so refuses one)."""
        def _pack_val(self, val, vtype, add_vtype, sub_type=None):
            if vtype == g.GGUFValueType.ARRAY and sub_type is not None and len(val) == 0:
                return (self._pack("I", vtype) if add_vtype else b"") + self._pack("I", sub_type) + self._pack("Q", 0)
            return super()._pack_val(val, vtype, add_vtype, sub_type)

    return Writer


def _write(path, arch: str, fill) -> Path:
    """A GGUFWriter on a temp file beside ``path``, filled by ``fill(writer)``, written and renamed
    into place; on any error the destination is untouched and the temp file gone."""
    path = Path(path)

    def write(tmp):
        w = _writer_class()(tmp, arch)
        try:
            fill(w)
            w.write_header_to_file()
            w.write_kv_data_to_file()
            w.write_tensors_to_file()
            w.flush()
            short = w.fout[0].tell() - os.path.getsize(tmp)
        except OSError as e:
            if e.errno is not None:
                raise
            short = 1                   # numpy's "N requested and M written": the disk's error not said
        finally:
            w.close()
        if short:
            _raise_disk_error(tmp, short)

    replace_with(path, write)
    return path


def _raise_disk_error(tmp, short: int) -> None:
    """gguf writes tensor data with numpy's tofile, which on a full disk writes short and either says
    nothing or raises without an errno: writing the missing bytes again raises the disk's own error
    (ENOSPC, EFBIG), so the message says what happened; the file never replaces the old one."""
    with open(tmp, "ab") as f:
        f.write(bytes(max(short, 1 << 16)))
        f.flush()
    raise OSError(errno.EIO, f"the file came out {short} bytes short", str(tmp))


def write_model(path, cfg, tensors: dict[str, np.ndarray], tokenizer, outtype: str = "f16",
                name: str | None = None) -> Path:
    """``path``: a GGUF file of the model ``cfg`` with ``tensors`` (transformers names) and the
    tokenizer.json ``tokenizer`` (a file or its directory, with tokenizer_config.json beside it)."""
    check_outtype(outtype)
    planned = [(n, a, tensor_type(n, a, outtype)) for n, a in model_tensors(cfg, tensors)]
    tokenizer_file(tokenizer)                                       # before any file is made
    read_vocab(tokenizer, cfg.vocab_size)

    def fill(w):
        g = _gguf()
        w.add_type(g.GGUFType.MODEL)
        w.add_name(name or "LFM2")
        _add_hparams(w, cfg, outtype)
        _add_vocab(w, tokenizer, cfg.vocab_size)
        for n, a, q in planned:
            w.add_tensor(n, encoded(a, q), raw_dtype=q)

    return _write(path, arch_of(cfg), fill)


# ---- LoRA adapters ----
def adapter_tensors(cfg, config: LoraConfig, peft: dict[str, np.ndarray]) -> list[tuple[str, np.ndarray]]:
    """(GGUF name, array) for each adapted module, as convert_lora_to_gguf.py names them:
    ``blk.N.<tensor>.weight.lora_a`` = A [r, in] and ``.lora_b`` = B [out, r]; ``peft`` is checked
    against the model (lora.check_weights) by the caller."""
    g = _gguf()
    check_supported(cfg)
    if config.target_parameters:
        raise GgufError("an adapter on MoE expert tensors (target_parameters) has no llama.cpp LoRA form; "
                        "merge it into the model instead (--merge)")
    names = g.get_tensor_name_map(g.MODEL_ARCH.LFM2MOE if isinstance(cfg, Lfm2MoeConfig) else g.MODEL_ARCH.LFM2,
                                  cfg.num_hidden_layers)
    out = []
    for module in config.modules(cfg):
        mapped = names.get_name(module + ".weight", try_suffixes=(".weight",))
        if mapped is None:
            raise GgufError(f"{module}: no llama.cpp tensor name for it")
        a, b = peft_names(module)
        out.append((mapped + ".lora_a", np.ascontiguousarray(peft[a], np.float32)))
        out.append((mapped + ".lora_b", np.ascontiguousarray(peft[b], np.float32)))
    return out


def lora_alpha(config: LoraConfig) -> float:
    """llama.cpp scales an adapter by alpha / r; rsLoRA's alpha / sqrt(r) is that with alpha * sqrt(r)
    (as convert_lora_to_gguf.py writes it)."""
    return float(config.alpha * np.sqrt(config.r)) if config.use_rslora else float(config.alpha)


def write_adapter(path, cfg, config: LoraConfig, peft: dict[str, np.ndarray], outtype: str = "f32",
                  name: str | None = None) -> Path:
    """``path``: a LoRA adapter GGUF (general.type = adapter) that ``llama-cli --lora`` applies to
    the model's GGUF."""
    check_outtype(outtype)
    planned = [(n, a, tensor_type(n, a, outtype)) for n, a in adapter_tensors(cfg, config, peft)]

    def fill(w):
        g = _gguf()
        w.add_type(g.GGUFType.ADAPTER)
        w.add_name(name or "LFM2 LoRA")
        w.add_string(g.Keys.Adapter.TYPE, "lora")
        w.add_float32(g.Keys.Adapter.LORA_ALPHA, lora_alpha(config))
        w.add_file_type(_types(outtype)[1])
        w.add_quantization_version(g.GGML_QUANT_VERSION)
        for n, a, q in planned:
            w.add_tensor(n, encoded(a, q), raw_dtype=q)

    return _write(path, arch_of(cfg), fill)
