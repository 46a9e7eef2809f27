"""The Llama-family decoder (Llama 2/3, Mistral, Qwen2, SmolLM) in plain torch: a step's tokens packed in one row,
Q/K/V and gate/up fused, a step's `LoraBatch` adding the adapters' deltas to the projections' outputs."""

from __future__ import annotations

import torch
from torch import nn

from tritium.backend.layers.activation import SiluAndMul
from tritium.backend.layers.attention import (
    Attention,
    AttentionBackend,
    AttentionMetadata,
    KVCache,
    get_attention_backend,
)
from tritium.backend.layers.linear import CpuPackedLinear
from tritium.backend.layers.norm import RMSNorm
from tritium.backend.layers.rotary import RotaryEmbedding
from tritium.backend.lora.weights import LoraBatch
from tritium.backend.model_config import ModelConfig

PROJECTIONS = ("qkv_proj", "o_proj", "gate_up_proj", "down_proj")


class LlamaDecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig, index: int, rotary: RotaryEmbedding, backend: AttentionBackend) -> None:
        super().__init__()
        self.index = index
        heads, kv_heads, head_dim = config.num_attention_heads, config.num_key_value_heads, config.head_dim
        self.q_size, self.kv_size = heads * head_dim, kv_heads * head_dim
        h = config.hidden_size
        self.qkv_proj = nn.Linear(h, self.q_size + 2 * self.kv_size, bias=config.attention_bias)
        self.o_proj = nn.Linear(self.q_size, h, bias=config.o_proj_bias)
        self.gate_up_proj = nn.Linear(h, 2 * config.intermediate_size, bias=config.mlp_bias)
        self.down_proj = nn.Linear(config.intermediate_size, h, bias=config.mlp_bias)
        self.input_layernorm = RMSNorm(h, config.rms_norm_eps, backend)
        self.post_attention_layernorm = RMSNorm(h, config.rms_norm_eps, backend)
        self.rotary = rotary
        self.attn = Attention(heads, kv_heads, head_dim, head_dim**-0.5, backend)
        self.act = SiluAndMul(backend)

    def forward(self, hidden: torch.Tensor, residual: torch.Tensor | None, positions: torch.Tensor,
                kv_cache: KVCache, meta: AttentionMetadata, lora: LoraBatch | None = None,
                ) -> tuple[torch.Tensor, torch.Tensor]:
        if residual is None:
            residual, x = hidden, self.input_layernorm(hidden)
        else:
            x, residual = self.input_layernorm.add(hidden, residual)
        qkv = self.qkv_proj(x)
        if lora is not None:
            lora.apply(self.index, "qkv_proj", x, qkv)
        n, attn = qkv.shape[0], self.attn
        # q, k and v stay strided views of the fused projection: every kernel takes strides.
        q = qkv[:, : self.q_size].view(n, attn.num_heads, attn.head_dim)
        k = qkv[:, self.q_size : self.q_size + self.kv_size].view(n, attn.num_kv_heads, attn.head_dim)
        v = qkv[:, self.q_size + self.kv_size :].view(n, attn.num_kv_heads, attn.head_dim)
        self.rotary(q, k, positions)
        out = attn(q, k, v, kv_cache, meta).reshape(n, self.q_size)
        hidden = self.o_proj(out)
        if lora is not None:
            lora.apply(self.index, "o_proj", out, hidden)
        x, residual = self.post_attention_layernorm.add(hidden, residual)
        gate_up = self.gate_up_proj(x)
        if lora is not None:
            lora.apply(self.index, "gate_up_proj", x, gate_up)
        act = self.act(gate_up)
        hidden = self.down_proj(act)
        if lora is not None:
            lora.apply(self.index, "down_proj", act, hidden)
        return hidden, residual


class LlamaForCausalLM(nn.Module):
    quantization: str | None = None  # "int8" or "int4" once quantize_model (quantization.py) has run

    def __init__(self, config: ModelConfig, backend: AttentionBackend | None = None,
                 max_positions: int | None = None) -> None:
        """`backend`: the kernels every layer calls (None: the torch references)."""
        super().__init__()
        backend = backend or get_attention_backend("torch", torch.device("cpu"))
        self.config = config
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.rotary = RotaryEmbedding(config.head_dim, config.rope_theta, config.rope_scaling,
                                      max_positions or config.max_position_embeddings, backend)
        self.layers = nn.ModuleList(LlamaDecoderLayer(config, i, self.rotary, backend)
                                    for i in range(config.num_hidden_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps, backend)
        self.lm_head = None if config.tie_word_embeddings else nn.Linear(config.hidden_size, config.vocab_size,
                                                                         bias=False)
        self.packed_lm_head: nn.Module | None = None  # CpuPackedLinear, or an Int8Linear / Int4Linear (quantization.py)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, kv_caches: list[KVCache],
                meta: AttentionMetadata, lora: LoraBatch | None = None) -> torch.Tensor:
        """Hidden states `[num_tokens, hidden]` after the final norm; `lora`: the step's adapter rows, if any."""
        hidden = self.embed_tokens(input_ids)
        residual = None
        for layer, kv_cache in zip(self.layers, kv_caches, strict=True):
            hidden, residual = layer(hidden, residual, positions, kv_cache, meta, lora)
        assert residual is not None
        return self.norm.add(hidden, residual)[0]

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """fp32 logits `[rows, vocab]` for the given hidden rows."""
        if self.packed_lm_head is not None:
            logits: torch.Tensor = self.packed_lm_head(hidden)
            return logits.float()
        return torch.nn.functional.linear(hidden, self.head_weight).float()

    @property
    def head_weight(self) -> torch.Tensor:
        """The logits projection's weight (the embedding's when tied)."""
        return self.embed_tokens.weight if self.lm_head is None else self.lm_head.weight

    def pack_for_cpu(self) -> None:
        """Swap every projection and the logits head for a CpuPackedLinear (CPU only; see cpu_packing_available)."""
        for layer in self.layers:
            for name in PROJECTIONS:
                linear = getattr(layer, name)
                setattr(layer, name, CpuPackedLinear(linear.weight, linear.bias))
        self.packed_lm_head = CpuPackedLinear(self.head_weight, None)
