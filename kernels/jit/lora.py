"""The @triton.jit bodies of `tritium.kernels.lora`: LoRA shrink (`buffer = scaling[s] * x @ A[s]^T`) and expand
(`y += buffer @ B[s]^T`), segmented over a step's adapter groups (prefill, mixed steps) or one adapter per row
(decode steps, CUDA-graph capturable).

The launch configuration, the specialization and the contract are documented with the host wrappers in
kernels/lora.py. This body is Triton language, not Python: mypy skips this package.
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def _segment_places(rows_ptr, seg_starts_ptr, seg_slots_ptr, seg, pid_m, BLOCK_M: tl.constexpr):
    """Program (seg, pid_m)'s BLOCK_M places in the sorted rows: the places, which lie in segment `seg`, their
    rows, the segment's slot, and whether the program has any place in it."""
    start = tl.load(seg_starts_ptr + seg)
    end = tl.load(seg_starts_ptr + seg + 1)
    slot = tl.load(seg_slots_ptr + seg).to(tl.int64)
    idx = start + pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    row_ok = idx < end
    rows = tl.load(rows_ptr + idx, mask=row_ok, other=0).to(tl.int64)
    return idx, row_ok, rows, slot, start + pid_m * BLOCK_M < end


@triton.jit
def _row_slot(slots_ptr, row):
    """Whether `row` has an adapter, and its slot (0 when it has none: every access is then masked)."""
    slot = tl.load(slots_ptr + row)
    return slot >= 0, tl.maximum(slot, 0).to(tl.int64)


@triton.jit(do_not_specialize=["rows_ptr", "seg_starts_ptr", "seg_slots_ptr"])
def lora_shrink_kernel(
    x_ptr, a_ptr, scaling_ptr, rows_ptr, seg_starts_ptr, seg_slots_ptr, buf_ptr,
    K, RANK, stride_xm, stride_as, stride_ar, stride_bm,
    BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_R: tl.constexpr, DOT_PRECISION: tl.constexpr,
):
    idx, row_ok, rows, slot, inside = _segment_places(rows_ptr, seg_starts_ptr, seg_slots_ptr, tl.program_id(0),
                                                      tl.program_id(1), BLOCK_M)
    rs = tl.arange(0, BLOCK_R)
    r_ok = rs < RANK
    ks = tl.arange(0, BLOCK_K)
    # a program past its segment's end runs no K iteration (the grid covers the longest segment)
    k_end = tl.where(inside, K, 0)
    x_base = x_ptr + rows[:, None] * stride_xm
    a_base = a_ptr + slot * stride_as + rs[None, :] * stride_ar  # A[s] read as [BLOCK_K, BLOCK_R]
    acc = tl.zeros((BLOCK_M, BLOCK_R), dtype=tl.float32)
    for k0 in range(0, k_end, BLOCK_K):
        kk = k0 + ks
        x = tl.load(x_base + kk[None, :], mask=row_ok[:, None] & (kk[None, :] < K), other=0.0)
        a = tl.load(a_base + kk[:, None], mask=(kk[:, None] < K) & r_ok[None, :], other=0.0)
        acc = tl.dot(x, a, acc, input_precision=DOT_PRECISION)
    acc = acc * tl.load(scaling_ptr + slot)
    tl.store(buf_ptr + idx.to(tl.int64)[:, None] * stride_bm + rs[None, :], acc.to(buf_ptr.dtype.element_ty),
             mask=row_ok[:, None] & r_ok[None, :])


