"""Qwen3-MoE: Qwen3 (q/k norms) whose MLP is a mixture of experts in every `decoder_sparse_step`-th layer not in
`mlp_only_layers` (a dense MLP elsewhere); each token runs the top `num_experts_per_tok` of a softmax over the
experts, renormalized when `norm_topk_prob`. MoeDecoderLayer is also Mixtral's (mixtral.py)."""

from __future__ import annotations

from typing import ClassVar

import torch

from tritium.backend.layers.attention import AttentionBackend
from tritium.backend.layers.moe import FusedMoE
from tritium.backend.layers.rotary import RotaryEmbedding
from tritium.backend.lora.weights import LoraBatch
from tritium.backend.model_config import ModelConfig
from tritium.backend.models.llama import LlamaDecoderLayer, Qwen3ForCausalLM


class MoeDecoderLayer(LlamaDecoderLayer):
    """A Llama layer whose MLP is a FusedMoE where `config.is_moe_layer(index)`, the dense MLP elsewhere."""

    def __init__(self, config: ModelConfig, index: int, rotary: RotaryEmbedding, backend: AttentionBackend) -> None:
        super().__init__(config, index, rotary, backend)
        self.moe: FusedMoE | None = None
        if config.is_moe_layer(index):
            del self.gate_up_proj, self.down_proj  # the experts replace the dense MLP
            self.moe = FusedMoE(config.hidden_size, config.moe_intermediate_size, config.num_experts,
                                config.num_experts_per_tok, backend, renormalize=config.norm_topk_prob)

    def mlp(self, x: torch.Tensor, lora: LoraBatch | None) -> torch.Tensor:
        if self.moe is None:
            return super().mlp(x, lora)
        out: torch.Tensor = self.moe(x)  # LoRA on an MoE model is refused at engine start
        return out


class Qwen3MoeForCausalLM(Qwen3ForCausalLM):
    decoder_layer = MoeDecoderLayer

    LAYER_WEIGHTS: ClassVar[dict[str, str]] = {
        **Qwen3ForCausalLM.LAYER_WEIGHTS,
        "mlp.gate.weight": "moe.router.weight",
        "mlp.experts.gate_up_proj": "moe.w13",  # the experts stacked, as transformers holds them in memory
        "mlp.experts.down_proj": "moe.w2",
    }
    EXPERT_BLOCK = "mlp.experts"
    EXPERT_WEIGHTS: ClassVar[dict[str, tuple[str, int | None]]] = {
        "gate_proj.weight": ("moe.w13", 0),
        "up_proj.weight": ("moe.w13", 1),
        "down_proj.weight": ("moe.w2", None),
    }
