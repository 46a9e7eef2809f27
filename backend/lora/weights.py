"""The resident adapters' weights stacked over the device slots, and a step's adapter rows over them."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from tritium.backend.lora.adapter import MODULES, LoraAdapter, module_shapes
from tritium.backend.lora.ops import LoraGroups, LoraSlice, Segment, add_lora_fused, add_lora_rows, add_lora_segments
from tritium.backend.lora.windows import LoraWindows, add_lora_windows
from tritium.backend.model_config import ModelConfig
from tritium.kernels.cpu_lora import CpuLora
from tritium.kernels.interface import KernelOps

# The engine's fused projections and the PEFT modules whose outputs are their column slices, in order.
FUSED = {"qkv_proj": ("q_proj", "k_proj", "v_proj"), "o_proj": ("o_proj",),
         "gate_up_proj": ("gate_proj", "up_proj"), "down_proj": ("down_proj",)}
_PROJ_OF = {module: proj for proj, parts in FUSED.items() for module in parts}


class LoraStacks:
    """`a[layer][module]` [max_loras, max_rank, in], `b[layer][module]` [max_loras, out, max_rank], written in place
    (captured graphs see later adapters); zeros wherever an adapter has no weight, which add nothing."""

    def __init__(self, config: ModelConfig, max_loras: int, max_rank: int, dtype: torch.dtype,
                 device: torch.device, b_rank_major: bool = False) -> None:
        self.max_loras, self.max_rank = max_loras, max_rank
        shapes = module_shapes(config)
        # A of a fused projection's modules side by side on the rank axis: the torch form shrinks them with one bmm
        self.a_fused = [{proj: torch.zeros(max_loras, len(parts) * max_rank, shapes[parts[0]][0], dtype=dtype,
                                           device=device) for proj, parts in FUSED.items()}
                        for _ in range(config.num_hidden_layers)]
        self.a = [{m: fused[proj][:, j * max_rank : (j + 1) * max_rank] for proj, parts in FUSED.items()
                   for j, m in enumerate(parts)} for fused in self.a_fused]
        if b_rank_major:  # the torch form's expand is faster on a rank-major B^T
            self.b = [{m: torch.zeros(max_loras, max_rank, shapes[m][1], dtype=dtype, device=device).transpose(1, 2)
                       for m in MODULES} for _ in range(config.num_hidden_layers)]
        else:  # the kernels read B with unit stride on the rank axis, a fused projection's modules one launch
            self.b_fused = [{proj: torch.zeros(max_loras, sum(shapes[m][1] for m in parts), max_rank, dtype=dtype,
                                               device=device) for proj, parts in FUSED.items()}
                            for _ in range(config.num_hidden_layers)]
            self.b = [{m: fused[proj][:, start:end] for proj, parts in FUSED.items()
                       for m, start, end in _slices(shapes, parts)} for fused in self.b_fused]
        self.scaling = torch.zeros(max_loras, dtype=torch.float32, device=device)
        self.targets: list[frozenset[tuple[int, str]]] = [frozenset()] * max_loras
        self.proj_targets: list[frozenset[tuple[int, str]]] = [frozenset()] * max_loras
        self.slices = {fused: _slices(shapes, parts) for fused, parts in FUSED.items()}
        # where each module's columns start in its fused output, and its end: the kernels' `bounds`
        self.bounds = {proj: (0, *(end for _, _, end in slices)) for proj, slices in self.slices.items()}
        self.num_layers = config.num_hidden_layers
        # every module's slice of each projection, and B as the CPU kernel reads it: made once for decode steps
        self.full_slices: list[dict[str, list[LoraSlice | None]]] = [
            {proj: [(self.b[layer][m], start, end) for m, start, end in self.slices[proj]] for proj in FUSED}
            for layer in range(config.num_hidden_layers)]
        self.b_rows: list[dict[str, list[torch.Tensor | None]]] | None = [
            {proj: [self.b[layer][m].transpose(1, 2) for m, _, _ in self.slices[proj]] for proj in FUSED}
            for layer in range(config.num_hidden_layers)] if b_rank_major else None

    b_fused: list[dict[str, torch.Tensor]]  # (the kernels' layout) B of each fused projection, `b` its views

    @property
    def nbytes(self) -> int:
        """Device bytes of all slots."""
        return sum(t.nbytes for layer in (*self.a, *self.b) for t in layer.values())

    def covers_all(self, slot: int) -> bool:
        return len(self.targets[slot]) == self.num_layers * len(MODULES)

    def write(self, slot: int, adapter: LoraAdapter) -> None:
        """Copy `adapter`'s weights into `slot` (zeros where it has none)."""
        self.clear(slot)
        for (layer, module), (a, b) in adapter.weights.items():
            self.a[layer][module][slot, : adapter.rank].copy_(a)
            self.b[layer][module][slot, :, : adapter.rank].copy_(b)
        self.scaling[slot] = adapter.scaling
        self.targets[slot] = frozenset(adapter.weights)
        self.proj_targets[slot] = frozenset((layer, _PROJ_OF[module]) for layer, module in adapter.weights)

    def clear(self, slot: int) -> None:
        for layer in (*self.a, *self.b):
            for t in layer.values():
                t[slot].zero_()
        self.scaling[slot] = 0.0
        self.targets[slot] = frozenset()
        self.proj_targets[slot] = frozenset()


