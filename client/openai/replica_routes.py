"""The model-server protocol that production routers speak to a replica, on the OpenAI endpoint.

vllm-router, sglang-router and the Gateway API Inference Extension's endpoint picker know a model server by a
few endpoints beside the OpenAI ones; these are tritium's answers (`add_replica_routes`):

- `GET /health`: 200 while a replica's model is ready and its engine serves, else 503 (the router's probe).
- `GET /server_info`, `/get_server_info`, `/model_info`, `/get_model_info`: what sglang-router reads when it
  registers a worker (`model_path` and `tokenizer_path`, the local model folder, so it loads the tokenizer
  from there and never from a hub; `served_model_name`; `is_generation`; `max_model_len`).
- `GET /get_load`: the engine's load (`EngineLoad`: running, waiting, KV cache usage) and the endpoint's own
  requests in flight, as a JSON object; `load` (waiting + running) is what vllm-router's power_of_two
  compares. sglang-router 0.3.2 expects a list of per-rank dicts instead and counts its own requests when it
  gets anything else: one reply cannot satisfy both, and vllm-router's is the one served.
- `POST /tokenize`, `POST /detokenize`: vLLM's shapes (a prompt or chat messages -> `count`, `tokens`,
  `max_model_len`, `token_strs`; token ids -> `prompt`).
- `POST /v1/completions/render` (a list, one per prompt), `POST /v1/chat/completions/render` (one): a
  request as the engine will run it, without generating, in vLLM's GenerateRequest shape (`token_ids`,
  `sampling_params`, `model`, `stream`, `request_id`); vllm-router's cache_aware policy asks every worker.
- `GET /metrics`: the `vllm:*` gauges (client/cluster/replica_load.py says where each value comes from),
  the endpoint's own `tritium_openai_*` gauges and each upstream tritonserver's `tritium_*` metrics.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from typing import Annotated, Any

from fastapi import FastAPI
from fastapi.responses import JSONResponse, PlainTextResponse
from pydantic import BaseModel, ConfigDict, Discriminator, Field, Tag, field_validator

from tritium.client.cluster.replica_load import EngineLoad, engine_load, fetch_metrics_async, vllm_metrics
from tritium.client.cluster.router import Router
from tritium.client.openai.chat_format import chat_constraint, render_prompt
from tritium.client.openai.protocol import (
    ChatMessage,
    ChatRequest,
    CompletionRequest,
    RequestError,
    Tool,
    distinct_tool_names,
    error_response,
    utf8_text,
)
from tritium.client.openai.service import OpenAIService

METRICS_MAX_AGE_S = 0.1  # endpoint pickers scrape every 50 ms; the engine pushes every 500 ms


class _Lenient(BaseModel):
    model_config = ConfigDict(extra="ignore")  # routers add fields of their own


class TokenizeCompletion(_Lenient):
    model: str | None = None
    prompt: str
    add_special_tokens: bool = True
    return_token_strs: bool = False

    _check_utf8 = field_validator("model", "prompt")(utf8_text)


class TokenizeChat(_Lenient):
    model: str | None = None
    messages: list[ChatMessage] = Field(min_length=1)
    tools: list[Tool] | None = None
    add_generation_prompt: bool = True
    add_special_tokens: bool = False
    return_token_strs: bool = False
    chat_template_kwargs: dict[str, Any] | None = None  # extra variables of the chat template

    _check_utf8 = field_validator("model")(utf8_text)
    _distinct_names = field_validator("tools")(distinct_tool_names)


def _tokenize_kind(value: Any) -> str:
    """Which shape a /tokenize body has (so that errors come from that shape alone)."""
    return "Chat" if isinstance(value, dict) and "messages" in value else "Completion"


TokenizeBody = Annotated[Annotated[TokenizeCompletion, Tag("Completion")] | Annotated[TokenizeChat, Tag("Chat")],
                         Discriminator(_tokenize_kind)]


class Detokenize(_Lenient):
    model: str | None = None
    tokens: list[int]


class UpstreamMetrics:
    """The upstream tritonservers' metrics text, fetched at most every METRICS_MAX_AGE_S."""

    def __init__(self, router: Router) -> None:
        self.router = router
        self._texts: list[str | None] = []
        self._fetched_at = 0.0
        self._lock = asyncio.Lock()

    async def texts(self) -> list[str | None]:
        """Each replica's metrics text (None: no metrics URL, or it did not answer)."""
        async with self._lock:
            if time.monotonic() - self._fetched_at > METRICS_MAX_AGE_S:
                self._texts = list(await asyncio.gather(*(fetch_metrics_async(r.metrics_url)
                                                          for r in self.router.replicas)))
                self._fetched_at = time.monotonic()
            return self._texts


