"""gpt-oss (transformers' GptOssForCausalLM): Llama's attention with biases on q/k/v and o, a learned sink logit per
head in every softmax, sliding (`sliding_window`) and full layers by `layer_types`, yarn rotary; every MLP a mixture
of experts: a biased router, each token's top `num_experts_per_tok` logits softmaxed over those k, experts with biases
and a clamped SwiGLU (fused_moe's "swiglu_oai"). The checkpoint stacks each layer's experts as transformers holds
them (`gate_up_proj` `[E, H, 2I]`, gate and up interleaved in the last dim; `down_proj` `[E, I, H]`), converted at
load to FusedMoE's `w13` `[E, 2I, H]` (gate rows first) and `w2` `[E, H, I]`; MXFP4 experts are dequantized."""

from __future__ import annotations

from collections.abc import Iterator
from typing import ClassVar

import torch
from torch import nn

from tritium.backend.layers.attention import AttentionBackend
from tritium.backend.layers.moe import FusedMoE
from tritium.backend.layers.rotary import RotaryEmbedding
from tritium.backend.lora.weights import LoraBatch
from tritium.backend.model_config import ModelConfig
from tritium.backend.models.llama import LlamaDecoderLayer, LlamaForCausalLM
from tritium.backend.models.mxfp4 import dequantized_tensors


class GptOssDecoderLayer(LlamaDecoderLayer):
    """A Llama layer with attention sinks whose MLP is gpt-oss's experts."""

    def __init__(self, config: ModelConfig, index: int, rotary: RotaryEmbedding, backend: AttentionBackend) -> None:
        super().__init__(config, index, rotary, backend)
        del self.gate_up_proj, self.down_proj  # the experts replace the dense MLP
        self.attn.sinks = nn.Parameter(torch.empty(config.num_attention_heads), requires_grad=False)
        self.moe = FusedMoE(config.hidden_size, config.moe_intermediate_size, config.num_experts,
                            config.num_experts_per_tok, backend, routing="topk_softmax", renormalize=False,
                            activation="swiglu_oai", router_bias=True, expert_bias=True)

    def mlp(self, x: torch.Tensor, lora: LoraBatch | None) -> torch.Tensor:
        out: torch.Tensor = self.moe(x)  # LoRA on an MoE model is refused at engine start
        return out


class GptOssForCausalLM(LlamaForCausalLM):
    decoder_layer = GptOssDecoderLayer
    CONVERTS_LAYOUT = True

    LAYER_WEIGHTS: ClassVar[dict[str, str]] = {
        **LlamaForCausalLM.LAYER_WEIGHTS,
        "self_attn.sinks": "attn.sinks",
        "mlp.router.weight": "moe.router.weight",
        "mlp.router.bias": "moe.router.bias",
        "mlp.experts.gate_up_proj": "moe.w13",
        "mlp.experts.gate_up_proj_bias": "moe.w13_bias",
        "mlp.experts.down_proj": "moe.w2",
        "mlp.experts.down_proj_bias": "moe.w2_bias",
    }

    @classmethod
    def checkpoint_tensors(cls, tensors: Iterator[tuple[str, torch.Tensor]]) -> Iterator[tuple[str, torch.Tensor]]:
        # MXFP4 experts are `[E, out, in]` blocks: dequantized and transposed, as unquantized checkpoints hold them.
        return dequantized_tensors(tensors, transpose=True)

    @classmethod
    def convert_weight(cls, key: str, tensor: torch.Tensor) -> torch.Tensor:
        if key.endswith("moe.w13"):  # [E, H, 2I], gate and up interleaved -> [E, 2I, H], gate rows first
            return deinterleave(tensor).transpose(1, 2).contiguous()
        if key.endswith("moe.w13_bias"):
            return deinterleave(tensor)
        if key.endswith("moe.w2"):  # [E, I, H] -> [E, H, I]
            return tensor.transpose(1, 2).contiguous()
        return tensor


def deinterleave(gate_up: torch.Tensor) -> torch.Tensor:
    """gpt-oss's gate and up features, interleaved along the last dim (gate at even places), as gate then up."""
    return torch.cat([gate_up[..., 0::2], gate_up[..., 1::2]], dim=-1)
