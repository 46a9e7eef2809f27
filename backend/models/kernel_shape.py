"""What a model's kernel launches specialize on, for compiling them at start (tritium.kernels.warmup)."""

from __future__ import annotations

from dataclasses import replace

import torch

from tritium.backend.layers.activation import gated_op
from tritium.backend.layers.moe import FusedMoE
from tritium.backend.models.base import CausalLM
from tritium.kernels.warmup import EngineShape


def with_experts(shape: EngineShape, model: CausalLM) -> EngineShape:
    """`shape` with the mixture-of-experts fields of the model's experts (unchanged for a dense model)."""
    moe = next((m for m in model.modules() if isinstance(m, FusedMoE)), None)
    if moe is None:
        return shape
    return replace(shape, num_experts=moe.num_experts, moe_top_k=moe.top_k, moe_intermediate=moe.w13.shape[1] // 2,
                   moe_activation=moe.activation, moe_bias=moe.w13_bias is not None)


def kernel_shape(model: CausalLM, block_size: int, max_blocks_per_seq: int, dtype: torch.dtype,
                 device: torch.device, lora_rank: int | None = None) -> EngineShape:
    """What `model`'s kernel launches specialize on, for `warm_up_kernels` (positions and slots int32)."""
    c = model.config
    windows = sorted({c.window_of(i) for i in range(c.num_hidden_layers)}, key=lambda w: w or 0)
    shape = EngineShape(c.num_attention_heads, c.num_key_value_heads, c.head_dim, c.hidden_size, c.intermediate_size,
                        model.rotaries()[0].cos_sin_cache.shape[-1], block_size, max_blocks_per_seq, dtype, device,
                        torch.int32, vocab_size=c.vocab_size, quantization=getattr(model, "quantization", None),
                        lora_rank=lora_rank, windows=tuple(windows), softcap=c.attn_logit_softcapping,
                        activation=gated_op(c.hidden_act), qk_norm=c.qk_norm, sinks=c.attention_sinks)
    return with_experts(shape, model)
