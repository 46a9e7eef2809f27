"""The `tiles` option every Triton wrapper takes: which launch configuration (tile sizes, warps, stages).

"auto" is the GPU configuration on CUDA and the small one elsewhere (the interpreter is slow on big tiles);
"gpu" is what a GPU launch uses, on any device, so the interpreter can run the real tile shapes and the
compile check can read them; "small" is the interpreter's configuration.
"""

from __future__ import annotations

import torch

TILES = ("auto", "gpu", "small")


def check_tiles(tiles: str) -> None:
    """Raise ValueError unless `tiles` is one of TILES."""
    if tiles not in TILES:
        raise ValueError(f"tiles must be one of {TILES}, got {tiles!r}")


def use_gpu_tiles(tiles: str, device: torch.device | str) -> bool:
    """True when `tiles` on `device` means the GPU configuration."""
    check_tiles(tiles)
    if tiles == "auto":
        return torch.device(device).type == "cuda"
    return tiles == "gpu"


def lora_row_splits(in_features: int) -> int:
    """How many K splits the per-row shrink of `in_features` inputs runs (the first dimension of its partial sums):
    a batch of few rows then still fills the GPU (a program per row, module and split)."""
    return max(1, min(32, in_features // 256))
