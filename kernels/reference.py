"""Plain-torch references of the kernels, with the signatures fixed in docs/architecture.md.

They are the `torch` attention backend on CPU and the ground truth the Triton kernels are tested
against. Shapes: packed tokens first; caches are `[num_blocks, block_size, num_kv_heads, head_dim]`.
"""

from __future__ import annotations

from collections.abc import Sequence
from itertools import pairwise

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
    sliding_window: int | None = None,
    softcap: float | None = None,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """Causal attention of packed query rows against their paged contexts.

    Sequence i owns rows `cu_seqlens_q[i]:cu_seqlens_q[i+1]` of `q` `[num_tokens, num_heads, head_dim]`;
    they are the last positions of a context of `seq_lens[i]` tokens whose K/V are already cached.
    Returns `[num_tokens, num_heads, head_dim]` in `q`'s dtype. `max_query_len` is only a launch hint for the
    Triton kernel. A query at position p sees keys p - sliding_window < k <= p; `softcap` caps the scaled scores
    (c * tanh(s / c)); `sinks` fp32 `[num_heads]`: a logit per head in the softmax's denominator only (gpt-oss).
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
        if num_q == context_len and sliding_window is None and softcap is None and sinks is None:
            o = F.scaled_dot_product_attention(qi, ki, vi, is_causal=True, scale=scale)
        else:
            # Query row j sits at position context_len - num_q + j.
            q_pos = torch.arange(context_len - num_q, context_len, device=q.device)
            mask = visible_keys(q_pos, context_len, sliding_window)
            o = _attention(qi, ki, vi, mask, scale, softcap, sinks)
        out[start:end] = o.transpose(0, 1)
    return out


def visible_keys(q_pos: torch.Tensor, context_len: int, sliding_window: int | None) -> torch.Tensor:
    """`[len(q_pos), context_len]` bool: key k is visible from position p when k <= p (and p - W < k)."""
    keys = torch.arange(context_len, device=q_pos.device)[None, :]
    mask = keys <= q_pos[:, None]
    if sliding_window is not None:
        mask &= keys > q_pos[:, None] - sliding_window
    return mask


def _attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor, scale: float,
               softcap: float | None, sinks: torch.Tensor | None = None) -> torch.Tensor:
    """Masked attention of `[..., heads, rows, d]` queries; with `softcap` the scores are capped before the softmax;
    `sinks` `[heads]` join each row's softmax as one more logit whose probability is dropped (transformers'
    gpt-oss eager attention: the max over scores and sink subtracted first)."""
    if softcap is None and sinks is None:
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale)
    scores = (q.float() @ k.float().transpose(-1, -2)) * scale
    if softcap is not None:
        scores = torch.tanh(scores / softcap) * softcap
    scores = scores.masked_fill(~mask, float("-inf"))
    if sinks is None:
        probs = scores.softmax(dim=-1)
    else:
        sink = sinks.float().reshape(-1, 1, 1).expand(*scores.shape[:-1], 1)
        logits = torch.cat([scores, sink], dim=-1)
        logits = logits - logits.amax(dim=-1, keepdim=True)
        probs = logits.softmax(dim=-1)[..., :-1]
    return (probs @ v.float()).to(q.dtype)


def decode_attention(
    q: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    sliding_window: int | None = None,
    softcap: float | None = None,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """One query row per sequence `[num_seqs, num_heads, head_dim]` against its paged context (the last
    `sliding_window` keys when set, reading only the blocks that hold them; `softcap` and `sinks` as in
    prefill_attention).

    Returns `[num_seqs, num_heads, head_dim]` in `q`'s dtype. Computes in fp32.
    """
    num_seqs, num_heads, head_dim = q.shape
    if num_seqs == 0:
        return torch.empty_like(q)
    block_size, num_kv_heads = key_cache.shape[1], key_cache.shape[2]
    lens = seq_lens.to(q.device).long()
    max_blocks = (int(lens.max()) + block_size - 1) // block_size
    first = torch.zeros_like(lens)  # each sequence's first block read: with a window, the one holding its start
    if sliding_window is not None:
        first = (lens - sliding_window).clamp(min=0) // block_size
        max_blocks = min(max_blocks, (sliding_window - 1) // block_size + 2)
    ctx = max_blocks * block_size
    index = (first[:, None] + torch.arange(max_blocks, device=q.device)).clamp(max=block_tables.shape[1] - 1)
    blocks = block_tables.to(q.device).gather(1, index).reshape(-1).long()
    # One gather per cache; the [seq, kv_head, pos, d] views feed one SDPA call for all heads (GQA in the op):
    # 1.2-1.5x faster on a CPU than a baddbmm / softmax / bmm per KV head.
    k = key_cache.index_select(0, blocks).view(num_seqs, ctx, num_kv_heads, head_dim).transpose(1, 2).float()
    v = value_cache.index_select(0, blocks).view(num_seqs, ctx, num_kv_heads, head_dim).transpose(1, 2).float()
    keys = (first[:, None] * block_size + torch.arange(ctx, device=q.device))[:, None, None, :]
    lens = lens[:, None, None, None]
    visible = keys < lens
    if sliding_window is not None:
        visible &= keys >= lens - sliding_window
    if softcap is None and sinks is None:
        out = F.scaled_dot_product_attention(q.float().unsqueeze(2), k, v, attn_mask=visible, scale=scale,
                                             enable_gqa=num_kv_heads != num_heads)
        return out.squeeze(2).to(q.dtype)
    group = num_heads // num_kv_heads
    k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
    return _attention(q.float().unsqueeze(2), k, v, visible, scale, softcap, sinks).squeeze(2).to(q.dtype)


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


def gelu_tanh_and_mul(x: torch.Tensor) -> torch.Tensor:
    """`[..., 2*d] -> [..., d]`: gelu (tanh approximation) of the first half * second half."""
    d = x.shape[-1] // 2
    return F.gelu(x[..., :d], approximate="tanh").mul_(x[..., d:])


_SAME_SIZE_INT = {4: torch.int32, 2: torch.int16}
_MASK_CHUNK = 1 << 20  # tokens of integer mask unpacked at once


def apply_token_bitmask(logits: torch.Tensor, bitmask: torch.Tensor, rows: torch.Tensor) -> None:
    """Set the tokens a grammar disallows to -inf, in place.

    `logits` `[B, V]`; `bitmask` `[R, W]` int32, bit `t % 32` of word `t // 32` set when token `t` is
    allowed (llguidance's / xgrammar's layout); tokens `t >= 32 * W` are disallowed. Bitmask row `r` applies
    to logits row `rows[r]` (int32 or int64); other rows are untouched, allowed tokens keep their exact
    value. A row listed twice gets the intersection of its masks.

    This is also the CPU path, so it avoids what is slow in torch on CPU (boolean masked_fill and where,
    index_select / index_copy of the rows, big temporaries): the bits of up to about 1M tokens at a time
    unpack into an integer mask, all ones (allowed) or zeros per token, and each run of consecutive logits
    rows is updated in place as one 2D view (three integer ops): its bits become `((x ^ NEG) & mask) ^ NEG`,
    NEG being -inf's bit pattern. fp64 logits or strided tokens take a plain masked_fill. Reads `rows` on
    the host (a sync on CUDA).
    """
    num_rows, num_words = bitmask.shape
    vocab = logits.shape[1]
    if num_rows == 0 or vocab == 0:
        return
    packed = min(vocab, 32 * num_words)
    row_list = rows.tolist()
    int_dtype = _SAME_SIZE_INT.get(logits.element_size()) if logits.is_floating_point() else None
    if int_dtype is None or logits.stride(1) != 1:  # other dtypes, strided tokens: the plain definition
        tokens = torch.arange(packed, device=logits.device)
        words = bitmask.gather(1, (tokens // 32).expand(num_rows, packed))
        allowed = torch.zeros(num_rows, vocab, dtype=torch.bool, device=logits.device)
        allowed[:, :packed] = ((words >> (tokens % 32).to(torch.int32)) & 1).bool()
        for r, row in enumerate(row_list):
            logits[row].masked_fill_(~allowed[r], float("-inf"))
        return
    if bitmask.stride(1) != 1:
        bitmask = bitmask.contiguous()
    bits = 8 * logits.element_size()
    neg = torch.tensor(float("-inf"), dtype=logits.dtype).view(int_dtype).item()
    shifts = (bits - 1) - torch.arange(bits, dtype=int_dtype, device=logits.device)
    units = bitmask.view(int_dtype)  # little-endian: unit k of a word holds the word's bits bits*k and up
    ints = logits.view(int_dtype)
    step = max(1, _MASK_CHUNK // (32 * num_words))
    for start in range(0, num_rows, step):
        # Each bit moved to the sign bit, then shifted back arithmetically: -1 (allowed) or 0.
        chunk = units[start : start + step]
        mask = (chunk[:, :, None] << shifts).bitwise_right_shift_(bits - 1).view(chunk.shape[0], -1)
        r, end = 0, mask.shape[0]
        while r < end:
            first = row_list[start + r]
            n = 1
            while r + n < end and row_list[start + r + n] == first + n:
                n += 1
            x = ints[first : first + n]
            x[:, :packed].bitwise_xor_(neg).bitwise_and_(mask[r : r + n, :packed]).bitwise_xor_(neg)
            if packed < vocab:
                x[:, packed:] = neg
            r += n


def int8_gemm(a: torch.Tensor, q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """W8A16 reference: `a` `[M, K]` @ `(q int8 [N, K] * scale fp32 [N, None]).T` in fp32, returned in a's dtype."""
    return (a.float() @ (q.float() * scale.float()[:, None]).T).to(a.dtype)


