"""A random Llama checkpoint with a real tokenizer: a model whose forward pass costs almost nothing, so
benchmarks and tests can measure everything around it (scheduling, sampling, detokenizing, serving)."""

from __future__ import annotations

import json
import shutil
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
    for i in range(num_layers):
        p = f"model.layers.{i}."
        tensors |= {
            p + "self_attn.q_proj.weight": rand(num_heads * head_dim, hidden_size),
            p + "self_attn.k_proj.weight": rand(num_kv_heads * head_dim, hidden_size),
            p + "self_attn.v_proj.weight": rand(num_kv_heads * head_dim, hidden_size),
            p + "self_attn.o_proj.weight": rand(hidden_size, num_heads * head_dim),
            p + "mlp.gate_proj.weight": rand(intermediate_size, hidden_size),
            p + "mlp.up_proj.weight": rand(intermediate_size, hidden_size),
            p + "mlp.down_proj.weight": rand(hidden_size, intermediate_size),
            p + "input_layernorm.weight": torch.ones(hidden_size),
            p + "post_attention_layernorm.weight": torch.ones(hidden_size),
        }
    dest.mkdir(parents=True, exist_ok=True)
    (dest / "config.json").write_text(json.dumps(config, indent=2), encoding="utf-8")
    save_file(tensors, str(dest / "model.safetensors"), metadata={"format": "pt"})
    for name in TOKENIZER_FILES:
        if (tokenizer_from / name).is_file():
            shutil.copy(tokenizer_from / name, dest / name)
    return dest
