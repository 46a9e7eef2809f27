"""W8A16 GEMM for int8 weight-only quantization (backend/layers/int8_linear.py): `a @ (q * scale[:, None]).T`.

`a` `[M, K]` in bf16/fp16 (fp32 also runs), `q` int8 `[N, K]` (one row per output channel), `scale` fp32
`[N]`; the output is `[M, N]` in a's dtype. A program computes a BLOCK_M x BLOCK_N tile: it walks K in
BLOCK_K steps, loads the int8 weight tile, converts it to a's dtype in registers (exact: |q| <= 127) and
accumulates `tl.dot` in fp32; the per-channel scale multiplies the accumulator once at the end. The weight
is read as int8 from memory: half the bytes of bf16, which is what decode steps (M = batch) are bound by.
The @triton.jit body is in kernels/jit/int8_gemm.py; the torch reference is `reference.int8_gemm`.

Specialization: M (the step's row count) is `do_not_specialize`, so one compile per tile configuration serves
every batch size; N, K and the strides are fixed per layer and keep the JIT's divisible-by-16 specialization.
Tiles: M <= 16 gets BLOCK_M 16 (the smallest `tl.dot` tile), 17-64 rows 32 or 64 x 64-wide tiles (more programs
on a decode batch's single row of tiles), prefill-sized M 64x128 (32x64 in fp32); the interpreter uses 16x16x16
tiles. `python -m tritium.kernels.compile_check --kernel int8_gemm_kernel` builds them for sm_80/sm_90.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import triton

from tritium.kernels.jit.int8_gemm import int8_gemm_kernel
from tritium.kernels.tiles import use_gpu_tiles


class Int8GemmConfig(NamedTuple):
    block_m: int
    block_n: int
    block_k: int
    num_warps: int
    num_stages: int


def int8_gemm_config(m: int, dtype: torch.dtype = torch.bfloat16, tiles: str = "gpu",
                     device: torch.device | str = "cuda") -> Int8GemmConfig:
    """Launch configuration for `m` rows of `dtype` activations (GPU tiles; 16x16x16 for the interpreter)."""
    if not use_gpu_tiles(tiles, device):
        return Int8GemmConfig(16, 16, 16, 4, 1)
    if m <= 16:
        return Int8GemmConfig(16, 64, 128, 4, 4)
    if dtype == torch.float32:  # 64x128 fp32 tiles spill registers on sm_80 (compile_check); these spill 8 bytes
        return Int8GemmConfig(32, 64, 32, 4, 3)
    if m <= 64:  # decode batches: one row of tiles, so half-wide ones give a 4096-wide layer 64 programs, not 32
        return Int8GemmConfig(32 if m <= 32 else 64, 64, 128, 4, 4)
    return Int8GemmConfig(64, 128, 64, 4, 3)


# A row count per configuration of int8_gemm_config (bf16/fp16): what the engine's warm-up launches, so that no
# batch size compiles a variant while serving.
CONFIG_ROWS = (1, 32, 64, 128)


def int8_gemm(a: torch.Tensor, q: torch.Tensor, scale: torch.Tensor, tiles: str = "auto") -> torch.Tensor:
    """`a @ (q.float() * scale[:, None]).T` in a's dtype, fp32 accumulation. `a` `[M, K]` may be row-strided."""
    m, k = a.shape
    n = q.shape[0]
    if q.shape[1] != k or scale.shape != (n,):
        raise ValueError(f"int8_gemm: a {tuple(a.shape)}, q {tuple(q.shape)}, scale {tuple(scale.shape)} mismatch")
    out = torch.empty((m, n), dtype=a.dtype, device=a.device)
    if m == 0:
        return out
    if a.stride(1) != 1:
        a = a.contiguous()
    cfg = int8_gemm_config(m, a.dtype, tiles, a.device)
    grid = (triton.cdiv(m, cfg.block_m), triton.cdiv(n, cfg.block_n))
    int8_gemm_kernel[grid](
        a, q, scale, out, m, n, k, a.stride(0), q.stride(0), out.stride(0),
        BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k,
        num_warps=cfg.num_warps, num_stages=cfg.num_stages,
    )
    return out
