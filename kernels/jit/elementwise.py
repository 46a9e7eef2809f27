"""The @triton.jit bodies of `tritium.kernels.elementwise`: KV-cache write, RMSNorm (+ residual add),
rotary embedding, SiLU-and-mul and GELU(tanh)-and-mul.

The launch configuration, the specialization and the contract are documented with the host wrappers in
kernels/elementwise.py. These bodies are Triton language, not Python: mypy skips this package.
"""

from __future__ import annotations

import triton
import triton.language as tl


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


@triton.jit
def _rotate_rows(ptr, tokens, num_tokens, num_heads, stride_t, stride_h, cos, sin,
                 HALF: tl.constexpr, BLOCK_HALF: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_HEADS: tl.constexpr):
    heads = tl.arange(0, BLOCK_HEADS)
    cols = tl.arange(0, BLOCK_HALF)
    base = (tokens.to(tl.int64)[:, None, None] * stride_t + heads[None, :, None] * stride_h
            + cols[None, None, :])
    mask = (tokens[:, None, None] < num_tokens) & (heads[None, :, None] < num_heads)
    if BLOCK_HALF != HALF:  # a half that is not a power of two, padded
        mask = mask & (cols[None, None, :] < HALF)
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
    HALF: tl.constexpr, BLOCK_HALF: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_QH: tl.constexpr,
    BLOCK_KH: tl.constexpr,
):
    tokens = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    pos = tl.load(pos_ptr + tokens, mask=tokens < num_tokens, other=0).to(tl.int64)
    cols = tl.arange(0, BLOCK_HALF)
    if BLOCK_HALF != HALF:
        cos = tl.load(cache_ptr + pos[:, None] * stride_cache + cols[None, :], mask=cols[None, :] < HALF, other=0.0)
        sin = tl.load(cache_ptr + pos[:, None] * stride_cache + HALF + cols[None, :], mask=cols[None, :] < HALF,
                      other=0.0)
    else:
        cos = tl.load(cache_ptr + pos[:, None] * stride_cache + cols[None, :])
        sin = tl.load(cache_ptr + pos[:, None] * stride_cache + HALF + cols[None, :])
    cos = cos.to(tl.float32)
    sin = sin.to(tl.float32)
    _rotate_rows(q_ptr, tokens, num_tokens, num_heads, stride_qt, stride_qh, cos, sin, HALF, BLOCK_HALF, BLOCK_T,
                 BLOCK_QH)
    _rotate_rows(k_ptr, tokens, num_tokens, num_kv_heads, stride_kt, stride_kh, cos, sin, HALF, BLOCK_HALF, BLOCK_T,
                 BLOCK_KH)


@triton.jit
def _act_and_mul(x_ptr, out_ptr, num_rows, d, stride_x, GELU: tl.constexpr, BLOCK_R: tl.constexpr,
                 BLOCK_D: tl.constexpr):
    """out = act(gate) * up, act rounded to the input dtype first (as torch's two ops round)."""
    rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    cols = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
    mask = (rows[:, None] < num_rows) & (cols[None, :] < d)
    r64 = rows.to(tl.int64)[:, None]
    gate = tl.load(x_ptr + r64 * stride_x + cols[None, :], mask=mask, other=0.0)
    up = tl.load(x_ptr + r64 * stride_x + d + cols[None, :], mask=mask, other=0.0)
    g = gate.to(tl.float32)
    if GELU:
        # 0.5 g (1 + tanh(u)) = g * sigmoid(2u), u = sqrt(2 / pi) (g + 0.044715 g^3): no cancellation for g < 0
        u = 0.7978845608028654 * (g + 0.044715 * g * g * g)
        act = (g / (1.0 + tl.math.exp2(u * -2.8853900817779268))).to(gate.dtype)  # e^(-2u) = 2^(-2u / ln 2)
    else:
        act = (g / (1.0 + tl.exp(-g))).to(gate.dtype)
    out = (act.to(tl.float32) * up.to(tl.float32)).to(gate.dtype)
    tl.store(out_ptr + r64 * d + cols[None, :], out, mask=mask)


@triton.jit(do_not_specialize=["num_rows"])
def silu_and_mul_kernel(x_ptr, out_ptr, num_rows, d, stride_x,
                        BLOCK_R: tl.constexpr, BLOCK_D: tl.constexpr):
    _act_and_mul(x_ptr, out_ptr, num_rows, d, stride_x, False, BLOCK_R, BLOCK_D)


@triton.jit(do_not_specialize=["num_rows"])
def gelu_tanh_and_mul_kernel(x_ptr, out_ptr, num_rows, d, stride_x,
                             BLOCK_R: tl.constexpr, BLOCK_D: tl.constexpr):
    _act_and_mul(x_ptr, out_ptr, num_rows, d, stride_x, True, BLOCK_R, BLOCK_D)
