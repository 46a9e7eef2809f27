"""Paged decode attention, flash-decoding style.

One query token per sequence. The context is cut into `num_splits` segments handled by separate
programs (so a few long sequences still fill the GPU); each writes a partial output and its
log-sum-exp, and a second kernel merges the segments. The query heads sharing one KV head are
processed together, padded to 16 rows so `tl.dot` has a legal shape.

Specialization, so that an engine compiles every variant before serving (kernels/warmup.py) and none
while serving: the ints that change from step to step are `do_not_specialize` (num_splits follows
the batch size and the block-table width; stride_bt is that width; min_keys_per_split and num_heads gain
nothing from it). The step's metadata pointers (block tables, lengths) may be views at any offset of a
staging buffer, so their alignment is not specialized either (they are read by gathers and scalar loads).
The q, cache and output pointers (fresh buffers, and q rows starting at multiples of head_dim) and the
q/out/cache strides (multiples of head_dim, fixed for an engine) keep the JIT's divisible-by-16
specialization, which gives vector loads and stores. The split count is always one of SPLIT_CHOICES, so
the reduce kernel's SPLITS constexpr takes only those values (a `num_splits` override outside them
compiles a variant of its own).
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl

from tritium.kernels.tiles import use_gpu_tiles

MIN_ROWS = 16
TARGET_PROGRAMS = 264  # about two waves on a 132-SM H100/H200
MIN_KEYS_PER_SPLIT = 256
SPLIT_CHOICES = (1, 2, 4, 8, 16, 32, 64)


@triton.jit(do_not_specialize=["min_keys_per_split", "num_heads", "num_splits", "stride_bt"],
            do_not_specialize_on_alignment=["block_tables_ptr", "seq_lens_ptr"])
def decode_split_kernel(
    q_ptr, k_cache_ptr, v_cache_ptr, block_tables_ptr, seq_lens_ptr, partial_out_ptr, partial_lse_ptr,
    scale_log2e, min_keys_per_split, num_heads, num_splits,
    stride_qs, stride_qh, stride_cache_block, stride_cache_pos, stride_bt,
    GROUP: tl.constexpr, ROWS: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_N: tl.constexpr,
    PAGE: tl.constexpr, DOT_PRECISION: tl.constexpr,
):
    seq = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    context_len = tl.load(seq_lens_ptr + seq)
    rows = tl.arange(0, ROWS)
    row_valid = rows < GROUP
    heads = kv_head * GROUP + tl.where(row_valid, rows, 0)
    dims = tl.arange(0, HEAD_DIM)
    q = tl.load(q_ptr + seq.to(tl.int64) * stride_qs + heads[:, None] * stride_qh + dims[None, :],
                mask=row_valid[:, None], other=0.0)
    m_i = tl.full([ROWS], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([ROWS], dtype=tl.float32)
    acc = tl.zeros([ROWS, HEAD_DIM], dtype=tl.float32)
    # Each sequence cuts its own context into equal segments (whole key tiles, at least min_keys_per_split
    # keys): the split count is chosen for the longest possible context (the block table's width, fixed
    # in a CUDA graph), and shorter contexts still spread over the splits.
    keys_per_split = tl.cdiv(tl.maximum(tl.cdiv(context_len, num_splits), min_keys_per_split), BLOCK_N) * BLOCK_N
    start = split * keys_per_split
    end = tl.minimum(start + keys_per_split, context_len)
    block_table = block_tables_ptr + seq.to(tl.int64) * stride_bt
    for start_n in range(start, end, BLOCK_N):
        keys = start_n + tl.arange(0, BLOCK_N)
        valid = keys < end
        blocks = tl.load(block_table + keys // PAGE, mask=valid, other=0).to(tl.int64)
        offs = blocks * stride_cache_block + (keys % PAGE) * stride_cache_pos + kv_head * HEAD_DIM
        offs = tl.multiple_of(offs, 16)  # rows of the cache start at multiples of head_dim
        k = tl.load(k_cache_ptr + offs[:, None] + dims[None, :], mask=valid[:, None], other=0.0)
        qk = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * scale_log2e
        qk = tl.where(valid[None, :], qk, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(qk, axis=1))
        alpha = tl.math.exp2(m_i - m_new)
        p = tl.math.exp2(qk - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, axis=1)
        v = tl.load(v_cache_ptr + offs[:, None] + dims[None, :], mask=valid[:, None], other=0.0)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
        m_i = m_new
    # An empty segment (past the end of this context) reports lse = -inf and weighs nothing.
    has_keys = start < end
    lse = tl.where(has_keys, m_i + tl.math.log2(tl.maximum(l_i, 1e-30)), float("-inf"))
    out = tl.where(has_keys, acc / tl.maximum(l_i, 1e-30)[:, None], 0.0)
    slot = (seq.to(tl.int64) * num_heads + heads) * num_splits + split
    tl.store(partial_lse_ptr + slot, lse, mask=row_valid)
    tl.store(partial_out_ptr + slot[:, None] * HEAD_DIM + dims[None, :], out, mask=row_valid[:, None])


@triton.jit(do_not_specialize=["num_heads", "num_splits"])
def decode_reduce_kernel(
    partial_out_ptr, partial_lse_ptr, out_ptr, num_heads, num_splits, stride_os, stride_oh,
    HEAD_DIM: tl.constexpr, SPLITS: tl.constexpr,
):
    seq = tl.program_id(0)
    head = tl.program_id(1)
    splits = tl.arange(0, SPLITS)
    dims = tl.arange(0, HEAD_DIM)
    base = (seq.to(tl.int64) * num_heads + head) * num_splits
    lse = tl.load(partial_lse_ptr + base + splits, mask=splits < num_splits, other=float("-inf"))
    top = tl.max(lse, axis=0)
    weights = tl.math.exp2(lse - top)
    parts = tl.load(partial_out_ptr + (base + splits)[:, None] * HEAD_DIM + dims[None, :],
                    mask=(splits < num_splits)[:, None], other=0.0)
    out = tl.sum(parts * weights[:, None], axis=0) / tl.sum(weights, axis=0)
    tl.store(out_ptr + seq.to(tl.int64) * stride_os + head * stride_oh + dims, out.to(out_ptr.dtype.element_ty))


class DecodeConfig(NamedTuple):
    block_n: int
    num_warps: int
    num_stages: int


def decode_config(head_dim: int, dtype: torch.dtype, tiles: str = "gpu",
                  device: torch.device | str = "cuda") -> DecodeConfig:
    """Launch configuration of the split kernel. On GPUs, K/V tiles of about 4K elements (2K in fp32)
    keep registers in bounds; the interpreter gets 16-key tiles."""
    if not use_gpu_tiles(tiles, device):
        return DecodeConfig(16, 4, 2)
    elems = 2048 if dtype == torch.float32 else 4096
    return DecodeConfig(max(16, min(64, elems // head_dim)), 4, 2)


def choose_num_splits(num_seqs: int, num_kv_heads: int, max_context: int, block_n: int) -> int:
    """The largest of SPLIT_CHOICES that neither exceeds what brings num_seqs * num_kv_heads * splits to
    TARGET_PROGRAMS nor leaves segments shorter than MIN_KEYS_PER_SPLIT keys."""
    wanted = triton.cdiv(TARGET_PROGRAMS, max(1, num_seqs * num_kv_heads))
    most = triton.cdiv(max_context, max(MIN_KEYS_PER_SPLIT, block_n))
    limit = max(1, min(wanted, most))
    return max(s for s in SPLIT_CHOICES if s <= limit)


def decode_attention(
    q: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    num_splits: int | None = None,
    tiles: str = "auto",
) -> torch.Tensor:
    """Same contract as `reference.decode_attention`. The split count is chosen for the block table's
    width (no device sync) and each sequence spreads its own context over the splits; `num_splits`
    overrides the choice (segments may then be shorter than MIN_KEYS_PER_SPLIT); `tiles` picks the launch
    configuration (kernels/tiles.py). `q` may be a strided view (rows of a fused qkv output)."""
    num_seqs, num_heads, head_dim = q.shape
    out = torch.empty((num_seqs, num_heads, head_dim), dtype=q.dtype, device=q.device)
    if num_seqs == 0:
        return out
    if q.stride(2) != 1:
        q = q.contiguous()
    page, num_kv_heads = key_cache.shape[1], key_cache.shape[2]
    group = num_heads // num_kv_heads
    rows = max(MIN_ROWS, triton.next_power_of_2(group))
    cfg = decode_config(head_dim, q.dtype, tiles, q.device)
    max_context = block_tables.shape[1] * page
    splits = num_splits or choose_num_splits(num_seqs, num_kv_heads, max_context, cfg.block_n)
    partial_out = torch.empty((num_seqs, num_heads, splits, head_dim), dtype=torch.float32, device=q.device)
    partial_lse = torch.empty((num_seqs, num_heads, splits), dtype=torch.float32, device=q.device)
    decode_split_kernel[(num_seqs, num_kv_heads, splits)](
        q, key_cache, value_cache, block_tables, seq_lens, partial_out, partial_lse,
        scale * 1.4426950408889634, MIN_KEYS_PER_SPLIT if num_splits is None else 1, num_heads, splits,
        q.stride(0), q.stride(1), key_cache.stride(0), key_cache.stride(1), block_tables.stride(0),
        GROUP=group, ROWS=rows, HEAD_DIM=head_dim, BLOCK_N=cfg.block_n, PAGE=page,
        DOT_PRECISION="ieee" if q.dtype == torch.float32 else "tf32",
        num_warps=cfg.num_warps, num_stages=cfg.num_stages,
    )
    decode_reduce_kernel[(num_seqs, num_heads)](
        partial_out, partial_lse, out, num_heads, splits, out.stride(0), out.stride(1),
        HEAD_DIM=head_dim, SPLITS=triton.next_power_of_2(splits), num_warps=4, num_stages=1,
    )
    return out
