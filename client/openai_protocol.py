"""OpenAI API request bodies (the fields tritium honours) and OpenAI-shaped errors."""

from __future__ import annotations

from typing import Any, Literal

from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict, Field

MAX_N = 16


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="forbid")
    include_usage: bool = False


class SamplingFields(BaseModel):
    model_config = ConfigDict(extra="forbid")
    model: str
    max_tokens: int | None = Field(default=None, ge=1)
    temperature: float = Field(default=1.0, ge=0.0, le=2.0)
    top_p: float = Field(default=1.0, gt=0.0, le=1.0)
    n: int = Field(default=1, ge=1, le=MAX_N)
    stream: bool = False
    stream_options: StreamOptions | None = None
    stop: str | list[str] | None = None
    seed: int | None = Field(default=None, ge=0, le=2**63 - 1)
    presence_penalty: float = Field(default=0.0, ge=-2.0, le=2.0)
    frequency_penalty: float = Field(default=0.0, ge=-2.0, le=2.0)
    user: str | None = None
    ignore_eos: bool = False  # extensions vLLM also accepts
    min_tokens: int = Field(default=0, ge=0)

    def sampling(self, max_tokens_default: int) -> dict[str, Any]:
        """The engine's sampling fields for this request."""
        out: dict[str, Any] = {
            "max_tokens": self.max_tokens or max_tokens_default, "temperature": self.temperature,
            "top_p": self.top_p, "presence_penalty": self.presence_penalty,
            "frequency_penalty": self.frequency_penalty,
        }
        if self.stop:
            out["stop"] = [self.stop] if isinstance(self.stop, str) else list(self.stop)
        if self.seed is not None:
            out["seed"] = self.seed
        if self.ignore_eos:
            out["ignore_eos"] = True
        if self.min_tokens:
            out["min_tokens"] = self.min_tokens
        return out


class CompletionRequest(SamplingFields):
    prompt: str | list[str]
    logprobs: int | None = Field(default=None, ge=0, le=20)
    echo: bool = False


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow")
    role: Literal["system", "user", "assistant", "tool", "developer"]
    content: str


class ChatRequest(SamplingFields):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(default=None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(default=None, ge=0, le=20)


def error_response(status: int, message: str, kind: str = "invalid_request_error", param: str | None = None,
                   code: str | None = None) -> JSONResponse:
    """OpenAI's error body: {"error": {"message", "type", "param", "code"}}."""
    return JSONResponse(status_code=status,
                        content={"error": {"message": message, "type": kind, "param": param, "code": code}})
