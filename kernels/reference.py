"""Plain-torch references of the kernels, with the signatures fixed in docs/architecture.md.

They are the `torch` attention backend on CPU and the ground truth the Triton kernels are tested
against. Shapes: packed tokens first; caches are `[num_blocks, block_size, num_kv_heads, head_dim]`.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def store_kv(
    key: torch.Tensor,
    value: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """Scatter `key`/`value` rows `[num_tokens, num_kv_heads, head_dim]` into the paged caches.

    Row i goes to slot `slot_mapping[i]` (= block * block_size + offset); -1 skips the row.
    """
    num_blocks, block_size, num_kv_heads, head_dim = key_cache.shape
    keep = slot_mapping >= 0
    if not bool(keep.all()):
        key, value, slot_mapping = key[keep], value[keep], slot_mapping[keep]
    slots = slot_mapping.long()
    key_cache.view(num_blocks * block_size, num_kv_heads, head_dim).index_copy_(0, slots, key)
    value_cache.view(num_blocks * block_size, num_kv_heads, head_dim).index_copy_(0, slots, value)


def gather_context(
    cache: torch.Tensor, block_table: torch.Tensor, context_len: int
) -> torch.Tensor:
    """The first `context_len` cached rows of one sequence: `[context_len, num_kv_heads, head_dim]`."""
    block_size = cache.shape[1]
    num_blocks = (context_len + block_size - 1) // block_size
    blocks = cache.index_select(0, block_table[:num_blocks].long())
    return blocks.reshape(num_blocks * block_size, *cache.shape[2:])[:context_len]


def prefill_attention(
    q: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_tables: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    max_query_len: int | None = None,
) -> torch.Tensor:
    """Causal attention of packed query rows against their paged contexts.

    Sequence i owns rows `cu_seqlens_q[i]:cu_seqlens_q[i+1]` of `q` `[num_tokens, num_heads, head_dim]`;
    they are the last positions of a context of `seq_lens[i]` tokens whose K/V are already cached.
    Returns `[num_tokens, num_heads, head_dim]` in `q`'s dtype. `max_query_len` (the longest run of
    query rows) is only a launch hint for the Triton kernel; the reference ignores it.
    """
    out = torch.empty_like(q)
    num_heads = q.shape[1]
    num_kv_heads = key_cache.shape[2]
    starts = cu_seqlens_q.tolist()
    lens = seq_lens.tolist()
    for i, context_len in enumerate(lens):
        start, end = starts[i], starts[i + 1]
        num_q = end - start
        if num_q == 0:
            continue
        k = gather_context(key_cache, block_tables[i], context_len)
        v = gather_context(value_cache, block_tables[i], context_len)
        qi = q[start:end].transpose(0, 1)  # [heads, num_q, d]
        ki = k.transpose(0, 1)
        vi = v.transpose(0, 1)
        if num_kv_heads != num_heads:
            group = num_heads // num_kv_heads
            ki = ki.repeat_interleave(group, dim=0)
            vi = vi.repeat_interleave(group, dim=0)
        if num_q == context_len:
            o = F.scaled_dot_product_attention(qi, ki, vi, is_causal=True, scale=scale)
        else:
            # Query row j sits at position context_len - num_q + j and sees keys 0..that position.
            q_pos = torch.arange(context_len - num_q, context_len, device=q.device)
            mask = torch.arange(context_len, device=q.device)[None, :] <= q_pos[:, None]
            o = F.scaled_dot_product_attention(qi, ki, vi, attn_mask=mask, scale=scale)
        out[start:end] = o.transpose(0, 1)
    return out


def decode_attention(
    q: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """One query row per sequence `[num_seqs, num_heads, head_dim]` against its whole paged context.

    Returns `[num_seqs, num_heads, head_dim]` in `q`'s dtype. Computes in fp32.
    """
    num_seqs, num_heads, head_dim = q.shape
    if num_seqs == 0:
        return torch.empty_like(q)
    block_size, num_kv_heads = key_cache.shape[1], key_cache.shape[2]
    group = num_heads // num_kv_heads
    max_blocks = (int(seq_lens.max()) + block_size - 1) // block_size
    ctx = max_blocks * block_size
    blocks = block_tables[:, :max_blocks].reshape(-1).long()
    # One gather per cache; per KV head, the [seq, pos, d] slices feed bmm without further copies.
    k = key_cache.index_select(0, blocks).view(num_seqs, ctx, num_kv_heads, head_dim).float()
    v = value_cache.index_select(0, blocks).view(num_seqs, ctx, num_kv_heads, head_dim).float()
    positions = torch.arange(ctx, device=q.device)
    bias = torch.zeros(num_seqs, 1, ctx, device=q.device)
    bias.masked_fill_(positions[None, None, :] >= seq_lens.to(q.device)[:, None, None], float("-inf"))
    qg = (q.float() * scale).view(num_seqs, num_kv_heads, group, head_dim)
    out = torch.empty(num_kv_heads, num_seqs, group, head_dim, device=q.device)
    for h in range(num_kv_heads):
        scores = torch.baddbmm(bias, qg[:, h], k[:, :, h].transpose(1, 2))  # [seqs, group, ctx]
        torch.bmm(scores.softmax(dim=-1), v[:, :, h], out=out[h])
    return out.transpose(0, 1).reshape(num_seqs, num_heads, head_dim).to(q.dtype)


def rms_norm(
    x: torch.Tensor,
    weight: torch.Tensor,
    eps: float,
    residual: torch.Tensor | None = None,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """RMSNorm over the last dim, computed in fp32 as Llama does.

    Without `residual` returns the normed `x`. With it, first `x = x + residual` and returns
    `(normed, x)`, the new residual stream.
    """
    if residual is not None:
        x = x + residual
        residual = x
    xf = x.float()
    variance = xf.pow(2).mean(-1, keepdim=True)
    normed = weight * (xf * torch.rsqrt(variance + eps)).to(x.dtype)
    if residual is not None:
        return normed, residual
    return normed


def rotary_embedding(
    q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor, cos_sin_cache: torch.Tensor
) -> None:
    """Rotate `q` `[num_tokens, num_heads, head_dim]` and `k` `[num_tokens, num_kv_heads, head_dim]` in
    place, neox style (halves), with `cos_sin_cache` `[max_position, rot_dim]` = cat(cos, sin) per
    position. When `rot_dim` < `head_dim` only the first `rot_dim` features rotate.
    """
    cos_sin = cos_sin_cache.index_select(0, positions.long())
    rot_dim = cos_sin.shape[-1]
    half = rot_dim // 2
    cos = cos_sin[:, None, :half]
    sin = cos_sin[:, None, half:]
    for t in (q, k):
        if t.dtype == torch.float32:
            x1, x2 = t[..., :half], t[..., half:rot_dim]
            first = x1 * cos - x2 * sin
            x2.mul_(cos).add_(x1 * sin)
            x1.copy_(first)
        else:
            x1 = t[..., :half].float()
            x2 = t[..., half:rot_dim].float()
            t[..., :half] = (x1 * cos - x2 * sin).to(t.dtype)
            t[..., half:rot_dim] = (x2 * cos + x1 * sin).to(t.dtype)


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """`[..., 2*d] -> [..., d]`: silu(first half) * second half."""
    d = x.shape[-1] // 2
    return F.silu(x[..., :d]).mul_(x[..., d:])
