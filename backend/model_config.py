"""The part of a Hugging Face `config.json` the Llama-family model needs."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

SUPPORTED_ARCHITECTURES = ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM")
SUPPORTED_ACTIVATIONS = ("silu", "swish")
SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3")


class ModelFolderError(ValueError):
    """A model folder that cannot be loaded; the message names the missing file or unsupported feature."""


def rope_type(rope_scaling: dict[str, Any] | None) -> str:
    scaling = rope_scaling or {}
    return str(scaling.get("rope_type", scaling.get("type", "default")))


def unsupported_features(raw: dict[str, Any]) -> list[str]:
    """The settings of a `config.json` that this model code would get wrong, each named with its value."""
    found = []
    act = raw.get("hidden_act", raw.get("hidden_activation", "silu"))
    if act not in SUPPORTED_ACTIVATIONS:
        found.append(f"hidden_act {act!r} (supported: silu)")
    rope_params = raw.get("rope_scaling") or raw.get("rope_parameters")
    if (kind := rope_type(rope_params)) not in SUPPORTED_ROPE_TYPES:
        found.append(f"rope_scaling type {kind!r} (supported: {', '.join(SUPPORTED_ROPE_TYPES)})")
    partial = raw.get("partial_rotary_factor", (rope_params or {}).get("partial_rotary_factor", 1.0))
    if partial is not None and float(partial) != 1.0:
        found.append(f"partial_rotary_factor {partial} (supported: 1.0)")
    for key in ("attn_logit_softcapping", "final_logit_softcapping"):
        if raw.get(key):
            found.append(f"{key} {raw[key]}")
    if quant := raw.get("quantization_config"):
        method = quant.get("quant_method", "?") if isinstance(quant, dict) else quant
        found.append(f"quantization_config ({method}); load an unquantized checkpoint")
    return found


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
    sliding_window: int | None = None  # an active window caps max_position_embeddings (attention is full)

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
        rope_scaling = raw.get("rope_scaling")
        if rope_scaling is None and rope_params.get("rope_type", "default") != "default":
            rope_scaling = rope_params
        max_positions = int(raw.get("max_position_embeddings", 2048))
        window = raw.get("sliding_window")
        active_window = None
        if window and (arch != "Qwen2ForCausalLM" or raw.get("use_sliding_window")):
            # Attention here is full; a context within the window is exactly what the model saw.
            active_window = int(window)
            max_positions = min(max_positions, active_window)
        # Llama puts attention_bias on q/k/v and o; Qwen2 has q/k/v bias only; Mistral has none.
        attention_bias = arch == "Qwen2ForCausalLM" or (arch == "LlamaForCausalLM" and bool(raw.get("attention_bias")))
        return cls(
            architecture=arch,
            vocab_size=raw["vocab_size"],
            hidden_size=raw["hidden_size"],
            intermediate_size=raw["intermediate_size"],
            num_hidden_layers=raw["num_hidden_layers"],
            num_attention_heads=heads,
            num_key_value_heads=raw.get("num_key_value_heads") or heads,
            head_dim=raw.get("head_dim") or raw["hidden_size"] // heads,
            rms_norm_eps=float(raw.get("rms_norm_eps", 1e-6)),
            rope_theta=float(rope_theta),
            max_position_embeddings=max_positions,
            tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
            attention_bias=attention_bias,
            rope_scaling=rope_scaling,
            eos_token_ids=eos_ids,
            bos_token_id=raw.get("bos_token_id"),
            o_proj_bias=attention_bias and arch == "LlamaForCausalLM",
            mlp_bias=arch == "LlamaForCausalLM" and bool(raw.get("mlp_bias")),
            sliding_window=active_window,
        )