@triton.jit(do_not_specialize=["rows_ptr", "seg_starts_ptr", "seg_slots_ptr"])
def lora_expand_kernel(
    buf_ptr, b_ptr, rows_ptr, seg_starts_ptr, seg_slots_ptr, y_ptr,
    N, RANK, stride_bm, stride_bs, stride_bn, stride_ym, stride_yn,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_R: tl.constexpr, DOT_PRECISION: tl.constexpr,
):
    idx, row_ok, rows, slot, _ = _segment_places(rows_ptr, seg_starts_ptr, seg_slots_ptr, tl.program_id(0),
                                                 tl.program_id(1), BLOCK_M)
    pid_n = tl.program_id(2)
    rs = tl.arange(0, BLOCK_R)
    r_ok = rs < RANK
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    col_ok = cols < N
    buf = tl.load(buf_ptr + idx.to(tl.int64)[:, None] * stride_bm + rs[None, :],
                  mask=row_ok[:, None] & r_ok[None, :], other=0.0)
    b = tl.load(b_ptr + slot * stride_bs + cols[None, :].to(tl.int64) * stride_bn + rs[:, None],
                mask=r_ok[:, None] & col_ok[None, :], other=0.0)  # B[s] read as [BLOCK_R, BLOCK_N]
    acc = tl.dot(buf.to(b.dtype), b, input_precision=DOT_PRECISION)
    mask = row_ok[:, None] & col_ok[None, :]
    y_ptrs = y_ptr + rows[:, None] * stride_ym + cols[None, :].to(tl.int64) * stride_yn
    y = tl.load(y_ptrs, mask=mask, other=0.0)
    tl.store(y_ptrs, (y.to(tl.float32) + acc).to(y_ptr.dtype.element_ty), mask=mask)


@triton.jit(do_not_specialize=["slots_ptr"])
def lora_shrink_rows_kernel(
    x_ptr, a_ptr, scaling_ptr, slots_ptr, buf_ptr,
    K, RANK, stride_xm, stride_as, stride_ar, stride_bm,
    BLOCK_K: tl.constexpr, BLOCK_R: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    active, slot = _row_slot(slots_ptr, row)
    rs = tl.arange(0, BLOCK_R)
    r_ok = rs < RANK
    ks = tl.arange(0, BLOCK_K)
    k_end = tl.where(active, K, 0)  # a row of no adapter reads nothing
    a_base = a_ptr + slot * stride_as + rs[:, None] * stride_ar
    acc = tl.zeros((BLOCK_R,), dtype=tl.float32)
    for k0 in range(0, k_end, BLOCK_K):
        kk = k0 + ks
        x = tl.load(x_ptr + row * stride_xm + kk, mask=kk < K, other=0.0).to(tl.float32)
        a = tl.load(a_base + kk[None, :], mask=r_ok[:, None] & (kk[None, :] < K), other=0.0).to(tl.float32)
        acc += tl.sum(a * x[None, :], axis=1)
    acc = acc * tl.load(scaling_ptr + slot)
    tl.store(buf_ptr + row * stride_bm + rs, acc.to(buf_ptr.dtype.element_ty), mask=r_ok & active)


@triton.jit(do_not_specialize=["slots_ptr"])
def lora_expand_rows_kernel(
    buf_ptr, b_ptr, slots_ptr, y_ptr,
    N, RANK, stride_bm, stride_bs, stride_bn, stride_ym, stride_yn,
    BLOCK_N: tl.constexpr, BLOCK_R: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    pid_n = tl.program_id(1)
    active, slot = _row_slot(slots_ptr, row)
    rs = tl.arange(0, BLOCK_R)
    r_ok = rs < RANK
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    col_ok = (cols < N) & active
    buf = tl.load(buf_ptr + row * stride_bm + rs, mask=r_ok & active, other=0.0).to(tl.float32)
    b = tl.load(b_ptr + slot * stride_bs + cols[:, None].to(tl.int64) * stride_bn + rs[None, :],
                mask=col_ok[:, None] & r_ok[None, :], other=0.0).to(tl.float32)
    acc = tl.sum(b * buf[None, :], axis=1)
    y_ptrs = y_ptr + row * stride_ym + cols.to(tl.int64) * stride_yn
    y = tl.load(y_ptrs, mask=col_ok, other=0.0)
    tl.store(y_ptrs, (y.to(tl.float32) + acc).to(y_ptr.dtype.element_ty), mask=col_ok)
