"""tritium's engine: paged KV cache, continuous batching, Llama-family models, sampling."""

from tritium.backend.config import EngineConfig
from tritium.backend.engine import LLMEngine
from tritium.backend.llm import LLM
from tritium.backend.outputs import RequestOutput
from tritium.backend.sampling_params import SamplingParams

__all__ = ["LLM", "EngineConfig", "LLMEngine", "RequestOutput", "SamplingParams"]
