"""The Llama-family decoder (Llama 2/3, Mistral, Qwen2, SmolLM) in plain torch.

Packed tokens, no batch dimension: a step's tokens from all sequences are one `[num_tokens]` row.
Q/K/V and gate/up projections are fused into one matmul each; attention, norms and rotary go
through the `AttentionBackend` so the same module runs on the torch references or Triton kernels.
A step with LoRA adapter rows passes a `LoraBatch`, which adds each adapter's delta to the fused projections'
outputs (per slice); a step without one runs the projections untouched.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from tritium.backend.lora.weights import LoraBatch
from tritium.backend.models.config import ModelConfig
from tritium.backend.worker.attention import AttentionBackend, AttentionMetadata

KVCache = tuple[torch.Tensor, torch.Tensor]


def rope_inv_freq(config: ModelConfig) -> torch.Tensor:
    """Inverse frequencies, with Llama 3's `llama3` or plain `linear` scaling when configured."""
    dim = config.head_dim
    inv_freq = 1.0 / (config.rope_theta ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))
    scaling = config.rope_scaling or {}
    kind = scaling.get("rope_type", scaling.get("type", "default"))
    if kind == "linear":
        inv_freq = inv_freq / float(scaling["factor"])
    elif kind == "llama3":
        factor = float(scaling["factor"])
        low = float(scaling.get("low_freq_factor", 1.0))
        high = float(scaling.get("high_freq_factor", 4.0))
        old_len = float(scaling["original_max_position_embeddings"])
        wavelen = 2 * math.pi / inv_freq
        scaled = torch.where(wavelen > old_len / low, inv_freq / factor, inv_freq)
        smooth = (old_len / wavelen - low) / (high - low)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        medium = (wavelen >= old_len / high) & (wavelen <= old_len / low)
        inv_freq = torch.where(medium, smoothed, scaled)
    elif kind != "default":
        raise ValueError(f"unsupported rope_scaling type {kind!r}")
    return inv_freq


def build_cos_sin_cache(config: ModelConfig, max_positions: int) -> torch.Tensor:
    """`[max_positions, head_dim]` fp32: cat(cos, sin) of position * inv_freq."""
    inv_freq = rope_inv_freq(config)
    freqs = torch.outer(torch.arange(max_positions, dtype=torch.float32), inv_freq)
    return torch.cat([freqs.cos(), freqs.sin()], dim=-1)


def cpu_packing_available(dtype: torch.dtype) -> bool:
    """Whether oneDNN can pack linear weights of `dtype` on this CPU: fp32 wherever torch has oneDNN, bf16 only
    where the CPU has bf16 instructions (AVX512-BF16, AMX); never fp16."""
    if not (torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_reorder_linear_weight")):
        return False
    if dtype == torch.float32:
        return True
    return dtype == torch.bfloat16 and bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())


