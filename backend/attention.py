"""Attention backends: which implementation of the kernel interface the model calls.

`torch` uses `tritium.kernels.reference` (any device); `triton` uses the Triton-language kernels
(CUDA, or a CPU under TRITON_INTERPRET=1). The model only sees an `AttentionBackend`.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field

import torch

from tritium.kernels.interface import KernelOps

ATTENTION_BACKENDS = ("auto", "torch", "triton")


@dataclass
class AttentionMetadata:
    """How the packed tokens of one step map onto sequences and the paged cache.

    Rows `[0, num_decode_tokens)` are decode rows (one query token per sequence), the rest are
    prefill rows (several query tokens per sequence, the last ones of each context).
    """

    slot_mapping: torch.Tensor  # [num_tokens]
    num_decode_tokens: int
    decode_block_tables: torch.Tensor  # [num_decode, max_blocks] int32
    decode_seq_lens: torch.Tensor  # [num_decode] int32
    prefill_block_tables: torch.Tensor  # [num_prefill_seqs, max_blocks] int32
    prefill_cu_seqlens_q: torch.Tensor  # [num_prefill_seqs + 1] int32, relative to the prefill rows
    prefill_seq_lens: torch.Tensor  # [num_prefill_seqs] int32
    prefill_max_query_len: int = 0  # longest query run among the prefill sequences


@dataclass
class StepLayout:
    """Where one step's packed tokens go, as plain lists (the model runner's side): decode sequences first,
    then prefill chunks."""

    slot_mapping: list[int] = field(default_factory=list)
    decode_block_tables: list[list[int]] = field(default_factory=list)
    decode_seq_lens: list[int] = field(default_factory=list)
    prefill_block_tables: list[list[int]] = field(default_factory=list)
    prefill_query_lens: list[int] = field(default_factory=list)
    prefill_seq_lens: list[int] = field(default_factory=list)


def _block_table_tensor(tables: list[list[int]], device: torch.device) -> torch.Tensor:
    width = max((len(t) for t in tables), default=0)
    padded = [t + [0] * (width - len(t)) for t in tables]
    return torch.tensor(padded, dtype=torch.int32, device=device).reshape(len(tables), width)


class AttentionBackend:
    """Kernel entry points for one implementation of `KernelOps` (kernels/interface.py), and the metadata
    layout those kernels read."""

    def __init__(self, name: str, ops: KernelOps) -> None:
        self.name = name
        self.ops = ops
        self.rms_norm = ops.rms_norm
        self.rotary_embedding = ops.rotary_embedding
        self.silu_and_mul = ops.silu_and_mul

    def build_metadata(self, layout: StepLayout, device: torch.device) -> AttentionMetadata:
        """The kernels' view of a step: block tables padded to a rectangle, cumulative query lengths."""
        cu_seqlens = [0]
        for n in layout.prefill_query_lens:
            cu_seqlens.append(cu_seqlens[-1] + n)
        return AttentionMetadata(
            slot_mapping=torch.tensor(layout.slot_mapping, dtype=torch.int64, device=device),
            num_decode_tokens=len(layout.decode_seq_lens),
            decode_block_tables=_block_table_tensor(layout.decode_block_tables, device),
            decode_seq_lens=torch.tensor(layout.decode_seq_lens, dtype=torch.int32, device=device),
            prefill_block_tables=_block_table_tensor(layout.prefill_block_tables, device),
            prefill_cu_seqlens_q=torch.tensor(cu_seqlens, dtype=torch.int32, device=device),
            prefill_seq_lens=torch.tensor(layout.prefill_seq_lens, dtype=torch.int32, device=device),
            prefill_max_query_len=max(layout.prefill_query_lens, default=0),
        )

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
