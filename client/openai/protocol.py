"""OpenAI API request bodies (the fields tritium honours) and OpenAI-shaped errors.

The sampling fields follow SamplingParams: the vLLM-style extensions (`VLLM_EXTRA_FIELDS`) are generated
from its declared fields (type, default, bounds); OpenAI's own fields take their bounds from it too, except
where OpenAI's rule is stricter (temperature at most 2). tests/unit/test_serving_units.py checks that whatever
these models accept, SamplingParams accepts.

Structured output: OpenAI's `response_format`, vLLM's `guided_*` extras and its newer `structured_outputs`
object all become the engine's `structured_output` (`SamplingFields.structured_output`); one constraint per
request. `json_schema.strict` and `guided_decoding_backend` are accepted and ignored: the engine always
enforces the schema, with llguidance.

Responses: `speculative_usage` is the `usage.speculative_decoding` extension object.
"""

from __future__ import annotations

import json
from types import MappingProxyType
from typing import Any, Literal

from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict, Field, create_model, field_validator, model_validator

from tritium.backend.sampling_params import MAX_SEED as MAX_SEED  # re-exported: the bound of a request's seed
from tritium.backend.sampling_params import SAMPLING_FIELDS, SamplingField

MAX_N = 16
MAX_CHOICES = 32  # prompts x n in one request: at most half the seats (max_num_seqs 64) of a replica
MAX_PROMPTS = MAX_CHOICES
MAX_REQUEST_TOKENS = 65536  # choices x max_tokens in one request
DEFAULT_MAX_CONCURRENCY = 256  # upstream requests in flight per endpoint (`tritium openai --max-concurrency`)
RETRY_AFTER_S = 1  # the Retry-After of a 503


def utf8_text(value: Any) -> Any:
    """Reject strings that cannot be sent on as UTF-8 (lone surrogates such as JSON "\\ud800"); other
    values (text parts, checked on their own) pass."""
    for text in [value] if isinstance(value, str) else value if isinstance(value, list) else []:
        if not isinstance(text, str):
            continue
        try:
            text.encode("utf-8")
        except UnicodeEncodeError:
            raise ValueError("must be valid Unicode text (it holds a lone surrogate)") from None
    return value


class RequestError(ValueError):
    """A request the endpoint refuses with a 400: `message` names the field(s) and the rule."""

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.param = param


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class StreamOptions(_Strict):
    include_usage: bool = False


class JsonSchemaFormat(_Strict):
    name: str
    description: str | None = None
    schema_: dict[str, Any] | None = Field(default=None, alias="schema")  # None: any JSON object
    strict: bool | None = None  # accepted, ignored: the schema is always enforced


class ResponseFormat(_Strict):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None


class StructuredOutputs(_Strict):
    """vLLM's `structured_outputs`: the engine's `structured_output`, key for key."""

    json_: dict[str, Any] | str | None = Field(default=None, alias="json")
    json_object: bool | None = None
    regex: str | None = None
    choice: list[str] | None = Field(default=None, min_length=1)
    grammar: str | None = None
    whitespace_pattern: str | None = None
    disable_any_whitespace: bool | None = None
    backend: str | None = None  # accepted, ignored: the engine always uses llguidance

    _check_utf8 = field_validator("regex", "choice", "grammar", "whitespace_pattern")(utf8_text)


CONSTRAINT_KEYS = ("json", "json_object", "regex", "choice", "grammar")
GUIDED_FIELDS = MappingProxyType({"guided_json": "json", "guided_regex": "regex", "guided_choice": "choice",
                                  "guided_grammar": "grammar"})


def _json_schema(value: dict[str, Any] | str, param: str) -> dict[str, Any]:
    """A schema given as an object or as a string holding one."""
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except (ValueError, RecursionError):
            value = None
    if not isinstance(value, dict):
        raise RequestError(f"{param}: must be a JSON schema (an object, or a string holding one)", param)
    return value


# SamplingParams fields beyond OpenAI's that the endpoint accepts under their own names, as vLLM does.
# Adding a name here is all it takes: the field, its type and its bounds come from SamplingParams.
VLLM_EXTRA_FIELDS = ("ignore_eos", "min_tokens", "top_k", "min_p", "repetition_penalty", "stop_token_ids",
                     "include_stop_str_in_output", "skip_special_tokens", "priority")
