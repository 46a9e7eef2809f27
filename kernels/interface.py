"""The kernel interface: what an attention backend's ops module provides. `tritium.kernels.reference`
(plain torch) and `tritium.kernels.triton_ops` (Triton) both implement it: mypy checks both modules against
this Protocol (kernels/conformance.py: parameter kinds, types, defaults and return types; mypy does not compare
the names of positional parameters), and tests/kernels/test_kernel_interface.py checks their parameter names
and default values.

Shapes: packed tokens first; caches are `[num_blocks, block_size, num_kv_heads, head_dim]`; block tables
int32 `[num_seqs, max_blocks]`; `slot_mapping` `[num_tokens]` (block * block_size + offset, -1 skips).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

import torch


class KernelOps(Protocol):
    def store_kv(self, key: torch.Tensor, value: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
                 slot_mapping: torch.Tensor) -> None:
        """Scatter `key`/`value` `[num_tokens, num_kv_heads, head_dim]` into the caches at `slot_mapping`."""
        ...

    def prefill_attention(self, q: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
                          block_tables: torch.Tensor, cu_seqlens_q: torch.Tensor, seq_lens: torch.Tensor,
                          scale: float, max_query_len: int | None = None, sliding_window: int | None = None,
                          softcap: float | None = None, sinks: torch.Tensor | None = None) -> torch.Tensor:
        """Causal attention of packed query rows (sequence i: rows `cu_seqlens_q[i]:cu_seqlens_q[i+1]`, the
        last positions of a context of `seq_lens[i]` cached tokens). Returns q's shape and dtype.
        `sliding_window` W: a query at position p sees keys p - W < k <= p only; `softcap` c: scores (scaled)
        become c * tanh(score / c) before the softmax; `sinks` fp32 `[num_heads]`: a logit per head that joins
        the softmax's denominator and attends to nothing (gpt-oss)."""
        ...

    def decode_attention(self, q: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
                         block_tables: torch.Tensor, seq_lens: torch.Tensor, scale: float,
                         sliding_window: int | None = None, softcap: float | None = None,
                         sinks: torch.Tensor | None = None) -> torch.Tensor:
        """One query row per sequence `[num_seqs, num_heads, head_dim]` against its paged context (its last
        `sliding_window` keys when set); `softcap` and `sinks` as in prefill_attention."""
        ...

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float,
                 residual: torch.Tensor | None = None) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """RMSNorm over the last dim; with `residual`, first x += residual and return (normed, new residual)."""
        ...

    def rotary_embedding(self, q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor,
                         cos_sin_cache: torch.Tensor) -> None:
        """Rotate q and k in place (neox style) at `positions`; the cache is cat(cos, sin) per position."""
        ...

    def silu_and_mul(self, x: torch.Tensor) -> torch.Tensor:
        """`[..., 2*d] -> [..., d]`: silu(first half) * second half."""
        ...

    def gelu_tanh_and_mul(self, x: torch.Tensor) -> torch.Tensor:
        """`[..., 2*d] -> [..., d]`: gelu (tanh approximation) of the first half * second half."""
        ...

    def apply_token_bitmask(self, logits: torch.Tensor, bitmask: torch.Tensor, rows: torch.Tensor) -> None:
        """In place: logits row `rows[r]` keeps token t where bit t % 32 of `bitmask[r, t // 32]` is set; every
        other token (and any t >= 32 * bitmask.shape[1]) gets -inf. Other rows are untouched."""
        ...

    def int8_gemm(self, a: torch.Tensor, q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
        """W8A16: `a` `[M, K]` @ `(q int8 [N, K] * scale fp32 [N, None]).T` -> `[M, N]` in a's dtype, fp32
        accumulation (int8 weight-only quantization, backend/layers/int8_linear.py)."""
        ...

    def lora_shrink(self, x: torch.Tensor, lora_a: torch.Tensor, scaling: torch.Tensor, token_indices: torch.Tensor,
                    seg_starts: torch.Tensor, seg_slots: torch.Tensor, buffer: torch.Tensor, max_rows: int,
                    num_slices: int = 1) -> None:
        """LoRA shrink over segments of one slot each (kernels/lora.py): `buffer[i] = scaling[s] *
        x[token_indices[i]] @ A[s]^T`, segment j = places `seg_starts[j]:seg_starts[j+1]` of slot `seg_slots[j]`;
        `max_rows`: the longest segment. A `[slots, rank rows, in]` holds `num_slices` modules' ranks side by side
        (a fused projection's), scaling fp32 `[slots]`, buffer `[rows, rank rows]`."""
        ...

    def lora_expand(self, buffer: torch.Tensor, lora_b: torch.Tensor, token_indices: torch.Tensor,
                    seg_starts: torch.Tensor, seg_slots: torch.Tensor, y: torch.Tensor, max_rows: int,
                    bounds: Sequence[int] | None = None) -> None:
        """LoRA expand over the same segments, in place: `y[token_indices[i], c] += buffer[i, module m's ranks] @
        B[s, c]^T` for the columns c of module m, `bounds[m] <= c < bounds[m+1]` (None: one module; 1-3 modules
        from 0 to y's width). B `[slots, out, rank]`; y `[T, out]` may be a strided column slice. Other rows of y
        are not touched."""
        ...

    def lora_shrink_rows(self, x: torch.Tensor, lora_a: torch.Tensor, scaling: torch.Tensor, row_slots: torch.Tensor,
                         partials: torch.Tensor, num_slices: int = 1) -> None:
        """LoRA shrink with one adapter per row (-1: none, skipped), as split-K partial sums: fp32 `partials`
        `[splits, T, rank rows]` whose sum over splits is `scaling[s] * x[t] @ A[s]^T`, `row_slots[t] = s`. A fixed
        grid per row count: CUDA-graph capturable."""
        ...

    def lora_expand_rows(self, partials: torch.Tensor, lora_b: torch.Tensor, row_slots: torch.Tensor,
                         y: torch.Tensor, bounds: Sequence[int] | None = None) -> None:
        """LoRA expand with one adapter per row, in place: `y[t, c] += partials[:, t, module m's ranks].sum(0) @
        B[s, c]^T` (`bounds` as in `lora_expand`); rows with `row_slots[t] = -1` are not touched."""
        ...

    def fused_moe(self, hidden: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk_weights: torch.Tensor,
                  topk_ids: torch.Tensor, activation: str = "silu", w13_bias: torch.Tensor | None = None,
                  w2_bias: torch.Tensor | None = None) -> torch.Tensor:
        """Mixture-of-experts MLP: `hidden` `[T, H]`; expert e's gate and up projections `w13[e]` `[2I, H]` (gate
        rows first), its down projection `w2[e]` `[H, I]`; each token's `topk_ids` int32 `[T, K]` with fp32
        `topk_weights` `[T, K]`. Returns `[T, H]` in hidden's dtype: sum over k of topk_weights[t, k] *
        (w2[e] @ act(w13[e] @ h + w13_bias[e]) + w2_bias[e]), e = topk_ids[t, k], fp32 accumulation. `activation`:
        "silu" (silu(gate) * up) or "swiglu_oai" (gpt-oss: gate clamped above at 7, up to [-7, 7],
        gate * sigmoid(1.702 * gate) * (up + 1))."""
        ...


MOE_ACTIVATIONS = ("silu", "swiglu_oai")
OP_NAMES = ("store_kv", "prefill_attention", "decode_attention", "rms_norm", "rotary_embedding", "silu_and_mul",
            "gelu_tanh_and_mul", "apply_token_bitmask", "int8_gemm", "lora_shrink", "lora_expand", "lora_shrink_rows",
            "lora_expand_rows", "fused_moe")
