"""A step's small inputs in one persistent int32 buffer, one copy to the device (docs/architecture.md, "The
engine step"). The device buffer never moves, so graphs captured on its views read each step's values."""

from __future__ import annotations

from collections.abc import Sequence as Values
from dataclasses import dataclass
from typing import Any

import numpy as np
import numpy.typing as npt
import torch

from tritium.backend.sample.step_inputs import HostSamplingInputs, SamplingInputs


class StagingOverflow(RuntimeError):
    """A step's inputs do not fit the staging buffer."""


class StagingBuffer:
    def __init__(self, capacity: int, device: torch.device) -> None:
        self.device = device
        self.capacity = capacity
        self.host = torch.zeros(capacity, dtype=torch.int32, pin_memory=device.type == "cuda")
        self._ints = self.host.numpy()
        self._floats = self._ints.view(np.float32)
        self.device_buffer = torch.zeros(capacity, dtype=torch.int32, device=device)
        self.size = 0
        self._copied: torch.cuda.Event | None = None

    def begin(self) -> None:
        """Start a step's inputs, once the previous upload has left the host buffer."""
        if self._copied is not None:
            self._copied.synchronize()
            self._copied = None
        self.size = 0

    def _reserve(self, n: int) -> slice:
        start = self.size
        if start + n > self.capacity:
            raise StagingOverflow(f"step inputs need {start + n} int32 slots; the staging buffer has {self.capacity}")
        self.size = start + n
        return slice(start, start + n)

    def put(self, values: Values[int] | npt.NDArray[np.integer[Any]], pad_to: int = 0, fill: int = 0) -> slice:
        """Append ints, padded with `fill` to `pad_to`; returns where. Raises StagingOverflow when full."""
        n = len(values)
        where = self._reserve(max(n, pad_to))
        self._ints[where.start : where.start + n] = values
        if pad_to > n:
            self._ints[where.start + n : where.stop] = fill
        return where

    def put_floats(self, values: Values[float]) -> slice:
        """Append floats as their float32 bits; returns where. Raises StagingOverflow when full."""
        where = self._reserve(len(values))
        self._floats[where] = values
        return where

    def upload(self) -> None:
        """One copy of everything put since `begin` (non-blocking from pinned memory on CUDA)."""
        n = self.size
        if n == 0:
            return
        if self.device.type == "cuda":
            self.device_buffer[:n].copy_(self.host[:n], non_blocking=True)
            self._copied = torch.cuda.Event()
            self._copied.record()
        else:
            self.device_buffer[:n].copy_(self.host[:n])

    def staged(self) -> npt.NDArray[np.int32]:
        """A copy of what was put since `begin` (what another rank's buffer is given)."""
        return self._ints[: self.size].copy()

    def ints(self, where: slice) -> torch.Tensor:
        return self.device_buffer[where]

    def floats(self, where: slice) -> torch.Tensor:
        return self.device_buffer[where].view(torch.float32)


@dataclass
class StagedSamplingInputs:
    """Where `stage_sampling_inputs` put a sampler call's inputs (`where` None: they did not fit)."""

    host: HostSamplingInputs
    where: dict[str, slice] | None

    def tensors(self, staging: StagingBuffer) -> SamplingInputs:
        """Valid once `staging` was uploaded; inputs that did not fit are copied now, alone."""
        if self.where is None:
            return SamplingInputs.on(staging.device, self.host)
        return SamplingInputs.view(self.host, staging.device_buffer, self.where)


def stage_sampling_inputs(staging: StagingBuffer, host: HostSamplingInputs) -> StagedSamplingInputs:
    """Stage `host` after the step's other inputs when it fits."""
    array, where = host.packed()
    if staging.size + len(array) > staging.capacity:
        return StagedSamplingInputs(host, None)
    start = staging.put(array).start
    return StagedSamplingInputs(host, {name: slice(at.start + start, at.stop + start) for name, at in where.items()})
