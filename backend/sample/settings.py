"""The sampling settings of a step's random rows, declared once in ROW_SETTINGS (host lists, device views and
staging size follow). A new setting: an entry here and its op in logits_ops.py."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from tritium.backend.core.sequence import Sequence
from tritium.backend.sampling_params import SamplingParams

INT32_MAX = 2**31 - 1
Value = int | float


@dataclass(frozen=True)
class RowSetting:
    """`used`: whether a row's value does anything (no row uses it: its op is skipped)."""

    name: str
    is_float: bool
    read: Callable[[SamplingParams], Value]
    used: Callable[[Value], bool]


ROW_SETTINGS: tuple[RowSetting, ...] = (
    RowSetting("temperature", True, lambda p: p.temperature, lambda v: True),
    # Any top_k >= the vocabulary keeps every token; clamped so that it fits int32.
    RowSetting("top_k", False, lambda p: max(-1, min(p.top_k, INT32_MAX)), lambda v: v > 0),
    RowSetting("top_p", True, lambda p: p.top_p, lambda v: v < 1.0),
    RowSetting("min_p", True, lambda p: p.min_p, lambda v: v > 0),
)
SETTING_NAMES = frozenset(s.name for s in ROW_SETTINGS)


def sampling_slots(max_rows: int) -> int:
    """The staging-buffer slots a sampler call's inputs for `max_rows` rows take in a usual step (more, such as a
    long prompt's first penalty counts, are copied alone): per row its settings, logprobs, penalty and a few
    tokens' counts and bans."""
    return (len(ROW_SETTINGS) + 20) * max_rows


@dataclass
class RowSettings:
    """The random rows of a batch and their settings on the logits' device."""

    rows: list[int]
    index: torch.Tensor  # [R] int32, the same rows
    values: dict[str, torch.Tensor]  # by setting name: [R] float32 or int32
    used: frozenset[str]  # the settings at least one of these rows uses

    def __getitem__(self, name: str) -> torch.Tensor:
        return self.values[name]

    def uses(self, *names: str) -> bool:
        return not self.used.isdisjoint(names)


@dataclass
class HostRowSettings:
    """The random rows' settings as host lists, by setting name."""

    rows: list[int]
    values: dict[str, list[Value]]

    @classmethod
    def of(cls, seqs: list[Sequence]) -> HostRowSettings:
        """The rows of `seqs` that sample at random."""
        rows = [i for i, s in enumerate(seqs) if not s.params.greedy]
        params = [seqs[i].params for i in rows]
        return cls(rows, {s.name: [s.read(p) for p in params] for s in ROW_SETTINGS})

    @property
    def used(self) -> frozenset[str]:
        return frozenset(s.name for s in ROW_SETTINGS if any(s.used(v) for v in self.values[s.name]))
