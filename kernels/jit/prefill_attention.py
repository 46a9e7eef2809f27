"""The @triton.jit bodies of `tritium.kernels.prefill_attention`: causal flash attention of packed
variable-length queries against a paged KV cache.

The launch configuration, the specialization and the contract are documented with the host wrappers in
kernels/prefill_attention.py. These bodies are Triton language, not Python: mypy skips this package.
"""

from __future__ import annotations

import triton
import triton.language as tl

from tritium.kernels.jit.tanh import tanh


@triton.jit
def _attend_tile(acc, m_i, l_i, q, k_cache_ptr, v_cache_ptr, block_table_ptr, start_n, context_len, q_pos,
                 kv_head, scale_log2e, cap_in, window, stride_cache_block, stride_cache_pos,
                 HEAD_DIM: tl.constexpr, BLOCK_N: tl.constexpr, PAGE: tl.constexpr,
                 MASK: tl.constexpr, SOFTCAP: tl.constexpr, DOT_PRECISION: tl.constexpr):
    """One key tile into the online softmax. MASK: 0 none, 1 causal, 2 causal and the window's start."""
    keys = start_n + tl.arange(0, BLOCK_N)
    dims = tl.arange(0, HEAD_DIM)
    in_context = keys < context_len
    blocks = tl.load(block_table_ptr + keys // PAGE, mask=in_context, other=0).to(tl.int64)
    offs = blocks * stride_cache_block + (keys % PAGE) * stride_cache_pos + kv_head * HEAD_DIM
    offs = tl.multiple_of(offs, 16)  # rows of the cache start at multiples of head_dim
    k = tl.load(k_cache_ptr + offs[:, None] + dims[None, :], mask=in_context[:, None], other=0.0)
    qk = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION)
    if SOFTCAP:  # c * tanh(s / c), in the exp2 domain: cap_in = scale / c, scale_log2e = c * log2(e)
        qk = tanh(qk * cap_in)
    qk = qk * scale_log2e
    if MASK == 1:
        qk = tl.where((keys[None, :] <= q_pos[:, None]) & in_context[None, :], qk, float("-inf"))
    if MASK == 2:
        visible = (keys[None, :] <= q_pos[:, None]) & (keys[None, :] > q_pos[:, None] - window)
        qk = tl.where(visible & in_context[None, :], qk, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(qk, axis=1))
    m_ref = m_new
    if MASK == 2:  # a row whose window starts past this tile has seen no key yet: it must add nothing (not NaN)
        m_ref = tl.where(m_new == float("-inf"), 0.0, m_new)
    alpha = tl.math.exp2(m_i - m_ref)
    p = tl.math.exp2(qk - m_ref[:, None])
    l_i = l_i * alpha + tl.sum(p, axis=1)
    v = tl.load(v_cache_ptr + offs[:, None] + dims[None, :], mask=in_context[:, None], other=0.0)
    acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
    return acc, m_new, l_i


@triton.jit
def add_sink(acc, m_i, l_i, sinks_ptr, head):
    """The online softmax's (acc, l_i) with each row's head's sink logit joined to the denominator; both rescaled to
    the larger of the running max and the sink (exp2 domain), so a sink far above the scores cannot overflow."""
    sink = tl.load(sinks_ptr + head).to(tl.float32) * 1.4426950408889634  # log2(e)
    m_end = tl.maximum(m_i, sink)
    alpha = tl.math.exp2(m_i - m_end)
    return acc * alpha[:, None], l_i * alpha + tl.math.exp2(sink - m_end)


@triton.jit
def query_tile(slot, rows, BLOCK_M: tl.constexpr):
    """The query tile that program `slot` (the grid's first axis) computes for a sequence of `rows` rows, which has
    n tiles: slot 0 takes tile n - 1 (the one with the most keys to visit), slot n - 1 tile 0; negative from n on."""
    return (rows + BLOCK_M - 1) // BLOCK_M - 1 - slot


@triton.jit(do_not_specialize=["stride_bt", "window"],
            do_not_specialize_on_alignment=["block_tables_ptr", "cu_seqlens_ptr", "seq_lens_ptr"])
def prefill_attention_kernel(
    q_ptr, k_cache_ptr, v_cache_ptr, block_tables_ptr, cu_seqlens_ptr, seq_lens_ptr, out_ptr, sinks_ptr,
    scale_log2e, cap_in, window, stride_qt, stride_qh, stride_ot, stride_oh,
    stride_cache_block, stride_cache_pos, stride_bt,
    GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    PAGE: tl.constexpr, WINDOW: tl.constexpr, SOFTCAP: tl.constexpr, SINKS: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    seq = tl.program_id(1)
    kv_head = tl.program_id(2)
    q_start = tl.load(cu_seqlens_ptr + seq)
    q_len = tl.load(cu_seqlens_ptr + seq + 1) - q_start
    tile = query_tile(tl.program_id(0), q_len * GROUP, BLOCK_M)
    if tile >= 0:
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
        # Key tiles entirely at or before the first query position of this tile need no causal mask.
        unmasked_end = ((first_pos + 1) // BLOCK_N) * BLOCK_N
        unmasked_start = 0
        causal_start = unmasked_end
        if WINDOW:
            # Key tiles wholly before the first row's window are never visited; from the one holding its start up
            # to the first tile inside every row's window they are masked by window (and causally).
            window_tile = (tl.maximum(first_pos - window + 1, 0) // BLOCK_N) * BLOCK_N
            unmasked_start = tl.cdiv(tl.maximum(last_pos - window + 1, 0), BLOCK_N) * BLOCK_N
            causal_start = tl.maximum(unmasked_end, unmasked_start)
            for start_n in range(window_tile, tl.minimum(unmasked_start, last_pos + 1), BLOCK_N):
                acc, m_i, l_i = _attend_tile(acc, m_i, l_i, q, k_cache_ptr, v_cache_ptr, block_table, start_n,
                                             context_len, q_pos, kv_head, scale_log2e, cap_in, window,
                                             stride_cache_block, stride_cache_pos, HEAD_DIM, BLOCK_N, PAGE, 2,
                                             SOFTCAP, DOT_PRECISION)
        for start_n in range(unmasked_start, unmasked_end, BLOCK_N):
            acc, m_i, l_i = _attend_tile(acc, m_i, l_i, q, k_cache_ptr, v_cache_ptr, block_table, start_n,
                                         context_len, q_pos, kv_head, scale_log2e, cap_in, window, stride_cache_block,
                                         stride_cache_pos, HEAD_DIM, BLOCK_N, PAGE, 0, SOFTCAP, DOT_PRECISION)
        for start_n in range(causal_start, last_pos + 1, BLOCK_N):
            acc, m_i, l_i = _attend_tile(acc, m_i, l_i, q, k_cache_ptr, v_cache_ptr, block_table, start_n,
                                         context_len, q_pos, kv_head, scale_log2e, cap_in, window, stride_cache_block,
                                         stride_cache_pos, HEAD_DIM, BLOCK_N, PAGE, 1, SOFTCAP, DOT_PRECISION)
        if SINKS:
            acc, l_i = add_sink(acc, m_i, l_i, sinks_ptr, head)
        out = acc / l_i[:, None]
        o_offs = (q_start + q_idx).to(tl.int64)[:, None] * stride_ot + head[:, None] * stride_oh + dims[None, :]
        tl.store(out_ptr + o_offs, out.to(out_ptr.dtype.element_ty), mask=row_valid[:, None])
