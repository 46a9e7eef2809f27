"""Small fused Triton kernels: KV-cache write, RMSNorm (+ residual add), rotary embedding, SiLU-and-mul,
GELU(tanh)-and-mul.

Each program handles a tile of rows so the grid stays small; all math is in fp32 and results are cast
back to the input dtype, as the torch references in `reference.py` do (the @triton.jit bodies are in
kernels/jit/elementwise.py). Their tiles are small enough for the interpreter, so `tiles` (kernels/tiles.py)
is accepted and checked but picks the same launch anywhere.

Specialization, so that an engine compiles every variant before serving (kernels/warmup.py) and none
while serving: the token/row counts (and rotary's head counts, which gain nothing) are
`do_not_specialize`, else the JIT would compile again for a count of 1 or a multiple of 16. The sizes
fixed for an engine keep the JIT's divisible-by-16 specialization where it gives vector loads and stores:
`hidden` (rms_norm), `d` (silu_and_mul, gelu_tanh_and_mul), the row strides (multiples of the hidden size, of
head_dim or of the rotary dim) and the data pointers (fresh buffers, or views starting at multiples of head_dim). The
slot and position pointers may be views at any offset of a step's staging buffer: their alignment is not
specialized.
"""

from __future__ import annotations

from typing import Any

import torch
import triton

from tritium.kernels.jit.elementwise import (
    gelu_tanh_and_mul_kernel,
    rms_norm_kernel,
    rotary_kernel,
    silu_and_mul_kernel,
    store_kv_kernel,
)
from tritium.kernels.tiles import check_tiles


