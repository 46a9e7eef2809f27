"""Attention backends: which implementation of the kernel interface the model calls.

`torch` uses `tritium.kernels.reference` (any device); `triton` uses the Triton-language kernels
(CUDA, or a CPU under TRITON_INTERPRET=1). The model only sees an `AttentionBackend`.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch

from tritium.kernels.interface import KernelOps

ATTENTION_BACKENDS = ("auto", "torch", "triton")


@dataclass
class AttentionMetadata:
    """How the packed tokens of one step map onto sequences and the paged cache.

    Rows `[0, num_decode_tokens)` are decode rows (one query token per sequence), the rest are
    prefill rows (several query tokens per sequence, the last ones of each context).
    """

    slot_mapping: torch.Tensor  # [num_tokens] int32
    num_decode_tokens: int
    decode_block_tables: torch.Tensor  # [num_decode, max_blocks] int32
    decode_seq_lens: torch.Tensor  # [num_decode] int32
    prefill_block_tables: torch.Tensor  # [num_prefill_seqs, max_blocks] int32
    prefill_cu_seqlens_q: torch.Tensor  # [num_prefill_seqs + 1] int32, relative to the prefill rows
    prefill_seq_lens: torch.Tensor  # [num_prefill_seqs] int32
    prefill_max_query_len: int = 0  # longest query run among the prefill sequences


class AttentionBackend:
    """Kernel entry points for one implementation of `KernelOps` (kernels/interface.py), and the metadata
    layout those kernels read."""

    def __init__(self, name: str, ops: KernelOps) -> None:
        self.name = name
        self.ops = ops
        self.rms_norm = ops.rms_norm
        self.rotary_embedding = ops.rotary_embedding
        self.silu_and_mul = ops.silu_and_mul

    def attention(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        key_cache: torch.Tensor,
        value_cache: torch.Tensor,
        meta: AttentionMetadata,
        scale: float,
    ) -> torch.Tensor:
        """Write this step's K/V into the cache, then attend. q: [tokens, heads, d] -> same shape."""
        self.ops.store_kv(k, v, key_cache, value_cache, meta.slot_mapping)
        nd = meta.num_decode_tokens
        if nd == q.shape[0]:
            return self.ops.decode_attention(
                q, key_cache, value_cache, meta.decode_block_tables, meta.decode_seq_lens, scale
            )
        if nd == 0:
            return self.ops.prefill_attention(
                q, key_cache, value_cache, meta.prefill_block_tables,
                meta.prefill_cu_seqlens_q, meta.prefill_seq_lens, scale, meta.prefill_max_query_len,
            )
        out = torch.empty_like(q)
        out[:nd] = self.ops.decode_attention(
            q[:nd], key_cache, value_cache, meta.decode_block_tables, meta.decode_seq_lens, scale
        )
        out[nd:] = self.ops.prefill_attention(
            q[nd:], key_cache, value_cache, meta.prefill_block_tables,
            meta.prefill_cu_seqlens_q, meta.prefill_seq_lens, scale, meta.prefill_max_query_len,
        )
        return out


def resolve_backend_name(name: str, device: torch.device) -> str:
    """`auto` is `triton` on CUDA and `torch` elsewhere. Raises ValueError for an unknown name, or
    for `triton` on a CPU without TRITON_INTERPRET=1."""
    if name not in ATTENTION_BACKENDS:
        raise ValueError(f"attention_backend must be one of {ATTENTION_BACKENDS}, got {name!r}")
    if name == "auto":
        return "triton" if device.type == "cuda" else "torch"
    if name == "triton" and device.type != "cuda" and os.environ.get("TRITON_INTERPRET") != "1":
        raise ValueError("attention_backend='triton' on a CPU needs TRITON_INTERPRET=1 set before start")
    return name


def get_attention_backend(name: str, device: torch.device) -> AttentionBackend:
    """Build the backend for `name` (see resolve_backend_name)."""
    resolved = resolve_backend_name(name, device)
    if resolved == "triton":
        try:
            from tritium.kernels import triton_ops
        except ImportError as exc:
            raise ValueError("the triton attention backend is not available in this build") from exc
        return AttentionBackend("triton", triton_ops)
    from tritium.kernels import reference

    return AttentionBackend("torch", reference)
