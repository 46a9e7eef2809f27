"""A step's small inputs (token ids, positions, slots, lengths, block-table updates, sampling settings),
written on the host into one persistent int32 buffer and sent to the device in one non-blocking copy.

The host buffer is pinned on CUDA and written through a numpy view, so filling it builds no tensors; the
device buffer never moves, so a CUDA graph captured on views of it reads each step's values. Floats are
stored as their float32 bits.
"""

from __future__ import annotations

from collections.abc import Sequence as Values
from dataclasses import dataclass
from typing import Any

import numpy as np
import numpy.typing as npt
import torch

from tritium.backend.core.sequence import Sequence
from tritium.backend.sample.settings import ROW_SETTINGS, HostRowSettings, RowSettings


class StagingOverflow(RuntimeError):
    """A step's inputs do not fit the staging buffer (its capacity is sized from the engine's limits)."""


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
        """Start a step's inputs. Waits for the previous step's copy to have left the host buffer (it has,
        whenever that step fetched sampled tokens)."""
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
        """Append int values, padded with `fill` up to `pad_to` entries; returns where they went."""
        n = len(values)
        where = self._reserve(max(n, pad_to))
        self._ints[where.start : where.start + n] = values
        if pad_to > n:
            self._ints[where.start + n : where.stop] = fill
        return where

    def put_floats(self, values: Values[float]) -> slice:
        """Append float values (stored as their float32 bits); returns where they went. Raises StagingOverflow
        when the buffer is full."""
        where = self._reserve(len(values))
        self._floats[where] = values
        return where

    def upload(self) -> None:
        """One host-to-device copy of everything put since `begin` (non-blocking from pinned memory)."""
        n = self.size
        if n == 0:
            return
        if self.device.type == "cuda":
            self.device_buffer[:n].copy_(self.host[:n], non_blocking=True)
            self._copied = torch.cuda.Event()
            self._copied.record()
        else:
            self.device_buffer[:n].copy_(self.host[:n])

    def ints(self, where: slice) -> torch.Tensor:
        """The device view of `where` as int32 (valid after `upload`)."""
        return self.device_buffer[where]

    def floats(self, where: slice) -> torch.Tensor:
        """The device view of `where` as float32 (valid after `upload`)."""
        return self.device_buffer[where].view(torch.float32)


@dataclass
class StagedRowSettings:
    """Where `stage_row_settings` put the settings in the staging buffer (device views exist after upload)."""

    rows: list[int]
    index: slice
    where: dict[str, slice]
    used: frozenset[str]

    def tensors(self, staging: StagingBuffer) -> RowSettings:
        """The device views of the staged settings; valid once `staging` was uploaded."""
        views = {s.name: (staging.floats if s.is_float else staging.ints)(self.where[s.name]) for s in ROW_SETTINGS}
        return RowSettings(self.rows, staging.ints(self.index), views, self.used)


def stage_row_settings(staging: StagingBuffer, seqs: list[Sequence]) -> StagedRowSettings | None:
    """Put the random rows' settings into this step's staging buffer; None when every row is greedy."""
    host = HostRowSettings.of(seqs)
    if not host.rows:
        return None
    index = staging.put(host.rows)
    where = {s.name: staging.put_floats(host.values[s.name]) if s.is_float else
             staging.put([int(v) for v in host.values[s.name]]) for s in ROW_SETTINGS}
    return StagedRowSettings(host.rows, index, where, host.used)
