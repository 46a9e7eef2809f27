"""Which device a Triton model instance's engine runs on (docs/architecture.md#devices, docs/operating.md#multi-gpu)."""

from __future__ import annotations

from collections.abc import Mapping

import torch

GPU_KIND = "GPU"  # what Triton's python backend passes for KIND_GPU (also "CPU", "AUTO", "MODEL")


def select_device(args: Mapping[str, str], configured: str, tensor_parallel_size: int = 1) -> str:
    """`cuda:<id>` for a KIND_GPU instance, else `configured` (model.json's `device`). Raises ValueError naming
    the setting when `configured` contradicts the GPU Triton placed the instance on, or when a KIND_GPU instance
    (one GPU) would shard its model over `tensor_parallel_size` > 1 GPUs (KIND_MODEL lets the engine place them)."""
    if args.get("model_instance_kind", "").upper() != GPU_KIND:
        return configured
    if tensor_parallel_size > 1:
        raise ValueError(
            f"model.json sets tensor_parallel_size {tensor_parallel_size}, but Triton placed this model instance "
            f"on one GPU (instance_group kind KIND_GPU): use instance_group [{{ count: 1, kind: KIND_MODEL }}] so "
            f"that the engine places its {tensor_parallel_size} ranks on the visible GPUs (cuda:0 to "
            f"cuda:{tensor_parallel_size - 1} of CUDA_VISIBLE_DEVICES), or set tensor_parallel_size to 1 for one "
            "engine per GPU"
        )
    raw_id = args.get("model_instance_device_id")
    try:
        device_id = int(raw_id)  # type: ignore[arg-type]
    except (TypeError, ValueError):
        raise ValueError(
            f"Triton placed this model instance on a GPU (instance_group kind KIND_GPU) but gave no valid "
            f"model_instance_device_id ({raw_id!r})"
        ) from None
    chosen = f"cuda:{device_id}"
    if configured in ("auto", "cuda") or _names_gpu(configured, device_id):
        return chosen
    raise ValueError(
        f"model.json sets device {configured!r}, but Triton placed this model instance on GPU {device_id} "
        f"(instance_group kind KIND_GPU): set device to \"auto\" or \"cuda\" to follow Triton (or "
        f"{chosen!r}), or give the instance_group kind KIND_CPU to let the engine pick its device"
    )


def _names_gpu(configured: str, device_id: int) -> bool:
    try:
        device = torch.device(configured)
    except RuntimeError:
        return False
    return device.type == "cuda" and device.index == device_id

