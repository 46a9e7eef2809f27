"""OpenAI API request bodies (the fields tritium honours) and OpenAI-shaped errors.

The sampling fields follow SamplingParams: the vLLM-style extensions (`VLLM_EXTRA_FIELDS`) are generated
from its declared fields (type, default, bounds); OpenAI's own fields take their bounds from it too, except
where OpenAI's rule is stricter (temperature at most 2). tests/test_serving_units.py checks that whatever
these models accept, SamplingParams accepts.
"""

from __future__ import annotations

import json
from typing import Any, Literal

from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict, Field, create_model, field_validator

from tritium.backend.sampling_params import MAX_SEED as MAX_SEED  # re-exported for openai_server
from tritium.backend.sampling_params import SAMPLING_FIELDS, SamplingField

MAX_N = 16
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


# SamplingParams fields beyond OpenAI's that the endpoint accepts under their own names, as vLLM does.
# Adding a name here is all it takes: the field, its type and its bounds come from SamplingParams.
VLLM_EXTRA_FIELDS = ("ignore_eos", "min_tokens")


def engine_field(name: str, **overrides: Any) -> Any:
    """A pydantic Field with the SamplingParams field's default and bounds, `overrides` where OpenAI's
    own rule differs."""
    spec = SAMPLING_FIELDS[name]
    return Field(**({"default": spec.default} | spec.bounds | overrides))


def _annotation(spec: SamplingField) -> Any:
    kind: Any = list[spec.item] if spec.type is list and spec.item is not None else spec.type
    return kind | None if spec.optional else kind


class _RequestBody(BaseModel):
    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)


VllmExtraFields: type[BaseModel] = create_model(
    "VllmExtraFields", __base__=_RequestBody,
    **{name: (_annotation(SAMPLING_FIELDS[name]), engine_field(name)) for name in VLLM_EXTRA_FIELDS},
)


class SamplingFields(VllmExtraFields):
    model: str
    max_tokens: int | None = engine_field("max_tokens", default=None)  # None: the endpoint's default
    temperature: float = engine_field("temperature", le=2.0)  # OpenAI's limit (the engine takes up to 100)
    top_p: float = engine_field("top_p")
    n: int = Field(default=1, ge=1, le=MAX_N)
    stream: bool = False
    stream_options: StreamOptions | None = None
    stop: str | list[str] | None = None
    seed: int | None = engine_field("seed")
    presence_penalty: float = engine_field("presence_penalty")
    frequency_penalty: float = engine_field("frequency_penalty")
    user: str | None = None

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
        for name in VLLM_EXTRA_FIELDS:  # sent only when set, as the engine's defaults are theirs
            if (value := getattr(self, name)) != SAMPLING_FIELDS[name].default:
                out[name] = value
        return out


class CompletionRequest(SamplingFields):
    prompt: str | list[str]
    logprobs: int | None = engine_field("logprobs")
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
    top_logprobs: int | None = engine_field("logprobs")  # sent as the engine's logprobs


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
