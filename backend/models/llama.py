"""The Llama-family decoder (Llama 2/3, Mistral, Qwen2, Qwen3, Phi-3/Phi-4, SmolLM) in plain torch: a step's tokens
packed in one row, Q/K/V and gate/up fused, a step's `LoraBatch` adding the adapters' deltas to the projections'
outputs. The config switches on what a family adds: Qwen3's per-head q/k norms, Phi's partial rotary, sliding
windows; the subclasses only name their checkpoints' tensors."""

from __future__ import annotations

from typing import ClassVar

import torch
from torch import nn

from tritium.backend.layers.activation import GatedActivation
from tritium.backend.layers.attention import (
    Attention,
    AttentionBackend,
    AttentionMetadata,
    KVCache,
)
from tritium.backend.layers.norm import RMSNorm
from tritium.backend.layers.rotary import RotaryEmbedding
from tritium.backend.lora.weights import LoraBatch
from tritium.backend.model_config import ModelConfig
from tritium.backend.models.base import CausalLM


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
        # Qwen3, Gemma 3: each head's q and k RMS-normed (weights of head_dim) before rotary
        self.q_norm = RMSNorm(head_dim, config.rms_norm_eps, backend) if config.qk_norm else None
        self.k_norm = RMSNorm(head_dim, config.rms_norm_eps, backend) if config.qk_norm else None
        self.rotary = rotary
        scale = (config.query_pre_attn_scalar or head_dim) ** -0.5
        self.attn = Attention(heads, kv_heads, head_dim, scale, backend, config.window_of(index),
                              config.attn_logit_softcapping)
        self.act = GatedActivation(config.hidden_act, backend)

    def forward(self, hidden: torch.Tensor, residual: torch.Tensor | None, positions: torch.Tensor,
                kv_cache: KVCache, meta: AttentionMetadata, lora: LoraBatch | None = None,
                ) -> tuple[torch.Tensor, torch.Tensor]:
        x, residual = self.input_norm(hidden, residual)
        x, residual = self.post_attention_layernorm.add(self.attention(x, positions, kv_cache, meta, lora), residual)
        return self.mlp(x, lora), residual

    def input_norm(self, hidden: torch.Tensor, residual: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
        """(the normed input, the residual stream): the first layer's residual is its input."""
        if residual is None:
            return self.input_layernorm(hidden), hidden
        return self.input_layernorm.add(hidden, residual)

    def attention(self, x: torch.Tensor, positions: torch.Tensor, kv_cache: KVCache, meta: AttentionMetadata,
                  lora: LoraBatch | None) -> torch.Tensor:
        """The attention block on the normed `x`, through o_proj."""
        qkv = self.qkv_proj(x)
        if lora is not None:
            lora.apply(self.index, "qkv_proj", x, qkv)
        n, attn = qkv.shape[0], self.attn
        # q, k and v stay strided views of the fused projection: every kernel takes strides.
        q = qkv[:, : self.q_size].view(n, attn.num_heads, attn.head_dim)
        k = qkv[:, self.q_size : self.q_size + self.kv_size].view(n, attn.num_kv_heads, attn.head_dim)
        v = qkv[:, self.q_size + self.kv_size :].view(n, attn.num_kv_heads, attn.head_dim)
        if self.q_norm is not None and self.k_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)  # new tensors, which rotary rotates in place
        self.rotary(q, k, positions)
        out = attn(q, k, v, kv_cache, meta).reshape(n, self.q_size)
        hidden: torch.Tensor = self.o_proj(out)
        if lora is not None:
            lora.apply(self.index, "o_proj", out, hidden)
        return self.attn.backend.parallel.all_reduce(hidden)  # row-parallel: the ranks' parts summed

    def mlp(self, x: torch.Tensor, lora: LoraBatch | None) -> torch.Tensor:
        """The gated MLP on the normed `x`."""
        gate_up = self.gate_up_proj(x)
        if lora is not None:
            lora.apply(self.index, "gate_up_proj", x, gate_up)
        act = self.act(gate_up)
        hidden: torch.Tensor = self.down_proj(act)
        if lora is not None:
            lora.apply(self.index, "down_proj", act, hidden)
        return self.attn.backend.parallel.all_reduce(hidden)


class LlamaForCausalLM(CausalLM):
    decoder_layer: ClassVar[type[LlamaDecoderLayer]] = LlamaDecoderLayer  # what each layer is (MoE models: theirs)

    def __init__(self, config: ModelConfig, backend: AttentionBackend | None = None,
                 max_positions: int | None = None) -> None:
        super().__init__(config, backend, max_positions)
        backend = self.backend
        rotary_dim = int(config.head_dim * config.partial_rotary_factor)  # the first features of each head rotate
        self.rotary = RotaryEmbedding(rotary_dim, config.rope_theta, config.rope_scaling, self.max_positions, backend)
        self.layers.extend(self.decoder_layer(config, i, self.rotary, backend) for i in range(config.num_hidden_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps, backend)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, kv_caches: list[KVCache],
                meta: AttentionMetadata, lora: LoraBatch | None = None) -> torch.Tensor:
        hidden = self.embed_tokens(input_ids)
        residual = None
        for layer, kv_cache in zip(self.layers, kv_caches, strict=True):
            hidden, residual = layer(hidden, residual, positions, kv_cache, meta, lora)
        assert residual is not None
        return self.norm.add(hidden, residual)[0]

    def rotaries(self) -> list[RotaryEmbedding]:
        return [self.rotary]


class Qwen3ForCausalLM(LlamaForCausalLM):
    """Qwen3: Llama with q_norm / k_norm (its config sets qk_norm)."""

    LAYER_WEIGHTS: ClassVar[dict[str, str]] = {
        **LlamaForCausalLM.LAYER_WEIGHTS,
        "self_attn.q_norm.weight": "q_norm.weight",
        "self_attn.k_norm.weight": "k_norm.weight",
    }


class Phi3ForCausalLM(LlamaForCausalLM):
    """Phi-3 and Phi-4: Llama whose checkpoints hold q/k/v and gate/up already fused, in our order."""

    LAYER_WEIGHTS: ClassVar[dict[str, str]] = {
        **LlamaForCausalLM.LAYER_WEIGHTS,
        "self_attn.qkv_proj.weight": "qkv_proj.weight",
        "mlp.gate_up_proj.weight": "gate_up_proj.weight",
    }
    FUSED_WEIGHTS: ClassVar[dict[str, tuple[str, int]]] = {}
