"""Decode attention's launch configuration per GPU architecture: the split kernel's key tile (BLOCK_N), warps
and pipeline stages.

`TUNED` holds what gpu-check's sweep (client/bench/kernels.py, `sweep_decode`) found fastest at the decode
goal's point (batch 64, 4k context, bf16) on each architecture, keyed by compute capability and then by
head_dim. gpu-check prints its winners as a `TUNED` entry to paste here. fp16/bf16 launches on an
architecture or head_dim the table does not hold, and every fp32 launch, get `default_decode_config`.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import NamedTuple

import torch


class DecodeConfig(NamedTuple):
    """The split kernel's key tile (keys per loop step), warps and software-pipeline stages."""

    block_n: int
    num_warps: int
    num_stages: int


# (major, minor) -> head_dim -> config, for fp16 / bf16. Empty until a sweep on a GPU is pasted in.
TUNED: Mapping[tuple[int, int], Mapping[int, DecodeConfig]] = {}


def default_decode_config(head_dim: int, dtype: torch.dtype) -> DecodeConfig:
    """The rule when the table has nothing: K/V tiles of about 4K elements (2K in fp32), which keep registers
    in bounds, 4 warps, 2 stages."""
    elems = 2048 if dtype == torch.float32 else 4096
    return DecodeConfig(max(16, min(64, elems // head_dim)), 4, 2)


def tuned_decode_config(capability: tuple[int, int] | None, head_dim: int,
                        table: Mapping[tuple[int, int], Mapping[int, DecodeConfig]] = TUNED) -> DecodeConfig | None:
    """The configuration `table` records for `head_dim` on the architecture of compute `capability`; None when
    it records none (or `capability` is None: not a GPU)."""
    if capability is None:
        return None
    return table.get(capability, {}).get(head_dim)


def table_entry(capability: tuple[int, int], configs: Mapping[int, DecodeConfig]) -> str:
    """`configs` (by head_dim) as the line to paste into TUNED for `capability`."""
    by_dim = ", ".join(f"{d}: DecodeConfig({c.block_n}, {c.num_warps}, {c.num_stages})"
                       for d, c in sorted(configs.items()))
    return f"{capability}: {{{by_dim}}},"