def _slices(shapes: dict[str, tuple[int, int]], parts: tuple[str, ...]) -> list[tuple[str, int, int]]:
    out, start = [], 0
    for m in parts:
        out.append((m, start, start + shapes[m][1]))
        start += shapes[m][1]
    return out


@dataclass
class LoraBatch:
    """A step's adapter rows (built only when it has some): by slot (`groups`), decode rows in `windows` (torch
    form), or one slot per row (`row_slots`: CUDA graphs)."""

    groups: LoraGroups | None
    stacks: LoraStacks
    row_slots: torch.Tensor | None = None
    kernels: KernelOps | None = None
    windows: LoraWindows | None = None
    native: CpuLora | None = None  # the CPU kernel of the windowed form (kernels/cpu_lora.py), where built
    _subsets: dict[tuple[Segment, ...], LoraGroups] = field(default_factory=dict, repr=False)
    _covers_all: bool | None = field(default=None, repr=False)  # every window's adapter targets every module

    def apply(self, layer: int, proj: str, x: torch.Tensor, y: torch.Tensor) -> None:
        """Add the adapters' deltas to `y`, the output of `layer`'s fused projection `proj` for input rows `x`,
        in place, skipping modules no slot of the step targets."""
        stacks, groups = self.stacks, self.groups
        if self.windows is not None:  # a step's decode rows; its prefill rows, if any, are in `groups`
            self._apply_windows(layer, proj, x, y, self.windows)
            if groups is None:
                return
        elif groups is None:
            assert self.row_slots is not None
            if self.kernels is not None:
                add_lora_rows(y, x, self.row_slots, stacks.a_fused[layer][proj], stacks.b_fused[layer][proj],
                              stacks.scaling, self.kernels, stacks.bounds[proj])
                return
            a, b = stacks.a[layer], stacks.b[layer]
            for module, start, end in stacks.slices[proj]:
                add_lora_rows(y[:, start:end], x, self.row_slots, a[module], b[module], stacks.scaling)
            return
        if self.kernels is not None:  # the staged device segments, all of them, every module (zeros add nothing)
            add_lora_segments(y, x, groups, stacks.a_fused[layer][proj], stacks.b_fused[layer][proj],
                              stacks.bounds[proj], stacks.scaling, self.kernels)
            return
        key = (layer, proj)
        segments = [seg for seg in groups.segments if key in stacks.proj_targets[seg[0]]]
        if not segments:
            return
        slices = self._slices(layer, proj, [slot for slot, _, _ in segments])
        subset_key = tuple(segments)  # the same few subsets recur in every layer: their padded form is kept
        subset = self._subsets.get(subset_key)
        if subset is None:
            subset = self._subsets[subset_key] = LoraGroups(groups.token_indices, segments)
        add_lora_fused(y, x, subset, stacks.a_fused[layer][proj], slices, stacks.scaling)

    def _apply_windows(self, layer: int, proj: str, x: torch.Tensor, y: torch.Tensor, windows: LoraWindows) -> None:
        stacks = self.stacks
        if self._covers_all is None:
            self._covers_all = all(stacks.covers_all(slot) for slot in windows.slots)
        if self._covers_all:
            add_lora_windows(y, x, windows, stacks.a_fused[layer][proj], stacks.full_slices[layer][proj],
                             stacks.scaling, self.native, stacks.b_rows[layer][proj] if stacks.b_rows else None)
        elif any((layer, proj) in stacks.proj_targets[slot] for slot in windows.slots):
            add_lora_windows(y, x, windows, stacks.a_fused[layer][proj], self._slices(layer, proj, windows.slots),
                             stacks.scaling, self.native)

    def _slices(self, layer: int, proj: str, slots: list[int]) -> list[LoraSlice | None]:
        """`proj`'s (B, start, end) slices, None for a module none of `slots` targets in `layer`."""
        b, targets = self.stacks.b[layer], self.stacks.targets
        return [(b[module], start, end) if any((layer, module) in targets[slot] for slot in slots) else None
                for module, start, end in self.stacks.slices[proj]]