def store_kv_rows(block_row: int) -> int:
    """Tokens per program: tiles of at most 1024 elements keep registers low on GPUs."""
    return max(1, min(64, 1024 // block_row))


def store_kv(
    key: torch.Tensor,
    value: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    tiles: str = "auto",
) -> None:
    """Scatter `[num_tokens, num_kv_heads, head_dim]` rows into the paged caches; slot -1 skips. `key` and
    `value` may be strided views (parts of a fused qkv output)."""
    check_tiles(tiles)
    num_tokens = key.shape[0]
    if num_tokens == 0:
        return
    row = key_cache.shape[2] * key_cache.shape[3]
    key = key.reshape(num_tokens, row)
    value = value.reshape(num_tokens, row)
    if key.stride(1) != 1:
        key = key.contiguous()
    if value.stride(1) != 1:
        value = value.contiguous()
    block_row = triton.next_power_of_2(row)
    block_t = store_kv_rows(block_row)
    grid = (triton.cdiv(num_tokens, block_t),)
    store_kv_kernel[grid](
        key, value, key_cache, value_cache, slot_mapping, num_tokens, key.stride(0), value.stride(0),
        ROW=row, BLOCK_T=block_t, BLOCK_ROW=block_row,
    )


def rms_norm_tiles(hidden: int) -> tuple[int, int]:
    """(BLOCK_R, BLOCK_H): whole rows, up to 4096 elements per program."""
    block_h = triton.next_power_of_2(hidden)
    return max(1, min(16, 4096 // block_h)), block_h


def rms_norm(
    x: torch.Tensor,
    weight: torch.Tensor,
    eps: float,
    residual: torch.Tensor | None = None,
    tiles: str = "auto",
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """RMSNorm over the last dim; with `residual`, adds it first and returns `(normed, x + residual)`."""
    check_tiles(tiles)
    shape = x.shape
    hidden = shape[-1]
    x2 = x.reshape(-1, hidden)
    if x2.stride(1) != 1:
        x2 = x2.contiguous()
    rows = x2.shape[0]
    out = torch.empty((rows, hidden), dtype=x.dtype, device=x.device)
    res2 = residual.reshape(-1, hidden) if residual is not None else x2
    if res2.stride(1) != 1:
        res2 = res2.contiguous()
    res_out = torch.empty_like(out) if residual is not None else out
    block_r, block_h = rms_norm_tiles(hidden)
    if rows:
        rms_norm_kernel[(triton.cdiv(rows, block_r),)](
            x2, res2, weight, out, res_out, rows, hidden, x2.stride(0), res2.stride(0), eps,
            HAS_RESIDUAL=residual is not None, BLOCK_R=block_r, BLOCK_H=block_h,
        )
    if residual is not None:
        return out.view(shape), res_out.view(shape)
    return out.view(shape)


def rotary_tokens(block_heads: int, half: int) -> int:
    """Tokens per program: up to 2048 rotated pairs of q (`half` padded to a power of two)."""
    return max(1, min(16, 2048 // (block_heads * int(triton.next_power_of_2(half)))))


def rotary_embedding(
    q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor, cos_sin_cache: torch.Tensor, tiles: str = "auto"
) -> None:
    """Neox-style rotary embedding of `q` `[tokens, heads, d]` and `k` `[tokens, kv_heads, d]`, in place.
    `cos_sin_cache` is `[max_position, rot_dim]` = cat(cos, sin); the first rot_dim features rotate (any even
    rot_dim: a half that is not a power of two is padded, masked). `q` and `k` may be strided views (parts of a
    fused qkv output) with a contiguous last dim."""
    check_tiles(tiles)
    num_tokens = q.shape[0]
    if num_tokens == 0:
        return
    half = cos_sin_cache.shape[-1] // 2
    assert q.stride(-1) == 1 and k.stride(-1) == 1, "rotary_embedding needs the last dim contiguous"
    assert cos_sin_cache.shape[-1] == 2 * half <= q.shape[-1], "rotary dim must be even and at most head_dim"
    block_qh = triton.next_power_of_2(q.shape[1])
    block_t = rotary_tokens(block_qh, half)
    rotary_kernel[(triton.cdiv(num_tokens, block_t),)](
        q, k, positions, cos_sin_cache, num_tokens, q.shape[1], k.shape[1],
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), cos_sin_cache.stride(0),
        HALF=half, BLOCK_HALF=triton.next_power_of_2(half), BLOCK_T=block_t, BLOCK_QH=block_qh,
        BLOCK_KH=triton.next_power_of_2(k.shape[1]),
    )


def act_and_mul_tiles(d: int) -> tuple[int, int]:
    """(BLOCK_R, BLOCK_D) of silu_and_mul and gelu_tanh_and_mul: up to 1024 columns and 4096 elements per
    program."""
    block_d = min(1024, triton.next_power_of_2(d))
    return max(1, min(16, 4096 // block_d)), block_d


def _act_and_mul(kernel: Any, x: torch.Tensor, tiles: str) -> torch.Tensor:
    check_tiles(tiles)
    d = x.shape[-1] // 2
    x2 = x.reshape(-1, 2 * d)
    if x2.stride(1) != 1:
        x2 = x2.contiguous()
    rows = x2.shape[0]
    out = torch.empty((rows, d), dtype=x.dtype, device=x.device)
    block_r, block_d = act_and_mul_tiles(d)
    if rows:
        kernel[(triton.cdiv(rows, block_r), triton.cdiv(d, block_d))](
            x2, out, rows, d, x2.stride(0), BLOCK_R=block_r, BLOCK_D=block_d,
        )
    return out.view(*x.shape[:-1], d)


def silu_and_mul(x: torch.Tensor, tiles: str = "auto") -> torch.Tensor:
    """`[..., 2*d] -> [..., d]`: silu(first half) * second half."""
    return _act_and_mul(silu_and_mul_kernel, x, tiles)


def gelu_tanh_and_mul(x: torch.Tensor, tiles: str = "auto") -> torch.Tensor:
    """`[..., 2*d] -> [..., d]`: gelu (tanh approximation) of the first half * second half."""
    return _act_and_mul(gelu_tanh_and_mul_kernel, x, tiles)
