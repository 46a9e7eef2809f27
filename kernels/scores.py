"""What the attention kernels take for the softmax scale, a soft cap, a sliding window and sinks (host side)."""

from __future__ import annotations

import torch

LOG2E = 1.4426950408889634


def check_window_and_cap(sliding_window: int | None, softcap: float | None) -> None:
    """Raise ValueError for a window below one key or a cap that is not positive."""
    if sliding_window is not None and sliding_window < 1:
        raise ValueError(f"sliding_window must be at least 1, got {sliding_window}")
    if softcap is not None and not softcap > 0:
        raise ValueError(f"softcap must be positive, got {softcap}")


def score_scales(scale: float, softcap: float | None) -> tuple[float, float]:
    """(scale_log2e, cap_in) the attention kernels take: scores become `dot * scale_log2e` without a cap, and
    `tanh(dot * cap_in) * scale_log2e` with one (c * tanh(s / c) in the exp2 domain)."""
    if softcap is None:
        return scale * LOG2E, 0.0
    return softcap * LOG2E, scale / softcap


def check_sinks(sinks: torch.Tensor | None, num_heads: int) -> None:
    """Raise ValueError unless `sinks` is None or an fp32 tensor of `num_heads` logits."""
    if sinks is not None and (sinks.shape != (num_heads,) or sinks.dtype != torch.float32):
        raise ValueError(f"sinks must be fp32 [num_heads={num_heads}], got {sinks.dtype} {tuple(sinks.shape)}")
