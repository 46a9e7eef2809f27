"""What the model code needs of a Hugging Face `config.json`, read as transformers reads it (the generic readers in
config_readers.py, the families' own in family_configs.py)."""

from __future__ import annotations

import json
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

from tritium.backend.config_readers import (
    GEMMA_ARCHITECTURES,
    MOE_ARCHITECTURES,
    ModelFolderError,
    resolved_rope_scaling,
    rotary_fraction,
    served_context,
    sliding_layers,
    unsupported_features,
)
from tritium.backend.family_configs import (
    GEMMA_DEFAULTS,
    gemma_fields,
    gemma_unsupported_features,
    gpt_oss_config,
    gpt_oss_fields,
    gpt_oss_unsupported_features,
    moe_fields,
)

if TYPE_CHECKING:
    import torch

__all__ = ["SUPPORTED_ARCHITECTURES", "ModelConfig", "ModelFolderError"]

SUPPORTED_ARCHITECTURES = ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM",
                           "Phi3ForCausalLM", *GEMMA_ARCHITECTURES, *MOE_ARCHITECTURES, "GptOssForCausalLM")


@dataclass
class ModelConfig:
    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    max_position_embeddings: int
    tie_word_embeddings: bool
    attention_bias: bool  # bias on the q/k/v projections
    rope_scaling: dict[str, Any] | None = None
    eos_token_ids: list[int] = field(default_factory=list)
    bos_token_id: int | None = None
    o_proj_bias: bool = False
    mlp_bias: bool = False
    sliding_window: int | None = None  # the window of the layers `layer_types` marks "sliding_attention"
    layer_types: tuple[str, ...] = ()  # per layer "full_attention" or "sliding_attention" (empty: all full)
    hidden_act: str = "silu"  # the gated MLP's activation: "silu" or "gelu_pytorch_tanh"
    qk_norm: bool = False  # a per-head RMSNorm on q and k before rotary
    query_pre_attn_scalar: float | None = None  # attention scale = this ** -0.5 (None: head_dim ** -0.5)
    attn_logit_softcapping: float | None = None
    final_logit_softcapping: float | None = None
    partial_rotary_factor: float = 1.0  # rotary over the first head_dim * this features
    local_rope_theta: float | None = None  # the sliding layers' rotary base, when it differs
    local_rope_scaling: dict[str, Any] | None = None
    num_experts: int = 0  # mixture of experts (0: a dense MLP in every layer)
    num_experts_per_tok: int = 0  # the experts each token runs (top k)
    moe_intermediate_size: int = 0  # one expert's intermediate size
    norm_topk_prob: bool = False  # the top k routing weights renormalized to sum to 1
    decoder_sparse_step: int = 1  # every this-th layer is MoE (Qwen3-MoE)
    mlp_only_layers: tuple[int, ...] = ()  # layers that keep the dense MLP (Qwen3-MoE)
    attention_sinks: bool = False  # a learned sink logit per head in every layer's softmax (gpt-oss)

    def is_moe_layer(self, layer: int) -> bool:
        """Whether layer `layer` runs experts, as transformers' Qwen3MoeDecoderLayer decides (Mixtral: every layer)."""
        return (self.num_experts > 0 and (layer + 1) % self.decoder_sparse_step == 0
                and layer not in self.mlp_only_layers)

    @property
    def is_moe(self) -> bool:
        """Whether any layer runs experts."""
        return any(self.is_moe_layer(i) for i in range(self.num_hidden_layers))

    def window_of(self, layer: int) -> int | None:
        """Layer `layer`'s sliding window (None: full attention)."""
        sliding = self.layer_types and self.layer_types[layer] == "sliding_attention"
        return self.sliding_window if sliding else None

    def kv_bytes_per_block(self, block_size: int, dtype: torch.dtype) -> int:
        """Bytes of one KV block (keys and values of `block_size` tokens, every layer) in `dtype`."""
        return 2 * self.num_hidden_layers * self.num_key_value_heads * self.head_dim * block_size * dtype.itemsize

    @classmethod
    def from_folder(cls, folder: str | Path) -> ModelConfig:
        """Read `config.json` (eos ids from `generation_config.json` when present). Raises ModelFolderError
        when it is missing or names an unsupported architecture or feature (`unsupported_features`)."""
        folder = Path(folder)
        path = folder / "config.json"
        if not path.is_file():
            raise ModelFolderError(f"model folder {folder} has no config.json")
        raw = json.loads(path.read_text(encoding="utf-8"))
        archs = raw.get("architectures") or []
        arch = archs[0] if archs else ""
        if arch not in SUPPORTED_ARCHITECTURES:
            raise ModelFolderError(
                f"{path}: unsupported architecture {arch or '(none)'!r}; "
                f"supported: {', '.join(SUPPORTED_ARCHITECTURES)}"
            )
        if arch in GEMMA_ARCHITECTURES:
            raw = GEMMA_DEFAULTS[arch] | raw
            unsupported = gemma_unsupported_features(arch, raw)
        elif arch == "GptOssForCausalLM":
            raw = gpt_oss_config(raw)
            unsupported = gpt_oss_unsupported_features(raw)
        else:
            unsupported = unsupported_features(raw)
        if unsupported:
            raise ModelFolderError(f"{path}: unsupported checkpoint feature(s): {'; '.join(unsupported)}")
        heads = raw["num_attention_heads"]
        eos = raw.get("eos_token_id")
        gen_path = folder / "generation_config.json"
        if gen_path.is_file():
            gen = json.loads(gen_path.read_text(encoding="utf-8"))
            eos = gen.get("eos_token_id", eos)
        if eos is None:
            eos_ids: list[int] = []
        else:
            eos_ids = [int(e) for e in eos] if isinstance(eos, list) else [int(eos)]
        rope_params = raw.get("rope_parameters") or {}
        rope_theta = raw.get("rope_theta", rope_params.get("rope_theta", 10000.0))
        rope_scaling = resolved_rope_scaling(raw)
        max_positions = served_context(raw, rope_scaling)
        window, layer_types = sliding_layers(arch, raw)
        # Llama and Qwen3 put attention_bias on q/k/v and o; Qwen2 has q/k/v bias only; Mistral and Phi3 have none.
        biased = ("LlamaForCausalLM", "Qwen3ForCausalLM", "Qwen3MoeForCausalLM")
        attention_bias = arch == "Qwen2ForCausalLM" or (arch in biased and bool(raw.get("attention_bias")))
        qwen3 = arch == "Qwen3ForCausalLM"
        qwen3_moe = arch == "Qwen3MoeForCausalLM"
        config = cls(
            architecture=arch,
            vocab_size=raw["vocab_size"],
            hidden_size=raw["hidden_size"],
            intermediate_size=raw["intermediate_size"],
            num_hidden_layers=raw["num_hidden_layers"],
            num_attention_heads=heads,
            num_key_value_heads=raw.get("num_key_value_heads") or heads,
            head_dim=raw.get("head_dim", 128) if qwen3 else raw.get("head_dim") or raw["hidden_size"] // heads,
            rms_norm_eps=float(raw.get("rms_norm_eps", 1e-6)),
            rope_theta=float(rope_theta),
            max_position_embeddings=max_positions,
            tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
            attention_bias=attention_bias,
            rope_scaling=rope_scaling,
            eos_token_ids=eos_ids,
            bos_token_id=raw.get("bos_token_id"),
            o_proj_bias=attention_bias and arch in biased,
            mlp_bias=arch == "LlamaForCausalLM" and bool(raw.get("mlp_bias")),
            sliding_window=window,
            layer_types=layer_types,
            qk_norm=qwen3 or qwen3_moe,
            partial_rotary_factor=rotary_fraction(raw),
        )
        if arch == "GptOssForCausalLM":
            return replace(config, **gpt_oss_fields(raw))
        if arch in MOE_ARCHITECTURES:
            try:
                return replace(config, **moe_fields(arch, raw))
            except ModelFolderError as exc:
                raise ModelFolderError(f"{path}: {exc}") from None
        return replace(config, **gemma_fields(arch, raw)) if arch in GEMMA_ARCHITECTURES else config
