"""The resident adapters on the model's device: per layer and module, A and B stacked over `max_loras` slots
(ranks padded with zeros to `max_lora_rank`), and a step's view of them for the model's projections."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from tritium.backend.lora.adapter import MODULES, LoraAdapter, module_shapes
from tritium.backend.lora.ops import LoraGroups, add_lora
from tritium.backend.models.config import ModelConfig

# The engine's fused projections and the PEFT modules whose outputs are their column slices, in order.
FUSED = {"qkv_proj": ("q_proj", "k_proj", "v_proj"), "o_proj": ("o_proj",),
         "gate_up_proj": ("gate_proj", "up_proj"), "down_proj": ("down_proj",)}


class LoraStacks:
    """Slot-stacked adapter weights on `device`: `a[layer][module]` [max_loras, max_rank, in] and
    `b[layer][module]` [max_loras, out, max_rank] in `dtype`, `scaling` [max_loras] float32. An empty slot and
    a module an adapter does not target hold zeros, which add nothing."""

    def __init__(self, config: ModelConfig, max_loras: int, max_rank: int, dtype: torch.dtype,
                 device: torch.device) -> None:
        self.max_loras, self.max_rank = max_loras, max_rank
        shapes = module_shapes(config)
        self.a = [{m: torch.zeros(max_loras, max_rank, shapes[m][0], dtype=dtype, device=device) for m in MODULES}
                  for _ in range(config.num_hidden_layers)]
        self.b = [{m: torch.zeros(max_loras, shapes[m][1], max_rank, dtype=dtype, device=device) for m in MODULES}
                  for _ in range(config.num_hidden_layers)]
        self.scaling = torch.zeros(max_loras, dtype=torch.float32, device=device)
        self.targets: list[frozenset[tuple[int, str]]] = [frozenset()] * max_loras  # (layer, module)s per slot
        self.slices = {fused: _slices(shapes, parts) for fused, parts in FUSED.items()}

    @property
    def nbytes(self) -> int:
        """Device bytes the stacks take (all slots)."""
        return sum(t.nbytes for layer in (*self.a, *self.b) for t in layer.values())

    def write(self, slot: int, adapter: LoraAdapter) -> None:
        """Copy `adapter`'s weights into `slot` (zeros where it has none)."""
        self.clear(slot)
        for (layer, module), (a, b) in adapter.weights.items():
            self.a[layer][module][slot, : adapter.rank].copy_(a)
            self.b[layer][module][slot, :, : adapter.rank].copy_(b)
        self.scaling[slot] = adapter.scaling
        self.targets[slot] = frozenset(adapter.weights)

    def clear(self, slot: int) -> None:
        """Zero `slot`."""
        for layer in (*self.a, *self.b):
            for t in layer.values():
                t[slot].zero_()
        self.scaling[slot] = 0.0
        self.targets[slot] = frozenset()


def _slices(shapes: dict[str, tuple[int, int]], parts: tuple[str, ...]) -> list[tuple[str, int, int]]:
    out, start = [], 0
    for m in parts:
        out.append((m, start, start + shapes[m][1]))
        start += shapes[m][1]
    return out


@dataclass
class LoraBatch:
    """One step's adapter rows (`groups`, by slot) over `stacks`. The runner builds it only when the step has
    adapter rows, so base-only steps run the projections untouched."""

    groups: LoraGroups
    stacks: LoraStacks

    def apply(self, layer: int, proj: str, x: torch.Tensor, y: torch.Tensor) -> None:
        """Add the adapters' deltas to `y`, the output of the fused projection `proj` (qkv_proj, o_proj,
        gate_up_proj, down_proj) of `layer` for input rows `x`, slice by slice, in place. Slots whose adapter
        does not target a module are left out of its slice (their weights there are zeros)."""
        stacks, groups = self.stacks, self.groups
        a, b = stacks.a[layer], stacks.b[layer]
        for module, start, end in stacks.slices[proj]:
            segments = [seg for seg in groups.segments if (layer, module) in stacks.targets[seg[0]]]
            if segments:
                add_lora(y[:, start:end], x, LoraGroups(groups.token_indices, segments), a[module], b[module],
                         stacks.scaling)