class CpuPackedLinear(nn.Module):
    """An fp32 or bf16 linear whose weight oneDNN packs once at load time. At the small row counts of decode
    steps `F.linear` repacks the weight on every call: packed is about 1.5x faster in fp32 and 10x in bf16 (the
    default model's projections at one row, `python -m tritium.client.bench.int8_matmul`)."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None) -> None:
        super().__init__()
        self.packed = torch.ops.mkldnn._reorder_linear_weight(weight.detach(), None)
        self.bias = None if bias is None else bias.detach()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = torch.ops.mkldnn._linear_pointwise(x, self.packed, self.bias, "none", [], "")
        return out


class LlamaDecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig, index: int = 0) -> None:
        super().__init__()
        self.index = index
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = config.num_key_value_heads
        self.head_dim = config.head_dim
        self.q_size = self.num_heads * self.head_dim
        self.kv_size = self.num_kv_heads * self.head_dim
        self.scale = self.head_dim**-0.5
        self.eps = config.rms_norm_eps
        h = config.hidden_size
        self.qkv_proj = nn.Linear(h, self.q_size + 2 * self.kv_size, bias=config.attention_bias)
        self.o_proj = nn.Linear(self.q_size, h, bias=config.o_proj_bias)
        self.gate_up_proj = nn.Linear(h, 2 * config.intermediate_size, bias=config.mlp_bias)
        self.down_proj = nn.Linear(config.intermediate_size, h, bias=config.mlp_bias)
        self.input_layernorm = nn.Parameter(torch.ones(h))
        self.post_attention_layernorm = nn.Parameter(torch.ones(h))

    def forward(
        self,
        hidden: torch.Tensor,
        residual: torch.Tensor | None,
        positions: torch.Tensor,
        cos_sin_cache: torch.Tensor,
        kv_cache: KVCache,
        meta: AttentionMetadata,
        ops: AttentionBackend,
        lora: LoraBatch | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        x: torch.Tensor
        if residual is None:
            residual = hidden
            x = ops.rms_norm(hidden, self.input_layernorm, self.eps)  # type: ignore[assignment]
        else:
            x, residual = ops.rms_norm(hidden, self.input_layernorm, self.eps, residual)
        qkv = self.qkv_proj(x)
        if lora is not None:
            lora.apply(self.index, "qkv_proj", x, qkv)
        n = qkv.shape[0]
        q = qkv[:, : self.q_size].reshape(n, self.num_heads, self.head_dim)
        k = qkv[:, self.q_size : self.q_size + self.kv_size].reshape(n, self.num_kv_heads, self.head_dim)
        v = qkv[:, self.q_size + self.kv_size :].reshape(n, self.num_kv_heads, self.head_dim)
        # q, k and v stay strided views of the fused projection: every kernel takes strides.
        ops.rotary_embedding(q, k, positions, cos_sin_cache)
        attn = ops.attention(q, k, v, kv_cache[0], kv_cache[1], meta, self.scale)
        attn = attn.reshape(n, self.q_size)
        hidden = self.o_proj(attn)
        if lora is not None:
            lora.apply(self.index, "o_proj", attn, hidden)
        x, residual = ops.rms_norm(hidden, self.post_attention_layernorm, self.eps, residual)
        gate_up = self.gate_up_proj(x)
        if lora is not None:
            lora.apply(self.index, "gate_up_proj", x, gate_up)
        act = ops.silu_and_mul(gate_up)
        hidden = self.down_proj(act)
        if lora is not None:
            lora.apply(self.index, "down_proj", act, hidden)
        return hidden, residual


class LlamaForCausalLM(nn.Module):
    cos_sin_cache: torch.Tensor  # a buffer (register_buffer below): nn.Module's attribute lookup types it loosely
    quantization: str | None = None  # "int8" or "int4" once quantize_model (quantization.py) has run

    def __init__(self, config: ModelConfig, max_positions: int | None = None) -> None:
        super().__init__()
        self.config = config
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(LlamaDecoderLayer(config, i) for i in range(config.num_hidden_layers))
        self.norm = nn.Parameter(torch.ones(config.hidden_size))
        if config.tie_word_embeddings:
            self.lm_head = None
        else:
            self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self.packed_lm_head: nn.Module | None = None  # CpuPackedLinear, or an Int8Linear / Int4Linear (quantization.py)
        positions = max_positions or config.max_position_embeddings
        self.register_buffer("cos_sin_cache", build_cos_sin_cache(config, positions), persistent=False)

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_caches: list[KVCache],
        meta: AttentionMetadata,
        ops: AttentionBackend,
        lora: LoraBatch | None = None,
    ) -> torch.Tensor:
        """Hidden states `[num_tokens, hidden]` after the final norm; `lora`: the step's adapter rows, if any."""
        hidden = self.embed_tokens(input_ids)
        residual = None
        for layer, kv_cache in zip(self.layers, kv_caches, strict=True):
            hidden, residual = layer(hidden, residual, positions, self.cos_sin_cache, kv_cache, meta, ops, lora)
        hidden, _ = ops.rms_norm(hidden, self.norm, self.config.rms_norm_eps, residual)
        return hidden

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """fp32 logits `[rows, vocab]` for the given hidden rows."""
        if self.packed_lm_head is not None:
            logits: torch.Tensor = self.packed_lm_head(hidden)
            return logits.float()
        weight = self.embed_tokens.weight if self.lm_head is None else self.lm_head.weight
        return torch.nn.functional.linear(hidden, weight).float()

    def pack_for_cpu(self) -> None:
        """Swap every projection and the logits head for a CpuPackedLinear (CPU only; see cpu_packing_available)."""
        for layer in self.layers:
            for name in ("qkv_proj", "o_proj", "gate_up_proj", "down_proj"):
                linear = getattr(layer, name)
                setattr(layer, name, CpuPackedLinear(linear.weight, linear.bias))
        weight = self.embed_tokens.weight if self.lm_head is None else self.lm_head.weight
        self.packed_lm_head = CpuPackedLinear(weight, None)
