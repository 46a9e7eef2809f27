"""Attention over the paged KV cache, and the kernels every layer calls (docs/architecture.md#kernel-interface)."""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch
from torch import nn

from tritium.backend.layers.parallel import RankGroup
from tritium.backend.model_config import ModelConfig, ModelFolderError
from tritium.kernels.interface import KernelOps

ATTENTION_BACKENDS = ("auto", "torch", "triton")
TRITON_HEAD_DIMS = (16, 32, 64, 128, 256)  # what the Triton attention kernels handle
KVCache = tuple[torch.Tensor, torch.Tensor]  # one layer's key and value caches


@dataclass
class AttentionMetadata:
    """One step's packed tokens over the paged cache: decode rows first (one query token each), then prefill."""

    slot_mapping: torch.Tensor  # [num_tokens] int32
    num_decode_tokens: int
    decode_block_tables: torch.Tensor  # [num_decode, max_blocks] int32
    decode_seq_lens: torch.Tensor  # [num_decode] int32
    prefill_block_tables: torch.Tensor  # [num_prefill_seqs, max_blocks] int32
    prefill_cu_seqlens_q: torch.Tensor  # [num_prefill_seqs + 1] int32, relative to the prefill rows
    prefill_seq_lens: torch.Tensor  # [num_prefill_seqs] int32
    prefill_max_query_len: int = 0  # longest query run among the prefill sequences


class AttentionBackend:
    """One implementation of `KernelOps` (kernels/interface.py), bound, and the ranks a model using it is sharded over
    (`parallel`: one rank unless `on_ranks` gave a group)."""

    def __init__(self, name: str, ops: KernelOps, parallel: RankGroup | None = None) -> None:
        self.name = name
        self.ops = ops
        self.parallel = parallel or RankGroup()
        self.rms_norm = ops.rms_norm
        self.rotary_embedding = ops.rotary_embedding
        self.silu_and_mul = ops.silu_and_mul
        self.gelu_tanh_and_mul = ops.gelu_tanh_and_mul

    def on_ranks(self, parallel: RankGroup) -> AttentionBackend:
        """The same kernels for a model sharded over `parallel` (a draft model keeps the one-rank backend)."""
        return AttentionBackend(self.name, self.ops, parallel)

    def attention(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, key_cache: torch.Tensor,
                  value_cache: torch.Tensor, meta: AttentionMetadata, scale: float, sliding_window: int | None = None,
                  softcap: float | None = None, sinks: torch.Tensor | None = None) -> torch.Tensor:
        """Store this step's K/V, then attend. q: [tokens, heads, d] -> same shape."""
        self.ops.store_kv(k, v, key_cache, value_cache, meta.slot_mapping)
        nd = meta.num_decode_tokens
        if nd == q.shape[0]:
            return self._decode(q, key_cache, value_cache, meta, scale, sliding_window, softcap, sinks)
        if nd == 0:
            return self._prefill(q, key_cache, value_cache, meta, scale, sliding_window, softcap, sinks)
        out = torch.empty_like(q)
        out[:nd] = self._decode(q[:nd], key_cache, value_cache, meta, scale, sliding_window, softcap, sinks)
        out[nd:] = self._prefill(q[nd:], key_cache, value_cache, meta, scale, sliding_window, softcap, sinks)
        return out

    def _decode(self, q: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor, meta: AttentionMetadata,
                scale: float, sliding_window: int | None, softcap: float | None,
                sinks: torch.Tensor | None) -> torch.Tensor:
        return self.ops.decode_attention(q, key_cache, value_cache, meta.decode_block_tables, meta.decode_seq_lens,
                                         scale, sliding_window, softcap, sinks)

    def _prefill(self, q: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor, meta: AttentionMetadata,
                 scale: float, sliding_window: int | None, softcap: float | None,
                 sinks: torch.Tensor | None) -> torch.Tensor:
        return self.ops.prefill_attention(q, key_cache, value_cache, meta.prefill_block_tables,
                                          meta.prefill_cu_seqlens_q, meta.prefill_seq_lens, scale,
                                          meta.prefill_max_query_len, sliding_window, softcap, sinks)


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
    """Raises ValueError as resolve_backend_name does, or when triton is not installed."""
    resolved = resolve_backend_name(name, device)
    if resolved == "triton":
        try:
            from tritium.kernels import triton_ops
        except ImportError as exc:
            raise ValueError("the triton attention backend is not available in this build") from exc
        return AttentionBackend("triton", triton_ops)
    from tritium.kernels import reference

    return AttentionBackend("torch", reference)


def check_attention_backend(config: ModelConfig, backend: str) -> None:
    """Raise ModelFolderError when the `backend` attention kernels cannot run this model's head size."""
    if backend == "triton" and config.head_dim not in TRITON_HEAD_DIMS:
        raise ModelFolderError(
            f"head_dim {config.head_dim} is not supported by the triton attention backend "
            f"(supported: {', '.join(map(str, TRITON_HEAD_DIMS))}); use attention_backend='torch'"
        )


class Attention(nn.Module):
    """One layer's attention over its paged cache; `sliding_window` W: each query sees its last W keys;
    `softcap`: scores capped by c * tanh(s / c); `sinks` `[num_heads]`: the layer's learned sink logits (gpt-oss), a
    parameter of this module (`attn.sinks`)."""

    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int, scale: float, backend: AttentionBackend,
                 sliding_window: int | None = None, softcap: float | None = None,
                 sinks: nn.Parameter | None = None) -> None:
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = num_heads, num_kv_heads, head_dim
        self.scale = scale
        self.backend = backend
        self.sliding_window = sliding_window
        self.softcap = softcap
        self.sinks = sinks

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_cache: KVCache,
                meta: AttentionMetadata) -> torch.Tensor:
        # The kernels take fp32 sinks; the loader casts every weight to the engine's dtype (a no-op in fp32).
        sinks = None if self.sinks is None else self.sinks.float()
        return self.backend.attention(q, k, v, kv_cache[0], kv_cache[1], meta, self.scale, self.sliding_window,
                                      self.softcap, sinks)
