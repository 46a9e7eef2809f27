"""OpenAI-compatible HTTP endpoint in front of one or more tritonservers (`tritium openai`).

`/v1/models`, `/v1/completions` (completions.py), `/v1/chat/completions` (chat.py; the chat template comes
from the model's tokenizer, tools and tool calls: chat_format.py, tool_calls.py), streaming as SSE ending in
`data: [DONE]` (streaming.py), and the routes routers ask a replica (replica_routes.py). Structured output
(`response_format`, vLLM's `guided_*` and `structured_outputs`) goes to the engine as its `structured_output`
sampling field. `Authorization: Bearer KEY` is checked (guard.py) and forwarded to Triton as its API key.
Errors use OpenAI's shape (errors.py): 400 bad field, 401 key, 404 model, 413 body over MAX_BODY_BYTES,
500 internal error (with a request id; the details are logged, never sent), 503 with Retry-After: no replica
up, or overloaded (over `max_concurrency` upstream requests in flight, or every replica refused). A client
that disconnects has its upstream requests cancelled.
"""

from __future__ import annotations

import json
import logging
import sys
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, StreamingResponse
from starlette.exceptions import HTTPException

from tritium.backend.tokenizer import Tokenizer
from tritium.client.cluster.router import Router, default_metrics_url
from tritium.client.openai.chat import chat_completion
from tritium.client.openai.completions import completion
from tritium.client.openai.embeddings import EmbeddingRequest, embeddings
from tritium.client.openai.errors import http_error_response, validation_error_response
from tritium.client.openai.guard import RequestGuard
from tritium.client.openai.lora import add_lora_routes
from tritium.client.openai.protocol import DEFAULT_MAX_CONCURRENCY, ChatRequest, CompletionRequest
from tritium.client.openai.replica_routes import add_replica_routes
from tritium.client.openai.service import OpenAIService

if TYPE_CHECKING:
    from tritium.client.triton.served_model import ServedModel

MAX_BODY_BYTES = 4 << 20


def create_app(upstreams: list[str], api_key: str | None = None, model: str = "tritium",
               tokenizer: Tokenizer | None = None, default_max_tokens: int = 16,
               max_concurrency: int = DEFAULT_MAX_CONCURRENCY, metrics_urls: list[str | None] | None = None,
               model_path: str | None = None, max_model_len: int | None = None,
               admin_key: str | None = None, served_model_name: str | None = None,
               reasoning_parser: str | None = None) -> FastAPI:
    """The endpoint's app in front of the tritonservers at `upstreams` (gRPC addresses), serving the Triton model
    `model` under the id `served_model_name` (None: `model`; `model` is accepted for it too), and the LoRA
    adapters the upstreams hold. `admin_key`: turns on `/v1/load_lora_adapter` and `/v1/unload_lora_adapter`
    (they take `Authorization: Bearer <admin_key>`; the key is sent on to the upstreams).
    `metrics_urls`: each upstream's tritonserver metrics (engine load and health; the `vllm:*` gauges);
    `model_path`, `max_model_len`: what `/model_info` and `/tokenize` report. Without `tokenizer`, the default
    model's. `reasoning_parser`: a name in `reasoning.REASONING_PARSERS` (chat replies split into reasoning and
    content), None for none. `app.state.router` and `app.state.admission` are the router and the upstream seats
    it uses. Raises ValueError when `metrics_urls` does not hold one entry per upstream, or for an unknown
    `reasoning_parser`."""
    router = Router(upstreams, model=model, api_key=api_key, metrics_urls=metrics_urls)
    if tokenizer is None:
        from tritium.backend.models.registry import resolve_model

        tokenizer = Tokenizer(resolve_model(None))
    model_id = served_model_name or model
    service = OpenAIService(router, tokenizer, model_id, default_max_tokens, max_concurrency, model_path,
                            max_model_len, reasoning_parser=reasoning_parser)

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        await router.start()
        yield
        await router.close()

    app = FastAPI(title="tritium OpenAI-compatible API", lifespan=lifespan)
    app.state.router = router
    app.state.admission = service.admission
    app.add_middleware(RequestGuard, api_key=api_key, max_bytes=MAX_BODY_BYTES, admin_key=admin_key)

    @app.exception_handler(RequestValidationError)
    async def bad_request(request: Request, exc: RequestValidationError) -> JSONResponse:
        return validation_error_response(exc)

    @app.exception_handler(HTTPException)
    async def http_error(request: Request, exc: HTTPException) -> JSONResponse:
        return http_error_response(exc)

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        base = {"id": model_id, "object": "model", "created": 0, "owned_by": "tritium",
                "root": model_path or model_id, "parent": None, "max_model_len": max_model_len}
        adapters = [{"id": a.name, "object": "model", "created": 0, "owned_by": "tritium", "root": a.path,
                     "parent": model_id, "max_model_len": max_model_len}
                    for a in (await service.adapters.current()).values()]
        return {"object": "list", "data": [base, *adapters]}

    add_lora_routes(app, router, service.adapters, service.base_names, admin_key)

    add_replica_routes(app, service)

    @app.post("/v1/completions", response_model=None)
    async def completions(body: CompletionRequest, request: Request
                          ) -> dict[str, Any] | JSONResponse | StreamingResponse:
        return await completion(service, body, request)

    @app.post("/v1/chat/completions", response_model=None)
    async def chat_completions(body: ChatRequest, request: Request
                               ) -> dict[str, Any] | JSONResponse | StreamingResponse:
        return await chat_completion(service, body, request)

    @app.post("/v1/embeddings", response_model=None)
    async def create_embeddings(body: EmbeddingRequest) -> dict[str, Any] | JSONResponse:
        return await embeddings(service, body)

    return app


