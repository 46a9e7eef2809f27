"""The part of a Hugging Face `config.json` the Llama-family model needs."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

SUPPORTED_ARCHITECTURES = ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM")


class ModelFolderError(ValueError):
    """A model folder that cannot be loaded: a missing file or an unsupported architecture."""


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
    attention_bias: bool
    rope_scaling: dict[str, Any] | None = None
    eos_token_ids: list[int] = field(default_factory=list)
    bos_token_id: int | None = None

    @classmethod
    def from_folder(cls, folder: str | Path) -> ModelConfig:
        """Read `config.json` (and `generation_config.json` when present) from `folder`.

        Raises ModelFolderError when config.json is missing or names an unsupported architecture.
        """
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
        if window and (arch != "Qwen2ForCausalLM" or raw.get("use_sliding_window")):
            # Attention here is full; a context within the window is exactly what the model saw.
            max_positions = min(max_positions, int(window))
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
            attention_bias=bool(raw.get("attention_bias", arch == "Qwen2ForCausalLM")),
            rope_scaling=rope_scaling,
            eos_token_ids=eos_ids,
            bos_token_id=raw.get("bos_token_id"),
        )
