"""LoRA shrink and expand (multi-LoRA, backend/lora/): the adapter delta `y[t] += scaling[s] * (x[t] @ A[s]^T) @ B[s]^T`
of each row t run on the adapter in slot s, in two launches through a small `[rows, rank]` buffer, for every module
of a fused projection at once (q/k/v of qkv_proj, gate/up of gate_up_proj: a slice axis in the grid).

Weights are stacked over slots (backend/lora/weights.py): A `[slots, modules * max_rank, in]` (a fused projection's
modules side by side on the rank axis), B `[slots, out, max_rank]` (the modules' output rows one after another, as
y's columns), scaling fp32 `[slots]`; ranks below max_rank are zero-padded there. The expand's `bounds` say where
each module's columns start (1-3 modules). The rank is one tile, BLOCK_R = max_rank rounded up to a power of two
>= 16 (the smallest `tl.dot` size). fp32 accumulation; fp32/bf16/fp16 inputs (fp32 `tl.dot` runs in IEEE
precision so it matches the reference). `y` may be a strided column slice of a wider output: it is read, added to
and written in place; rows of no adapter are never touched.

Two forms:
- segmented (`lora_shrink`, `lora_expand`): the adapter rows' indices sorted by slot (`token_indices`) and
  segments on the device (`seg_starts` `[S+1]` into token_indices, `seg_slots` `[S]`); grid = segments x row
  tiles x modules (x column tiles for expand), sized by `max_rows`, the longest segment (a host int the caller
  knows from its host segments). `tl.dot` tiles: prefill and mixed steps.
- per row (`lora_shrink_rows`, `lora_expand_rows`): `row_slots` `[T]` (-1: no adapter, skipped), GEMVs for
  decode steps. The shrink runs a program per row, module and K split (`tiles.lora_row_splits`: a few rows still
  fill the GPU) writing fp32 partial sums `[splits, T, rank rows]`; the expand adds the splits in a fixed order (no
  atomics: the same result every run) and multiplies by B, a program per row, module and column tile. The grid
  depends only on T, so a CUDA graph captured for a batch-size bucket replays any mix of adapters staged into
  `row_slots`.

Specialization: the index and segment pointers are views into the staging buffer at any offset, so they are
`do_not_specialize` (as in kernels/token_bitmask.py), as is the partial sums' split stride (T times the rank rows);
the other sizes and strides are fixed per projection and engine. The @triton.jit bodies are in kernels/jit/lora.py;
the torch references (`reference.lora_*`) take the same arguments. `python -m tritium.kernels.compile_check --kernel
lora_shrink_kernel ...` builds them for sm_80/sm_90."""

from __future__ import annotations

from collections.abc import Sequence
from itertools import pairwise
from typing import NamedTuple

import torch
import triton

from tritium.kernels.jit.lora import (
    lora_expand_kernel,
    lora_expand_rows_kernel,
    lora_shrink_kernel,
    lora_shrink_rows_kernel,
)
from tritium.kernels.tiles import use_gpu_tiles


class LoraConfig(NamedTuple):
    block_m: int  # rows per program (segmented forms)
    block_k: int  # shrink: input columns per step
    block_n: int  # expand: output columns per program
    block_r: int  # the rank tile
    num_warps: int
    num_stages: int


def rank_tile(max_rank: int) -> int:
    """The rank tile of `max_rank`: the next power of two, at least 16."""
    return max(16, 1 << (max_rank - 1).bit_length())


