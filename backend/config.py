"""Engine settings: `EngineConfig` and its defaults."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

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
SCHEDULING_POLICIES = ("fcfs", "priority")  # core/waiting_queue.py
QUANTIZATIONS = ("int8", "int4")  # weight-only schemes (models/quantization.py)
CPU_ONLY_QUANTIZATIONS = ("int4",)
MAX_TENSOR_PARALLEL_SIZE = 64
EMBEDDING_POOLINGS = ("last", "mean", "cls")  # worker/pooling.py


def check_quantization(value: object) -> None:
    """Raise ValueError naming the field and the allowed values unless `value` is None or a known scheme."""
    if value is not None and value not in QUANTIZATIONS:
        raise ValueError(f"quantization must be one of {list(QUANTIZATIONS)} (or null: none), got {value!r}; "
                         "other schemes are not implemented")


def check_quantization_device(value: str | None, device: torch.device) -> None:
    """Raise ValueError naming the scheme and the device when `value` cannot run on `device` (int4 off a CPU)."""
    if value in CPU_ONLY_QUANTIZATIONS and device.type != "cpu":
        raise ValueError(f"quantization {value!r} is implemented for CPUs only (the device is {device.type}); "
                         "'int8' is the weight-only scheme on CUDA")


METHODS = ("ngram", "draft_model")
MAX_SPECULATIVE_TOKENS = 16
DEFAULT_PROMPT_LOOKUP_MIN = 2
DEFAULT_PROMPT_LOOKUP_MAX = 4
KNOWN_KEYS = frozenset({"method", "num_speculative_tokens", "prompt_lookup_min", "prompt_lookup_max", "model"})


@dataclass(frozen=True)
class SpeculativeConfig:
    """Validated `speculative_config` (docs/speculative-decoding.md#settings)."""

    method: str
    num_speculative_tokens: int
    prompt_lookup_min: int = DEFAULT_PROMPT_LOOKUP_MIN
    prompt_lookup_max: int = DEFAULT_PROMPT_LOOKUP_MAX
    model: str | None = None  # the draft model's folder (method "draft_model")

    @classmethod
    def parse(cls, raw: Any) -> SpeculativeConfig | None:
        """`raw` (model.json's dict, or a SpeculativeConfig) validated; None for None. Raises ValueError naming
        the field and the rule."""
        if raw is None or isinstance(raw, SpeculativeConfig):
            return raw
        if not isinstance(raw, dict):
            raise ValueError(f"speculative_config must be an object like {{\"method\": \"ngram\", "
                             f"\"num_speculative_tokens\": 3}}, got {raw!r}")
        unknown = sorted(set(raw) - KNOWN_KEYS)
        if unknown:
            raise ValueError(f"speculative_config: unknown key(s) {', '.join(unknown)}; known: "
                             f"{', '.join(sorted(KNOWN_KEYS))}")
        method = raw.get("method", "ngram")
        if method not in METHODS:
            raise ValueError(f"speculative_config.method must be one of {METHODS}, got {method!r}")
        k = _int(raw, "num_speculative_tokens", None, 1, MAX_SPECULATIVE_TOKENS)
        if method == "draft_model":
            model = raw.get("model")
            if not isinstance(model, str) or not model:
                raise ValueError("speculative_config.model must name the draft model's folder (method "
                                 f"'draft_model'), got {model!r}")
            return cls(method, k, model=model)
        if "model" in raw:
            raise ValueError("speculative_config.model is for method 'draft_model' only")
        low_given, high_given = raw.get("prompt_lookup_min"), raw.get("prompt_lookup_max")
        if low_given is None and high_given is None:
            low_given, high_given = DEFAULT_PROMPT_LOOKUP_MIN, DEFAULT_PROMPT_LOOKUP_MAX
        # One of them alone sets both, as in vLLM.
        low = _int({"prompt_lookup_min": high_given if low_given is None else low_given}, "prompt_lookup_min",
                   None, 1, 64)
        high = _int({"prompt_lookup_max": low_given if high_given is None else high_given}, "prompt_lookup_max",
                    None, 1, 64)
        if low > high:
            raise ValueError(f"speculative_config.prompt_lookup_min ({low}) must be <= prompt_lookup_max ({high})")
        return cls(method, k, low, high)


def _int(raw: dict[str, Any], name: str, default: int | None, low: int, high: int) -> int:
    value = raw.get(name, default)
    if not isinstance(value, int) or isinstance(value, bool) or not low <= value <= high:
        raise ValueError(f"speculative_config.{name} must be an integer in [{low}, {high}], got {value!r}")
    return value


@dataclass
class EngineConfig:
    """How to build an engine: the settings of docs/serving.md#engine-settings. Raises ValueError naming the
    field and the rule."""

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
    enforce_eager: bool | None = None  # None: decode graphs on CUDA with the triton backend (decode_graphs.py)
    max_structured_output_bytes: int = DEFAULT_MAX_STRUCTURED_OUTPUT_BYTES
    grammar_cache_bytes: int = DEFAULT_GRAMMAR_CACHE_BYTES
    num_threads: int | None = None  # CPU intra-op threads; None: sized to the host (worker/threads.py)
    quantization: str | None = None  # weight-only, of every linear layer: "int8", "int4" (CPU only) or None
    enable_lora: bool = False
    max_loras: int = 4  # adapters resident on the device at once
    max_lora_rank: int = 16
    lora_modules: dict[str, str] | None = None  # {name: folder}, loaded at start
    speculative_config: dict[str, object] | SpeculativeConfig | None = None  # vLLM's shape; None: off
    scheduling_policy: str = "fcfs"  # or "priority" (docs/priority.md)
    priority_aging_s: float = DEFAULT_PRIORITY_AGING_S
    tensor_parallel_size: int = 1  # ranks one model is sharded over: one process each (worker/ranks.py)
    # embeddings (LLMEngine.embed): None takes the model folder's sentence-transformers files, else "last" / true
    embedding_pooling: str | None = None  # "last", "mean" or "cls" (worker/pooling.py)
    embedding_normalize: bool | None = None  # L2-normalise each vector

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
        self._check_embedding()
        self._check_scheduling()
        self._check_tensor_parallel()

    def _check_tensor_parallel(self) -> None:
        size = self.tensor_parallel_size
        if not isinstance(size, int) or isinstance(size, bool) or not 1 <= size <= MAX_TENSOR_PARALLEL_SIZE:
            raise ValueError(f"tensor_parallel_size must be an integer in [1, {MAX_TENSOR_PARALLEL_SIZE}], "
                             f"got {size!r}")
        if size > 1 and self.enable_lora:
            raise ValueError("enable_lora: LoRA adapters with tensor_parallel_size > 1 are not implemented; serve "
                             "adapters with tensor_parallel_size 1 (one engine per GPU)")

    def _check_scheduling(self) -> None:
        if self.scheduling_policy not in SCHEDULING_POLICIES:
            raise ValueError(f"scheduling_policy must be one of {', '.join(map(repr, SCHEDULING_POLICIES))}, "
                             f"got {self.scheduling_policy!r}")
        aging = self.priority_aging_s
        if isinstance(aging, bool) or not isinstance(aging, (int, float)) or not 0 < aging < float("inf"):
            raise ValueError(f"priority_aging_s must be a number of seconds > 0, got {aging!r}")

    def _check_embedding(self) -> None:
        if self.embedding_pooling is not None and self.embedding_pooling not in EMBEDDING_POOLINGS:
            raise ValueError(f"embedding_pooling must be one of {', '.join(map(repr, EMBEDDING_POOLINGS))} (or null: "
                             f"the model folder's, else 'last'), got {self.embedding_pooling!r}")
        if self.embedding_normalize is not None and not isinstance(self.embedding_normalize, bool):
            raise ValueError(f"embedding_normalize must be true or false (or null), got {self.embedding_normalize!r}")

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

