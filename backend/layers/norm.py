"""RMSNorm through the bound kernels, with the residual add fused where a layer has one."""

from __future__ import annotations

import torch
from torch import nn

from tritium.backend.layers.attention import AttentionBackend


class RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float, backend: AttentionBackend) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps
        self.backend = backend

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.backend.rms_norm(x, self.weight, self.eps)  # type: ignore[assignment]
        return out

    def add(self, x: torch.Tensor, residual: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(norm(x + residual), x + residual)."""
        normed, summed = self.backend.rms_norm(x, self.weight, self.eps, residual)
        return normed, summed
