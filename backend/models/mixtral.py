"""Mixtral: Mistral whose every MLP is a mixture of experts (`num_local_experts`, each token the top
`num_experts_per_tok` of a softmax over them, always renormalized); experts named w1 (gate), w3 (up), w2 (down)."""

from __future__ import annotations

from typing import ClassVar

from tritium.backend.models.llama import LlamaForCausalLM
from tritium.backend.models.qwen3_moe import MoeDecoderLayer


class MixtralForCausalLM(LlamaForCausalLM):
    decoder_layer = MoeDecoderLayer

    LAYER_WEIGHTS: ClassVar[dict[str, str]] = {
        **LlamaForCausalLM.LAYER_WEIGHTS,
        "block_sparse_moe.gate.weight": "moe.router.weight",
        "mlp.gate.weight": "moe.router.weight",  # transformers' in-memory names, the experts stacked
        "mlp.experts.gate_up_proj": "moe.w13",
        "mlp.experts.down_proj": "moe.w2",
    }
    EXPERT_BLOCK = "block_sparse_moe.experts"
    EXPERT_WEIGHTS: ClassVar[dict[str, tuple[str, int | None]]] = {
        "w1.weight": ("moe.w13", 0),
        "w3.weight": ("moe.w13", 1),
        "w2.weight": ("moe.w2", None),
    }
