"""Which model class runs each `architectures` name of a checkpoint's config.json."""

from __future__ import annotations

from tritium.backend.model_config import ModelFolderError
from tritium.backend.models.base import CausalLM
from tritium.backend.models.gemma import GemmaForCausalLM
from tritium.backend.models.gpt_oss import GptOssForCausalLM
from tritium.backend.models.llama import LlamaForCausalLM, Phi3ForCausalLM, Qwen3ForCausalLM
from tritium.backend.models.mixtral import MixtralForCausalLM
from tritium.backend.models.qwen3_moe import Qwen3MoeForCausalLM

MODEL_CLASSES: dict[str, type[CausalLM]] = {
    "LlamaForCausalLM": LlamaForCausalLM,
    "MistralForCausalLM": LlamaForCausalLM,
    "Qwen2ForCausalLM": LlamaForCausalLM,
    "Qwen3ForCausalLM": Qwen3ForCausalLM,
    "Phi3ForCausalLM": Phi3ForCausalLM,
    "Gemma2ForCausalLM": GemmaForCausalLM,
    "Gemma3ForCausalLM": GemmaForCausalLM,
    "Qwen3MoeForCausalLM": Qwen3MoeForCausalLM,
    "MixtralForCausalLM": MixtralForCausalLM,
    "GptOssForCausalLM": GptOssForCausalLM,
}


def model_class(architecture: str) -> type[CausalLM]:
    """Raises ModelFolderError naming an architecture no class runs."""
    cls = MODEL_CLASSES.get(architecture)
    if cls is None:
        raise ModelFolderError(f"unsupported architecture {architecture!r}; supported: {', '.join(MODEL_CLASSES)}")
    return cls