def upstream_tritium_metrics(texts: list[str | None]) -> str:
    """The `tritium_*` families of each upstream's metrics; with several upstreams each sample gets an
    `upstream` label, the replica's index in `--upstream` order (not its address), so their series stay
    apart."""
    lines: list[str] = []
    seen_meta: set[str] = set()
    for index, text in enumerate(texts):
        if text is None:
            continue
        for line in text.splitlines():
            if line.startswith(("# HELP tritium_", "# TYPE tritium_")):
                if line not in seen_meta:
                    seen_meta.add(line)
                    lines.append(line)
            elif line.startswith("tritium_"):
                if len(texts) > 1:  # Triton's samples always carry labels (model, version)
                    line = line.replace("{", f'{{upstream="{index}",', 1)
                lines.append(line)
    return "\n".join(lines) + ("\n" if lines else "")


def total_load(router: Router, texts: list[str | None]) -> EngineLoad:
    """The replicas' loads as one: what this endpoint, in front of all of them, reports. A replica whose
    metrics text is missing or holds no engine of the model counts by this endpoint's own requests there."""
    total = EngineLoad()
    for replica, text in zip(router.replicas, texts, strict=True):
        try:
            load = engine_load(text, router.model) if text is not None else None
        except ValueError:  # a figure that is no count (NaN, Inf): the engine's load is unknown
            load = None
        if load is None or not load.engines:
            load = EngineLoad.in_flight(replica.streaming, replica.in_flight - replica.streaming)
        total = total.add(load)
    return total


def _constraint(structured_output: dict[str, Any] | None) -> dict[str, Any]:
    return {"structured_output": structured_output} if structured_output is not None else {}


def rendered(prompt_ids: list[int], model: str, sampling: dict[str, Any], stream: bool) -> dict[str, Any]:
    """One prompt as vLLM's render endpoints give it (a GenerateRequest: the token ids and sampling the
    engine would run), with `prompt_token_count` added."""
    return {"request_id": f"render-{uuid.uuid4().hex}", "model": model, "token_ids": prompt_ids,
            "prompt_token_count": len(prompt_ids), "sampling_params": sampling, "stream": stream,
            "cache_salt": None, "priority": 0}


