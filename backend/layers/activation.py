"""Gated activations through the bound kernels."""

from __future__ import annotations

import torch
from torch import nn

from tritium.backend.layers.attention import AttentionBackend


class SiluAndMul(nn.Module):
    """`[..., 2 * d]` -> `[..., d]`: silu(gate) * up."""

    def __init__(self, backend: AttentionBackend) -> None:
        super().__init__()
        self.backend = backend

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.backend.silu_and_mul(x)


class GeluTanhAndMul(nn.Module):
    """`[..., 2 * d]` -> `[..., d]`: gelu(gate, tanh approximation) * up."""

    def __init__(self, backend: AttentionBackend) -> None:
        super().__init__()
        self.backend = backend

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.backend.gelu_tanh_and_mul(x)
