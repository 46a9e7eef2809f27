"""Small fused Triton kernels: KV-cache write, RMSNorm (+ residual add), rotary embedding, SiLU-and-mul.

Each program handles a tile of rows so the grid stays small; all math is in fp32 and results are cast
back to the input dtype, as the torch references in `reference.py` do. Their tiles are small enough for
the interpreter, so `tiles` (kernels/tiles.py) is accepted and checked but picks the same launch anywhere.

Specialization, so that an engine compiles every variant before serving (kernels/warmup.py) and none
while serving: the token/row counts (and rotary's head counts, which gain nothing) are
`do_not_specialize`, else the JIT would compile again for a count of 1 or a multiple of 16. The sizes
fixed for an engine keep the JIT's divisible-by-16 specialization where it gives vector loads and stores:
`hidden` (rms_norm), `d` (silu_and_mul), the row strides (multiples of the hidden size, of head_dim or of
the rotary dim) and the data pointers (fresh buffers, or views starting at multiples of head_dim). The
slot and position pointers may be views at any offset of a step's staging buffer: their alignment is not
specialized.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from tritium.kernels.tiles import check_tiles


@triton.jit(do_not_specialize=["num_tokens"], do_not_specialize_on_alignment=["slot_ptr"])
def store_kv_kernel(
    key_ptr, value_ptr, key_cache_ptr, value_cache_ptr, slot_ptr,
    num_tokens, stride_key, stride_value,
    ROW: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_ROW: tl.constexpr,
):
    tokens = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    cols = tl.arange(0, BLOCK_ROW)
    slots = tl.load(slot_ptr + tokens, mask=tokens < num_tokens, other=-1).to(tl.int64)
    mask = (slots[:, None] >= 0) & (cols[None, :] < ROW)
    rows = tokens.to(tl.int64)[:, None]
    k = tl.load(key_ptr + rows * stride_key + cols[None, :], mask=mask)
    v = tl.load(value_ptr + rows * stride_value + cols[None, :], mask=mask)
    dest = slots[:, None] * ROW + cols[None, :]
    tl.store(key_cache_ptr + dest, k, mask=mask)
    tl.store(value_cache_ptr + dest, v, mask=mask)


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


@triton.jit(do_not_specialize=["num_rows"])
def rms_norm_kernel(
    x_ptr, residual_ptr, weight_ptr, out_ptr, residual_out_ptr,
    num_rows, hidden, stride_x, stride_residual, eps,
    HAS_RESIDUAL: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_H: tl.constexpr,
):
    rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    cols = tl.arange(0, BLOCK_H)
    mask = (rows[:, None] < num_rows) & (cols[None, :] < hidden)
    r64 = rows.to(tl.int64)[:, None]
    x = tl.load(x_ptr + r64 * stride_x + cols[None, :], mask=mask, other=0.0)
    if HAS_RESIDUAL:
        res = tl.load(residual_ptr + r64 * stride_residual + cols[None, :], mask=mask, other=0.0)
        x = (x.to(tl.float32) + res.to(tl.float32)).to(x.dtype)
        tl.store(residual_out_ptr + r64 * hidden + cols[None, :], x, mask=mask)
    xf = x.to(tl.float32)
    variance = tl.sum(xf * xf, axis=1) / hidden
    normed = (xf * tl.math.rsqrt(variance + eps)[:, None]).to(x.dtype)
    w = tl.load(weight_ptr + cols, mask=cols < hidden, other=0.0)
    out = (w[None, :].to(tl.float32) * normed.to(tl.float32)).to(x.dtype)
    tl.store(out_ptr + r64 * hidden + cols[None, :], out, mask=mask)


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


@triton.jit
def _rotate_rows(ptr, tokens, num_tokens, num_heads, stride_t, stride_h, cos, sin,
                 HALF: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_HEADS: tl.constexpr):
    heads = tl.arange(0, BLOCK_HEADS)
    cols = tl.arange(0, HALF)
    base = (tokens.to(tl.int64)[:, None, None] * stride_t + heads[None, :, None] * stride_h
            + cols[None, None, :])
    mask = (tokens[:, None, None] < num_tokens) & (heads[None, :, None] < num_heads)
    x1 = tl.load(ptr + base, mask=mask, other=0.0)
    x2 = tl.load(ptr + base + HALF, mask=mask, other=0.0)
    f1 = x1.to(tl.float32)
    f2 = x2.to(tl.float32)
    c = cos[:, None, :]
    s = sin[:, None, :]
    tl.store(ptr + base, (f1 * c - f2 * s).to(x1.dtype), mask=mask)
    tl.store(ptr + base + HALF, (f2 * c + f1 * s).to(x1.dtype), mask=mask)


@triton.jit(do_not_specialize=["num_tokens", "num_heads", "num_kv_heads"],
            do_not_specialize_on_alignment=["pos_ptr"])
def rotary_kernel(
    q_ptr, k_ptr, pos_ptr, cache_ptr, num_tokens, num_heads, num_kv_heads,
    stride_qt, stride_qh, stride_kt, stride_kh, stride_cache,
    HALF: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_QH: tl.constexpr, BLOCK_KH: tl.constexpr,
):
    tokens = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    pos = tl.load(pos_ptr + tokens, mask=tokens < num_tokens, other=0).to(tl.int64)
    cols = tl.arange(0, HALF)
    cos = tl.load(cache_ptr + pos[:, None] * stride_cache + cols[None, :]).to(tl.float32)
    sin = tl.load(cache_ptr + pos[:, None] * stride_cache + HALF + cols[None, :]).to(tl.float32)
    _rotate_rows(q_ptr, tokens, num_tokens, num_heads, stride_qt, stride_qh, cos, sin, HALF, BLOCK_T, BLOCK_QH)
    _rotate_rows(k_ptr, tokens, num_tokens, num_kv_heads, stride_kt, stride_kh, cos, sin, HALF, BLOCK_T, BLOCK_KH)


def rotary_tokens(block_heads: int, half: int) -> int:
    """Tokens per program: up to 2048 rotated pairs of q."""
    return max(1, min(16, 2048 // (block_heads * half)))


def rotary_embedding(
    q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor, cos_sin_cache: torch.Tensor, tiles: str = "auto"
) -> None:
    """Neox-style rotary embedding of `q` `[tokens, heads, d]` and `k` `[tokens, kv_heads, d]`, in place.
    `cos_sin_cache` is `[max_position, rot_dim]` = cat(cos, sin); the first rot_dim features rotate.
    `q` and `k` may be strided views (parts of a fused qkv output) with a contiguous last dim."""
    check_tiles(tiles)
    num_tokens = q.shape[0]
    if num_tokens == 0:
        return
    half = cos_sin_cache.shape[-1] // 2
    assert q.stride(-1) == 1 and k.stride(-1) == 1, "rotary_embedding needs the last dim contiguous"
    assert half & (half - 1) == 0, "rotary dim must be a power of two"
    block_qh = triton.next_power_of_2(q.shape[1])
    block_t = rotary_tokens(block_qh, half)
    rotary_kernel[(triton.cdiv(num_tokens, block_t),)](
        q, k, positions, cos_sin_cache, num_tokens, q.shape[1], k.shape[1],
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), cos_sin_cache.stride(0),
        HALF=half, BLOCK_T=block_t, BLOCK_QH=block_qh, BLOCK_KH=triton.next_power_of_2(k.shape[1]),
    )


@triton.jit(do_not_specialize=["num_rows"])
def silu_and_mul_kernel(x_ptr, out_ptr, num_rows, d, stride_x,
                        BLOCK_R: tl.constexpr, BLOCK_D: tl.constexpr):
    rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    cols = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
    mask = (rows[:, None] < num_rows) & (cols[None, :] < d)
    r64 = rows.to(tl.int64)[:, None]
    gate = tl.load(x_ptr + r64 * stride_x + cols[None, :], mask=mask, other=0.0)
    up = tl.load(x_ptr + r64 * stride_x + d + cols[None, :], mask=mask, other=0.0)
    g = gate.to(tl.float32)
    silu = (g / (1.0 + tl.exp(-g))).to(gate.dtype)
    out = (silu.to(tl.float32) * up.to(tl.float32)).to(gate.dtype)
    tl.store(out_ptr + r64 * d + cols[None, :], out, mask=mask)


def silu_and_mul_tiles(d: int) -> tuple[int, int]:
    """(BLOCK_R, BLOCK_D): up to 1024 columns and 4096 elements per program."""
    block_d = min(1024, triton.next_power_of_2(d))
    return max(1, min(16, 4096 // block_d)), block_d


def silu_and_mul(x: torch.Tensor, tiles: str = "auto") -> torch.Tensor:
    """`[..., 2*d] -> [..., d]`: silu(first half) * second half."""
    check_tiles(tiles)
    d = x.shape[-1] // 2
    x2 = x.reshape(-1, 2 * d)
    if x2.stride(1) != 1:
        x2 = x2.contiguous()
    rows = x2.shape[0]
    out = torch.empty((rows, d), dtype=x.dtype, device=x.device)
    block_r, block_d = silu_and_mul_tiles(d)
    if rows:
        silu_and_mul_kernel[(triton.cdiv(rows, block_r), triton.cdiv(d, block_d))](
            x2, out, rows, d, x2.stride(0), BLOCK_R=block_r, BLOCK_D=block_d,
        )
    return out.view(*x.shape[:-1], d)
