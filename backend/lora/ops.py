"""The LoRA shrink and expand ops in plain torch, with the signatures the Triton kernels will take.

A step's rows are grouped by adapter slot once, on the host (`lora_groups`): the adapter rows' indices sorted
by slot, and one segment (slot, start, end) per slot in use. For every row t of slot s:
    shrink: buffer[i] = scaling[s] * x[t] @ A[s]^T         (A: [slots, rank, in]; i: t's place in the order)
    expand: y[t]     += buffer[i] @ B[s]^T                  (B: [slots, out, rank])
y may be a column slice of a fused projection's output (q, k or v of qkv; gate or up of gate_up): it is
written in place, so strided views work. Rows of no adapter are never touched. The segments are host ints, so
the reference launches no host-device synchronization.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

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
class LoraGroups:
    """A step's adapter rows: `token_indices` [adapter rows] (device) sorted by slot, `segments` on the host."""

    token_indices: torch.Tensor
    segments: list[Segment]

    @property
    def num_rows(self) -> int:
        """Rows that have an adapter."""
        return self.segments[-1][2] if self.segments else 0


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
             scaling: torch.Tensor) -> None:
    """`y[t] += scaling[s] * (x[t] @ A[s]^T) @ B[s]^T` for every adapter row t of slot s (shrink then expand).
    x: [T, in]; y: [T, out] (a view is fine); lora_a: [slots, rank, in]; lora_b: [slots, out, rank];
    scaling: [slots] float32."""
    if not groups.segments:
        return
    buffer = x.new_empty(groups.num_rows, lora_a.shape[1])
    lora_shrink(x, lora_a, groups, scaling, buffer)
    lora_expand(buffer, lora_b, groups, y)
