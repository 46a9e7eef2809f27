"""Gated activations through the bound kernels."""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from tritium.backend.layers.attention import AttentionBackend


def gated_op(hidden_act: str) -> str:
    """The kernel op of a checkpoint's gated-MLP activation: silu_and_mul (silu, swish), else gelu_tanh_and_mul."""
    return "silu_and_mul" if hidden_act in ("silu", "swish") else "gelu_tanh_and_mul"


class GatedActivation(nn.Module):
    """`[..., 2 * d]` -> `[..., d]`: act(gate) * up, through the bound kernel of `hidden_act` (gated_op)."""

    def __init__(self, hidden_act: str, backend: AttentionBackend) -> None:
        super().__init__()
        self.op: Callable[[torch.Tensor], torch.Tensor] = getattr(backend, gated_op(hidden_act))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.op(x)
