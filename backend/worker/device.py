"""Which device an engine runs on, made current for the thread that drives it."""

from __future__ import annotations

import torch

from tritium.backend.config import EngineConfig


def use_device(device: torch.device) -> None:
    """Make `device` this thread's current CUDA device (per thread; Triton launches and graph capture use it,
    not their tensors' device). A no-op on a CPU or for an index-less "cuda"."""
    if device.type == "cuda" and device.index is not None and torch.cuda.current_device() != device.index:
        torch.cuda.set_device(device)


def set_up_device(config: EngineConfig) -> torch.device:
    """The device `config` names (on CUDA with its index), made current for this thread."""
    device = config.torch_device()
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    use_device(device)
    return device
