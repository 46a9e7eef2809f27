"""Which adapters are loaded (by name, in host memory) and which are resident in a device slot (pinned while a
sequence runs on it, else reused least recently used first): docs/architecture.md#lora. Engine thread only."""

from __future__ import annotations

from collections import OrderedDict
from pathlib import Path

import torch

from tritium.backend.lora.adapter import LoraAdapter, load_adapter
from tritium.backend.lora.weights import LoraStacks
from tritium.backend.model_config import ModelConfig


class LoraManager:
    def __init__(self, stacks: LoraStacks, config: ModelConfig, dtype: torch.dtype) -> None:
        self.stacks = stacks
        self.config = config
        self.dtype = dtype
        self.adapters: dict[str, LoraAdapter] = {}
        self._refs: dict[LoraAdapter, int] = {}  # accepted requests holding each adapter
        self._slot_of: dict[LoraAdapter, int] = {}
        self._slots: list[LoraAdapter | None] = [None] * stacks.max_loras
        self._pins = [0] * stacks.max_loras
        self._idle: OrderedDict[int, None] = OrderedDict()  # resident, unpinned slots, least recently used first

    @property
    def max_loras(self) -> int:
        return self.stacks.max_loras

    def load(self, name: str, folder: str | Path) -> LoraAdapter:
        """Raises ValueError for an empty or loaded `name`, LoraAdapterError naming what does not fit the model."""
        if not isinstance(name, str) or not name:
            raise ValueError(f"a LoRA adapter's name must be a non-empty string, got {name!r}")
        if name in self.adapters:
            raise ValueError(f"LoRA adapter {name!r} is loaded already; unload it first")
        adapter = load_adapter(name, folder, self.config, self.stacks.max_rank, self.dtype)
        self.adapters[name] = adapter
        return adapter

    def unload(self, name: str) -> None:
        """Requests holding it (`retain`) finish on it. Raises ValueError naming an unknown adapter."""
        adapter = self.get(name)
        del self.adapters[name]
        if not self._refs.get(adapter):
            self._evict(adapter)

    def get(self, name: str) -> LoraAdapter:
        """The adapter loaded as `name`. Raises ValueError naming it when there is none."""
        adapter = self.adapters.get(name)
        if adapter is None:
            known = ", ".join(sorted(self.adapters)) or "none"
            raise ValueError(f"unknown LoRA adapter {name!r} (loaded: {known})")
        return adapter

    def retain(self, adapter: LoraAdapter) -> None:
        """An accepted request holds `adapter` until `drop`."""
        self._refs[adapter] = self._refs.get(adapter, 0) + 1

    def drop(self, adapter: LoraAdapter) -> None:
        """A request holding `adapter` ended; an unloaded adapter nobody holds leaves its slot."""
        self._refs[adapter] -= 1
        if self._refs[adapter] == 0:
            del self._refs[adapter]
            if self.adapters.get(adapter.name) is not adapter:
                self._evict(adapter)

    def acquire(self, adapter: LoraAdapter) -> int | None:
        """Pin `adapter` in a slot, writing it there when not resident. Returns the slot, or None when every slot
        is pinned by other adapters (the sequence waits)."""
        slot = self._slot_of.get(adapter)
        if slot is None:
            free = [i for i, a in enumerate(self._slots) if a is None]
            if free:
                slot = free[0]
            elif self._idle:
                slot, _ = self._idle.popitem(last=False)
                old = self._slots[slot]
                assert old is not None
                del self._slot_of[old]
            else:
                return None
            self.stacks.write(slot, adapter)
            self._slots[slot] = adapter
            self._slot_of[adapter] = slot
        self._idle.pop(slot, None)
        self._pins[slot] += 1
        return slot

    def release(self, adapter: LoraAdapter) -> None:
        """A sequence pinning `adapter` finished or was preempted."""
        slot = self._slot_of[adapter]
        self._pins[slot] -= 1
        if self._pins[slot] == 0:
            self._idle[slot] = None

    def num_pinned(self) -> int:
        return sum(1 for pins in self._pins if pins)

    def resident(self) -> list[str | None]:
        """The adapter name in each slot (None: empty)."""
        return [a.name if a is not None else None for a in self._slots]

    def _evict(self, adapter: LoraAdapter) -> None:
        slot = self._slot_of.pop(adapter, None)
        if slot is None:
            return
        assert self._pins[slot] == 0
        self._idle.pop(slot, None)
        self._slots[slot] = None
        self.stacks.clear(slot)
