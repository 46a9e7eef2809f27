"""How many KV-cache blocks an engine gets (the arithmetic is memory_budget.py's)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from tritium.backend.config import DEFAULT_CPU_KV_CACHE_BYTES, EngineConfig
from tritium.backend.models.llama import LlamaForCausalLM
from tritium.backend.worker.memory_budget import (
    MemoryPlan,
    check_fits_one_sequence,
    check_free_memory,
    module_bytes,
    plan_memory,
)


@dataclass(frozen=True)
class KvSizing:
    """The KV cache's blocks and, when sized from a CUDA device's share, the memory plan behind them."""

    num_blocks: int
    plan: MemoryPlan | None


def num_kv_blocks(config: EngineConfig, model: LlamaForCausalLM, device: torch.device, dtype: torch.dtype,
                  max_model_len: int, largest_graph_bucket: int = 0, resident_bytes: int = 0,
                  planned_block_bytes: int = 0, logit_rows: int | None = None) -> KvSizing:
    """KV blocks for this engine: `kv_cache_bytes` when set, else 1 GiB on a CPU and on CUDA its share
    (`gpu_memory_utilization`) of the device less weights, activations, the decode graphs' pool (of
    `largest_graph_bucket` rows; 0: no graphs), the sampler's temporaries and overhead (memory_budget.py);
    `resident_bytes` (adapter slots, a draft model's weights) counts as weights, and on CUDA's share each block
    also leaves `planned_block_bytes` (a draft model's cache of as many blocks; kv_cache_bytes is the target's).
    `logit_rows`: the rows a step samples at most (max_num_seqs, x (1 + k) with speculation).
    Call it with the weights loaded and nothing else allocated yet. Raises ValueError (numbers in it) when that
    cannot hold one sequence of `max_model_len` tokens, or the share does not fit what the device has free."""
    per_block = model.config.kv_bytes_per_block(config.block_size, dtype)
    weights = module_bytes(model) + resident_bytes
    budget = config.kv_cache_bytes
    plan = None
    if budget is None and device.type == "cuda":
        free, total = torch.cuda.mem_get_info(device)
        plan = plan_memory(model.config, total, config.gpu_memory_utilization, weights,
                           config.max_num_batched_tokens, logit_rows or config.max_num_seqs, largest_graph_bucket,
                           dtype.itemsize)
        check_free_memory(plan.kv_cache, plan.step_bytes, free, config.gpu_memory_utilization)
        budget = plan.kv_cache * per_block // (per_block + planned_block_bytes)
    elif budget is None:
        budget = DEFAULT_CPU_KV_CACHE_BYTES
    num_blocks = budget // per_block
    check_fits_one_sequence(num_blocks, config.block_size, per_block, max_model_len, weights)
    return KvSizing(num_blocks, plan)
