"""A random Llama checkpoint with a real tokenizer: a model whose forward pass costs almost nothing, so
benchmarks and tests can measure everything around it (scheduling, sampling, detokenizing, serving)."""

from __future__ import annotations

import json
import math
import shutil
from collections.abc import Callable
from pathlib import Path

import torch
from safetensors.torch import save_file

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json")


def write_random_llama(dest: Path, tokenizer_from: Path, num_layers: int = 2, hidden_size: int = 64,
                       num_heads: int = 4, num_kv_heads: int = 2, intermediate_size: int = 128,
                       max_position_embeddings: int = 2048, seed: int = 0) -> Path:
    """Write a Hugging Face Llama folder (config.json, model.safetensors, the tokenizer files of
    `tokenizer_from`) with normal(0, 0.2) weights; the vocabulary is the tokenizer's. Returns `dest`."""
    source = json.loads((tokenizer_from / "config.json").read_text(encoding="utf-8"))
    vocab = int(source["vocab_size"])
    head_dim = hidden_size // num_heads
    config = {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": vocab,
        "hidden_size": hidden_size, "intermediate_size": intermediate_size, "num_hidden_layers": num_layers,
        "num_attention_heads": num_heads, "num_key_value_heads": num_kv_heads, "head_dim": head_dim,
        "rms_norm_eps": 1e-5, "rope_theta": 10000.0, "max_position_embeddings": max_position_embeddings,
        "tie_word_embeddings": False, "hidden_act": "silu", "torch_dtype": "float32",
        "bos_token_id": source.get("bos_token_id", 1), "eos_token_id": source.get("eos_token_id", 2),
    }
    g = torch.Generator().manual_seed(seed)

    def rand(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=g) * 0.2

    tensors = {"model.embed_tokens.weight": rand(vocab, hidden_size), "model.norm.weight": torch.ones(hidden_size),
               "lm_head.weight": rand(vocab, hidden_size)}
    ones = torch.ones(hidden_size)
    for i in range(num_layers):
        tensors |= layer_tensors(i, hidden_size, num_heads * head_dim, num_kv_heads * head_dim, intermediate_size,
                                 lambda out_features, in_features: rand(out_features, in_features), ones)
    dest.mkdir(parents=True, exist_ok=True)
    (dest / "config.json").write_text(json.dumps(config, indent=2), encoding="utf-8")
    save_file(tensors, str(dest / "model.safetensors"), metadata={"format": "pt"})
    for name in TOKENIZER_FILES:
        if (tokenizer_from / name).is_file():
            shutil.copy(tokenizer_from / name, dest / name)
    return dest


def layer_tensors(index: int, hidden: int, q_size: int, kv_size: int, intermediate: int,
                  linear: Callable[[int, int], torch.Tensor], ones: torch.Tensor) -> dict[str, torch.Tensor]:
    """Decoder layer `index`'s tensors under Hugging Face names: projections `linear(out, in)`, norms `ones`."""
    p = f"model.layers.{index}."
    return {
        p + "self_attn.q_proj.weight": linear(q_size, hidden),
        p + "self_attn.k_proj.weight": linear(kv_size, hidden),
        p + "self_attn.v_proj.weight": linear(kv_size, hidden),
        p + "self_attn.o_proj.weight": linear(hidden, q_size),
        p + "mlp.gate_proj.weight": linear(intermediate, hidden),
        p + "mlp.up_proj.weight": linear(intermediate, hidden),
        p + "mlp.down_proj.weight": linear(hidden, intermediate),
        p + "input_layernorm.weight": ones.clone(),
        p + "post_attention_layernorm.weight": ones.clone(),
    }


LLAMA_8B_LIKE = {"hidden_size": 4096, "num_attention_heads": 32, "num_key_value_heads": 8, "head_dim": 128,
                 "intermediate_size": 14336}
SHAPE_FIELDS = ("num_hidden_layers", "hidden_size", "num_attention_heads", "num_key_value_heads", "head_dim",
                "intermediate_size", "tie_word_embeddings")
CONFIG_FILES = ("generation_config.json", "chat_template.jinja")


def write_random_like(dest: Path, source: Path, dtype: torch.dtype = torch.bfloat16, device: str = "cpu",
                      seed: int = 0, **shape: int | bool) -> Path:
    """A Llama folder with `source`'s config (`shape`'s fields replaced) and tokenizer, weights of std
    1/sqrt(fan-in) (activations keep their scale at any width). Raises ValueError for a field outside SHAPE_FIELDS."""
    unknown = set(shape) - set(SHAPE_FIELDS)
    if unknown:
        raise ValueError(f"not a shape field: {sorted(unknown)} (known: {', '.join(SHAPE_FIELDS)})")
    config = json.loads((source / "config.json").read_text(encoding="utf-8")) | dict(shape)
    hidden, heads = int(config["hidden_size"]), int(config["num_attention_heads"])
    kv_heads = int(config.get("num_key_value_heads", heads))
    head_dim = int(config.get("head_dim") or hidden // heads)
    inter, vocab = int(config["intermediate_size"]), int(config["vocab_size"])
    config |= {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "head_dim": head_dim,
               "torch_dtype": str(dtype).removeprefix("torch.")}
    config.pop("quantization_config", None)
    g = torch.Generator(device=device).manual_seed(seed)

    def linear(out_features: int, in_features: int) -> torch.Tensor:
        w = torch.randn(out_features, in_features, generator=g, device=device, dtype=torch.float32)
        w.mul_(1.0 / math.sqrt(in_features))
        return w.to(dtype).cpu()

    ones = torch.ones(hidden, dtype=dtype)
    tensors = {"model.embed_tokens.weight": torch.randn(vocab, hidden, generator=g, device=device).to(dtype).cpu(),
               "model.norm.weight": ones}
    if not config.get("tie_word_embeddings", False):
        tensors["lm_head.weight"] = linear(vocab, hidden)
    for i in range(int(config["num_hidden_layers"])):
        p = f"model.layers.{i}."
        tensors |= layer_tensors(i, hidden, heads * head_dim, kv_heads * head_dim, inter, linear, ones)
        if config.get("attention_bias"):
            tensors |= {p + "self_attn.q_proj.bias": torch.zeros(heads * head_dim, dtype=dtype),
                        p + "self_attn.k_proj.bias": torch.zeros(kv_heads * head_dim, dtype=dtype),
                        p + "self_attn.v_proj.bias": torch.zeros(kv_heads * head_dim, dtype=dtype)}
    dest.mkdir(parents=True, exist_ok=True)
    (dest / "config.json").write_text(json.dumps(config, indent=2), encoding="utf-8")
    save_file(tensors, str(dest / "model.safetensors"), metadata={"format": "pt"})
    for name in TOKENIZER_FILES + CONFIG_FILES:
        if (source / name).is_file():
            shutil.copy(source / name, dest / name)
    return dest
