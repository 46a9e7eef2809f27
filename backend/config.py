"""Engine settings: `EngineConfig` and its defaults."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from tritium.backend.core.waiting_queue import SCHEDULING_POLICIES
from tritium.backend.models.quantization import check_quantization, check_quantization_device
from tritium.backend.spec.config import SpeculativeConfig

DTYPES = {
    "float32": torch.float32, "fp32": torch.float32,
    "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
    "float16": torch.float16, "fp16": torch.float16, "half": torch.float16,
}
DEFAULT_CPU_KV_CACHE_BYTES = 1 << 30
DEFAULT_GPU_MEMORY_UTILIZATION = 0.9
DEFAULT_MAX_STRUCTURED_OUTPUT_BYTES = 128 << 10
DEFAULT_GRAMMAR_CACHE_BYTES = 256 << 20
MAX_LORA_LIMIT = 256  # the bound of max_loras and max_lora_rank
DEFAULT_PRIORITY_AGING_S = 10.0


@dataclass
class EngineConfig:
    """How to build an engine. `model=None` is the embedded default model.

    dtype "auto" is float32 on a CPU and bfloat16 on CUDA. kv_cache_bytes None is 1 GiB on a CPU;
    on CUDA it is what is left of `gpu_memory_utilization` x the device's total memory (the share
    this engine may use, weights and activations included; engines sharing a GPU split it) once the
    weights and the activations of a max_num_batched_tokens forward pass are counted
    (see memory_budget.py). A set kv_cache_bytes wins. max_model_len None is the model's own; the KV
    cache must hold one sequence of max_model_len tokens or the engine refuses to start.
    enforce_eager False runs decode steps through the CUDA-graph path (captured per batch-size bucket on
    CUDA; on a CPU the same padded static buffers run eagerly), True never does, None picks graphs on CUDA.
    Graphs need the triton attention backend: with `attention_backend="torch"` on CUDA decode steps always run
    eagerly (that backend's forward synchronizes with the host and cannot be captured; see decode_graphs.py).
    """

    model: str | None = None
    dtype: str = "auto"
    device: str = "auto"
    block_size: int = 16
    kv_cache_bytes: int | None = None
    gpu_memory_utilization: float = DEFAULT_GPU_MEMORY_UTILIZATION
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 1024
    max_model_len: int | None = None
    enable_prefix_caching: bool = True
    enable_chunked_prefill: bool = True
    attention_backend: str = "auto"
    seed: int = 0
    enforce_eager: bool | None = None  # None: CUDA graphs for decode steps on CUDA, eager elsewhere
    # Structured output: the most bytes a request's schema, regex or grammar may have, and the bound of the
    # compiled-grammar cache (entries charged by their estimated memory; see structured_output/compiler.py).
    max_structured_output_bytes: int = DEFAULT_MAX_STRUCTURED_OUTPUT_BYTES
    grammar_cache_bytes: int = DEFAULT_GRAMMAR_CACHE_BYTES
    # CPU intra-op (torch/OpenMP) threads; None: sized to the usable cores, one or two left free when served
    # (worker/threads.py). Not used on CUDA.
    num_threads: int | None = None
    # Weight-only quantization of every linear layer and the logits head at load: "int8" (per output channel,
    # symmetric; models/quantization.py), "int4" (CPU only: groups of 32, asymmetric; models/int4.py) or None (the
    # weights stay in `dtype`).
    quantization: str | None = None
    # LoRA adapters (backend/lora/): off unless enable_lora. max_loras adapters are resident on the device at
    # once (slots; the others wait in host memory, least recently used evicted first), each of rank at most
    # max_lora_rank; lora_modules {name: folder} are loaded at start.
    enable_lora: bool = False
    max_loras: int = 4
    max_lora_rank: int = 16
    lora_modules: dict[str, str] | None = None
    # Speculative decoding (backend/spec/), vLLM's shape: {"method": "ngram", "num_speculative_tokens": k,
    # "prompt_lookup_min": a, "prompt_lookup_max": b}; None: off.
    speculative_config: dict[str, object] | SpeculativeConfig | None = None
    # Request priority (core/waiting_queue.py): "fcfs" serves in order of arrival (a request's priority must be
    # 0); "priority" admits by priority (lower first, aged: one level better per priority_aging_s seconds waited)
    # then arrival, and preempts running requests of a lower priority to make room for a waiting one.
    scheduling_policy: str = "fcfs"
    priority_aging_s: float = DEFAULT_PRIORITY_AGING_S

    def __post_init__(self) -> None:
        if self.dtype != "auto" and self.dtype not in DTYPES:
            raise ValueError(f"dtype must be 'auto' or one of {sorted(DTYPES)}, got {self.dtype!r}")
        if self.block_size not in (8, 16, 32, 64, 128):
            raise ValueError(f"block_size must be one of 8, 16, 32, 64, 128, got {self.block_size}")
        if self.max_num_seqs < 1:
            raise ValueError(f"max_num_seqs must be >= 1, got {self.max_num_seqs}")
        if self.max_num_batched_tokens < self.max_num_seqs:
            raise ValueError(
                f"max_num_batched_tokens ({self.max_num_batched_tokens}) must be >= max_num_seqs "
                f"({self.max_num_seqs}) so every running sequence can decode each step"
            )
        if self.kv_cache_bytes is not None and self.kv_cache_bytes <= 0:
            raise ValueError(f"kv_cache_bytes must be > 0, got {self.kv_cache_bytes}")
        if not 0 < self.gpu_memory_utilization <= 1:
            raise ValueError(f"gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization}")
        if self.max_model_len is not None and self.max_model_len < 1:
            raise ValueError(f"max_model_len must be >= 1, got {self.max_model_len}")
        if self.max_structured_output_bytes < 1:
            raise ValueError(f"max_structured_output_bytes must be >= 1, got {self.max_structured_output_bytes}")
        if self.grammar_cache_bytes < 0:
            raise ValueError(f"grammar_cache_bytes must be >= 0, got {self.grammar_cache_bytes}")
        if self.num_threads is not None and (not isinstance(self.num_threads, int) or
                                             isinstance(self.num_threads, bool) or self.num_threads < 1):
            raise ValueError(f"num_threads must be an integer >= 1 (or null: sized to the host), "
                             f"got {self.num_threads!r}")
        check_quantization(self.quantization)
        if isinstance(self.device, str) and self.device.startswith("cuda"):  # "auto" is checked once resolved (loader)
            check_quantization_device(self.quantization, torch.device("cuda"))
        SpeculativeConfig.parse(self.speculative_config)
        self._check_lora()
        self._check_scheduling()

    def _check_scheduling(self) -> None:
        if self.scheduling_policy not in SCHEDULING_POLICIES:
            raise ValueError(f"scheduling_policy must be one of {', '.join(map(repr, SCHEDULING_POLICIES))}, "
                             f"got {self.scheduling_policy!r}")
        aging = self.priority_aging_s
        if isinstance(aging, bool) or not isinstance(aging, (int, float)) or not 0 < aging < float("inf"):
            raise ValueError(f"priority_aging_s must be a number of seconds > 0, got {aging!r}")

    def _check_lora(self) -> None:
        if not isinstance(self.enable_lora, bool):
            raise ValueError(f"enable_lora must be true or false, got {self.enable_lora!r}")
        for name in ("max_loras", "max_lora_rank"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or not 1 <= value <= MAX_LORA_LIMIT:
                raise ValueError(f"{name} must be an integer in [1, {MAX_LORA_LIMIT}], got {value!r}")
        modules = self.lora_modules
        if modules is None:
            return
        if not isinstance(modules, dict) or not all(isinstance(k, str) and k and isinstance(v, str) and v
                                                    for k, v in modules.items()):
            raise ValueError(f"lora_modules must map adapter names to folders ({{name: folder}}), got {modules!r}")
        if modules and not self.enable_lora:
            raise ValueError("lora_modules needs enable_lora: true")

    def torch_device(self) -> torch.device:
        """The device `device` names; "auto" is CUDA when there is one, else the CPU."""
        if self.device == "auto":
            return torch.device("cuda" if torch.cuda.is_available() else "cpu")
        return torch.device(self.device)

    def torch_dtype(self, device: torch.device) -> torch.dtype:
        """The weights' and KV cache's dtype on `device`; "auto" is bfloat16 on CUDA, float32 elsewhere."""
        if self.dtype == "auto":
            return torch.bfloat16 if device.type == "cuda" else torch.float32
        return DTYPES[self.dtype]

