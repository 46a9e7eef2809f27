"""OpenAI API request bodies (the fields tritium honours) and OpenAI-shaped errors."""

from __future__ import annotations

import json
from typing import Any, Literal

from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict, Field, field_validator

MAX_N = 16
MAX_SEED = 2**63 - 1
MAX_CHOICES = 32  # prompts x n in one request: at most half the seats (max_num_seqs 64) of a replica
MAX_PROMPTS = MAX_CHOICES
MAX_REQUEST_TOKENS = 65536  # choices x max_tokens in one request
DEFAULT_MAX_CONCURRENCY = 256  # upstream requests in flight per endpoint (`tritium openai --max-concurrency`)
RETRY_AFTER_S = 1  # the Retry-After of a 503


def _utf8(value: str | list[str] | None) -> str | list[str] | None:
    """Reject strings that cannot be sent on as UTF-8 (lone surrogates such as JSON "\\ud800")."""
    for text in [value] if isinstance(value, str) else value or []:
        try:
            text.encode("utf-8")
        except UnicodeEncodeError:
            raise ValueError("must be valid Unicode text (it holds a lone surrogate)") from None
    return value


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="forbid")
    include_usage: bool = False


class SamplingFields(BaseModel):
    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)
    model: str
    max_tokens: int | None = Field(default=None, ge=1)
    temperature: float = Field(default=1.0, ge=0.0, le=2.0)
    top_p: float = Field(default=1.0, gt=0.0, le=1.0)
    n: int = Field(default=1, ge=1, le=MAX_N)
    stream: bool = False
    stream_options: StreamOptions | None = None
    stop: str | list[str] | None = None
    seed: int | None = Field(default=None, ge=0, le=MAX_SEED)
    presence_penalty: float = Field(default=0.0, ge=-2.0, le=2.0)
    frequency_penalty: float = Field(default=0.0, ge=-2.0, le=2.0)
    user: str | None = None
    ignore_eos: bool = False  # extensions vLLM also accepts
    min_tokens: int = Field(default=0, ge=0)

    _check_utf8 = field_validator("model", "stop", "user")(_utf8)

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

    _check_prompt_utf8 = field_validator("prompt")(_utf8)


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow")
    role: Literal["system", "user", "assistant", "tool", "developer"]
    content: str

    _check_utf8 = field_validator("content")(_utf8)


class ChatRequest(SamplingFields):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(default=None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(default=None, ge=0, le=20)


def error_response(status: int, message: str, kind: str = "invalid_request_error", param: str | None = None,
                   code: str | None = None) -> JSONResponse:
    """OpenAI's error body: {"error": {"message", "type", "param", "code"}}."""
    return AsciiJSONResponse(status_code=status,
                             content={"error": {"message": message, "type": kind, "param": param, "code": code}})


def retry_later_response(message: str, code: str | None = "overloaded") -> JSONResponse:
    """503 with Retry-After: the endpoint or every replica is full (code "overloaded"), or none is up."""
    response = error_response(503, message, kind="server_error", code=code)
    response.headers["Retry-After"] = str(RETRY_AFTER_S)
    return response


class AsciiJSONResponse(JSONResponse):
    """JSON with non-ASCII escaped, so that an error quoting bad input (a lone surrogate) still renders."""

    def render(self, content: Any) -> bytes:
        return json.dumps(content, separators=(",", ":")).encode("ascii")
