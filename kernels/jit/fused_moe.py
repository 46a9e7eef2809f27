"""The @triton.jit bodies of `tritium.kernels.fused_moe`: the gate/up GEMM with the activation in its epilogue, and
the down GEMM with the routing weight, both over rows grouped by expert (kernels/moe_align.py).

The launch configuration, the specialization and the contract are documented with the host wrapper in
kernels/fused_moe.py. This body is Triton language, not Python: mypy skips this package.
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def _block_of(num_blocks_m, N, BLOCK_N: tl.constexpr, GROUP_M: tl.constexpr):
    # Program -> (row block, column block), GROUP_M row blocks at a time per column sweep: neighbouring programs
    # share column blocks of the same expert's weights while they are in L2.
    pid = tl.program_id(0)
    num_blocks_n = tl.cdiv(N, BLOCK_N)
    per_group = GROUP_M * num_blocks_n
    first_m = (pid // per_group) * GROUP_M
    group_size = tl.minimum(num_blocks_m - first_m, GROUP_M)
    pid_m = first_m + (pid % per_group) % group_size
    pid_n = (pid % per_group) // group_size
    return pid_m, pid_n


@triton.jit(do_not_specialize=["num_pairs", "num_blocks_m"])
def moe_gate_up_kernel(
    hidden_ptr, w13_ptr, bias_ptr, out_ptr, sorted_ids_ptr, expert_ids_ptr, num_post_padded_ptr,
    num_pairs, num_blocks_m, N, K, stride_h, stride_we, stride_wn, stride_be, stride_o,
    TOP_K: tl.constexpr, ACTIVATION: tl.constexpr, HAS_BIAS: tl.constexpr, DOT_PRECISION: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
):
    # out[p, n] = act(gate, up) for pair p = t * TOP_K + k routed to expert e: gate = hidden[t] @ w13[e, n] (+ bias),
    # up = hidden[t] @ w13[e, N + n] (+ bias); N is the intermediate size, K the hidden size.
    pid_m, pid_n = _block_of(num_blocks_m, N, BLOCK_N, GROUP_M)
    if pid_m * BLOCK_M >= tl.load(num_post_padded_ptr):
        return  # past the padded rows: the grid is sized for the most there can be
    expert = tl.load(expert_ids_ptr + pid_m).to(tl.int64)
    pairs = tl.load(sorted_ids_ptr + pid_m * BLOCK_M + tl.arange(0, BLOCK_M))
    row_ok = pairs < num_pairs  # padding rows hold the sentinel num_pairs
    tokens = (pairs // TOP_K).to(tl.int64)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    col_ok = cols < N
    ks = tl.arange(0, BLOCK_K)
    a_base = hidden_ptr + tokens[:, None] * stride_h
    w_base = w13_ptr + expert * stride_we + cols.to(tl.int64)[None, :] * stride_wn
    up_offset = N * stride_wn
    gate = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    up = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        kk = k0 + ks
        k_ok = kk < K
        a = tl.load(a_base + kk[None, :], mask=row_ok[:, None] & k_ok[None, :], other=0.0)
        w_mask = k_ok[:, None] & col_ok[None, :]
        w_gate = tl.load(w_base + kk[:, None], mask=w_mask, other=0.0)  # [BLOCK_K, BLOCK_N]
        w_up = tl.load(w_base + up_offset + kk[:, None], mask=w_mask, other=0.0)
        gate = tl.dot(a, w_gate, gate, input_precision=DOT_PRECISION)
        up = tl.dot(a, w_up, up, input_precision=DOT_PRECISION)
    if HAS_BIAS:
        b_base = bias_ptr + expert * stride_be + cols
        gate += tl.load(b_base, mask=col_ok, other=0.0).to(tl.float32)[None, :]
        up += tl.load(b_base + N, mask=col_ok, other=0.0).to(tl.float32)[None, :]
    if ACTIVATION == "silu":
        act = gate / (1.0 + tl.exp(-gate)) * up
    else:  # "swiglu_oai" (gpt-oss)
        gate = tl.minimum(gate, 7.0)
        up = tl.minimum(tl.maximum(up, -7.0), 7.0)
        act = gate / (1.0 + tl.exp(-1.702 * gate)) * (up + 1.0)
    o_ptrs = out_ptr + pairs.to(tl.int64)[:, None] * stride_o + cols[None, :]
    tl.store(o_ptrs, act.to(out_ptr.dtype.element_ty), mask=row_ok[:, None] & col_ok[None, :])


@triton.jit(do_not_specialize=["num_pairs", "num_blocks_m"])
def moe_down_kernel(
    act_ptr, w2_ptr, bias_ptr, weights_ptr, out_ptr, sorted_ids_ptr, expert_ids_ptr, num_post_padded_ptr,
    num_pairs, num_blocks_m, N, K, stride_a, stride_we, stride_wn, stride_be, stride_o,
    HAS_BIAS: tl.constexpr, DOT_PRECISION: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
):
    # out[p, n] = topk_weights[p] * (act[p] @ w2[e, n] (+ bias)) for pair p routed to expert e, in fp32; N is the
    # hidden size, K the intermediate size.
    pid_m, pid_n = _block_of(num_blocks_m, N, BLOCK_N, GROUP_M)
    if pid_m * BLOCK_M >= tl.load(num_post_padded_ptr):
        return
    expert = tl.load(expert_ids_ptr + pid_m).to(tl.int64)
    pairs = tl.load(sorted_ids_ptr + pid_m * BLOCK_M + tl.arange(0, BLOCK_M))
    row_ok = pairs < num_pairs
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    col_ok = cols < N
    ks = tl.arange(0, BLOCK_K)
    a_base = act_ptr + pairs.to(tl.int64)[:, None] * stride_a
    w_base = w2_ptr + expert * stride_we + cols.to(tl.int64)[None, :] * stride_wn
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        kk = k0 + ks
        k_ok = kk < K
        a = tl.load(a_base + kk[None, :], mask=row_ok[:, None] & k_ok[None, :], other=0.0)
        w = tl.load(w_base + kk[:, None], mask=k_ok[:, None] & col_ok[None, :], other=0.0)
        acc = tl.dot(a, w, acc, input_precision=DOT_PRECISION)
    if HAS_BIAS:
        acc += tl.load(bias_ptr + expert * stride_be + cols, mask=col_ok, other=0.0).to(tl.float32)[None, :]
    weight = tl.load(weights_ptr + pairs, mask=row_ok, other=0.0).to(tl.float32)
    o_ptrs = out_ptr + pairs.to(tl.int64)[:, None] * stride_o + cols[None, :]
    tl.store(o_ptrs, (acc * weight[:, None]).to(out_ptr.dtype.element_ty), mask=row_ok[:, None] & col_ok[None, :])
