"""The fused MoE kernel's launch configuration per GPU architecture: row, column and reduction tiles, the row-block
grouping, warps and pipeline stages.

The configuration depends on how many rows each expert gets, on average: `rows_per_expert` = cdiv(T * K, E) for T
tokens routed to K of E experts. Few rows (decode) want 16-row blocks, so padding wastes little and the weights
are read once; many rows (prefill) want bigger tiles. `TUNED` holds what the MoE sweep (client/bench/moe.py,
`sweep_moe`, also run by gpu-check) found fastest on each architecture, keyed by compute capability and then by
the most rows per expert an entry is for (the largest key serves any more); it prints its winners as a `TUNED`
entry to paste here. fp16/bf16 launches on an architecture the table does not hold, and every fp32 launch, get
`default_moe_config`.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import NamedTuple

import torch

from tritium.kernels.tiles import use_gpu_tiles

SMALL_ROWS = 16  # rows per expert up to which the default configuration uses 16-row blocks


class MoeConfig(NamedTuple):
    """Rows per block (the alignment's block size), output columns and reduction depth per program, row blocks
    grouped per column sweep (L2 reuse of the weights), warps, software-pipeline stages."""

    block_m: int
    block_n: int
    block_k: int
    group_m: int
    num_warps: int
    num_stages: int


# (major, minor) -> the most rows per expert -> config, for fp16 / bf16. Empty until a sweep on a GPU is pasted in.
TUNED: Mapping[tuple[int, int], Mapping[int, MoeConfig]] = {}
INTERPRETER_CONFIG = MoeConfig(16, 16, 16, 1, 4, 1)


def rows_per_expert(num_tokens: int, top_k: int, num_experts: int) -> int:
    """The rows each expert gets on average: cdiv(T * K, E)."""
    return -(-num_tokens * top_k // max(1, num_experts))


def default_moe_config(rows: int, dtype: torch.dtype) -> MoeConfig:
    """The rule when the table has nothing, by `rows` per expert: 16-row blocks up to SMALL_ROWS, 64-row ones
    above (32 in fp32, whose tiles take twice the registers and shared memory)."""
    if dtype == torch.float32:
        return MoeConfig(16, 32, 32, 1, 4, 2) if rows <= SMALL_ROWS else MoeConfig(32, 32, 32, 8, 4, 2)
    return MoeConfig(16, 64, 64, 1, 4, 3) if rows <= SMALL_ROWS else MoeConfig(64, 64, 64, 8, 4, 3)


def tuned_moe_config(capability: tuple[int, int] | None, rows: int,
                     table: Mapping[tuple[int, int], Mapping[int, MoeConfig]] = TUNED) -> MoeConfig | None:
    """The entry `table` records for `rows` per expert on the architecture of compute `capability` (the smallest
    key at least `rows`, else the largest); None when it records none (or `capability` is None: not a GPU)."""
    entries = table.get(capability, {}) if capability is not None else {}
    if not entries:
        return None
    fits = [key for key in entries if key >= rows]
    return entries[min(fits) if fits else max(entries)]


def moe_config(rows: int, dtype: torch.dtype, tiles: str = "gpu", device: torch.device | str = "cuda") -> MoeConfig:
    """Launch configuration for `rows` per expert: on a CUDA device in fp16/bf16 what TUNED records for its
    architecture, else the default rule; the interpreter gets 16-wide tiles."""
    if not use_gpu_tiles(tiles, device):
        return INTERPRETER_CONFIG
    if torch.device(device).type == "cuda" and dtype != torch.float32:
        tuned = tuned_moe_config(torch.cuda.get_device_capability(device), rows)
        if tuned is not None:
            return tuned
    return default_moe_config(rows, dtype)


def config_row_counts(capability: tuple[int, int] | None, dtype: torch.dtype,
                      table: Mapping[tuple[int, int], Mapping[int, MoeConfig]] = TUNED) -> list[int]:
    """One `rows` per expert value for each distinct configuration `moe_config` can pick on this architecture and
    dtype (the warm-up launches at each, so no configuration compiles while serving)."""
    tuned = table.get(capability, {}) if capability is not None and dtype != torch.float32 else {}
    if not tuned:
        return [1, SMALL_ROWS + 1]
    keys = sorted(tuned)
    return [1, *(key + 1 for key in keys[:-1])]


def table_entry(capability: tuple[int, int], configs: Mapping[int, MoeConfig]) -> str:
    """`configs` (by the most rows per expert) as the line to paste into TUNED for `capability`."""
    body = ", ".join(f"{rows}: MoeConfig{tuple(c)}" for rows, c in sorted(configs.items()))
    return f"{capability}: {{{body}}},"
