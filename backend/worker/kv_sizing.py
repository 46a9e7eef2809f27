"""How many KV-cache blocks an engine gets (the arithmetic is memory_budget.py's)."""

from __future__ import annotations

import torch

from tritium.backend.config import DEFAULT_CPU_KV_CACHE_BYTES, EngineConfig
from tritium.backend.models.llama import LlamaForCausalLM
from tritium.backend.worker.memory_budget import (
    check_fits_one_sequence,
    check_free_memory,
    estimate_activation_bytes,
    kv_cache_budget,
    module_bytes,
)


def kv_bytes_per_block(model: LlamaForCausalLM, block_size: int, dtype: torch.dtype) -> int:
    """Bytes of one KV block (keys and values of `block_size` tokens, every layer) in `dtype`."""
    c = model.config
    per_token = 2 * c.num_hidden_layers * c.num_key_value_heads * c.head_dim
    return per_token * block_size * torch.tensor([], dtype=dtype).element_size()


def num_kv_blocks(config: EngineConfig, model: LlamaForCausalLM, device: torch.device, dtype: torch.dtype,
                  max_model_len: int) -> int:
    """KV blocks for this engine: `kv_cache_bytes` when set, else 1 GiB on a CPU and on CUDA its share
    (`gpu_memory_utilization`) of the device less weights, activations and overhead. Call it with the weights
    loaded and nothing else allocated yet. Raises ValueError (numbers in it) when that cannot hold one
    sequence of `max_model_len` tokens, or the share does not fit what the device has free."""
    per_block = kv_bytes_per_block(model, config.block_size, dtype)
    weights = module_bytes(model)
    budget = config.kv_cache_bytes
    if budget is None and device.type == "cuda":
        free, total = torch.cuda.mem_get_info(device)
        activations = estimate_activation_bytes(
            model.config, config.max_num_batched_tokens, config.max_num_seqs, dtype.itemsize
        )
        budget = kv_cache_budget(total, config.gpu_memory_utilization, weights, activations)
        check_free_memory(budget, activations, free, config.gpu_memory_utilization)
    elif budget is None:
        budget = DEFAULT_CPU_KV_CACHE_BYTES
    num_blocks = budget // per_block
    check_fits_one_sequence(num_blocks, config.block_size, per_block, max_model_len, weights)
    return num_blocks
