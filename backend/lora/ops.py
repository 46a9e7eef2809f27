"""The LoRA shrink and expand ops in plain torch, with the signatures the Triton kernels will take.

A step's rows are grouped by adapter slot once, on the host (`lora_groups`): the adapter rows' indices sorted
by slot, and one segment (slot, start, end) per slot in use. For every row t of slot s:
    shrink: buffer[i] = scaling[s] * x[t] @ A[s]^T         (A: [slots, rank, in]; i: t's place in the order)
    expand: y[t]     += buffer[i] @ B[s]^T                  (B: [slots, out, rank])
y may be a column slice of a fused projection's output (q, k or v of qkv; gate or up of gate_up): it is
written in place, so strided views work. Rows of no adapter are never touched. The segments are host ints, so
the reference launches no host-device synchronization.

`add_lora` / `add_lora_rows` take `kernels`: None runs the torch code here (the engine on a CPU: exact, the
reference the engine tests hold to transformers), a KernelOps module (kernels/lora.py through triton_ops: the
engine with the triton attention backend, CUDA) runs its shrink and expand. `add_lora` is the segmented form
(prefill and mixed steps); `add_lora_rows` takes one slot per row on the device (-1: none), which is what a
decode step captured as a CUDA graph runs (decode_graphs.py): nothing in it depends on host values of the step.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from tritium.kernels.interface import KernelOps

Segment = tuple[int, int, int]  # (slot, start, end) into LoraGroups.token_indices


def lora_groups(token_slots: list[int]) -> tuple[list[int], list[Segment]]:
    """The rows of `token_slots` (-1: no adapter) sorted by slot, and one (slot, start, end) segment per slot
    in use, in slot order."""
    order = sorted((s, t) for t, s in enumerate(token_slots) if s >= 0)
    segments: list[Segment] = []
    for i, (slot, _) in enumerate(order):
        if segments and segments[-1][0] == slot:
            segments[-1] = (slot, segments[-1][1], i + 1)
        else:
            segments.append((slot, i, i + 1))
    return [t for _, t in order], segments


@dataclass
class PaddedSegments:
    """A step's segments padded to the longest, for one batched matmul over all of them (the torch form):
    `rows` [S * length] the row of x at each padded place (a padding place repeats a row of its segment),
    `real` [adapter rows] the padded places of the real rows in `token_indices` order, `targets` those rows
    (the segments' part of `token_indices`), `slots` [S] (int64)."""

    rows: torch.Tensor
    real: torch.Tensor
    targets: torch.Tensor
    slots: torch.Tensor
    length: int


@dataclass
class LoraGroups:
    """A step's adapter rows: `token_indices` [adapter rows] (device) sorted by slot, `segments` on the host."""

    token_indices: torch.Tensor
    segments: list[Segment]
    seg_starts: torch.Tensor | None = None  # the segments on the device (the kernels' form): starts [S+1] int32
    seg_slots: torch.Tensor | None = None  # and slots [S] int32; built from `segments` when None
    _padded: PaddedSegments | None = field(default=None, repr=False)  # built once a step, by `padded()`

    @property
    def num_rows(self) -> int:
        """Rows that have an adapter."""
        return self.segments[-1][2] if self.segments else 0

    @property
    def max_rows(self) -> int:
        """Rows of the longest segment."""
        return max((end - start for _, start, end in self.segments), default=0)

    def padded(self) -> PaddedSegments:
        """The segments laid out as [S, longest] for the batched torch form (built on the first call, then kept:
        every module of every layer of the step reuses it)."""
        if self._padded is None:
            length = self.max_rows
            places = [start + min(j, end - start - 1) for _, start, end in self.segments for j in range(length)]
            real = [k * length + j for k, (_, start, end) in enumerate(self.segments) for j in range(end - start)]
            dev = self.token_indices.device
            rows = self.token_indices.index_select(0, torch.tensor(places, device=dev))
            real_places = torch.tensor(real, device=dev)
            self._padded = PaddedSegments(
                rows=rows, real=real_places, targets=rows.index_select(0, real_places),
                slots=torch.tensor([slot for slot, _, _ in self.segments], device=dev), length=length)
        return self._padded

    def device_segments(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(seg_starts [S+1], seg_slots [S]) int32 on token_indices' device: the staged ones, else built from
        the host segments (one small copy each)."""
        if self.seg_starts is not None and self.seg_slots is not None:
            return self.seg_starts, self.seg_slots
        dev = self.token_indices.device
        starts, slots = segment_arrays(self.segments)
        return (torch.tensor(starts, dtype=torch.int32, device=dev),
                torch.tensor(slots, dtype=torch.int32, device=dev))


def segment_arrays(segments: list[Segment]) -> tuple[list[int], list[int]]:
    """The host segments as the kernels take them: starts (with the end appended) and slots."""
    return [start for _, start, _ in segments] + [segments[-1][2] if segments else 0], [s for s, _, _ in segments]


def lora_shrink(x: torch.Tensor, lora_a: torch.Tensor, groups: LoraGroups, scaling: torch.Tensor,
                buffer: torch.Tensor) -> None:
    """Write `scaling[s] * x[t] @ A[s]^T` into `buffer` ([groups.num_rows, rank], x's dtype) at each adapter
    row's place in `groups.token_indices`."""
    for slot, start, end in groups.segments:
        rows = groups.token_indices[start:end]
        buffer[start:end] = (x.index_select(0, rows) @ lora_a[slot].t()) * scaling[slot].to(x.dtype)


def lora_expand(buffer: torch.Tensor, lora_b: torch.Tensor, groups: LoraGroups, y: torch.Tensor) -> None:
    """Add `buffer[i] @ B[s]^T` to `y[t]` ([T, out], in place) for each adapter row t (at place i, of slot s)."""
    for slot, start, end in groups.segments:
        y.index_add_(0, groups.token_indices[start:end], buffer[start:end] @ lora_b[slot].t())


def add_lora(y: torch.Tensor, x: torch.Tensor, groups: LoraGroups, lora_a: torch.Tensor, lora_b: torch.Tensor,
             scaling: torch.Tensor, kernels: KernelOps | None = None) -> None:
    """`y[t] += scaling[s] * (x[t] @ A[s]^T) @ B[s]^T` for every adapter row t of slot s (shrink then expand).
    x: [T, in]; y: [T, out] (a view is fine); lora_a: [slots, rank, in]; lora_b: [slots, out, rank];
    scaling: [slots] float32. `kernels`: run their segmented shrink / expand (None: the torch code here)."""
    if not groups.segments:
        return
    if kernels is None:
        if len(groups.segments) > 1:
            _add_lora_batched(y, x, groups.padded(), lora_a, lora_b, scaling)
            return
        buffer = x.new_empty(groups.num_rows, lora_a.shape[1])
        lora_shrink(x, lora_a, groups, scaling, buffer)
        lora_expand(buffer, lora_b, groups, y)
        return
    buffer = x.new_empty(groups.num_rows, lora_a.shape[1])
    starts, slots = groups.device_segments()
    kernels.lora_shrink(x, lora_a, scaling, groups.token_indices, starts, slots, buffer, groups.max_rows)
    kernels.lora_expand(buffer, lora_b, groups.token_indices, starts, slots, y, groups.max_rows)


def _add_lora_batched(y: torch.Tensor, x: torch.Tensor, padded: PaddedSegments, lora_a: torch.Tensor,
                      lora_b: torch.Tensor, scaling: torch.Tensor) -> None:
    """`add_lora`'s torch form for several segments: one bmm each for shrink and expand over the padded
    segments instead of a matmul per segment (a decode step mixing adapters would otherwise pay a few small ops
    per adapter in every module of every layer: on a CPU that op overhead, not the math, is the cost)."""
    num_segments = padded.slots.shape[0]
    xs = x.index_select(0, padded.rows).view(num_segments, padded.length, -1)
    buffer = torch.bmm(xs, lora_a.index_select(0, padded.slots).transpose(1, 2))
    buffer *= scaling.index_select(0, padded.slots).to(x.dtype).view(num_segments, 1, 1)
    delta = torch.bmm(buffer, lora_b.index_select(0, padded.slots).transpose(1, 2))
    y.index_add_(0, padded.targets, delta.view(num_segments * padded.length, -1).index_select(0, padded.real))


def add_lora_rows(y: torch.Tensor, x: torch.Tensor, row_slots: torch.Tensor, lora_a: torch.Tensor,
                  lora_b: torch.Tensor, scaling: torch.Tensor, kernels: KernelOps | None = None) -> None:
    """`y[t] += scaling[s] * (x[t] @ A[s]^T) @ B[s]^T` for every row t with `row_slots[t] = s >= 0` (a device
    tensor [T]); other rows are not changed. No host value of the step is read, so a CUDA graph may capture it.
    `kernels`: run their per-row shrink / expand (None: batched torch, for a CPU)."""
    if kernels is not None:
        buffer = x.new_empty(row_slots.shape[0], lora_a.shape[1])
        kernels.lora_shrink_rows(x, lora_a, scaling, row_slots, buffer)
        kernels.lora_expand_rows(buffer, lora_b, row_slots, y)
        return
    slots = row_slots.clamp(min=0).long()
    buffer = torch.bmm(lora_a.index_select(0, slots), x.unsqueeze(-1)).squeeze(-1)
    buffer = buffer * scaling.index_select(0, slots).to(x.dtype)[:, None]
    delta = torch.bmm(lora_b.index_select(0, slots), buffer.unsqueeze(-1)).squeeze(-1)
    y += torch.where((row_slots >= 0)[:, None], delta, torch.zeros((), dtype=delta.dtype, device=delta.device))
