"""Group a batch's (token, k) routing pairs by expert, each expert's group padded to whole blocks of `block_m` rows,
so that every row block of the fused MoE GEMM (kernels/fused_moe.py) belongs to one expert.

Written with torch ops on the routing tensors' device and no host sync: the number of rows after padding is only
known on the device, so the arrays are sized for the most it can be (`max_padded_rows`) and the kernel's blocks
past `num_tokens_post_padded` exit at once.
"""

from __future__ import annotations

import torch


def max_padded_rows(num_pairs: int, block_m: int, num_experts: int) -> int:
    """The most rows `num_pairs` routing pairs take once each expert's group is padded to a multiple of `block_m`:
    each expert that gets a pair (at most min(E, pairs) of them) adds fewer than `block_m` padding rows."""
    return num_pairs + min(num_experts, num_pairs) * (block_m - 1)


def moe_align_block_size(topk_ids: torch.Tensor, block_m: int,
                         num_experts: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """`topk_ids` `[T, K]` -> (sorted_ids, expert_ids, num_tokens_post_padded), all int32 on its device.

    sorted_ids `[B * block_m]`, B = cdiv(max_padded_rows, block_m): the flat pair indices `t * K + k`, grouped by
    expert in expert order (pairs in their flat order within a group), each group padded with the sentinel T * K
    to a multiple of `block_m`; the sentinel also fills the rows past the end. expert_ids `[B]`: the expert of each
    block of `block_m` rows, -1 for blocks past the end. num_tokens_post_padded `[1]`: the rows in use."""
    flat = topk_ids.reshape(-1).long()
    num_pairs = flat.numel()
    device = topk_ids.device
    capacity = max_padded_rows(num_pairs, block_m, num_experts)
    num_blocks = -(-capacity // block_m)
    # not torch.bincount: on CUDA it reads the largest id back to size its output
    counts = torch.zeros(num_experts, dtype=torch.long, device=device).scatter_add_(0, flat, torch.ones_like(flat))
    padded = (counts + block_m - 1) // block_m * block_m
    padded_ends = padded.cumsum(0)
    padded_starts = padded_ends - padded
    starts = counts.cumsum(0) - counts
    order = flat.argsort(stable=True)
    experts_in_order = flat[order]
    rank = torch.arange(num_pairs, device=device) - starts[experts_in_order]
    sorted_ids = torch.full((num_blocks * block_m,), num_pairs, dtype=torch.int32, device=device)
    sorted_ids[padded_starts[experts_in_order] + rank] = order.to(torch.int32)
    block_starts = torch.arange(num_blocks, device=device) * block_m
    expert_ids = torch.searchsorted(padded_ends, block_starts, right=True)
    expert_ids = torch.where(expert_ids < num_experts, expert_ids, -1).to(torch.int32)
    return sorted_ids, expert_ids, padded_ends[-1:].to(torch.int32)