# Fields that SGLang/vLLM routers (sglang-router, vllm-router) add to the requests they forward, accepted with
# any value and ignored: no_stop_trim (a stop string is always trimmed unless include_stop_str_in_output),
# return_hidden_states and return_text_in_logprobs (not returned), separate_reasoning and stream_reasoning
# (with --reasoning-parser the reasoning is always separated and streamed), rid and request_id (the endpoint
# names its own requests), lora_path (an adapter is chosen by `model`), session_params, the disaggregation
# bootstrap_* fields, spaces_between_special_tokens, cache_salt, data_parallel_rank, include_reasoning.
ROUTER_IGNORED_FIELDS = (
    "no_stop_trim", "return_hidden_states", "return_text_in_logprobs", "separate_reasoning", "stream_reasoning",
    "include_reasoning", "rid", "request_id", "lora_path", "session_params", "bootstrap_host", "bootstrap_port",
    "bootstrap_room", "spaces_between_special_tokens", "cache_salt", "data_parallel_rank",
)


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
    **{name: (Any, None) for name in ROUTER_IGNORED_FIELDS},
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
    response_format: ResponseFormat | None = None
    guided_json: dict[str, Any] | str | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = Field(default=None, min_length=1)
    guided_grammar: str | None = None
    guided_whitespace_pattern: str | None = None
    guided_decoding_backend: str | None = None  # accepted, ignored: the engine always uses llguidance
    structured_outputs: StructuredOutputs | None = None

    _check_utf8 = field_validator("model", "stop", "user", "guided_regex", "guided_choice", "guided_grammar",
                                  "guided_whitespace_pattern")(utf8_text)

    def output_constraints(self) -> list[tuple[str, dict[str, Any]]]:
        """(the field that asked, the engine's constraint) for each output constraint in the request."""
        found: list[tuple[str, dict[str, Any]]] = []
        fmt = self.response_format
        if fmt is not None and fmt.type == "json_object":
            found.append(("response_format", {"json_object": True}))
        elif fmt is not None and fmt.type == "json_schema":
            if fmt.json_schema is None:
                raise RequestError("response_format.json_schema: required when type is json_schema",
                                   "response_format.json_schema")
            schema = fmt.json_schema.schema_
            found.append(("response_format", {"json": schema} if schema is not None else {"json_object": True}))
        for name, key in GUIDED_FIELDS.items():
            if (value := getattr(self, name)) is not None:
                found.append((name, {key: _json_schema(value, name) if key == "json" else value}))
        if (so := self.structured_outputs) is not None:
            given = [(key, value) for key in CONSTRAINT_KEYS
                     if (value := getattr(so, "json_" if key == "json" else key)) not in (None, False)]
            if not given:
                raise RequestError(f"structured_outputs: needs one of {', '.join(CONSTRAINT_KEYS)}",
                                   "structured_outputs")
            for key, value in given:
                param = f"structured_outputs.{key}"
                found.append((param, {key: _json_schema(value, param) if key == "json" else value}))
        return found

    def structured_output(self) -> dict[str, Any] | None:
        """The engine's `structured_output` for this request (None: unconstrained). Raises RequestError
        when the request holds more than one output constraint."""
        found = self.output_constraints()
        if len(found) > 1:
            (first, _), (second, _) = found[:2]
            raise RequestError(f"{first} and {second}: a request may hold only one output constraint "
                               "(response_format, guided_json, guided_regex, guided_choice, guided_grammar or "
                               "structured_outputs)", first)
        if not found:
            return None
        out = found[0][1]
        so = self.structured_outputs
        whitespace = so.whitespace_pattern if so and so.whitespace_pattern is not None else \
            self.guided_whitespace_pattern
        if whitespace is not None:
            out["whitespace_pattern"] = whitespace
        if so is not None and so.disable_any_whitespace is not None:
            out["disable_any_whitespace"] = so.disable_any_whitespace
        return out

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

    _check_prompt_utf8 = field_validator("prompt")(utf8_text)


class TextPart(_Strict):
    type: Literal["text"]
    text: str

    _check_utf8 = field_validator("text")(utf8_text)


class _Echoed(BaseModel):
    """Parts of an earlier response that clients send back as they got them (extra keys such as a stream's
    `index` are ignored)."""

    model_config = ConfigDict(extra="ignore")


class CalledFunction(_Echoed):
    name: str
    arguments: str | dict[str, Any]  # JSON text (OpenAI) or an object


