"""How much memory an engine's KV cache gets, and whether it is enough: plain arithmetic (docs/operating.md,
"GPU memory"). Eager steps cannot reuse the decode graphs' pool, so it is a term of its own."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from tritium.backend.model_config import ModelConfig

MiB = 1 << 20
GiB = 1 << 30
CUDA_OVERHEAD_BYTES = 768 * MiB
ACTIVATION_SAFETY_FACTOR = 2  # temporaries, the caching allocator's rounding and fragmentation
CAPTURE_STREAM_WORKSPACE_BYTES = 32 * MiB  # cuBLAS's workspace on the graph capture stream (torch's Hopper size)
# Live bytes per (row, vocabulary entry) at top-k / top-p's peak: scaled logits (8), the sort (12) and its
# scratch, masked copies, softmax and sums (4 each), mask (1), scatter (4), the draw's noise and probs; rounded up.
SAMPLER_BYTES_PER_LOGIT = 64
# The penalty rows kept per running request (sample/penalty_rows.py): seen (1) and counts (4) per token.
PENALTY_BYTES_PER_TOKEN = 5


def _gib(n: float) -> str:
    return f"{n / GiB:.2f} GiB"


def _mib(n: float) -> str:
    return f"{n / MiB:.1f} MiB"


def kv_cache_budget(
    total_bytes: int, gpu_memory_utilization: float, weight_bytes: int, activation_bytes: int,
    overhead_bytes: int = CUDA_OVERHEAD_BYTES,
) -> int:
    """Bytes left for the KV cache in the share; `activation_bytes`: all a step allocates. Raises ValueError
    (with the numbers) when the rest alone exceeds the share."""
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
    """Raise ValueError when the KV cache and activations exceed the device's free memory now."""
    needed = kv_bytes + activation_bytes
    if needed > free_bytes:
        raise ValueError(
            f"the KV cache ({_gib(kv_bytes)}) + activations ({_gib(activation_bytes)}) that "
            f"gpu_memory_utilization {gpu_memory_utilization} allows need {_gib(needed)}, but only "
            f"{_gib(free_bytes)} of the device is free; lower gpu_memory_utilization here or in the "
            "other engines sharing this GPU, or set kv_cache_bytes"
        )


def blocks_for_tokens(num_tokens: int, block_size: int) -> int:
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
    """Peak bytes of one forward pass x ACTIVATION_SAFETY_FACTOR. Per token, a layer's widest point: hidden,
    residual, normed input, q/k/v and copies, attention out, gate/up, SiLU product, down; logits in both dtypes."""
    h, inter = config.hidden_size, config.intermediate_size
    qkv = (config.num_attention_heads + 2 * config.num_key_value_heads) * config.head_dim
    mlp = 3 * inter
    if config.num_experts:  # each token's k experts: gate/up, product and down rows; the router's logits; an fp32 sum
        mlp = max(mlp, config.num_experts_per_tok * (3 * config.moe_intermediate_size + h) + config.num_experts + 2 * h)
    per_token = 4 * h + 2 * qkv + config.num_attention_heads * config.head_dim + mlp
    logits = num_logit_rows * config.vocab_size * (dtype_bytes + 4)
    return ACTIVATION_SAFETY_FACTOR * (num_tokens * per_token * dtype_bytes + logits)


def estimate_graph_pool_bytes(config: ModelConfig, largest_bucket: int, dtype_bytes: int) -> int:
    """The largest bucket's forward pass without logits (buckets share the pool, captured largest first) plus
    the capture stream's cuBLAS workspace; 0 without graphs."""
    if largest_bucket <= 0:
        return 0
    return estimate_activation_bytes(config, largest_bucket, 0, dtype_bytes) + CAPTURE_STREAM_WORKSPACE_BYTES


def estimate_sampler_bytes(num_rows: int, vocab_size: int) -> int:
    """A step's temporaries for `num_rows` rows, and penalty rows for as many requests (and the empty row)."""
    return num_rows * vocab_size * SAMPLER_BYTES_PER_LOGIT + (num_rows + 1) * (vocab_size + 1) * PENALTY_BYTES_PER_TOKEN


@dataclass(frozen=True)
class MemoryPlan:
    """An engine's memory on CUDA, in bytes."""

    total: int
    share: int  # gpu_memory_utilization x total
    weights: int
    activations: int  # one eager forward pass of max_num_batched_tokens tokens
    graph_pool: int  # the decode graphs' pool (0 without graphs)
    sampler: int  # the rows a step samples (max_num_seqs, x (1 + k) speculating): top-k/top-p temporaries, penalties
    overhead: int  # what torch does not count: CUDA context, kernels, the default stream's cuBLAS workspace
    kv_cache: int  # the budget left for the KV cache

    @property
    def step_bytes(self) -> int:
        return self.activations + self.graph_pool + self.sampler

    @property
    def torch_bytes(self) -> int:
        """What torch's caching allocator should reserve at most: all but the overhead."""
        return self.weights + self.kv_cache + self.step_bytes


def plan_memory(
    config: ModelConfig, total_bytes: int, gpu_memory_utilization: float, weight_bytes: int,
    max_num_batched_tokens: int, num_logit_rows: int, largest_graph_bucket: int, dtype_bytes: int,
    overhead_bytes: int = CUDA_OVERHEAD_BYTES,
) -> MemoryPlan:
    """Every term estimated (`largest_graph_bucket` 0: no graphs). Raises ValueError as kv_cache_budget does."""
    activations = estimate_activation_bytes(config, max_num_batched_tokens, num_logit_rows, dtype_bytes)
    graph_pool = estimate_graph_pool_bytes(config, largest_graph_bucket, dtype_bytes)
    sampler = estimate_sampler_bytes(num_logit_rows, config.vocab_size)
    kv = kv_cache_budget(total_bytes, gpu_memory_utilization, weight_bytes, activations + graph_pool + sampler,
                         overhead_bytes)
    return MemoryPlan(total_bytes, int(gpu_memory_utilization * total_bytes), weight_bytes, activations,
                      graph_pool, sampler, overhead_bytes, kv)


def module_bytes(module: torch.nn.Module) -> int:
    """Parameters, buffers and plain tensor attributes (CpuPackedLinear's packed weights), in bytes."""
    tensors = {id(t): t for t in [*module.parameters(), *module.buffers()]}
    for sub in module.modules():
        tensors.update({id(v): v for v in vars(sub).values() if isinstance(v, torch.Tensor)})
    return sum(t.numel() * t.element_size() for t in tensors.values())