def _module_edges(bounds: Sequence[int] | None, y: torch.Tensor) -> list[int]:
    return list(bounds) if bounds is not None else [0, y.shape[1]]


def lora_shrink(x: torch.Tensor, lora_a: torch.Tensor, scaling: torch.Tensor, token_indices: torch.Tensor,
                seg_starts: torch.Tensor, seg_slots: torch.Tensor, buffer: torch.Tensor, max_rows: int,
                num_slices: int = 1) -> None:
    """LoRA shrink reference: `buffer[i] = scaling[s] * x[token_indices[i]] @ A[s]^T` over each segment
    (slot `seg_slots[j]`, places `seg_starts[j]:seg_starts[j+1]`), fp32 accumulation (reads the segments on the
    host; backend/lora/ops.py has the engine's synchronization-free form). `num_slices` only splits the work."""
    starts = seg_starts.tolist()
    for j, slot in enumerate(seg_slots.tolist()):
        rows = token_indices[starts[j] : starts[j + 1]].long()
        out = (x.index_select(0, rows).float() @ lora_a[slot].float().t()) * scaling[slot].float()
        buffer[starts[j] : starts[j + 1]] = out.to(buffer.dtype)


def lora_expand(buffer: torch.Tensor, lora_b: torch.Tensor, token_indices: torch.Tensor, seg_starts: torch.Tensor,
                seg_slots: torch.Tensor, y: torch.Tensor, max_rows: int, bounds: Sequence[int] | None = None) -> None:
    """LoRA expand reference: `y[token_indices[i], c] += buffer[i, module m's ranks] @ B[s, c]^T` over each segment
    and each module m's columns `bounds[m]:bounds[m+1]` (None: one module), in place (fp32 accumulation, then y's
    dtype)."""
    starts, edges, rank = seg_starts.tolist(), _module_edges(bounds, y), lora_b.shape[2]
    for j, slot in enumerate(seg_slots.tolist()):
        rows = token_indices[starts[j] : starts[j + 1]].long()
        for m, (lo, hi) in enumerate(pairwise(edges)):
            part = buffer[starts[j] : starts[j + 1], m * rank : (m + 1) * rank]
            delta = part.float() @ lora_b[slot, lo:hi].float().t()
            y[rows, lo:hi] = (y[rows, lo:hi].float() + delta).to(y.dtype)