class MessageToolCall(_Echoed):
    id: str
    type: Literal["function"] = "function"
    function: CalledFunction


class ChatMessage(BaseModel):
    """A message; content is text, a list of text parts, or null (an assistant message holding tool calls).
    Fields beyond these are passed on to the chat template."""

    model_config = ConfigDict(extra="allow")
    role: Literal["system", "user", "assistant", "tool", "developer"]
    content: str | list[TextPart] | None = None
    tool_calls: list[MessageToolCall] | None = None
    tool_call_id: str | None = None

    _check_utf8 = field_validator("content")(utf8_text)

    @model_validator(mode="after")
    def _content_given(self) -> ChatMessage:
        if self.content is None and self.role != "assistant":
            raise ValueError(f"content is required in a {self.role} message (only an assistant message may "
                             "leave it null)")
        return self

    @property
    def text(self) -> str | None:
        """The content as one string (text parts joined by newlines)."""
        if isinstance(self.content, list):
            return "\n".join(part.text for part in self.content)
        return self.content


TOOL_NAME_PATTERN = r"^[a-zA-Z0-9_-]{1,64}$"  # OpenAI's rule for function names


class FunctionDefinition(_Strict):
    name: str = Field(pattern=TOOL_NAME_PATTERN)
    description: str | None = None
    parameters: dict[str, Any] | None = None  # a JSON schema; None: no arguments
    strict: bool | None = None  # accepted, ignored: forced calls are always enforced


class Tool(_Strict):
    type: Literal["function"]
    function: FunctionDefinition


class FunctionName(_Strict):
    name: str


class NamedToolChoice(_Strict):
    type: Literal["function"]
    function: FunctionName


def distinct_tool_names(tools: list[Tool] | None) -> list[Tool] | None:
    """A field validator: tools' function names must be distinct."""
    names = [t.function.name for t in tools or []]
    if dupes := sorted({n for n in names if names.count(n) > 1}):
        raise ValueError(f"function names must be distinct, {dupes[0]!r} is given twice")
    return tools


class ChatRequest(SamplingFields):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(default=None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = engine_field("logprobs")  # sent as the engine's logprobs
    tools: list[Tool] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool = True
    continue_final_message: Literal[False] = False  # vllm-router sends false; true is not supported
    # Extra variables of the chat template (vLLM's field), e.g. {"enable_thinking": false}; checked when rendered
    chat_template_kwargs: dict[str, Any] | None = None

    _distinct_names = field_validator("tools")(distinct_tool_names)

    def tool_mode(self) -> str:
        """"none", "auto", "required" or "named": what tool_choice asks, its default ("auto" with tools,
        "none" without) filled in. Raises RequestError when it cannot be honoured."""
        choice = self.tool_choice
        if choice is None:
            return "auto" if self.tools else "none"
        if choice in ("none", "auto"):
            return choice if self.tools else "none"
        if not self.tools:
            raise RequestError("tool_choice: needs tools (a required or named function with no tools given)",
                               "tool_choice")
        if isinstance(choice, NamedToolChoice) and choice.function.name not in {t.function.name for t in self.tools}:
            raise RequestError(f"tool_choice.function.name: {choice.function.name!r} is not one of the tools",
                               "tool_choice.function.name")
        if constraints := self.output_constraints():
            raise RequestError(f"tool_choice and {constraints[0][0]}: a required or named tool choice constrains "
                               "the output itself, leave out the other constraint", "tool_choice")
        return "required" if choice == "required" else "named"


def speculative_usage(figures: list[dict[str, int]]) -> dict[str, int | float] | None:
    """`usage.speculative_decoding`, tritium's extension: the request's choices' speculative figures summed
    (vLLM's names: `num_drafts` verification steps, `num_draft_tokens`, `num_accepted_tokens`) and
    `mean_acceptance_length` = 1 + accepted / drafts (tokens per verification step); None when no choice
    verified a draft."""
    drafts = sum(f["num_drafts"] for f in figures)
    if not drafts:
        return None
    accepted = sum(f["num_accepted_tokens"] for f in figures)
    return {"num_drafts": drafts, "num_draft_tokens": sum(f["num_draft_tokens"] for f in figures),
            "num_accepted_tokens": accepted, "mean_acceptance_length": 1.0 + accepted / drafts}


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
        """The body: compact JSON, ASCII only."""
        return json.dumps(content, separators=(",", ":")).encode("ascii")
