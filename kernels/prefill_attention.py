"""Causal flash attention for packed variable-length queries against a paged KV cache.

Sequence i owns query rows `cu_seqlens_q[i]:cu_seqlens_q[i+1]`, the last positions of a context of
`seq_lens[i]` tokens already in the cache: one kernel covers plain prefill, chunked prefill and
prefix-cache hits. A program takes one KV head of one sequence and a tile of BLOCK_M rows, where a
row is a (query position, query head of that KV head's group) pair, so `tl.dot` gets full tiles even
for small GQA groups. Keys are visited tile by tile (online softmax, fp32 accumulation): tiles left
of the diagonal need no mask, tiles past the last query position are never visited. The grid is
(query tile slots, sequences, KV heads); the first axis is the one the GPU launches fastest, and
`query_tile` maps its slots to each sequence's tiles from the last to the first: the last query tile of a
causal sequence visits the most keys, so the longest programs start first and the short ones fill the tail
(the mapping is a permutation of each sequence's tiles; the results are the same bits in any order). The
@triton.jit bodies are in kernels/jit/prefill_attention.py.

Specialization: the only int that changes from step to step, stride_bt (the block-table width, 1 for a
one-block batch), is `do_not_specialize`; token and sequence counts live in the grid and in tensors. The
step's metadata pointers (block tables, cu_seqlens, lengths) may be views at any offset of a staging
buffer, so their alignment is not specialized (they are read by gathers and scalar loads). The q, cache
and output pointers (fresh buffers, q rows starting at multiples of head_dim, also inside a fused qkv
output) and the q/out/cache strides (multiples of head_dim, fixed for an engine) keep the JIT's divisible-by-16
specialization, which gives vector loads and stores of the q, K, V and output rows.

Sliding windows and soft-capping are constexpr switches (WINDOW, SOFTCAP), so a model without them compiles the
kernel it always did; an engine compiles at most one variant per (window?, softcap?) pair its layers use. The
window size is a runtime int (`do_not_specialize`: one binary for any size) and the cap a runtime float (the JIT
never specializes floats). With a window, a query tile visits only the key tiles that hold a key of some row's
window: those wholly before it are skipped (the work per tile is bounded by the window, not the context), those
that hold a window's start are masked, the rest as without a window. The cap is applied to the scaled scores
before the online softmax, which works in the exp2 domain: c * tanh(s * scale / c) * log2(e), so the kernel takes
scale / c and c * log2(e) in place of scale * log2(e).

Attention sinks (gpt-oss) are a third constexpr switch (SINKS; without sinks the pointer is None, a constexpr the kernel
never reads): after the last key tile each row's head's sink logit joins the online softmax's denominator, so it is
counted once per row whatever tiles were visited.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import triton

from tritium.kernels.jit.prefill_attention import prefill_attention_kernel
from tritium.kernels.scores import check_sinks, check_window_and_cap, score_scales
from tritium.kernels.tiles import use_gpu_tiles


class PrefillConfig(NamedTuple):
    block_m: int
    block_n: int
    num_warps: int
    num_stages: int


def prefill_config(head_dim: int, dtype: torch.dtype, tiles: str = "gpu",
                   device: torch.device | str = "cuda") -> PrefillConfig:
    """Launch configuration for this head size and dtype (GPU tiles; 16x16 ones for the interpreter)."""
    if not use_gpu_tiles(tiles, device):
        return PrefillConfig(16, 16, 4, 1)
    if dtype == torch.float32:
        return PrefillConfig(32, 32, 4, 2) if head_dim <= 64 else PrefillConfig(16, 16, 4, 1)
    if head_dim <= 64:
        return PrefillConfig(128, 64, 8, 3)
    if head_dim <= 128:
        return PrefillConfig(128, 64, 8, 2)
    return PrefillConfig(64, 32, 8, 2)


def prefill_attention(
    q: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_tables: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    max_query_len: int | None = None,
    sliding_window: int | None = None,
    softcap: float | None = None,
    sinks: torch.Tensor | None = None,
    tiles: str = "auto",
) -> torch.Tensor:
    """Same contract as `reference.prefill_attention`. `max_query_len` (the longest query run) sizes
    the grid; when omitted it is read from `cu_seqlens_q` (one device sync: the engine always passes it).
    `tiles` picks the launch configuration (kernels/tiles.py). `q` may be a strided view (rows of a
    fused qkv output)."""
    check_window_and_cap(sliding_window, softcap)
    num_tokens, num_heads, head_dim = q.shape
    check_sinks(sinks, num_heads)
    out = torch.empty((num_tokens, num_heads, head_dim), dtype=q.dtype, device=q.device)
    num_seqs = seq_lens.shape[0]
    if num_tokens == 0 or num_seqs == 0:
        return out
    if q.stride(2) != 1:
        q = q.contiguous()
    num_kv_heads, page = key_cache.shape[2], key_cache.shape[1]
    group = num_heads // num_kv_heads
    if max_query_len is None:
        max_query_len = int((cu_seqlens_q[1:] - cu_seqlens_q[:-1]).max())
    cfg = prefill_config(head_dim, q.dtype, tiles, q.device)
    grid = (triton.cdiv(max_query_len * group, cfg.block_m), num_seqs, num_kv_heads)
    scale_log2e, cap_in = score_scales(scale, softcap)
    prefill_attention_kernel[grid](
        q, key_cache, value_cache, block_tables, cu_seqlens_q, seq_lens, out, sinks,
        scale_log2e, cap_in, sliding_window or 0, q.stride(0), q.stride(1), out.stride(0), out.stride(1),
        key_cache.stride(0), key_cache.stride(1), block_tables.stride(0),
        GROUP=group, HEAD_DIM=head_dim, BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, PAGE=page,
        WINDOW=sliding_window is not None, SOFTCAP=softcap is not None, SINKS=sinks is not None,
        DOT_PRECISION="ieee" if q.dtype == torch.float32 else "tf32",
        num_warps=cfg.num_warps, num_stages=cfg.num_stages,
    )
    return out