def lora_shrink_rows(x: torch.Tensor, lora_a: torch.Tensor, scaling: torch.Tensor, row_slots: torch.Tensor,
                     partials: torch.Tensor, num_slices: int = 1) -> None:
    """Per-row LoRA shrink reference: the whole `scaling[s] * x[t] @ A[s]^T` in split 0 of fp32 `partials`
    `[splits, T, rank rows]` and zeros in the other splits, where `row_slots[t] = s >= 0` (other rows are left as
    they are)."""
    for t, slot in enumerate(row_slots.tolist()):
        if slot >= 0:
            partials[:, t] = 0.0
            partials[0, t] = (lora_a[slot].float() @ x[t].float()) * scaling[slot].float()


def lora_expand_rows(partials: torch.Tensor, lora_b: torch.Tensor, row_slots: torch.Tensor, y: torch.Tensor,
                     bounds: Sequence[int] | None = None) -> None:
    """Per-row LoRA expand reference: `y[t, c] += partials[:, t, module m's ranks].sum(0) @ B[s, c]^T` where
    `row_slots[t] = s >= 0`, for each module m's columns (`bounds` as in `lora_expand`), in place."""
    edges, rank = _module_edges(bounds, y), lora_b.shape[2]
    for t, slot in enumerate(row_slots.tolist()):
        if slot < 0:
            continue
        buffer = partials[:, t].sum(0)
        for m, (lo, hi) in enumerate(pairwise(edges)):
            delta = lora_b[slot, lo:hi].float() @ buffer[m * rank : (m + 1) * rank]
            y[t, lo:hi] = (y[t, lo:hi].float() + delta).to(y.dtype)


