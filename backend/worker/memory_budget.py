"""How much memory an engine's KV cache gets, and whether it is enough (plain arithmetic).

On CUDA an engine may use `gpu_memory_utilization` x the device's total memory, everything included,
so several engines (several models in one tritonserver) can share a GPU by giving each a fraction:

    KV budget = gpu_memory_utilization x total - weights - activations - CUDA overhead

where activations is the peak memory of one forward pass of max_num_batched_tokens tokens
(estimate_activation_bytes) and the overhead is the CUDA context, cuBLAS workspaces and compiled
kernels, which torch does not count. Whatever the budget, the cache must hold one sequence of
max_model_len tokens, or the engine refuses to start.
"""

from __future__ import annotations

import torch

from tritium.backend.models.config import ModelConfig

MiB = 1 << 20
GiB = 1 << 30
CUDA_OVERHEAD_BYTES = 768 * MiB
ACTIVATION_SAFETY_FACTOR = 2  # temporaries, the caching allocator's rounding and fragmentation


def _gib(n: float) -> str:
    return f"{n / GiB:.2f} GiB"


def _mib(n: float) -> str:
    return f"{n / MiB:.1f} MiB"


def kv_cache_budget(
    total_bytes: int, gpu_memory_utilization: float, weight_bytes: int, activation_bytes: int,
    overhead_bytes: int = CUDA_OVERHEAD_BYTES,
) -> int:
    """Bytes left for the KV cache out of `gpu_memory_utilization` x `total_bytes`. Raises ValueError
    (with the numbers) when the weights, activations and overhead alone do not fit that share."""
    share = int(gpu_memory_utilization * total_bytes)
    budget = share - weight_bytes - activation_bytes - overhead_bytes
    if budget <= 0:
        raise ValueError(
            f"gpu_memory_utilization {gpu_memory_utilization} of {_gib(total_bytes)} is {_gib(share)}, "
            f"which does not fit the weights ({_gib(weight_bytes)}) + activations ({_gib(activation_bytes)}) "
            f"+ CUDA overhead ({_gib(overhead_bytes)}), let alone a KV cache; raise gpu_memory_utilization"
        )
    return budget


def check_free_memory(kv_bytes: int, activation_bytes: int, free_bytes: int, gpu_memory_utilization: float) -> None:
    """Raise ValueError when the KV cache plus the activations still to come exceed what the device has
    free now (other processes or engines took more than their share)."""
    needed = kv_bytes + activation_bytes
    if needed > free_bytes:
        raise ValueError(
            f"the KV cache ({_gib(kv_bytes)}) + activations ({_gib(activation_bytes)}) that "
            f"gpu_memory_utilization {gpu_memory_utilization} allows need {_gib(needed)}, but only "
            f"{_gib(free_bytes)} of the device is free; lower gpu_memory_utilization here or in the "
            "other engines sharing this GPU, or set kv_cache_bytes"
        )


def blocks_for_tokens(num_tokens: int, block_size: int) -> int:
    """Blocks of `block_size` tokens that hold `num_tokens` tokens."""
    return -(-num_tokens // block_size)


def check_fits_one_sequence(
    num_blocks: int, block_size: int, bytes_per_block: int, max_model_len: int, weight_bytes: int,
) -> None:
    """Raise ValueError (with the numbers) when `num_blocks` cannot hold one sequence of max_model_len tokens."""
    needed = blocks_for_tokens(max_model_len, block_size)
    if num_blocks < needed:
        raise ValueError(
            f"the KV cache holds {num_blocks} blocks ({num_blocks * block_size} tokens, "
            f"{_mib(num_blocks * bytes_per_block)}), fewer than one full-length sequence needs: "
            f"max_model_len {max_model_len} tokens = {needed} blocks = {_mib(needed * bytes_per_block)} "
            f"(weights: {_mib(weight_bytes)}); raise kv_cache_bytes or gpu_memory_utilization, "
            "or lower max_model_len"
        )


def estimate_activation_bytes(config: ModelConfig, num_tokens: int, num_logit_rows: int, dtype_bytes: int) -> int:
    """Peak memory of one forward pass over `num_tokens` packed tokens, `num_logit_rows` of which get
    logits, x ACTIVATION_SAFETY_FACTOR. Per token, at the widest point of a layer: hidden, residual
    and normed input, q/k/v and their contiguous copies, the attention output, gate/up, the SiLU
    product and the projection back. Logits are computed in the weights' dtype, then made fp32."""
    h, inter = config.hidden_size, config.intermediate_size
    qkv = (config.num_attention_heads + 2 * config.num_key_value_heads) * config.head_dim
    per_token = 4 * h + 2 * qkv + config.num_attention_heads * config.head_dim + 3 * inter
    logits = num_logit_rows * config.vocab_size * (dtype_bytes + 4)
    return ACTIVATION_SAFETY_FACTOR * (num_tokens * per_token * dtype_bytes + logits)


def module_bytes(module: torch.nn.Module) -> int:
    """Bytes of a module's weights: parameters, buffers and plain tensor attributes (the weights
    CpuPackedLinear holds packed)."""
    tensors = {id(t): t for t in [*module.parameters(), *module.buffers()]}
    for sub in module.modules():
        tensors.update({id(v): v for v in vars(sub).values() if isinstance(v, torch.Tensor)})
    return sum(t.numel() * t.element_size() for t in tensors.values())