def add_replica_routes(app: FastAPI, service: OpenAIService) -> None:
    """Add the protocol's routes to the OpenAI app (which checks keys and body sizes before them)."""
    router, tokenizer, model = service.router, service.tokenizer, service.model
    upstream = UpstreamMetrics(router)

    def tokenized(ids: list[int], strs: bool) -> dict[str, Any]:
        return {"count": len(ids), "max_model_len": service.max_model_len, "tokens": ids,
                "token_strs": [tokenizer.id_to_token(i) for i in ids] if strs else None}

    @app.get("/health")
    async def health() -> JSONResponse:
        healthy = service.healthy_replicas
        return JSONResponse({"status": "ok" if healthy else "unavailable", "healthy_replicas": healthy,
                             "replicas": len(router.replicas)}, status_code=200 if healthy else 503)

    @app.get("/server_info")
    @app.get("/get_server_info")
    @app.get("/model_info")
    @app.get("/get_model_info")
    async def model_info() -> dict[str, Any]:
        path = service.model_path or model
        return {"model_path": path, "tokenizer_path": path, "is_generation": True,
                "served_model_name": model, "max_model_len": service.max_model_len}

    @app.get("/get_load")
    async def get_load() -> dict[str, Any]:
        load = total_load(router, await upstream.texts())
        reply: dict[str, Any] = {"load": load.requests, "num_requests_running": load.running,
                                 "num_requests_waiting": load.waiting}
        if load.kv_cache_usage is not None:  # unknown without the engines' metrics: left out, not 0
            reply["kv_cache_usage_perc"] = round(load.kv_cache_usage, 6)
        return reply | {"in_flight": service.admission.in_flight, "healthy_replicas": service.healthy_replicas}

    @app.post("/tokenize", response_model=None)
    async def tokenize(body: TokenizeBody) -> dict[str, Any] | JSONResponse:
        if (bad := await service.wrong_model(body.model)) is not None:
            return bad
        if isinstance(body, TokenizeChat):
            chat = ChatRequest.model_construct(model=model, messages=body.messages, tools=body.tools,
                                               chat_template_kwargs=body.chat_template_kwargs)
            try:
                text = await asyncio.to_thread(render_prompt, tokenizer, chat, "auto" if body.tools else "none",
                                               body.add_generation_prompt)
            except RequestError as exc:  # chat_template_kwargs the template cannot take
                return error_response(400, f"invalid request: {exc.message}", param=exc.param)
            except ValueError as exc:
                return error_response(400, f"invalid request: {exc}", param="messages")
            except Exception:
                return error_response(400, "invalid request: messages cannot be rendered with the model's chat "
                                      "template", param="messages")
            ids = await asyncio.to_thread(tokenizer.encode, text, body.add_special_tokens)
        else:
            ids = await asyncio.to_thread(tokenizer.encode, body.prompt, body.add_special_tokens)
        return tokenized(ids, body.return_token_strs)

    @app.post("/detokenize", response_model=None)
    async def detokenize(body: Detokenize) -> dict[str, Any] | JSONResponse:
        if (bad := await service.wrong_model(body.model)) is not None:
            return bad
        if (out := next((t for t in body.tokens if not 0 <= t < tokenizer.vocab_size), None)) is not None:
            return error_response(400, f"tokens: every id must be in [0, {tokenizer.vocab_size}), got {out}",
                                  param="tokens")
        return {"prompt": tokenizer.decode(body.tokens, skip_special_tokens=False)}

    @app.post("/v1/completions/render", response_model=None)
    async def render_completion(body: CompletionRequest) -> list[dict[str, Any]] | JSONResponse:
        if (bad := await service.wrong_model(body.model)) is not None:
            return bad
        prompts = [body.prompt] if isinstance(body.prompt, str) else list(body.prompt)
        if not prompts or any(not p for p in prompts):
            return error_response(400, "prompt must be a non-empty string or list of strings", param="prompt")
        try:
            sampling = body.sampling(service.default_max_tokens) | _constraint(body.structured_output())
        except RequestError as exc:
            return error_response(400, exc.message, param=exc.param)
        ids = await asyncio.to_thread(lambda: [tokenizer.encode(p) for p in prompts])
        return [rendered(i, model, sampling, body.stream) for i in ids]

    @app.post("/v1/chat/completions/render", response_model=None)
    async def render_chat(body: ChatRequest) -> dict[str, Any] | JSONResponse:
        if (bad := await service.wrong_model(body.model)) is not None:
            return bad
        try:
            mode = body.tool_mode()
            sampling = body.sampling(service.default_max_tokens) | _constraint(chat_constraint(body, mode))
            prompt = await asyncio.to_thread(render_prompt, tokenizer, body, mode)
        except RequestError as exc:
            return error_response(400, exc.message, param=exc.param)
        except Exception:
            return error_response(400, "invalid request: messages cannot be rendered with the model's chat "
                                  "template", param="messages")
        if body.max_completion_tokens:
            sampling["max_tokens"] = body.max_completion_tokens
        return rendered(await asyncio.to_thread(tokenizer.encode, prompt), model, sampling, body.stream)

    @app.get("/metrics")
    async def metrics() -> PlainTextResponse:
        texts = await upstream.texts()
        load = total_load(router, texts)
        own = [
            "# HELP tritium_openai_requests_in_flight Upstream requests (choices) this endpoint has in flight.",
            "# TYPE tritium_openai_requests_in_flight gauge",
            f"tritium_openai_requests_in_flight {service.admission.in_flight}",
            "# HELP tritium_openai_healthy_replicas Replicas whose model is ready and engine serving.",
            "# TYPE tritium_openai_healthy_replicas gauge",
            f"tritium_openai_healthy_replicas {service.healthy_replicas}",
        ]
        body = vllm_metrics(load, model) + "\n".join(own) + "\n" + upstream_tritium_metrics(texts)
        return PlainTextResponse(body, media_type="text/plain; version=0.0.4; charset=utf-8")
