"""Tiny random checkpoints written with transformers (llama, mistral, qwen2, qwen3, phi3, gemma2, gemma3), with the
default model's tokenizer."""

from __future__ import annotations

import shutil
from pathlib import Path

import torch

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json")
# Gemma's own sizes for tiny models: a head_dim and an attention scale of their own, a window shorter than prompts
GEMMA_TINY = {"head_dim": 32, "query_pre_attn_scalar": 24, "sliding_window": 8}


def save_tiny(kind: str, dest: Path, tokenizer_from: Path, shard: bool = False, **overrides: object) -> Path:
    import transformers

    common = dict(
        vocab_size=49152, hidden_size=64, intermediate_size=128, num_hidden_layers=3,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024,
        bos_token_id=1, eos_token_id=2, pad_token_id=2, initializer_range=0.2,
    )
    common.update(overrides)
    if kind == "llama":
        config = transformers.LlamaConfig(tie_word_embeddings=False, rope_theta=10000.0, **common)
        cls = transformers.LlamaForCausalLM
    elif kind == "mistral":
        config = transformers.MistralConfig(tie_word_embeddings=False, sliding_window=None, **common)
        cls = transformers.MistralForCausalLM
    elif kind == "gemma2":  # layers alternate sliding / full
        config = transformers.Gemma2Config(**(GEMMA_TINY | common))
        cls = transformers.Gemma2ForCausalLM
    elif kind == "gemma3":
        config = transformers.Gemma3TextConfig(**(GEMMA_TINY | {"sliding_window_pattern": 2} | common))
        cls = transformers.Gemma3ForCausalLM
    elif kind == "qwen3":  # a head_dim of its own, as Qwen3's are
        config = transformers.Qwen3Config(**({"head_dim": 32, "rope_theta": 1000000.0} | common))
        cls = transformers.Qwen3ForCausalLM
    elif kind == "phi3":
        config = transformers.Phi3Config(**common)
        cls = transformers.Phi3ForCausalLM
    else:
        config = transformers.Qwen2Config(tie_word_embeddings=True, rope_theta=1000000.0, **common)
        cls = transformers.Qwen2ForCausalLM
    torch.manual_seed(1234)
    model = cls(config).eval()
    if kind.startswith("gemma"):  # its norms start at 0 (a scale of 1 + 0): random ones check the scale
        with torch.no_grad():
            for name, param in model.named_parameters():
                if name.endswith("norm.weight"):
                    param.normal_(0.0, 0.5)
    model.save_pretrained(dest, max_shard_size="2MB" if shard else "5GB")
    for name in TOKENIZER_FILES:
        shutil.copy(tokenizer_from / name, dest / name)
    return dest