def lora_config(max_rank: int, per_row: bool, dtype: torch.dtype = torch.bfloat16, tiles: str = "gpu",
                device: torch.device | str = "cuda") -> LoraConfig:
    """Launch configuration for a stack of `max_rank` (GPU tiles; 16-wide tiles for the interpreter)."""
    r = rank_tile(max_rank)
    if not use_gpu_tiles(tiles, device):
        return LoraConfig(16, 16, 16, r, 4, 1)
    if per_row:  # [BLOCK_R, BLOCK_K] / [BLOCK_N, BLOCK_R] fp32 products: 4096 elements, 32 per thread
        width = min(256, max(16, 4096 // r))
        return LoraConfig(1, width, min(width, 128), r, 4, 2)
    wide = dtype == torch.float32 or r > 64  # fp32 tiles and big ranks: half the rows and columns
    return LoraConfig(16 if wide else 32, 64 if wide else 128, 32 if wide else 64, r, 4, 2)


def _dot_precision(dtype: torch.dtype) -> str:
    return "ieee" if dtype == torch.float32 else "tf32"


def _check(x: torch.Tensor, lora_a: torch.Tensor, buffer: torch.Tensor, num_slices: int) -> None:
    if x.dim() != 2 or lora_a.dim() != 3 or x.shape[1] != lora_a.shape[2] or buffer.shape[-1] != lora_a.shape[1]:
        raise ValueError(f"lora shrink: x {tuple(x.shape)}, lora_a {tuple(lora_a.shape)}, buffer "
                         f"{tuple(buffer.shape)} mismatch")
    if num_slices < 1 or lora_a.shape[1] % num_slices:
        raise ValueError(f"lora shrink: lora_a's {lora_a.shape[1]} rank rows do not split into {num_slices} modules")
    if x.stride(1) != 1 or lora_a.stride(2) != 1 or buffer.stride(-1) != 1:
        raise ValueError("lora shrink: x, lora_a and buffer need unit stride in their last dimension")


def slice_bounds(bounds: Sequence[int] | None, y: torch.Tensor, lora_b: torch.Tensor, buffer: torch.Tensor
                 ) -> tuple[int, int, int, int]:
    """The expand's module bounds as the kernels take them: 4 ints, the last repeated past the last module. Raises
    ValueError unless `bounds` (None: one module) runs 0 < ... <= y's columns over 1-3 modules and B and the buffer
    fit them."""
    edges = list(bounds) if bounds is not None else [0, y.shape[1]]
    num_slices = len(edges) - 1
    if y.dim() != 2 or lora_b.dim() != 3 or lora_b.shape[1] != y.shape[1] \
            or buffer.shape[-1] != num_slices * lora_b.shape[2]:
        raise ValueError(f"lora expand: buffer {tuple(buffer.shape)}, lora_b {tuple(lora_b.shape)}, y "
                         f"{tuple(y.shape)}, {num_slices} modules mismatch")
    if not 1 <= num_slices <= 3 or edges[0] != 0 or edges[-1] != y.shape[1] \
            or any(a >= b for a, b in pairwise(edges)):
        raise ValueError(f"lora expand: slice bounds {edges} must rise from 0 to y's {y.shape[1]} columns over "
                         "1 to 3 modules")
    if lora_b.stride(2) != 1 or buffer.stride(-1) != 1:
        raise ValueError("lora expand: lora_b and buffer need unit stride in their last dimension")
    edges += [edges[-1]] * (4 - len(edges))
    return edges[0], edges[1], edges[2], edges[3]


def lora_shrink(x: torch.Tensor, lora_a: torch.Tensor, scaling: torch.Tensor, token_indices: torch.Tensor,
                seg_starts: torch.Tensor, seg_slots: torch.Tensor, buffer: torch.Tensor, max_rows: int,
                num_slices: int = 1, tiles: str = "auto") -> None:
    """`buffer[i] = scaling[s] * x[token_indices[i]] @ A[s]^T` for each place i of each segment (slot s, places
    `seg_starts[j]:seg_starts[j+1]`); A holds `num_slices` modules' rank rows side by side, each one program's.
    Raises ValueError on mismatched shapes."""
    _check(x, lora_a, buffer, num_slices)
    num_segments = seg_slots.shape[0]
    if num_segments == 0 or max_rows == 0:
        return
    rank = lora_a.shape[1] // num_slices
    cfg = lora_config(rank, False, x.dtype, tiles, x.device)
    grid = (num_segments, triton.cdiv(max_rows, cfg.block_m), num_slices)
    lora_shrink_kernel[grid](
        x, lora_a, scaling, token_indices, seg_starts, seg_slots, buffer,
        x.shape[1], rank, x.stride(0), lora_a.stride(0), lora_a.stride(1), buffer.stride(0),
        BLOCK_M=cfg.block_m, BLOCK_K=cfg.block_k, BLOCK_R=cfg.block_r, DOT_PRECISION=_dot_precision(x.dtype),
        num_warps=cfg.num_warps, num_stages=cfg.num_stages,
    )


def lora_expand(buffer: torch.Tensor, lora_b: torch.Tensor, token_indices: torch.Tensor, seg_starts: torch.Tensor,
                seg_slots: torch.Tensor, y: torch.Tensor, max_rows: int, bounds: Sequence[int] | None = None,
                tiles: str = "auto") -> None:
    """`y[token_indices[i], c] += buffer[i, module j's ranks] @ B[s, c]^T` for each place i of each segment (slot s)
    and each column c of module j (`bounds[j] <= c < bounds[j+1]`; None: one module), in place. Raises ValueError
    on mismatched shapes or bounds."""
    edges = slice_bounds(bounds, y, lora_b, buffer)
    num_segments = seg_slots.shape[0]
    if num_segments == 0 or max_rows == 0:
        return
    num_slices = len(bounds) - 1 if bounds is not None else 1
    cfg = lora_config(lora_b.shape[2], False, y.dtype, tiles, y.device)
    tiles_per_slice = triton.cdiv(max(b - a for a, b in pairwise(edges)), cfg.block_n)
    grid = (num_segments, triton.cdiv(max_rows, cfg.block_m), num_slices * tiles_per_slice)
    lora_expand_kernel[grid](
        buffer, lora_b, token_indices, seg_starts, seg_slots, y,
        lora_b.shape[2], tiles_per_slice, *edges, buffer.stride(0), lora_b.stride(0), lora_b.stride(1), y.stride(0),
        y.stride(1),
        BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_R=cfg.block_r, DOT_PRECISION=_dot_precision(y.dtype),
        num_warps=cfg.num_warps, num_stages=cfg.num_stages,
    )


def lora_shrink_rows(x: torch.Tensor, lora_a: torch.Tensor, scaling: torch.Tensor, row_slots: torch.Tensor,
                     partials: torch.Tensor, num_slices: int = 1, tiles: str = "auto") -> None:
    """Split-K partial sums of `scaling[s] * x[t] @ A[s]^T` for each row t with `row_slots[t] = s >= 0`: fp32
    `partials` `[splits, T, rank rows]`, split p over a contiguous 1/splits of x's columns (their sum is the product);
    A holds `num_slices` modules' rank rows side by side. Other rows are left as they are. Raises ValueError on
    mismatched shapes."""
    _check(x, lora_a, partials, num_slices)
    if partials.dim() != 3 or partials.shape[1] != row_slots.shape[0] or partials.dtype != torch.float32:
        raise ValueError(f"lora shrink: partials {tuple(partials.shape)} {partials.dtype} must be float32 "
                         f"[splits, {row_slots.shape[0]}, {lora_a.shape[1]}]")
    rows = row_slots.shape[0]
    if rows == 0:
        return
    rank, splits = lora_a.shape[1] // num_slices, partials.shape[0]
    cfg = lora_config(rank, True, x.dtype, tiles, x.device)
    k_per_split = triton.cdiv(triton.cdiv(x.shape[1], splits), cfg.block_k) * cfg.block_k
    lora_shrink_rows_kernel[(rows, num_slices, splits)](
        x, lora_a, scaling, row_slots, partials,
        x.shape[1], rank, k_per_split, x.stride(0), lora_a.stride(0), lora_a.stride(1), partials.stride(0),
        partials.stride(1),
        BLOCK_K=cfg.block_k, BLOCK_R=cfg.block_r, num_warps=cfg.num_warps, num_stages=cfg.num_stages,
    )


def lora_expand_rows(partials: torch.Tensor, lora_b: torch.Tensor, row_slots: torch.Tensor, y: torch.Tensor,
                     bounds: Sequence[int] | None = None, tiles: str = "auto") -> None:
    """`y[t, c] += (sum over splits of partials[:, t, module j's ranks]) @ B[s, c]^T` for each row t with
    `row_slots[t] = s >= 0` and each column c of module j (`bounds` as in `lora_expand`), in place; other rows are
    not touched. The splits are added in order: the same result every run. Raises ValueError on mismatched shapes."""
    edges = slice_bounds(bounds, y, lora_b, partials)
    rows = row_slots.shape[0]
    if rows == 0:
        return
    num_slices = len(bounds) - 1 if bounds is not None else 1
    cfg = lora_config(lora_b.shape[2], True, y.dtype, tiles, y.device)
    tiles_per_slice = triton.cdiv(max(b - a for a, b in pairwise(edges)), cfg.block_n)
    lora_expand_rows_kernel[(rows, num_slices, tiles_per_slice)](
        partials, lora_b, row_slots, y,
        lora_b.shape[2], partials.shape[0], *edges, partials.stride(0), partials.stride(1), lora_b.stride(0),
        lora_b.stride(1), y.stride(0), y.stride(1),
        BLOCK_N=cfg.block_n, BLOCK_R=cfg.block_r, num_warps=cfg.num_warps, num_stages=cfg.num_stages,
    )
