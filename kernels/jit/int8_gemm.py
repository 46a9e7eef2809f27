"""The @triton.jit body of `tritium.kernels.int8_gemm`: W8A16 GEMM, `out = a @ (q * scale[:, None]).T`.

The launch configuration, the specialization and the contract are documented with the host wrapper in
kernels/int8_gemm.py. This body is Triton language, not Python: mypy skips this package.
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit(do_not_specialize=["M"])
def int8_gemm_kernel(
    a_ptr, q_ptr, scale_ptr, out_ptr,
    M, N, K, stride_am, stride_qn, stride_om,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    ks = tl.arange(0, BLOCK_K)
    a_base = a_ptr + rows.to(tl.int64)[:, None] * stride_am
    q_base = q_ptr + cols.to(tl.int64)[None, :] * stride_qn
    row_ok = rows[:, None] < M
    col_ok = cols[None, :] < N
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        kk = k0 + ks
        a = tl.load(a_base + kk[None, :], mask=row_ok & (kk[None, :] < K), other=0.0)
        w = tl.load(q_base + kk[:, None], mask=col_ok & (kk[:, None] < K), other=0)  # [BLOCK_K, BLOCK_N] int8
        # dequantize in registers: int8 -> the activations' dtype (exact for |q| <= 127), fp32 accumulation;
        # the per-channel scale is applied once to the accumulator
        acc = tl.dot(a, w.to(tl.float32).to(a.dtype), acc)
    scale = tl.load(scale_ptr + cols, mask=cols < N, other=0.0)
    out = acc * scale[None, :]
    tl.store(out_ptr + rows.to(tl.int64)[:, None] * stride_om + cols[None, :], out.to(out_ptr.dtype.element_ty),
             mask=row_ok & col_ok)
