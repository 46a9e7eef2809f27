"""The @triton.jit bodies of `tritium.kernels.decode_attention`: paged decode attention, flash-decoding style
(the split kernel and the reduce kernel).

The launch configuration, the specialization and the contract are documented with the host wrappers in
kernels/decode_attention.py. These bodies are Triton language, not Python: mypy skips this package.
"""

from __future__ import annotations

import triton
import triton.language as tl

from tritium.kernels.jit.tanh import tanh


@triton.jit(do_not_specialize=["window", "min_keys_per_split", "num_heads", "num_splits", "stride_bt"],
            do_not_specialize_on_alignment=["block_tables_ptr", "seq_lens_ptr"])
def decode_split_kernel(
    q_ptr, k_cache_ptr, v_cache_ptr, block_tables_ptr, seq_lens_ptr, partial_out_ptr, partial_lse_ptr,
    scale_log2e, cap_in, window, min_keys_per_split, num_heads, num_splits,
    stride_qs, stride_qh, stride_cache_block, stride_cache_pos, stride_bt,
    GROUP: tl.constexpr, ROWS: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_N: tl.constexpr,
    PAGE: tl.constexpr, WINDOW: tl.constexpr, SOFTCAP: tl.constexpr, DOT_PRECISION: tl.constexpr,
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
    # in a CUDA graph), and shorter contexts still spread over the splits. With a window the segments cover
    # only the key tiles from the one holding the window's first key (masked below it) to the context's end.
    span_start = 0
    if WINDOW:
        window_start = tl.maximum(context_len - window, 0)
        span_start = (window_start // BLOCK_N) * BLOCK_N
    keys_per_split = tl.cdiv(tl.maximum(tl.cdiv(context_len - span_start, num_splits), min_keys_per_split),
                             BLOCK_N) * BLOCK_N
    start = span_start + split * keys_per_split
    end = tl.minimum(start + keys_per_split, context_len)
    block_table = block_tables_ptr + seq.to(tl.int64) * stride_bt
    for start_n in range(start, end, BLOCK_N):
        keys = start_n + tl.arange(0, BLOCK_N)
        valid = keys < end
        if WINDOW:
            valid = valid & (keys >= window_start)
        blocks = tl.load(block_table + keys // PAGE, mask=valid, other=0).to(tl.int64)
        offs = blocks * stride_cache_block + (keys % PAGE) * stride_cache_pos + kv_head * HEAD_DIM
        offs = tl.multiple_of(offs, 16)  # rows of the cache start at multiples of head_dim
        k = tl.load(k_cache_ptr + offs[:, None] + dims[None, :], mask=valid[:, None], other=0.0)
        qk = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION)
        if SOFTCAP:  # c * tanh(s / c), in the exp2 domain: cap_in = scale / c, scale_log2e = c * log2(e)
            qk = tanh(qk * cap_in)
        qk = tl.where(valid[None, :], qk * scale_log2e, float("-inf"))
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
    partial_out_ptr, partial_lse_ptr, out_ptr, sinks_ptr, num_heads, num_splits, stride_os, stride_oh,
    HEAD_DIM: tl.constexpr, SPLITS: tl.constexpr, SINKS: tl.constexpr,
):
    seq = tl.program_id(0)
    head = tl.program_id(1)
    splits = tl.arange(0, SPLITS)
    dims = tl.arange(0, HEAD_DIM)
    base = (seq.to(tl.int64) * num_heads + head) * num_splits
    lse = tl.load(partial_lse_ptr + base + splits, mask=splits < num_splits, other=float("-inf"))
    top = tl.max(lse, axis=0)
    if SINKS:  # the head's sink logit (exp2 domain) joins the denominator here, once, not in each segment
        sink = tl.load(sinks_ptr + head).to(tl.float32) * 1.4426950408889634  # log2(e)
        top = tl.maximum(top, sink)
    weights = tl.math.exp2(lse - top)
    denominator = tl.sum(weights, axis=0)
    if SINKS:
        denominator += tl.math.exp2(sink - top)
    parts = tl.load(partial_out_ptr + (base + splits)[:, None] * HEAD_DIM + dims[None, :],
                    mask=(splits < num_splits)[:, None], other=0.0)
    out = tl.sum(parts * weights[:, None], axis=0) / denominator
    tl.store(out_ptr + seq.to(tl.int64) * stride_os + head * stride_oh + dims, out.to(out_ptr.dtype.element_ty))
