"""Which device an engine runs on, made current for the thread that drives it."""

from __future__ import annotations

import torch

from tritium.backend.config import EngineConfig


def use_device(device: torch.device) -> None:
    """Make `device` the calling thread's current CUDA device (CUDA's current device is per thread, and Triton
    kernels and graph capture use it, not their tensors' device). A no-op for a CPU, an index-less "cuda" or
    when it already is."""
    if device.type == "cuda" and device.index is not None and torch.cuda.current_device() != device.index:
        torch.cuda.set_device(device)


def set_up_device(config: EngineConfig) -> torch.device:
    """The device `config` names, with its index on CUDA ("cuda" is the current one), made current for the
    calling thread."""
    device = config.torch_device()
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    use_device(device)  # this thread's kernels, graphs and allocations go there
    return device
