"""What one tensor-parallel rank holds of a model (docs/architecture.md, "Tensor parallelism"): its config (heads,
KV heads and intermediate sizes divided), and the part of each checkpoint tensor it loads, in our tensor layout.
Column-parallel: q/k/v by heads (KV heads replicated when there are fewer than ranks), gate/up and the experts'
w13 by intermediate rows. Row-parallel: o_proj, down_proj and the experts' w2 by input columns, their biases on rank 0
only (the ranks' outputs are summed). The embedding and the logits head by vocabulary rows; the rest replicated."""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

import torch

from tritium.backend.layers.parallel import vocab_range
from tritium.backend.model_config import ModelConfig, ModelFolderError


@dataclass(frozen=True)
class Shard:
    rank: int
    size: int


@dataclass(frozen=True)
class RankSlice:
    """Ranges of dimension `dim` joined in order, padded with zero rows to `pad_to`; `zero`: zeros of the whole
    shape (a row-parallel bias off rank 0); no ranges: the whole tensor."""

    dim: int = 0
    ranges: tuple[tuple[int, int], ...] = ()
    pad_to: int | None = None
    zero: bool = False

    def of(self, tensor: Any, shape: list[int]) -> torch.Tensor:
        """This part of `tensor` (a torch tensor or a safetensors slice of `shape`), as a new tensor."""
        if self.zero:
            return torch.zeros(shape, dtype=tensor.dtype if isinstance(tensor, torch.Tensor) else None)
        if not self.ranges:
            return tensor if isinstance(tensor, torch.Tensor) else tensor[:]
        dim = self.dim % len(shape)
        lead = (slice(None),) * dim
        indexes = [(*lead, slice(a, b)) for a, b in self.ranges]
        parts = [tensor[index] for index in indexes]
        out = torch.cat(parts, dim=dim) if len(parts) > 1 else parts[0].clone()
        if self.pad_to is not None and out.shape[dim] < self.pad_to:
            pad = list(out.shape)
            pad[dim] = self.pad_to - out.shape[dim]
            out = torch.cat([out, out.new_zeros(pad)], dim=dim)
        return out


def shard_config(config: ModelConfig, size: int) -> ModelConfig:
    """The config one of `size` ranks builds its layers from. Raises ModelFolderError naming the numbers when the
    heads or sizes do not divide."""
    if size == 1:
        return config
    heads, kv = config.num_attention_heads, config.num_key_value_heads
    if heads % size:
        raise ModelFolderError(f"tensor_parallel_size {size} does not divide num_attention_heads {heads}")
    if kv % size and size % kv:
        raise ModelFolderError(f"tensor_parallel_size {size} and num_key_value_heads {kv}: one must divide the other "
                               "(KV heads are split, or replicated when there are fewer than ranks)")
    dense = any(not config.is_moe_layer(i) for i in range(config.num_hidden_layers))
    if dense and config.intermediate_size % size:
        raise ModelFolderError(f"tensor_parallel_size {size} does not divide intermediate_size "
                               f"{config.intermediate_size}")
    if config.is_moe and config.moe_intermediate_size % size:
        raise ModelFolderError(f"tensor_parallel_size {size} does not divide the experts' intermediate size "
                               f"{config.moe_intermediate_size}")
    return replace(config, num_attention_heads=heads // size, num_key_value_heads=max(1, kv // size),
                   intermediate_size=config.intermediate_size // size,
                   moe_intermediate_size=config.moe_intermediate_size // size)


def rank_slice(key: str, part: int | None, config: ModelConfig, shard: Shard) -> RankSlice:
    """What `shard` loads of our tensor `key` (part `part` of a fused one); `config`: the whole model's."""
    r, n = shard.rank, shard.size
    if n == 1:
        return RankSlice()
    hd = config.head_dim
    q_rows = config.num_attention_heads * hd // n
    q = (r * q_rows, (r + 1) * q_rows)
    kv_full = config.num_key_value_heads * hd
    kv_first = r * config.num_key_value_heads // n * hd
    kv = (kv_first, kv_first + max(1, config.num_key_value_heads // n) * hd)
    inter = _split(config.intermediate_size, r, n)
    experts = _split(config.moe_intermediate_size, r, n) if config.is_moe else (0, 0)
    name = key.rsplit(".", 2)[-2:]
    module, kind = name[0], name[1]
    if module == "qkv_proj":
        if part is None:  # fused in the checkpoint (Phi-3): q, k and v sections
            full_q = config.num_attention_heads * hd
            return RankSlice(0, (q, _shift(kv, full_q), _shift(kv, full_q + kv_full)))
        return RankSlice(0, (q if part == 0 else kv,))
    if module == "gate_up_proj":
        return RankSlice(0, (inter, _shift(inter, config.intermediate_size)) if part is None else (inter,))
    if module in ("o_proj", "down_proj") or key.endswith("moe.w2_bias"):
        if kind == "bias" or key.endswith("_bias"):
            return RankSlice(zero=r != 0)
        return RankSlice(1, (q if module == "o_proj" else inter,))
    if key.endswith("attn.sinks"):
        return RankSlice(0, (_split(config.num_attention_heads, r, n),))
    if key in ("embed_tokens.weight", "lm_head.weight"):
        first, rows = vocab_range(config.vocab_size, r, n)
        return RankSlice(0, ((first, min(first + rows, config.vocab_size)),), pad_to=rows)
    if key.endswith("moe.w13"):  # one expert's gate or up `[I, H]`, or all stacked `[E, 2I, H]`
        if part is not None:
            return RankSlice(0, (experts,))
        return RankSlice(1, (experts, _shift(experts, config.moe_intermediate_size)))
    if key.endswith("moe.w13_bias"):
        return RankSlice(-1, (experts, _shift(experts, config.moe_intermediate_size)))
    if key.endswith("moe.w2"):  # one expert's `[H, I]` or all stacked `[E, H, I]`
        return RankSlice(-1, (experts,))
    return RankSlice()


def _split(total: int, rank: int, size: int) -> tuple[int, int]:
    part = total // size
    return rank * part, (rank + 1) * part


def _shift(span: tuple[int, int], by: int) -> tuple[int, int]:
    return span[0] + by, span[1] + by
