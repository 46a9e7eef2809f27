"""How many KV-cache blocks an engine gets (the arithmetic is memory_budget.py's)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from tritium.backend.config import DEFAULT_CPU_KV_CACHE_BYTES, EngineConfig
from tritium.backend.models.base import CausalLM
from tritium.backend.worker.memory_budget import (
    MemoryPlan,
    check_fits_one_sequence,
    check_free_memory,
    module_bytes,
    plan_memory,
)


@dataclass(frozen=True)
class KvSizing:
    """`plan`: when sized from a CUDA device's share."""

    num_blocks: int
    plan: MemoryPlan | None


def num_kv_blocks(config: EngineConfig, model: CausalLM, device: torch.device, dtype: torch.dtype,
                  max_model_len: int, largest_graph_bucket: int = 0, resident_bytes: int = 0,
                  planned_block_bytes: int = 0, logit_rows: int | None = None) -> KvSizing:
    """KV blocks (docs/operating.md, "GPU memory"); `resident_bytes` count as weights, and on CUDA each block
    leaves `planned_block_bytes` (a draft model's). Call it with only the weights allocated. Raises ValueError
    (numbers in it) when the cache cannot hold one `max_model_len` sequence or the share exceeds free memory."""
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
