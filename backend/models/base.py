"""What every model class shares: the embedding, the decoder layers' container, the final norm and the logits head,
and how a Hugging Face checkpoint's tensor names map onto it (architectures.py picks the class)."""

from __future__ import annotations

import re
from abc import ABCMeta, abstractmethod
from collections.abc import Iterator
from typing import ClassVar

import torch
from torch import nn

from tritium.backend.layers.attention import AttentionBackend, AttentionMetadata, KVCache, get_attention_backend
from tritium.backend.layers.linear import CpuPackedLinear
from tritium.backend.layers.parallel import VocabParallelEmbedding, vocab_range
from tritium.backend.layers.rotary import RotaryEmbedding
from tritium.backend.lora.weights import LoraBatch
from tritium.backend.model_config import ModelConfig

PROJECTIONS = ("qkv_proj", "o_proj", "gate_up_proj", "down_proj")  # every decoder layer's, by these names
_LAYER = re.compile(r"^model\.layers\.(\d+)\.(.+)$")
_EXPERT = re.compile(r"^model\.layers\.(\d+)\.(.+\.experts)\.(\d+)\.(.+)$")  # one expert's tensor


class CausalLM(nn.Module, metaclass=ABCMeta):
    """A decoder over packed tokens: `forward` gives the hidden states, `compute_logits` the fp32 logits."""

    # Checkpoint names (after "model.layers.N.") -> ours, and those fused into one of ours with their part index.
    LAYER_WEIGHTS: ClassVar[dict[str, str]] = {
        "self_attn.o_proj.weight": "o_proj.weight",
        "self_attn.o_proj.bias": "o_proj.bias",
        "mlp.down_proj.weight": "down_proj.weight",
        "mlp.down_proj.bias": "down_proj.bias",
        "input_layernorm.weight": "input_layernorm.weight",
        "post_attention_layernorm.weight": "post_attention_layernorm.weight",
    }
    FUSED_WEIGHTS: ClassVar[dict[str, tuple[str, int]]] = {
        "self_attn.q_proj.weight": ("qkv_proj.weight", 0),
        "self_attn.k_proj.weight": ("qkv_proj.weight", 1),
        "self_attn.v_proj.weight": ("qkv_proj.weight", 2),
        "self_attn.q_proj.bias": ("qkv_proj.bias", 0),
        "self_attn.k_proj.bias": ("qkv_proj.bias", 1),
        "self_attn.v_proj.bias": ("qkv_proj.bias", 2),
        "mlp.gate_proj.weight": ("gate_up_proj.weight", 0),
        "mlp.up_proj.weight": ("gate_up_proj.weight", 1),
        "mlp.gate_proj.bias": ("gate_up_proj.bias", 0),
        "mlp.up_proj.bias": ("gate_up_proj.bias", 1),
    }
    # MoE models: the experts' block ("mlp.experts") and each expert's tensor names -> ours, with the part index of
    # those fused (gate 0, up 1); the loader stacks the experts.
    EXPERT_BLOCK: ClassVar[str] = ""
    EXPERT_WEIGHTS: ClassVar[dict[str, tuple[str, int | None]]] = {}
    quantization: str | None = None  # "int8" or "int4" once quantize_model (quantization.py) has run
    CONVERTS_LAYOUT: ClassVar[bool] = False  # convert_weight reshapes tensors: a rank slices them after (loader.py)

    def __init__(self, config: ModelConfig, backend: AttentionBackend | None = None,
                 max_positions: int | None = None) -> None:
        """`backend`: the kernels every layer calls (None: the torch references) and the ranks the model is sharded
        over (`config` is then one rank's: models/sharding.py); `max_positions`: the rotary tables' size (None: the
        model's context)."""
        super().__init__()
        self.config = config
        self.backend = backend or get_attention_backend("torch", torch.device("cpu"))
        self.max_positions = max_positions or config.max_position_embeddings
        ranks = self.backend.parallel
        self.embed_tokens = VocabParallelEmbedding(config.vocab_size, config.hidden_size, ranks)
        self.layers = nn.ModuleList()
        rows = vocab_range(config.vocab_size, ranks.rank, ranks.size)[1]
        self.lm_head = None if config.tie_word_embeddings else nn.Linear(config.hidden_size, rows, bias=False)
        self.packed_lm_head: nn.Module | None = None  # CpuPackedLinear, or an Int8Linear / Int4Linear (quantization.py)

    @abstractmethod
    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, kv_caches: list[KVCache],
                meta: AttentionMetadata, lora: LoraBatch | None = None) -> torch.Tensor:
        """Hidden states `[num_tokens, hidden]` after the final norm; `lora`: the step's adapter rows, if any."""

    @abstractmethod
    def rotaries(self) -> list[RotaryEmbedding]:
        """The model's rotary tables (sized by `set_max_positions`)."""

    @classmethod
    def checkpoint_key(cls, name: str) -> tuple[str, int | None] | None:
        """Our state-dict key for checkpoint tensor `name`, with its part index when it is fused into one of ours;
        None when the model has no use for it."""
        if name == "model.embed_tokens.weight":
            return "embed_tokens.weight", None
        if name == "model.norm.weight":
            return "norm.weight", None
        if name == "lm_head.weight":
            return "lm_head.weight", None
        if (m := _LAYER.match(name)) is None:
            return None
        layer, rest = m.group(1), m.group(2)
        if rest in cls.LAYER_WEIGHTS:
            return f"layers.{layer}.{cls.LAYER_WEIGHTS[rest]}", None
        if rest in cls.FUSED_WEIGHTS:
            target, part = cls.FUSED_WEIGHTS[rest]
            return f"layers.{layer}.{target}", part
        return None

    @classmethod
    def expert_key(cls, name: str) -> tuple[str, int, int | None] | None:
        """(our stacked key, the expert, its part index when fused) for one expert's checkpoint tensor `name`; None
        when it is not one."""
        if not cls.EXPERT_WEIGHTS or (m := _EXPERT.match(name)) is None or m.group(2) != cls.EXPERT_BLOCK:
            return None
        if (found := cls.EXPERT_WEIGHTS.get(m.group(4))) is None:
            return None
        target, part = found
        return f"layers.{m.group(1)}.{target}", int(m.group(3)), part

    @classmethod
    def checkpoint_tensors(cls, tensors: Iterator[tuple[str, torch.Tensor]]) -> Iterator[tuple[str, torch.Tensor]]:
        """The checkpoint's (name, tensor) pairs as this model reads them (gpt-oss: MXFP4 experts dequantized)."""
        return tensors

    @classmethod
    def convert_weight(cls, key: str, tensor: torch.Tensor) -> torch.Tensor:
        """A checkpoint tensor as this model stores it under `key` (before the cast to the engine's dtype)."""
        return tensor

    def set_max_positions(self, positions: int) -> None:
        """Size the rotary tables for positions below `positions`."""
        self.max_positions = positions
        for rotary in self.rotaries():
            rotary.cos_sin_cache = rotary.table(positions)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """fp32 logits `[rows, vocab]` for the given hidden rows (on a rank other than 0: its vocabulary part)."""
        if self.packed_lm_head is not None:
            logits: torch.Tensor = self.packed_lm_head(hidden).float()
        else:
            logits = torch.nn.functional.linear(hidden, self.head_weight).float()
        return self.backend.parallel.gather_columns(logits, self.config.vocab_size)

    @property
    def head_weight(self) -> torch.Tensor:
        """The logits projection's weight (the embedding's when tied)."""
        return self.embed_tokens.weight if self.lm_head is None else self.lm_head.weight

    def pack_for_cpu(self) -> None:
        """Swap every projection and the logits head for a CpuPackedLinear (CPU only; see cpu_packing_available;
        experts stay stacked: layers/moe.py)."""
        for layer in self.layers:
            for name in PROJECTIONS:
                if (linear := getattr(layer, name, None)) is not None:  # an MoE layer has no dense MLP
                    setattr(layer, name, CpuPackedLinear(linear.weight, linear.bias))
        self.packed_lm_head = CpuPackedLinear(self.head_weight, None)
