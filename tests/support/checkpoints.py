"""Tiny random checkpoints written with transformers (llama, mistral, qwen2, qwen3, phi3, gemma2, gemma3, qwen3_moe,
mixtral, gpt_oss), with the default model's tokenizer."""

from __future__ import annotations

import shutil
from pathlib import Path

import torch

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json")
# Gemma's own sizes for tiny models: a head_dim and an attention scale of their own, a window shorter than prompts
GEMMA_TINY = {"head_dim": 32, "query_pre_attn_scalar": 24, "sliding_window": 8}
# 8 experts of 32, top 2; Qwen3-MoE's layer 1 keeps a dense MLP (decoder_sparse_step 1, mlp_only_layers [1])
MOE_TINY = {"num_experts_per_tok": 2, "num_experts": 8, "moe_intermediate_size": 32, "norm_topk_prob": True,
            "mlp_only_layers": [1], "head_dim": 32}
# gpt-oss: 4 experts of 32, top 2; 4 layers alternating sliding (window 8) / full
GPT_OSS_TINY = {"head_dim": 32, "num_local_experts": 4, "num_experts_per_tok": 2, "intermediate_size": 32,
                "num_hidden_layers": 4, "sliding_window": 8}


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
    elif kind == "qwen3_moe":
        config = transformers.Qwen3MoeConfig(**(MOE_TINY | common))
        cls = transformers.Qwen3MoeForCausalLM
    elif kind == "mixtral":  # each expert's intermediate size is intermediate_size
        experts = {"num_local_experts": 8, "num_experts_per_tok": 2, "sliding_window": None}
        config = transformers.MixtralConfig(**(experts | common | {"intermediate_size": overrides.get(
            "intermediate_size", 32)}))
        cls = transformers.MixtralForCausalLM
    elif kind == "gpt_oss":
        config = transformers.GptOssConfig(**(common | GPT_OSS_TINY | overrides))
        cls = transformers.GptOssForCausalLM
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
    if kind == "gpt_oss":  # transformers zeroes the projections' and experts' biases: random ones (and sinks) test them
        with torch.no_grad():
            for name, param in model.named_parameters():
                if name.endswith(("bias", "sinks")):
                    param.normal_(0.0, 1.0 if name.endswith("sinks") else 0.2)
    model.save_pretrained(dest, max_shard_size="2MB" if shard else "5GB")
    for name in TOKENIZER_FILES:
        shutil.copy(tokenizer_from / name, dest / name)
    return dest
