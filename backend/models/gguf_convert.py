"""Convert a Llama-architecture GGUF file into a Hugging Face folder: fp32 weights (llama.cpp's Q/K row
permutation undone), and the byte-level BPE tokenizer and chat template from the GGUF metadata."""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt
import torch
from gguf import GGUFReader
from gguf.quants import dequantize
from safetensors.torch import save_file
from tokenizers import AddedToken, decoders, models, pre_tokenizers, processors
from tokenizers import Tokenizer as HFTokenizer
from tqdm import tqdm

_CONTROL = 3  # llama.cpp token type for control (special) tokens
_TENSOR_NAMES = {
    "attn_norm.weight": "input_layernorm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "attn_q.weight": "self_attn.q_proj.weight",
    "attn_k.weight": "self_attn.k_proj.weight",
    "attn_v.weight": "self_attn.v_proj.weight",
    "attn_output.weight": "self_attn.o_proj.weight",
    "ffn_gate.weight": "mlp.gate_proj.weight",
    "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
}


def _field(reader: GGUFReader, key: str, default: Any = None) -> Any:
    f = reader.fields.get(key)
    return default if f is None else f.contents()


def unpermute_qk(weight: npt.NDArray[Any], num_heads: int) -> npt.NDArray[Any]:
    """Undo llama.cpp's interleaving of the rotary halves in Q/K rows (`[out, in]`)."""
    out, rest = weight.shape[0], weight.shape[1:]
    half = out // num_heads // 2
    return weight.reshape(num_heads, half, 2, *rest).swapaxes(1, 2).reshape(weight.shape)


def build_config(reader: GGUFReader) -> tuple[dict[str, Any], dict[str, Any]]:
    """(config.json, generation_config.json) contents. Raises ValueError for an architecture other than llama."""
    arch = _field(reader, "general.architecture")
    if arch != "llama":
        raise ValueError(f"GGUF architecture {arch!r} is not supported (only 'llama')")
    p = "llama."
    heads = int(_field(reader, p + "attention.head_count"))
    hidden = int(_field(reader, p + "embedding_length"))
    tokens = _field(reader, "tokenizer.ggml.tokens")
    has_output = any(t.name == "output.weight" for t in reader.tensors)
    bos = _field(reader, "tokenizer.ggml.bos_token_id")
    eos = _field(reader, "tokenizer.ggml.eos_token_id")
    pad = _field(reader, "tokenizer.ggml.padding_token_id", eos)
    eps = float(f"{float(_field(reader, p + 'attention.layer_norm_rms_epsilon')):.6g}")
    config = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "vocab_size": len(tokens),
        "hidden_size": hidden,
        "intermediate_size": int(_field(reader, p + "feed_forward_length")),
        "num_hidden_layers": int(_field(reader, p + "block_count")),
        "num_attention_heads": heads,
        "num_key_value_heads": int(_field(reader, p + "attention.head_count_kv", heads)),
        "head_dim": hidden // heads,
        "hidden_act": "silu",
        "max_position_embeddings": int(_field(reader, p + "context_length")),
        "rms_norm_eps": eps,
        "rope_theta": float(_field(reader, p + "rope.freq_base", 10000.0)),
        "tie_word_embeddings": not has_output,
        "attention_bias": False,
        "mlp_bias": False,
        "initializer_range": 0.02,
        "bos_token_id": bos,
        "eos_token_id": eos,
        "pad_token_id": pad,
        "torch_dtype": "float32",
    }
    generation = {"bos_token_id": bos, "eos_token_id": eos, "pad_token_id": pad}
    return config, generation


