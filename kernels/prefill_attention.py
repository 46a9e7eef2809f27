"""Causal flash attention for packed variable-length queries against a paged KV cache.

Sequence i owns query rows `cu_seqlens_q[i]:cu_seqlens_q[i+1]`, the last positions of a context of
`seq_lens[i]` tokens already in the cache: one kernel covers plain prefill, chunked prefill and
prefix-cache hits. A program takes one KV head of one sequence and a tile of BLOCK_M rows, where a
row is a (query position, query head of that KV head's group) pair, so `tl.dot` gets full tiles even
for small GQA groups. Keys are visited tile by tile (online softmax, fp32 accumulation): tiles left
of the diagonal need no mask, tiles past the last query position are never visited.

Specialization: the only int that changes from step to step, stride_bt (the block-table width, 1 for a
one-block batch), is `do_not_specialize`; token and sequence counts live in the grid and in tensors. The
step's metadata pointers (block tables, cu_seqlens, lengths) may be views at any offset of a staging
buffer, so their alignment is not specialized (they are read by gathers and scalar loads). The q, cache
and output pointers (fresh buffers, q rows starting at multiples of head_dim, also inside a fused qkv
output) and the q/out/cache strides (multiples of head_dim, fixed for an engine) keep the JIT's divisible-by-16
specialization, which gives vector loads and stores of the q, K, V and output rows.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl

from tritium.kernels.tiles import use_gpu_tiles


@triton.jit
def _attend_tile(acc, m_i, l_i, q, k_cache_ptr, v_cache_ptr, block_table_ptr, start_n, context_len, q_pos,
                 kv_head, scale_log2e, stride_cache_block, stride_cache_pos,
                 HEAD_DIM: tl.constexpr, BLOCK_N: tl.constexpr, PAGE: tl.constexpr,
                 CAUSAL_MASK: tl.constexpr, DOT_PRECISION: tl.constexpr):
    keys = start_n + tl.arange(0, BLOCK_N)
    dims = tl.arange(0, HEAD_DIM)
    in_context = keys < context_len
    blocks = tl.load(block_table_ptr + keys // PAGE, mask=in_context, other=0).to(tl.int64)
    offs = blocks * stride_cache_block + (keys % PAGE) * stride_cache_pos + kv_head * HEAD_DIM
    offs = tl.multiple_of(offs, 16)  # rows of the cache start at multiples of head_dim
    k = tl.load(k_cache_ptr + offs[:, None] + dims[None, :], mask=in_context[:, None], other=0.0)
    qk = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * scale_log2e
    if CAUSAL_MASK:
        qk = tl.where((keys[None, :] <= q_pos[:, None]) & in_context[None, :], qk, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(qk, axis=1))
    alpha = tl.math.exp2(m_i - m_new)
    p = tl.math.exp2(qk - m_new[:, None])
    l_i = l_i * alpha + tl.sum(p, axis=1)
    v = tl.load(v_cache_ptr + offs[:, None] + dims[None, :], mask=in_context[:, None], other=0.0)
    acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
    return acc, m_new, l_i


@triton.jit(do_not_specialize=["stride_bt"],
            do_not_specialize_on_alignment=["block_tables_ptr", "cu_seqlens_ptr", "seq_lens_ptr"])
def prefill_attention_kernel(
    q_ptr, k_cache_ptr, v_cache_ptr, block_tables_ptr, cu_seqlens_ptr, seq_lens_ptr, out_ptr,
    scale_log2e, stride_qt, stride_qh, stride_ot, stride_oh,
    stride_cache_block, stride_cache_pos, stride_bt,
    GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    PAGE: tl.constexpr, DOT_PRECISION: tl.constexpr,
):
    tile = tl.program_id(0)
    seq = tl.program_id(1)
    kv_head = tl.program_id(2)
    q_start = tl.load(cu_seqlens_ptr + seq)
    q_len = tl.load(cu_seqlens_ptr + seq + 1) - q_start
    if tile * BLOCK_M < q_len * GROUP:
        context_len = tl.load(seq_lens_ptr + seq)
        rows = tile * BLOCK_M + tl.arange(0, BLOCK_M)
        row_valid = rows < q_len * GROUP
        q_idx = tl.where(row_valid, rows // GROUP, q_len - 1)
        head = kv_head * GROUP + rows % GROUP
        q_pos = context_len - q_len + q_idx
        dims = tl.arange(0, HEAD_DIM)
        q_offs = (q_start + q_idx).to(tl.int64)[:, None] * stride_qt + head[:, None] * stride_qh + dims[None, :]
        q = tl.load(q_ptr + q_offs, mask=row_valid[:, None], other=0.0)

        m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
        l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
        acc = tl.zeros([BLOCK_M, HEAD_DIM], dtype=tl.float32)
        block_table = block_tables_ptr + seq.to(tl.int64) * stride_bt
        first_pos = context_len - q_len + (tile * BLOCK_M) // GROUP
        last_pos = tl.minimum(context_len - q_len + (tile * BLOCK_M + BLOCK_M - 1) // GROUP, context_len - 1)
        # Key tiles entirely at or before the first query position of this tile need no mask.
        unmasked_end = ((first_pos + 1) // BLOCK_N) * BLOCK_N
        for start_n in range(0, unmasked_end, BLOCK_N):
            acc, m_i, l_i = _attend_tile(acc, m_i, l_i, q, k_cache_ptr, v_cache_ptr, block_table, start_n,
                                         context_len, q_pos, kv_head, scale_log2e, stride_cache_block,
                                         stride_cache_pos, HEAD_DIM, BLOCK_N, PAGE, False, DOT_PRECISION)
        for start_n in range(unmasked_end, last_pos + 1, BLOCK_N):
            acc, m_i, l_i = _attend_tile(acc, m_i, l_i, q, k_cache_ptr, v_cache_ptr, block_table, start_n,
                                         context_len, q_pos, kv_head, scale_log2e, stride_cache_block,
                                         stride_cache_pos, HEAD_DIM, BLOCK_N, PAGE, True, DOT_PRECISION)
        out = acc / l_i[:, None]
        o_offs = (q_start + q_idx).to(tl.int64)[:, None] * stride_ot + head[:, None] * stride_oh + dims[None, :]
        tl.store(out_ptr + o_offs, out.to(out_ptr.dtype.element_ty), mask=row_valid[:, None])


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
    tiles: str = "auto",
) -> torch.Tensor:
    """Same contract as `reference.prefill_attention`. `max_query_len` (the longest query run) sizes
    the grid; when omitted it is read from `cu_seqlens_q` (one device sync: the engine always passes it).
    `tiles` picks the launch configuration (kernels/tiles.py). `q` may be a strided view (rows of a
    fused qkv output)."""
    num_tokens, num_heads, head_dim = q.shape
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
    prefill_attention_kernel[grid](
        q, key_cache, value_cache, block_tables, cu_seqlens_q, seq_lens, out,
        scale * 1.4426950408889634, q.stride(0), q.stride(1), out.stride(0), out.stride(1),
        key_cache.stride(0), key_cache.stride(1), block_tables.stride(0),
        GROUP=group, HEAD_DIM=head_dim, BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, PAGE=page,
        DOT_PRECISION="ieee" if q.dtype == torch.float32 else "tf32",
        num_warps=cfg.num_warps, num_stages=cfg.num_stages,
    )
    return out
