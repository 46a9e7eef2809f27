"""A Triton model instance's engine device from its initialize args and model.json's `device` (no CUDA needed)."""

from __future__ import annotations

import pytest
import torch

from tritium.backend.serving.device_selection import select_device
from tritium.backend.worker.device import use_device


def gpu(device_id: str) -> dict[str, str]:
    return {"model_name": "tritium", "model_instance_kind": "GPU", "model_instance_device_id": device_id}


@pytest.mark.parametrize("configured", ["auto", "cuda"])
@pytest.mark.parametrize("device_id", ["0", "1", "7"])
def test_kind_gpu_follows_triton(configured: str, device_id: str) -> None:
    assert select_device(gpu(device_id), configured) == f"cuda:{device_id}"


def test_kind_gpu_with_the_same_gpu_configured() -> None:
    assert select_device(gpu("1"), "cuda:1") == "cuda:1"


@pytest.mark.parametrize("configured", ["cpu", "cuda:3", "cuda:0", "mps", "nonsense"])
def test_kind_gpu_contradicted_by_model_json(configured: str) -> None:
    with pytest.raises(ValueError, match=r"model.json sets device .*GPU 1.*KIND_GPU") as info:
        select_device(gpu("1"), configured)
    assert repr(configured) in str(info.value)


@pytest.mark.parametrize("raw_id", [None, "", "x"])
def test_kind_gpu_without_a_device_id(raw_id: str | None) -> None:
    args = {"model_instance_kind": "GPU"} if raw_id is None else gpu(raw_id)
    with pytest.raises(ValueError, match="model_instance_device_id"):
        select_device(args, "auto")


@pytest.mark.parametrize("kind", ["CPU", "AUTO", "MODEL"])
@pytest.mark.parametrize("configured", ["auto", "cpu", "cuda", "cuda:2"])
def test_other_kinds_leave_the_choice_to_the_engine(kind: str, configured: str) -> None:
    args = {"model_instance_kind": kind, "model_instance_device_id": "0"}
    assert select_device(args, configured) == configured


@pytest.mark.parametrize("configured", ["auto", "cpu", "cuda:1"])
def test_missing_keys_leave_the_choice_to_the_engine(configured: str) -> None:
    assert select_device({}, configured) == configured
    assert select_device({"model_instance_device_id": "3"}, configured) == configured


def test_use_device_leaves_cpu_and_unindexed_cuda_alone(monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[torch.device] = []
    monkeypatch.setattr(torch.cuda, "set_device", calls.append)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    use_device(torch.device("cpu"))
    use_device(torch.device("cuda"))
    use_device(torch.device("cuda:0"))  # already current
    assert calls == []
    use_device(torch.device("cuda:1"))
    assert calls == [torch.device("cuda:1")]


@pytest.mark.parametrize("size", [2, 4])
@pytest.mark.parametrize("configured", ["auto", "cuda", "cuda:1"])
def test_kind_gpu_refuses_tensor_parallelism(size: int, configured: str) -> None:
    with pytest.raises(ValueError, match=rf"tensor_parallel_size {size}.*KIND_GPU.*KIND_MODEL") as info:
        select_device(gpu("1"), configured, size)
    assert f"cuda:0 to cuda:{size - 1} of CUDA_VISIBLE_DEVICES" in str(info.value)


@pytest.mark.parametrize("kind", ["MODEL", "CPU", "AUTO"])
@pytest.mark.parametrize("configured", ["auto", "cpu", "cuda", "cuda:2"])
def test_tensor_parallelism_keeps_model_json_device_outside_kind_gpu(kind: str, configured: str) -> None:
    args = {"model_instance_kind": kind, "model_instance_device_id": "0"}
    assert select_device(args, configured, 2) == configured


def test_kind_gpu_with_one_rank_follows_triton() -> None:
    assert select_device(gpu("3"), "auto", 1) == "cuda:3"
