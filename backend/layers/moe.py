"""The mixture-of-experts MLP: a router picks each token's experts, the bound `fused_moe` kernel runs them
(docs/serving.md, "Mixture of experts"). On a CPU that is the torch reference: tokens grouped by expert, only the
experts they picked read. Its experts stay stacked, not packed for oneDNN as the dense projections are: packed
ones were no faster (0.7-1.1x at 1-32 rows, `tritium bench moe-cpu`, docs/performance.md)."""

from __future__ import annotations

import torch
from torch import nn

from tritium.backend.layers.attention import AttentionBackend
from tritium.kernels.interface import MOE_ACTIVATIONS

# "softmax_topk": softmax over every expert's logit (fp32), the top k of those probabilities (Qwen3-MoE, Mixtral);
# "topk_softmax": the top k logits, softmax over those k (gpt-oss).
ROUTINGS = ("softmax_topk", "topk_softmax")


def route(logits: torch.Tensor, top_k: int, routing: str, renormalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """(fp32 weights `[T, top_k]`, int32 expert ids `[T, top_k]`) for router `logits` `[T, num_experts]`;
    `renormalize`: softmax_topk's weights scaled to sum to 1."""
    if routing == "softmax_topk":
        probs = torch.softmax(logits, dim=-1, dtype=torch.float32)
        weights, ids = torch.topk(probs, top_k, dim=-1)
        if renormalize:
            weights = weights / weights.sum(dim=-1, keepdim=True)
    elif routing == "topk_softmax":
        top, ids = torch.topk(logits, top_k, dim=-1)
        weights = torch.softmax(top.float(), dim=-1)
    else:
        raise ValueError(f"unknown MoE routing {routing!r} (supported: {', '.join(ROUTINGS)})")
    return weights, ids.to(torch.int32)


class FusedMoE(nn.Module):
    """Experts of one layer: `router` `[E, H]` (bias optional); expert e's gate and up rows `w13[e]` `[2I, H]` (gate
    rows first) and its down projection `w2[e]` `[H, I]`, biases `w13_bias` `[E, 2I]` and `w2_bias` `[E, H]` when
    `expert_bias`. `activation`: one of kernels.interface.MOE_ACTIVATIONS."""

    def __init__(self, hidden_size: int, intermediate_size: int, num_experts: int, top_k: int,
                 backend: AttentionBackend, routing: str = "softmax_topk", renormalize: bool = True,
                 activation: str = "silu", router_bias: bool = False, expert_bias: bool = False) -> None:
        super().__init__()
        if routing not in ROUTINGS:
            raise ValueError(f"unknown MoE routing {routing!r} (supported: {', '.join(ROUTINGS)})")
        if activation not in MOE_ACTIVATIONS:
            raise ValueError(f"unknown MoE activation {activation!r} (supported: {', '.join(MOE_ACTIVATIONS)})")
        if not 0 < top_k <= num_experts:
            raise ValueError(f"top_k {top_k} must be in 1..{num_experts} (the number of experts)")
        self.num_experts, self.top_k = num_experts, top_k
        self.routing, self.renormalize, self.activation = routing, renormalize, activation
        self.backend = backend
        self.router = nn.Linear(hidden_size, num_experts, bias=router_bias)
        self.w13 = nn.Parameter(torch.empty(num_experts, 2 * intermediate_size, hidden_size), requires_grad=False)
        self.w2 = nn.Parameter(torch.empty(num_experts, hidden_size, intermediate_size), requires_grad=False)
        self.w13_bias: nn.Parameter | None = None
        self.w2_bias: nn.Parameter | None = None
        if expert_bias:
            self.w13_bias = nn.Parameter(torch.empty(num_experts, 2 * intermediate_size), requires_grad=False)
            self.w2_bias = nn.Parameter(torch.empty(num_experts, hidden_size), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """`[T, H]` -> `[T, H]` in x's dtype."""
        weights, ids = route(self.router(x), self.top_k, self.routing, self.renormalize)
        out: torch.Tensor = self.backend.ops.fused_moe(x, self.w13, self.w2, weights, ids, self.activation,
                                                       self.w13_bias, self.w2_bias)
        return self.backend.parallel.all_reduce(out)  # each rank ran its part of every expert's intermediate rows