def fused_moe(hidden: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk_weights: torch.Tensor,
              topk_ids: torch.Tensor, activation: str = "silu", w13_bias: torch.Tensor | None = None,
              w2_bias: torch.Tensor | None = None) -> torch.Tensor:
    """Mixture-of-experts MLP (kernels/interface.py): tokens grouped by expert, one GEMM pair per expert that got
    tokens (never a loop over idle experts or over tokens); fp32 accumulation, returns hidden's dtype."""
    num_tokens, top_k = topk_ids.shape
    out = torch.zeros(num_tokens, hidden.shape[1], dtype=torch.float32, device=hidden.device)
    flat = topk_ids.reshape(-1).long()
    order = flat.argsort(stable=True)
    counts = torch.bincount(flat, minlength=w13.shape[0]).tolist()
    rows = order // top_k  # each (token, k) pair's token, grouped by expert
    weights = topk_weights.reshape(-1)[order].float()
    start = 0
    for expert, count in enumerate(counts):
        if count == 0:
            continue
        tokens = rows[start : start + count]
        x = hidden.index_select(0, tokens)
        gate_up = F.linear(x, w13[expert], None if w13_bias is None else w13_bias[expert]).float()
        act = moe_activation(gate_up, activation).to(hidden.dtype)
        y = F.linear(act, w2[expert], None if w2_bias is None else w2_bias[expert]).float()
        out.index_add_(0, tokens, y * weights[start : start + count, None])
        start += count
    return out.to(hidden.dtype)


def moe_activation(gate_up: torch.Tensor, activation: str) -> torch.Tensor:
    """`[..., 2I] -> [..., I]` (gate half first) for fused_moe's `activation`. Raises ValueError for another."""
    gate, up = gate_up.chunk(2, dim=-1)
    if activation == "silu":
        return F.silu(gate) * up
    if activation == "swiglu_oai":
        gate, up = gate.clamp(max=7.0), up.clamp(-7.0, 7.0)
        return gate * torch.sigmoid(1.702 * gate) * (up + 1)
    raise ValueError(f"unsupported MoE activation {activation!r} (supported: silu, swiglu_oai)")
