"""LoRA shrink / expand over a step's adapter rows, in torch or a KernelOps' kernels (docs/architecture.md#lora).
Rows of no adapter keep their values exactly; y is written in place, so it may be a fused output's column slice."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from itertools import pairwise

import torch

from tritium.kernels.interface import KernelOps
from tritium.kernels.tiles import lora_row_splits

Segment = tuple[int, int, int]  # (slot, start, end) into LoraGroups.token_indices


def lora_groups(token_slots: list[int]) -> tuple[list[int], list[Segment]]:
    """The adapter rows (`token_slots` -1: none) sorted by slot, and a (slot, start, end) segment per slot used."""
    order = sorted((s, t) for t, s in enumerate(token_slots) if s >= 0)
    segments: list[Segment] = []
    for i, (slot, _) in enumerate(order):
        if segments and segments[-1][0] == slot:
            segments[-1] = (slot, segments[-1][1], i + 1)
        else:
            segments.append((slot, i, i + 1))
    return [t for _, t in order], segments


LoraSlice = tuple[torch.Tensor, int, int]  # one module of a fused projection: (B [slots, out, rank], start, end)


@dataclass
class PaddedSegments:
    """A step's S segments padded to `length` places each, for one batched matmul (the torch form)."""

    rows: torch.Tensor  # [S * length]: the row of x at each place (a padding place repeats a row of its segment)
    places: torch.Tensor  # [T]: each row of x's place (rows outside the segments read a zeroed padding place)
    pad: torch.Tensor | None  # [S, length, 1] bool: True at padding places (None: every row is in a segment)
    slots: torch.Tensor
    slot_range: tuple[int, int] | None  # (lo, hi) when the slots are lo..hi-1: the stacks are sliced, not gathered
    length: int
    _scale: torch.Tensor | None = field(default=None, repr=False)

    def stacked(self, weights: torch.Tensor) -> torch.Tensor:
        if self.slot_range is not None:
            return weights[self.slot_range[0] : self.slot_range[1]]
        return weights.index_select(0, self.slots)

    def scale(self, scaling: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """Each segment's scaling as [S, 1, 1] (made once: a step's scaling is fixed)."""
        if self._scale is None:
            self._scale = scaling.index_select(0, self.slots).to(dtype).view(-1, 1, 1)
        return self._scale


@dataclass
class LoraGroups:
    """A step's adapter rows: `token_indices` (device) sorted by slot, `segments` on the host."""

    token_indices: torch.Tensor
    segments: list[Segment]
    seg_starts: torch.Tensor | None = None  # the staged device segments (kernels): starts [S+1] int32
    seg_slots: torch.Tensor | None = None  # and slots [S] int32; built from `segments` when None
    _padded: PaddedSegments | None = field(default=None, repr=False)

    @property
    def num_rows(self) -> int:
        """Rows that have an adapter."""
        return self.segments[-1][2] if self.segments else 0

    @property
    def max_rows(self) -> int:
        return max((end - start for _, start, end in self.segments), default=0)

    def padded(self, total_rows: int) -> PaddedSegments:
        """The segments padded for the torch form; built once a step (no host read of `token_indices`)."""
        if self._padded is not None and self._padded.places.shape[0] == total_rows:
            return self._padded
        counts = [end - start for _, start, end in self.segments]
        outside = sum(counts) < total_rows  # rows of no adapter (or of segments left out of this subset)
        # rows outside the segments read a padding place's (zeroed) product: make sure there is one
        length = max(counts) + (1 if outside and min(counts) == max(counts) else 0)
        places = [start + min(j, n - 1) for (_, start, _), n in zip(self.segments, counts, strict=True)
                  for j in range(length)]
        real = [k * length + j for k, n in enumerate(counts) for j in range(n)]
        dev = self.token_indices.device
        rows = self.token_indices.index_select(0, torch.tensor(places, device=dev))
        real_places = torch.tensor(real, device=dev)
        spare = next((k * length + n for k, n in enumerate(counts) if n < length), 0)
        row_places = torch.full((total_rows,), spare, dtype=torch.int64, device=dev)
        row_places.index_copy_(0, rows.index_select(0, real_places).long(), real_places)
        pad = None
        if outside:
            pad = (torch.arange(length, device=dev)[None, :] >= torch.tensor(counts, device=dev)[:, None])[..., None]
        slots = [slot for slot, _, _ in self.segments]
        contiguous = slots == list(range(slots[0], slots[0] + len(slots)))
        self._padded = PaddedSegments(
            rows=rows, places=row_places, pad=pad, slots=torch.tensor(slots, device=dev),
            slot_range=(slots[0], slots[0] + len(slots)) if contiguous else None, length=length)
        return self._padded

    def device_segments(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(seg_starts [S+1], seg_slots [S]) int32 on the device: the staged ones, else built from `segments`."""
        if self.seg_starts is not None and self.seg_slots is not None:
            return self.seg_starts, self.seg_slots
        dev = self.token_indices.device
        starts, slots = segment_arrays(self.segments)
        return (torch.tensor(starts, dtype=torch.int32, device=dev),
                torch.tensor(slots, dtype=torch.int32, device=dev))


def segment_arrays(segments: list[Segment]) -> tuple[list[int], list[int]]:
    """(starts with the end appended, slots): the segments as the kernels take them."""
    return [start for _, start, _ in segments] + [segments[-1][2] if segments else 0], [s for s, _, _ in segments]


def add_lora(y: torch.Tensor, x: torch.Tensor, groups: LoraGroups, lora_a: torch.Tensor, lora_b: torch.Tensor,
             scaling: torch.Tensor, kernels: KernelOps | None = None) -> None:
    """`y[t] += scaling[s] * (x[t] @ A[s]^T) @ B[s]^T` for every adapter row t of slot s. x: [T, in]; y: [T, out];
    lora_a: [slots, rank, in]; lora_b: [slots, out, rank]; scaling: [slots] float32; `kernels` None: torch."""
    if kernels is not None:
        add_lora_segments(y, x, groups, lora_a, lora_b, None, scaling, kernels)
        return
    add_lora_fused(y, x, groups, lora_a, [(lora_b, 0, y.shape[1])], scaling)


def add_lora_segments(y: torch.Tensor, x: torch.Tensor, groups: LoraGroups, lora_a: torch.Tensor, lora_b: torch.Tensor,
                      bounds: Sequence[int] | None, scaling: torch.Tensor, kernels: KernelOps) -> None:
    """`add_lora` of one fused projection's modules in the kernels' form, one shrink and one expand launch: module
    m's A is `lora_a[:, m * rank : (m + 1) * rank]`, its B rows and y's columns `bounds[m]:bounds[m+1]` of
    `lora_b` `[slots, out, rank]` (None: one module)."""
    if not groups.segments:
        return
    starts, slots = groups.device_segments()
    num_slices = len(bounds) - 1 if bounds is not None else 1
    buffer = x.new_empty(groups.num_rows, lora_a.shape[1])
    kernels.lora_shrink(x, lora_a, scaling, groups.token_indices, starts, slots, buffer, groups.max_rows, num_slices)
    kernels.lora_expand(buffer, lora_b, groups.token_indices, starts, slots, y, groups.max_rows, bounds)


def add_lora_fused(y: torch.Tensor, x: torch.Tensor, groups: LoraGroups, lora_a: torch.Tensor,
                   slices: Sequence[LoraSlice | None], scaling: torch.Tensor) -> None:
    """`add_lora` in torch for one fused projection's modules: module j's A is `lora_a[:, j * rank : (j + 1) *
    rank]`, `slices[j]` its (B, start, end) column slice of `y` (None: skipped)."""
    if not groups.segments or not any(slices):
        return
    _add_lora_padded(y, x, groups.padded(x.shape[0]), lora_a, slices, lora_a.shape[1] // len(slices), scaling)


def _add_lora_padded(y: torch.Tensor, x: torch.Tensor, padded: PaddedSegments, lora_a: torch.Tensor,
                     slices: Sequence[LoraSlice | None], rank: int, scaling: torch.Tensor) -> None:
    """A few bmms over padded segments, not small ops per adapter (on a CPU op overhead is the cost); a gather and
    a dense add per run of adjacent slices, since index_add into a column slice is slower on a CPU."""
    num_segments, length = padded.slots.shape[0], padded.length
    xs = x.index_select(0, padded.rows).view(num_segments, length, -1)
    buffer = torch.bmm(xs, padded.stacked(lora_a).transpose(1, 2))
    buffer.mul_(padded.scale(scaling, x.dtype))
    if padded.pad is not None:  # rows outside the segments read a padding place: exactly 0 whatever x holds
        buffer.masked_fill_(padded.pad, 0.0)
    runs: list[tuple[int, int, list[torch.Tensor]]] = []  # (start, end, products) of adjacent slices
    for j, part in enumerate(slices):
        if part is None:
            continue
        lora_b, start, end = part
        delta = torch.bmm(buffer[..., j * rank : (j + 1) * rank], padded.stacked(lora_b).transpose(1, 2))
        if runs and runs[-1][1] == start:
            runs[-1] = (runs[-1][0], end, [*runs[-1][2], delta])
        else:
            runs.append((start, end, [delta]))
    for start, end, deltas in runs:
        delta = deltas[0] if len(deltas) == 1 else torch.cat(deltas, dim=2)
        y[:, start:end].add_(delta.view(num_segments * length, -1).index_select(0, padded.places))


def add_lora_rows(y: torch.Tensor, x: torch.Tensor, row_slots: torch.Tensor, lora_a: torch.Tensor,
                  lora_b: torch.Tensor, scaling: torch.Tensor, kernels: KernelOps | None = None,
                  bounds: Sequence[int] | None = None) -> None:
    """`add_lora_segments` with one slot per row on the device (-1: none): with kernels one split-K shrink and one
    expand launch for all the projection's modules. Reads no host value of the step, so a CUDA graph may capture
    it."""
    edges = list(bounds) if bounds is not None else [0, y.shape[1]]
    if kernels is not None:
        partials = x.new_empty(lora_row_splits(x.shape[1]), row_slots.shape[0], lora_a.shape[1], dtype=torch.float32)
        kernels.lora_shrink_rows(x, lora_a, scaling, row_slots, partials, len(edges) - 1)
        kernels.lora_expand_rows(partials, lora_b, row_slots, y, bounds)
        return
    slots = row_slots.clamp(min=0).long()
    buffer = torch.bmm(lora_a.index_select(0, slots), x.unsqueeze(-1))
    buffer = buffer * scaling.index_select(0, slots).to(x.dtype)[:, None, None]
    active = (row_slots >= 0)[:, None]
    rank = lora_b.shape[2]
    for m, (lo, hi) in enumerate(pairwise(edges)):
        delta = torch.bmm(lora_b[:, lo:hi].index_select(0, slots), buffer[:, m * rank : (m + 1) * rank]).squeeze(-1)
        y[:, lo:hi] += torch.where(active, delta, torch.zeros((), dtype=delta.dtype, device=delta.device))