def model_max_len(folder: str | Path) -> int | None:
    """The model's context length (config.json's max_position_embeddings), the engine's default max_model_len;
    None when the folder has no readable config.json or it holds no such integer."""
    try:
        value = json.loads((Path(folder) / "config.json").read_text()).get("max_position_embeddings")
    except (OSError, ValueError):
        return None
    return value if isinstance(value, int) else None


def upstream_model(upstreams: list[str], model: str, api_key: str | None) -> ServedModel | None:
    """What the first upstream that answers says its Triton model `model` serves (`tritium serve --model`);
    None, with a warning on stderr, when none answers."""
    from tritium.client.triton.served_model import read_served_model

    failures = []
    for url in upstreams:
        try:
            return read_served_model(url, api_key, model)
        except RuntimeError as exc:
            failures.append(str(exc))
    print(f"warning: no upstream said which model it serves ({'; '.join(failures)}): without --served-model-name "
          f"the model id is {model!r}, without --tokenizer the tokenizer is the default model's (start `tritium serve` "
          "first)", file=sys.stderr, flush=True)
    return None


def tokenizer_folder(tokenizer_path: str | None, upstream: ServedModel | None) -> Path:
    """--tokenizer's folder; else the upstream's model folder when it is on this host; else the default model's
    (with a warning on stderr when the upstream serves another model)."""
    from tritium.backend.models.registry import resolve_model

    if tokenizer_path is not None or upstream is None:
        return resolve_model(tokenizer_path)
    if (folder := upstream.local_folder()) is not None:
        return folder
    if upstream.folder is not None:
        print(f"warning: the upstream serves {upstream.name or 'its model'} from {upstream.folder}, which is not on "
              "this host: the default model's tokenizer is used (give --tokenizer)", file=sys.stderr, flush=True)
    return resolve_model(None)


def serve_openai(upstreams: list[str], host: str, port: int, api_key: str | None, model: str,
                 tokenizer_path: str | None, max_concurrency: int = DEFAULT_MAX_CONCURRENCY,
                 metrics_urls: list[str] | None = None, expose_model_path: bool = False,
                 admin_key: str | None = None, served_model_name: str | None = None,
                 reasoning_parser: str | None = None) -> None:
    """Serve the endpoint until stopped. `metrics_urls`: one per upstream, in order; without them an upstream on
    Triton's default gRPC port 8001 is read at its host's port 8002, others not at all (their load is then
    counted from this endpoint's own requests). `expose_model_path`: /model_info names the local model folder.
    `admin_key`: turns on the runtime LoRA routes (see `create_app`). `served_model_name` (the model id) and
    `tokenizer_path`, when None, come from what the upstream reports serving (`upstream_model`).
    `reasoning_parser`: splits chat replies into reasoning and content (see `create_app`).
    Raises SystemExit when the number of `metrics_urls` does not match the upstreams."""
    import uvicorn

    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if metrics_urls and len(metrics_urls) != len(upstreams):
        raise SystemExit(f"error: {len(metrics_urls)} --upstream-metrics for {len(upstreams)} --upstream: give one "
                         "per upstream, in the same order")
    upstream = None
    if served_model_name is None or tokenizer_path is None:
        upstream = upstream_model(upstreams, model, api_key)
    folder = tokenizer_folder(tokenizer_path, upstream)
    tokenizer = Tokenizer(folder)
    model_id = served_model_name or (upstream.name if upstream is not None else None) or model
    urls: list[str | None] = list(metrics_urls) if metrics_urls else [default_metrics_url(u) for u in upstreams]
    app = create_app(upstreams, api_key=api_key, model=model, tokenizer=tokenizer, max_concurrency=max_concurrency,
                     metrics_urls=urls, model_path=str(folder) if expose_model_path else None,
                     max_model_len=model_max_len(folder), admin_key=admin_key, served_model_name=model_id,
                     reasoning_parser=reasoning_parser)
    print(f"tritium OpenAI endpoint on http://{host}:{port}/v1 -> {', '.join(upstreams)}, model {model_id!r} "
          f"(tokenizer: {folder})", flush=True)
    uvicorn.run(app, host=host, port=port, log_level="warning")

