"""A CPU decode step's rows laid out in windows by slot, since moving rows, not the matmuls, is most of ops.py's
padded form's cost: window k holds slot `slots[k]`'s rows, then rows of no adapter (fillers, products zeroed), so
`x` viewed as [S, length, in] is the shrink's batch as it lies. For the CPU kernel they are packed (no fillers)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from tritium.backend.lora.ops import LoraSlice
from tritium.kernels.cpu_lora import CpuLora


@dataclass
class LoraWindows:
    """`slots[k]` (ascending) has `counts[k]` rows from `starts[k]` (default `k * length`: even; else packed)."""

    slots: list[int]
    counts: list[int]
    length: int  # the longest window
    starts: list[int] = field(default_factory=list)
    _slot_index: torch.Tensor | None = field(default=None, repr=False)  # device tensors, made once a step
    _scale: torch.Tensor | None = field(default=None, repr=False)
    _fillers: torch.Tensor | None = field(default=None, repr=False)

    def __post_init__(self) -> None:
        if not self.starts:
            self.starts = self._even_starts()

    @property
    def even(self) -> bool:
        """Whether window k starts at row k * length."""
        return self.starts == self._even_starts()

    def _even_starts(self) -> list[int]:
        return [k * self.length for k in range(len(self.slots))]

    def stacked(self, weights: torch.Tensor) -> torch.Tensor:
        lo = self.slots[0]
        if self.slots == list(range(lo, lo + len(self.slots))):
            return weights[lo : lo + len(self.slots)]
        return weights.index_select(0, self._slots(weights.device))

    def scale_and_fillers(self, scaling: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Each window's scaling [S, 1, 1], and the fillers' [S, length, 1] bool mask (None: no filler)."""
        if self._scale is None:
            dev = scaling.device
            self._scale = scaling.index_select(0, self._slots(dev)).to(dtype).view(-1, 1, 1)
            if min(self.counts) < self.length:
                places = torch.arange(self.length, device=dev)[None, :]
                self._fillers = (places >= torch.tensor(self.counts, device=dev)[:, None])[..., None]
        return self._scale, self._fillers

    def _slots(self, device: torch.device) -> torch.Tensor:
        if self._slot_index is None:
            self._slot_index = torch.tensor(self.slots, device=device)
        return self._slot_index


def plan_windows(row_slots: list[int], packed: bool = False) -> tuple[list[int], LoraWindows] | None:
    """The rows' indices in windowed order (windows, then the leftover rows of no adapter) and the windows. None
    when no row has an adapter, or (even windows) too few rows of no adapter fill the gaps."""
    by_slot: dict[int, list[int]] = {}
    base: list[int] = []
    for row, slot in enumerate(row_slots):
        (by_slot.setdefault(slot, []) if slot >= 0 else base).append(row)
    if not by_slot:
        return None
    slots = sorted(by_slot)
    counts = [len(by_slot[s]) for s in slots]
    length = max(counts)
    if packed:
        starts = [sum(counts[:k]) for k in range(len(slots))]
        return [row for s in slots for row in by_slot[s]] + base, LoraWindows(slots, counts, length, starts)
    if length * len(slots) - sum(counts) > len(base):
        return None
    order: list[int] = []
    fillers = iter(base)
    for slot in slots:
        order += by_slot[slot]
        order += [next(fillers) for _ in range(length - len(by_slot[slot]))]
    order += fillers
    return order, LoraWindows(slots, counts, length)


def add_lora_windows(y: torch.Tensor, x: torch.Tensor, windows: LoraWindows, lora_a: torch.Tensor,
                     slices: Sequence[LoraSlice | None], scaling: torch.Tensor, native: CpuLora | None = None,
                     b_rows: list[torch.Tensor | None] | None = None) -> None:
    """`add_lora_fused` (ops.py) for rows laid out in `windows`; fillers and rows past them are left as they are.
    `native` runs fp32 operands in its layout; `b_rows`: each slice's B as it reads it (`B.transpose(1, 2)`)."""
    if not any(slices):
        return
    if native is not None and _native(y, x, windows, lora_a, slices, scaling, native, b_rows):
        return
    if not windows.even:
        _per_window(y, x, windows, lora_a, slices, scaling)
        return
    num, length = len(windows.slots), windows.length
    rank = lora_a.shape[1] // len(slices)
    buffer = torch.bmm(x[: num * length].unflatten(0, (num, length)), windows.stacked(lora_a).transpose(1, 2))
    scale, fillers = windows.scale_and_fillers(scaling, x.dtype)
    buffer.mul_(scale)
    if fillers is not None:  # a filler's product is exactly 0, NaN in its row or not
        buffer.masked_fill_(fillers, 0.0)
    out = y[: num * length].unflatten(0, (num, length))
    for j, part in enumerate(slices):
        if part is None:
            continue
        lora_b, start, end = part
        product = torch.bmm(buffer[..., j * rank : (j + 1) * rank], windows.stacked(lora_b).transpose(1, 2))
        out[..., start:end].add_(product)


def _per_window(y: torch.Tensor, x: torch.Tensor, windows: LoraWindows, lora_a: torch.Tensor,
                slices: Sequence[LoraSlice | None], scaling: torch.Tensor) -> None:
    """Packed windows the kernel cannot take: slow, never wrong."""
    rank = lora_a.shape[1] // len(slices)
    for slot, start, count in zip(windows.slots, windows.starts, windows.counts, strict=True):
        rows = slice(start, start + count)
        buffer = (x[rows] @ lora_a[slot].t()) * scaling[slot].to(x.dtype)
        for j, part in enumerate(slices):
            if part is not None:
                lora_b, col_start, col_end = part
                y[rows, col_start:col_end] += buffer[:, j * rank : (j + 1) * rank] @ lora_b[slot].t()


def _native(y: torch.Tensor, x: torch.Tensor, windows: LoraWindows, lora_a: torch.Tensor,
            slices: Sequence[LoraSlice | None], scaling: torch.Tensor, native: CpuLora,
            b_rows: list[torch.Tensor | None] | None) -> bool:
    """Whether the CPU kernel took the operands and ran."""
    if x.dtype != torch.float32 or x.stride(1) != 1 or y.stride(1) != 1 or y.dtype != torch.float32:
        return False
    if b_rows is None:
        b_rows = [None if part is None else part[0].transpose(1, 2) for part in slices]
        if not (lora_a.is_contiguous() and lora_a.dtype == scaling.dtype == torch.float32 and x.device.type == "cpu"
                and all(b is None or (b.is_contiguous() and b.dtype == torch.float32) for b in b_rows)):
            return False
    native.lora_windows(y, x, lora_a, b_rows, [0 if part is None else part[1] for part in slices], windows.slots,
                        windows.starts, windows.counts, windows.length, scaling)
    return True