def build_tokenizer(reader: GGUFReader) -> tuple[HFTokenizer, dict[str, Any]]:
    """The tokenizer and tokenizer_config.json's contents. Raises ValueError for a tokenizer other than gpt2's."""
    model = _field(reader, "tokenizer.ggml.model")
    if model != "gpt2":
        raise ValueError(f"GGUF tokenizer model {model!r} is not supported (only byte-level BPE 'gpt2')")
    tokens: list[str] = _field(reader, "tokenizer.ggml.tokens")
    types: list[int] = _field(reader, "tokenizer.ggml.token_type")
    merges = [tuple(m.split(" ", 1)) for m in _field(reader, "tokenizer.ggml.merges")]
    vocab = {t: i for i, t in enumerate(tokens)}
    tok = HFTokenizer(models.BPE(vocab=vocab, merges=merges, fuse_unk=False, byte_fallback=False))
    split_digits = _field(reader, "tokenizer.ggml.pre") in ("smollm", "starcoder", "refact", "qwen2")
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=True, use_regex=True)
    if split_digits:
        tok.pre_tokenizer = pre_tokenizers.Sequence(
            [pre_tokenizers.Digits(individual_digits=True), byte_level]
        )
    else:
        tok.pre_tokenizer = byte_level
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    specials = [tokens[i] for i, kind in enumerate(types) if kind == _CONTROL]
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in specials])

    def name(key: str) -> str | None:
        idx = _field(reader, key)
        return None if idx is None else tokens[int(idx)]

    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": name("tokenizer.ggml.bos_token_id"),
        "eos_token": name("tokenizer.ggml.eos_token_id"),
        "unk_token": name("tokenizer.ggml.unknown_token_id"),
        "pad_token": name("tokenizer.ggml.padding_token_id"),
        "add_bos_token": bool(_field(reader, "tokenizer.ggml.add_bos_token", False)),
        "add_prefix_space": False,
        "clean_up_tokenization_spaces": False,
        "model_max_length": int(_field(reader, "llama.context_length")),
        "chat_template": _field(reader, "tokenizer.chat_template"),
    }
    return tok, config


def convert_weights(reader: GGUFReader, config: dict[str, Any], progress: bool = True) -> dict[str, torch.Tensor]:
    """Dequantized fp32 tensors under their Hugging Face names."""
    heads, kv_heads = config["num_attention_heads"], config["num_key_value_heads"]
    out: dict[str, torch.Tensor] = {}
    for t in tqdm(reader.tensors, desc="converting weights", unit="tensor", disable=not progress):
        w = np.asarray(dequantize(t.data, t.tensor_type), dtype=np.float32)
        if t.name == "token_embd.weight":
            name = "model.embed_tokens.weight"
        elif t.name == "output_norm.weight":
            name = "model.norm.weight"
        elif t.name == "output.weight":
            name = "lm_head.weight"
        elif t.name.startswith("blk."):
            _, layer, rest = t.name.split(".", 2)
            if rest not in _TENSOR_NAMES:
                continue
            name = f"model.layers.{layer}.{_TENSOR_NAMES[rest]}"
            if rest == "attn_q.weight":
                w = unpermute_qk(w, heads)
            elif rest == "attn_k.weight":
                w = unpermute_qk(w, kv_heads)
        else:
            continue
        out[name] = torch.from_numpy(np.array(w, dtype=np.float32, order="C", copy=True))
    return out


def convert_gguf(gguf_path: str | Path, dest: str | Path, progress: bool = True) -> Path:
    """Returns `dest`, untouched when it exists. Built under a temporary name and renamed, so a killed conversion
    leaves no half folder."""
    dest = Path(dest)
    if (dest / "config.json").is_file():
        return dest
    dest.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{dest.name}.tmp-", dir=dest.parent))
    try:
        reader = GGUFReader(str(gguf_path))
        config, generation = build_config(reader)
        tokenizer, tok_config = build_tokenizer(reader)
        tensors = convert_weights(reader, config, progress)
        save_file(tensors, str(tmp / "model.safetensors"), metadata={"format": "pt"})
        tokenizer.save(str(tmp / "tokenizer.json"))
        for fname, content in (
            ("config.json", config),
            ("generation_config.json", generation),
            ("tokenizer_config.json", tok_config),
        ):
            (tmp / fname).write_text(json.dumps(content, indent=2, ensure_ascii=False), encoding="utf-8")
        tmp.chmod(0o755)
        (tmp / "model.safetensors").chmod(0o644)
        try:
            os.rename(tmp, dest)
        except OSError:
            if not (dest / "config.json").is_file():  # a concurrent converter did not win either
                raise
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    return dest
