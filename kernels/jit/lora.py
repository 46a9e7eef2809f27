"""The @triton.jit bodies of `tritium.kernels.lora`: LoRA shrink (`buffer = scaling[s] * x @ A[s]^T`) and expand
(`y += buffer @ B[s]^T`) over every module of a fused projection at once (a slice axis in the grid), segmented over
a step's adapter groups (prefill, mixed steps) or one adapter per row (decode steps, CUDA-graph capturable; the
shrink split over K).

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
    j = tl.program_id(2)  # the fused projection's module: rows [j * RANK, (j + 1) * RANK) of A
    rs = tl.arange(0, BLOCK_R)
    r_ok = rs < RANK
    ks = tl.arange(0, BLOCK_K)
    # a program past its segment's end runs no K iteration (the grid covers the longest segment)
    k_end = tl.where(inside, K, 0)
    x_base = x_ptr + rows[:, None] * stride_xm
    a_base = a_ptr + slot * stride_as + (j * RANK + rs[None, :]) * stride_ar  # A[s]'s module j as [BLOCK_K, BLOCK_R]
    acc = tl.zeros((BLOCK_M, BLOCK_R), dtype=tl.float32)
    for k0 in range(0, k_end, BLOCK_K):
        kk = k0 + ks
        x = tl.load(x_base + kk[None, :], mask=row_ok[:, None] & (kk[None, :] < K), other=0.0)
        a = tl.load(a_base + kk[:, None], mask=(kk[:, None] < K) & r_ok[None, :], other=0.0)
        acc = tl.dot(x, a, acc, input_precision=DOT_PRECISION)
    acc = acc * tl.load(scaling_ptr + slot)
    tl.store(buf_ptr + idx.to(tl.int64)[:, None] * stride_bm + j * RANK + rs[None, :], acc.to(buf_ptr.dtype.element_ty),
             mask=row_ok[:, None] & r_ok[None, :])


@triton.jit
def _slice_columns(j, B0, B1, B2, B3, pid_n, BLOCK_N: tl.constexpr):
    """Output slice j's BLOCK_N columns of tile pid_n (slice j: columns [B_j, B_j+1) of y and rows of B), and which
    of them lie in the slice."""
    start = tl.where(j == 0, B0, tl.where(j == 1, B1, B2))
    end = tl.where(j == 0, B1, tl.where(j == 1, B2, B3))
    cols = start + pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    return cols, cols < end


@triton.jit(do_not_specialize=["rows_ptr", "seg_starts_ptr", "seg_slots_ptr"])
def lora_expand_kernel(
    buf_ptr, b_ptr, rows_ptr, seg_starts_ptr, seg_slots_ptr, y_ptr,
    RANK, TILES_PER_SLICE, B0, B1, B2, B3, stride_bm, stride_bs, stride_bn, stride_ym, stride_yn,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_R: tl.constexpr, DOT_PRECISION: tl.constexpr,
):
    idx, row_ok, rows, slot, _ = _segment_places(rows_ptr, seg_starts_ptr, seg_slots_ptr, tl.program_id(0),
                                                 tl.program_id(1), BLOCK_M)
    j = tl.program_id(2) // TILES_PER_SLICE
    cols, col_ok = _slice_columns(j, B0, B1, B2, B3, tl.program_id(2) % TILES_PER_SLICE, BLOCK_N)
    rs = tl.arange(0, BLOCK_R)
    r_ok = rs < RANK
    buf = tl.load(buf_ptr + idx.to(tl.int64)[:, None] * stride_bm + j * RANK + rs[None, :],
                  mask=row_ok[:, None] & r_ok[None, :], other=0.0)
    b = tl.load(b_ptr + slot * stride_bs + cols[None, :].to(tl.int64) * stride_bn + rs[:, None],
                mask=r_ok[:, None] & col_ok[None, :], other=0.0)  # B[s] read as [BLOCK_R, BLOCK_N]
    acc = tl.dot(buf.to(b.dtype), b, input_precision=DOT_PRECISION)
    mask = row_ok[:, None] & col_ok[None, :]
    y_ptrs = y_ptr + rows[:, None] * stride_ym + cols[None, :].to(tl.int64) * stride_yn
    y = tl.load(y_ptrs, mask=mask, other=0.0)
    tl.store(y_ptrs, (y.to(tl.float32) + acc).to(y_ptr.dtype.element_ty), mask=mask)


@triton.jit(do_not_specialize=["slots_ptr", "stride_ps"])
def lora_shrink_rows_kernel(
    x_ptr, a_ptr, scaling_ptr, slots_ptr, part_ptr,
    K, RANK, K_PER_SPLIT, stride_xm, stride_as, stride_ar, stride_ps, stride_pm,
    BLOCK_K: tl.constexpr, BLOCK_R: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    j = tl.program_id(1)  # the fused projection's module: rows [j * RANK, (j + 1) * RANK) of A
    split = tl.program_id(2)  # K_PER_SPLIT columns of x
    active, slot = _row_slot(slots_ptr, row)
    rs = tl.arange(0, BLOCK_R)
    r_ok = rs < RANK
    ks = tl.arange(0, BLOCK_K)
    k_start = split * K_PER_SPLIT
    k_stop = tl.where(active, tl.minimum(k_start + K_PER_SPLIT, K), k_start)  # a row of no adapter reads nothing
    a_base = a_ptr + slot * stride_as + (j * RANK + rs[:, None]).to(tl.int64) * stride_ar
    acc = tl.zeros((BLOCK_R,), dtype=tl.float32)
    for k0 in range(k_start, k_stop, BLOCK_K):
        kk = k0 + ks
        k_ok = kk < k_stop
        x = tl.load(x_ptr + row * stride_xm + kk, mask=k_ok, other=0.0).to(tl.float32)
        a = tl.load(a_base + kk[None, :], mask=r_ok[:, None] & k_ok[None, :], other=0.0).to(tl.float32)
        acc += tl.sum(a * x[None, :], axis=1)
    acc = acc * tl.load(scaling_ptr + slot)
    tl.store(part_ptr + split * stride_ps + row * stride_pm + j * RANK + rs, acc, mask=r_ok & active)


@triton.jit(do_not_specialize=["slots_ptr", "stride_ps"])
def lora_expand_rows_kernel(
    part_ptr, b_ptr, slots_ptr, y_ptr,
    RANK, SPLITS, B0, B1, B2, B3, stride_ps, stride_pm, stride_bs, stride_bn, stride_ym, stride_yn,
    BLOCK_N: tl.constexpr, BLOCK_R: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    j = tl.program_id(1)
    active, slot = _row_slot(slots_ptr, row)
    cols, col_ok = _slice_columns(j, B0, B1, B2, B3, tl.program_id(2), BLOCK_N)
    col_ok = col_ok & active
    rs = tl.arange(0, BLOCK_R)
    r_ok = rs < RANK
    # the shrink's split-K partial sums, added in a fixed order: the same result every run
    part_ptrs = part_ptr + row * stride_pm + j * RANK + rs
    buf = tl.zeros((BLOCK_R,), dtype=tl.float32)
    for split in range(0, SPLITS):
        buf += tl.load(part_ptrs + split * stride_ps, mask=r_ok & active, other=0.0)
    b = tl.load(b_ptr + slot * stride_bs + cols[:, None].to(tl.int64) * stride_bn + rs[None, :],
                mask=col_ok[:, None] & r_ok[None, :], other=0.0).to(tl.float32)
    acc = tl.sum(b * buf[None, :], axis=1)
    y_ptrs = y_ptr + row * stride_ym + cols.to(tl.int64) * stride_yn
    y = tl.load(y_ptrs, mask=col_ok, other=0.0)
    tl.store(y_ptrs, (y.to(tl.float32) + acc).to(y_ptr.dtype.element_ty), mask=col_ok)
