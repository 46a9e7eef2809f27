"""Rotary position embeddings (neox style) from a checkpoint's rope settings: one cos/sin table per model."""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import nn

from tritium.backend.layers.attention import AttentionBackend
from tritium.backend.model_config import rope_type


def rope_inv_freq(head_dim: int, theta: float, scaling: dict[str, Any] | None) -> torch.Tensor:
    """Inverse frequencies, with `llama3` or `linear` scaling. Raises ValueError for another rope type."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
    kind = rope_type(scaling)
    if kind == "default":
        return inv_freq
    assert scaling is not None
    if kind == "linear":
        return inv_freq / float(scaling["factor"])
    if kind != "llama3":
        raise ValueError(f"unsupported rope_scaling type {kind!r}")
    factor = float(scaling["factor"])
    low = float(scaling.get("low_freq_factor", 1.0))
    high = float(scaling.get("high_freq_factor", 4.0))
    old_len = float(scaling["original_max_position_embeddings"])
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > old_len / low, inv_freq / factor, inv_freq)
    smooth = (old_len / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = (wavelen >= old_len / high) & (wavelen <= old_len / low)
    return torch.where(medium, smoothed, scaled)


def build_cos_sin_cache(inv_freq: torch.Tensor, max_positions: int) -> torch.Tensor:
    """`[max_positions, 2 * len(inv_freq)]` fp32: cat(cos, sin) of position * inv_freq."""
    freqs = torch.outer(torch.arange(max_positions, dtype=torch.float32), inv_freq)
    return torch.cat([freqs.cos(), freqs.sin()], dim=-1)


class RotaryEmbedding(nn.Module):
    """Rotates q and k in place by their positions; one instance is shared by a model's layers."""

    cos_sin_cache: torch.Tensor

    def __init__(self, head_dim: int, theta: float, scaling: dict[str, Any] | None, max_positions: int,
                 backend: AttentionBackend) -> None:
        super().__init__()
        self.inv_freq_args = (head_dim, theta, scaling)
        self.backend = backend
        self.register_buffer("cos_sin_cache", self.table(max_positions), persistent=False)

    def table(self, max_positions: int) -> torch.Tensor:
        """The cos/sin table for positions below `max_positions` (on the CPU)."""
        return build_cos_sin_cache(rope_inv_freq(*self.inv_freq_args), max_positions)

    def forward(self, q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor) -> None:
        self.backend.rotary_embedding(q, k, positions, self.cos_sin_cache)
