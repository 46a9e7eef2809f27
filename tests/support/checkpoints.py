"""Tiny random checkpoints written with transformers (llama, mistral, qwen2), with the default model's tokenizer."""

from __future__ import annotations

import shutil
from pathlib import Path

import torch

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json")


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
    else:
        config = transformers.Qwen2Config(tie_word_embeddings=True, rope_theta=1000000.0, **common)
        cls = transformers.Qwen2ForCausalLM
    torch.manual_seed(1234)
    model = cls(config).eval()
    model.save_pretrained(dest, max_shard_size="2MB" if shard else "5GB")
    for name in TOKENIZER_FILES:
        shutil.copy(tokenizer_from / name, dest / name)
    return dest
