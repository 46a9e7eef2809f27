"""Gemma 2 and Gemma 3 (text) in plain torch, laid out as llama.py is (packed tokens, Q/K/V and gate/up fused,
LoRA on the same projections), with what Gemma adds: embeddings scaled by sqrt(hidden), RMSNorm scaling by 1 + w
(folded into the weights at load), a norm on the attention output and on each side of the MLP, gelu-tanh, a
query_pre_attn_scalar attention scale, sliding and full layers; Gemma 2 soft-caps attention scores and logits,
Gemma 3 norms q and k per head and rotates its sliding layers with a rotary base of their own."""

from __future__ import annotations

from typing import ClassVar

import torch

from tritium.backend.layers.attention import (
    AttentionBackend,
    AttentionMetadata,
    KVCache,
)
from tritium.backend.layers.norm import RMSNorm
from tritium.backend.layers.rotary import RotaryEmbedding
from tritium.backend.lora.weights import LoraBatch
from tritium.backend.model_config import ModelConfig
from tritium.backend.models.base import CausalLM
from tritium.backend.models.llama import LlamaDecoderLayer


class GemmaDecoderLayer(LlamaDecoderLayer):
    """Llama's attention and MLP blocks (the config sets Gemma's scale, soft-cap, q/k norms and GELU), each block's
    output normed before the residual add, and the MLP's input normed after it."""

    def __init__(self, config: ModelConfig, index: int, rotary: RotaryEmbedding, backend: AttentionBackend) -> None:
        super().__init__(config, index, rotary, backend)
        self.pre_feedforward_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, backend)
        self.post_feedforward_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, backend)

    def forward(self, hidden: torch.Tensor, residual: torch.Tensor | None, positions: torch.Tensor,
                kv_cache: KVCache, meta: AttentionMetadata, lora: LoraBatch | None = None,
                ) -> tuple[torch.Tensor, torch.Tensor]:
        x, residual = self.input_norm(hidden, residual)
        attended = self.post_attention_layernorm(self.attention(x, positions, kv_cache, meta, lora))
        x, residual = self.pre_feedforward_layernorm.add(attended, residual)
        return self.post_feedforward_layernorm(self.mlp(x, lora)), residual


class GemmaForCausalLM(CausalLM):
    """Gemma 2 and Gemma 3 (text): the config says which parts apply (qk_norm, local_rope_theta, soft-capping)."""

    LAYER_WEIGHTS: ClassVar[dict[str, str]] = {
        **CausalLM.LAYER_WEIGHTS,
        "pre_feedforward_layernorm.weight": "pre_feedforward_layernorm.weight",
        "post_feedforward_layernorm.weight": "post_feedforward_layernorm.weight",
        "self_attn.q_norm.weight": "q_norm.weight",
        "self_attn.k_norm.weight": "k_norm.weight",
    }

    def __init__(self, config: ModelConfig, backend: AttentionBackend | None = None,
                 max_positions: int | None = None) -> None:
        super().__init__(config, backend, max_positions)
        backend, positions = self.backend, self.max_positions
        self.rotary = RotaryEmbedding(config.head_dim, config.rope_theta, config.rope_scaling, positions, backend)
        self.local_rotary = self.rotary
        if config.local_rope_theta is not None:
            self.local_rotary = RotaryEmbedding(config.head_dim, config.local_rope_theta, config.local_rope_scaling,
                                                positions, backend)
        self.layers.extend(
            GemmaDecoderLayer(config, i, self.rotary if config.window_of(i) is None else self.local_rotary, backend)
            for i in range(config.num_hidden_layers)
        )
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps, backend)

    @classmethod
    def convert_weight(cls, key: str, tensor: torch.Tensor) -> torch.Tensor:
        # Gemma's norms scale by 1 + w, in fp32: folded in here, so that the shared kernel's w * x serves.
        return tensor.float() + 1.0 if key.endswith("norm.weight") else tensor

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, kv_caches: list[KVCache],
                meta: AttentionMetadata, lora: LoraBatch | None = None) -> torch.Tensor:
        # sqrt(hidden) rounded to the weights' dtype first, as transformers does (bf16: 55.5 for 3072, not 55.43)
        dtype = self.embed_tokens.weight.dtype
        scale = torch.tensor(self.config.hidden_size**0.5, dtype=torch.float32).to(dtype).item()
        hidden = self.embed_tokens(input_ids) * scale
        residual = None
        for layer, kv_cache in zip(self.layers, kv_caches, strict=True):
            hidden, residual = layer(hidden, residual, positions, kv_cache, meta, lora)
        assert residual is not None
        return self.norm.add(hidden, residual)[0]

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        logits = super().compute_logits(hidden)
        if (cap := self.config.final_logit_softcapping) is not None:
            logits = torch.tanh(logits / cap) * cap
        return logits

    def rotaries(self) -> list[RotaryEmbedding]:
        return [self.rotary] if self.local_rotary is self.rotary else [self.rotary, self.local_rotary]
