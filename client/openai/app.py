"""OpenAI-compatible HTTP endpoint in front of one or more tritonservers (`tritium openai`).

`/v1/models`, `/v1/completions`, `/v1/chat/completions` (the chat template comes from the model's
tokenizer; tools and tool calls: client/openai_chat.py), streaming as SSE ending in `data: [DONE]`.
Structured output (`response_format`, vLLM's `guided_*` and `structured_outputs`) goes to the engine as its
`structured_output` sampling field. `Authorization: Bearer KEY` is checked and forwarded to Triton as its
API key. Errors use OpenAI's shape: 400 bad field, 401 key, 404 model,
413 body over MAX_BODY_BYTES, 500 internal error (with a request id; the details are logged, never sent),
503 with Retry-After: no replica up, or overloaded (over `max_concurrency` upstream requests in flight, or
every replica refused). A client that disconnects has its upstream requests cancelled.
"""

from __future__ import annotations

import asyncio
import functools
import json
import logging
import time
import uuid
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, StreamingResponse
from starlette.exceptions import HTTPException

from tritium.backend.tokenizer import Tokenizer
from tritium.client.cluster.router import Chunk, Router, UpstreamError, default_metrics_url
from tritium.client.openai.chat import ChatStream, chat_constraint, chat_message, parser_factory, render_prompt
from tritium.client.openai.guard import Admission, RequestGuard, new_request_id, unless_disconnected
from tritium.client.openai.protocol import (
    DEFAULT_MAX_CONCURRENCY,
    MAX_CHOICES,
    MAX_PROMPTS,
    MAX_REQUEST_TOKENS,
    MAX_SEED,
    ChatRequest,
    CompletionRequest,
    RequestError,
    error_response,
    retry_later_response,
)
from tritium.client.openai.replica_routes import add_replica_routes

logger = logging.getLogger(__name__)
MAX_BODY_BYTES = 4 << 20
UNION_TYPE_TAGS = {"str", "int", "float", "bool"}
UNPARSABLE_BODY = "There was an error parsing the body"  # FastAPI's words for a body json.loads raised on


def _is_union_tag(part: Any) -> bool:
    """Whether a pydantic error location part names the member of a union (`str`, `list[TextPart]`,
    `NamedToolChoice`, `literal[...]`) rather than a field: fields are snake_case names."""
    return isinstance(part, str) and (part in UNION_TYPE_TAGS or "[" in part or part[:1].isupper())


def _token_entries(decode: Callable[[int], str], logprobs: list[dict[str, float]]) -> list[tuple[str, float, list]]:
    """(sampled token text, its logprob, [(token text, logprob)] most likely first) per generated token.
    The engine lists the sampled token first, then the top-n."""
    out = []
    for entry in logprobs:
        items = [(decode(int(t)), lp) for t, lp in entry.items()]
        out.append((items[0][0], items[0][1], sorted(items, key=lambda item: -item[1])))
    return out


def create_app(upstreams: list[str], api_key: str | None = None, model: str = "tritium",
               tokenizer: Tokenizer | None = None, default_max_tokens: int = 16,
               max_concurrency: int = DEFAULT_MAX_CONCURRENCY, metrics_urls: list[str | None] | None = None,
               model_path: str | None = None, max_model_len: int | None = None) -> FastAPI:
    """`metrics_urls`: each upstream's tritonserver metrics (engine load and health; the `vllm:*` gauges);
    `model_path`, `max_model_len`: what `/model_info` and `/tokenize` report."""
    router = Router(upstreams, model=model, api_key=api_key, metrics_urls=metrics_urls)
    admission = Admission(max_concurrency)
    if tokenizer is None:
        from tritium.backend.models.registry import resolve_model

        tokenizer = Tokenizer(resolve_model(None))
    vocab = tokenizer

    @functools.lru_cache(maxsize=1 << 17)
    def decode_token(token_id: int) -> str:
        return vocab.decode([token_id], skip_special_tokens=False)

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        await router.start()
        yield
        await router.close()

    app = FastAPI(title="tritium OpenAI-compatible API", lifespan=lifespan)
    app.state.router = router
    app.state.admission = admission

    app.add_middleware(RequestGuard, api_key=api_key, max_bytes=MAX_BODY_BYTES)

    @app.exception_handler(RequestValidationError)
    async def bad_request(request: Request, exc: RequestValidationError) -> JSONResponse:
        # A value that fits no member of a union fails once per member: the deepest failure says most.
        errors = sorted(exc.errors(), key=lambda e: -len(e.get("loc", ())))
        err = errors[0] if errors else {"loc": (), "msg": "invalid request"}
        if err.get("type") == "json_invalid":
            return error_response(400, f"body is not valid JSON: {err.get('ctx', {}).get('error')}")
        # Past the field name, pydantic also names the member of a union that failed: not a field.
        loc = [str(p) for i, p in enumerate(err.get("loc", ())) if p != "body" and not (i >= 1 and _is_union_tag(p))]
        param = ".".join(loc) or None
        return error_response(400, f"{param or 'body'}: {err.get('msg')}", param=param)

    @app.exception_handler(HTTPException)
    async def http_error(request: Request, exc: HTTPException) -> JSONResponse:
        detail = str(exc.detail)
        if exc.status_code == 400 and detail == UNPARSABLE_BODY:
            detail = "invalid request: body is not valid JSON (nested too deeply, or a number too long?)"
        response = error_response(exc.status_code, detail)
        response.headers.update(exc.headers or {})
        return response

    def check_model(name: str) -> JSONResponse | None:
        if name != model:
            return error_response(404, f"The model '{name}' does not exist", param="model", code="model_not_found")
        return None

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        return {"object": "list", "data": [{"id": model, "object": "model", "created": 0, "owned_by": "tritium"}]}

    add_replica_routes(app, router, tokenizer, model, admission, default_max_tokens, model_path, max_model_len)

    async def run_choices(prompts: list[str], sampling: dict[str, Any], n: int, logprobs: bool
                          ) -> AsyncIterator[tuple[int, Chunk]]:
        """Merge the streams of every (prompt, sample) choice, tagged with the choice index. Each choice holds
        a seat of `admission` until its upstream request ends; without enough free seats, UpstreamError 503."""
        if not admission.try_acquire(len(prompts) * n):
            raise UpstreamError(f"over --max-concurrency ({admission.limit} upstream requests in flight)", 503,
                                overloaded=True)
        queue: asyncio.Queue[tuple[int, Chunk | BaseException | None]] = asyncio.Queue()
        jobs = []
        for p_idx, prompt in enumerate(prompts):
            for s_idx in range(n):
                params = dict(sampling)
                if "seed" in params and n > 1:
                    params["seed"] = (params["seed"] + s_idx) % (MAX_SEED + 1)
                index = p_idx * n + s_idx

                async def pump(index: int = index, prompt: str = prompt, params: dict = params) -> None:
                    try:
                        async for chunk in router.generate(prompt, params, logprobs):
                            await queue.put((index, chunk))
                        await queue.put((index, None))
                    except BaseException as exc:  # handed to the consumer, which raises it
                        await queue.put((index, exc))

                job = asyncio.create_task(pump())
                job.add_done_callback(lambda _: admission.release())  # also when cancelled before it ran
                jobs.append(job)
        remaining = len(jobs)
        try:
            while remaining:
                index, item = await queue.get()
                if item is None:
                    remaining -= 1
                elif isinstance(item, BaseException):
                    raise item
                else:
                    yield index, item
        finally:
            for job in jobs:
                job.cancel()

    async def collect(prompts: list[str], sampling: dict[str, Any], n: int, logprobs: bool) -> dict[int, dict]:
        choices: dict[int, dict] = {}
        async for index, chunk in run_choices(prompts, sampling, n, logprobs):
            c = choices.setdefault(index, {"text": "", "finish_reason": None, "prompt_tokens": 0,
                                           "completion_tokens": 0, "logprobs": []})
            c["text"] += chunk.text
            c["logprobs"] += chunk.logprobs
            if chunk.final:
                c["finish_reason"] = chunk.finish_reason
                c["prompt_tokens"] = chunk.num_input_tokens or 0
                c["completion_tokens"] = chunk.num_output_tokens or 0
        return choices

    def usage(choices: dict[int, dict], n: int) -> dict[str, int]:
        prompt_tokens = sum(c["prompt_tokens"] for i, c in choices.items() if i % n == 0)
        completion = sum(c["completion_tokens"] for c in choices.values())
        return {"prompt_tokens": prompt_tokens, "completion_tokens": completion,
                "total_tokens": prompt_tokens + completion}

    def upstream_error(exc: UpstreamError, request_id: str) -> tuple[int, str, str]:
        """(status, message, type) for the client. Only the engine's verdict on the request itself (400) is
        passed on; anything else is logged with the request id, and the client gets the id."""
        if exc.status == 400:
            return 400, str(exc), "invalid_request_error"
        logger.warning("request %s: %s", request_id, exc)
        if exc.overloaded:
            return 503, f"overloaded, retry later (request id {request_id})", "server_error"
        if exc.status == 503:
            return 503, f"no tritonserver replica is up, retry later (request id {request_id})", "server_error"
        return exc.status, f"internal error (request id {request_id})", "server_error"

    def upstream_response(exc: UpstreamError, request_id: str) -> JSONResponse:
        status, message, kind = upstream_error(exc, request_id)
        if status == 503:
            return retry_later_response(message, "overloaded" if exc.overloaded else None)
        return error_response(status, message, kind=kind)

    def client_gone() -> JSONResponse:
        return error_response(499, "client closed the request")  # nobody reads it

    def check_budget(choices: int, max_tokens: int, param: str) -> JSONResponse | None:
        if choices * max_tokens > MAX_REQUEST_TOKENS:
            shown = max_tokens if max_tokens < 10**9 else "over 10^9"
            return error_response(400, f"invalid request: {param} times the number of choices must be at most "
                                  f"{MAX_REQUEST_TOKENS}, got {shown} x {choices}", param=param)
        return None

    def sse(payload: dict[str, Any]) -> str:
        return f"data: {json.dumps(payload)}\n\n"

    async def stream_response(request: Request, kind: str, prompts: list[str], sampling: dict[str, Any], n: int,
                              logprobs: bool, include_usage: bool, make_delta: Any) -> Any:
        rid = f"{'chatcmpl' if kind == 'chat' else 'cmpl'}-{uuid.uuid4().hex}"
        request_id = new_request_id()
        created = int(time.time())
        obj = "chat.completion.chunk" if kind == "chat" else "text_completion"
        iterator = run_choices(prompts, sampling, n, logprobs)

        async def first_item() -> tuple[int, Chunk] | None:
            try:
                return await iterator.__anext__()
            except StopAsyncIteration:
                return None

        try:  # fail with a proper status when the request is rejected before anything streams
            connected, first = await unless_disconnected(request, first_item())
        except UpstreamError as exc:
            return upstream_response(exc, request_id)
        if not connected:
            return client_gone()

        async def events() -> AsyncIterator[str]:
            totals: dict[int, dict] = {}
            started: set[int] = set()
            pending = [first] if first else []

            async def all_chunks() -> AsyncIterator[tuple[int, Chunk]]:
                for item in pending:
                    yield item
                async for item in iterator:
                    yield item

            try:
                async for index, chunk in all_chunks():
                    t = totals.setdefault(index, {"prompt_tokens": 0, "completion_tokens": 0})
                    if chunk.final:
                        t["prompt_tokens"] = chunk.num_input_tokens or 0
                        t["completion_tokens"] = chunk.num_output_tokens or 0
                    choice = make_delta(index, chunk, index not in started)
                    if choice is None:  # nothing to show yet (a tool call being read)
                        continue
                    started.add(index)
                    yield sse({"id": rid, "object": obj, "created": created, "model": model, "choices": [choice]})
            except Exception as exc:  # the status line is sent: the error goes in the stream
                if isinstance(exc, UpstreamError):
                    _, message, error_type = upstream_error(exc, request_id)
                else:
                    logger.exception("request %s: stream failed", request_id)
                    message, error_type = f"internal error (request id {request_id})", "server_error"
                yield sse({"error": {"message": message, "type": error_type, "param": None, "code": None}})
                return
            finally:
                await iterator.aclose()
            if include_usage:
                u = usage({i: t for i, t in totals.items()}, n)
                yield sse({"id": rid, "object": obj, "created": created, "model": model, "choices": [], "usage": u})
            yield "data: [DONE]\n\n"

        return StreamingResponse(events(), media_type="text/event-stream")

    async def run_collect(request: Request, prompts: list[str], sampling: dict[str, Any], n: int,
                          want_lp: bool) -> dict[int, dict] | JSONResponse:
        """The choices of a non-streamed request, or the error response (the client gone: cancelled)."""
        try:
            connected, choices = await unless_disconnected(request, collect(prompts, sampling, n, want_lp))
        except UpstreamError as exc:
            return upstream_response(exc, new_request_id())
        return choices if connected and choices is not None else client_gone()

    @app.post("/v1/completions", response_model=None)
    async def completions(body: CompletionRequest, request: Request) -> Any:
        if (bad := check_model(body.model)) is not None:
            return bad
        prompts = [body.prompt] if isinstance(body.prompt, str) else list(body.prompt)
        if not prompts or any(not p for p in prompts):
            return error_response(400, "prompt must be a non-empty string or list of strings", param="prompt")
        if len(prompts) > MAX_PROMPTS:
            return error_response(400, f"prompt may hold at most {MAX_PROMPTS} strings, got {len(prompts)}",
                                  param="prompt")
        if len(prompts) * body.n > MAX_CHOICES:
            return error_response(400, f"n times the number of prompts must be at most {MAX_CHOICES}, got "
                                  f"{body.n} x {len(prompts)}", param="n")
        sampling = body.sampling(default_max_tokens)
        if (bad := check_budget(len(prompts) * body.n, sampling["max_tokens"], "max_tokens")) is not None:
            return bad
        try:
            if (constraint := body.structured_output()) is not None:
                sampling["structured_output"] = constraint
        except RequestError as exc:
            return error_response(400, exc.message, param=exc.param)
        want_lp = body.logprobs is not None
        if want_lp:
            sampling["logprobs"] = body.logprobs

        def completion_logprobs(entries: list[dict[str, float]]) -> dict[str, Any] | None:
            if not want_lp:
                return None
            rows = _token_entries(decode_token, entries)
            return {"tokens": [r[0] for r in rows], "token_logprobs": [r[1] for r in rows],
                    "top_logprobs": [dict(r[2][: body.logprobs]) for r in rows], "text_offset": []}

        if body.stream:
            def delta(index: int, chunk: Chunk, first: bool) -> dict[str, Any]:
                return {"index": index, "text": chunk.text, "logprobs": completion_logprobs(chunk.logprobs),
                        "finish_reason": chunk.finish_reason if chunk.final else None}
            include = bool(body.stream_options and body.stream_options.include_usage)
            return await stream_response(request, "completion", prompts, sampling, body.n, want_lp, include, delta)
        choices = await run_collect(request, prompts, sampling, body.n, want_lp)
        if isinstance(choices, JSONResponse):
            return choices

        def build() -> dict[str, Any]:  # decoding many logprobs takes a while: off the event loop
            return {
                "id": f"cmpl-{uuid.uuid4().hex}", "object": "text_completion", "created": int(time.time()),
                "model": model,
                "choices": [{"index": i, "text": (prompts[i // body.n] if body.echo else "") + c["text"],
                             "logprobs": completion_logprobs(c["logprobs"]), "finish_reason": c["finish_reason"]}
                            for i, c in sorted(choices.items())],
                "usage": usage(choices, body.n),
            }

        return await asyncio.to_thread(build) if want_lp else build()

    @app.post("/v1/chat/completions", response_model=None)
    async def chat_completions(body: ChatRequest, request: Request) -> Any:
        if (bad := check_model(body.model)) is not None:
            return bad
        sampling = body.sampling(default_max_tokens)
        if body.max_completion_tokens:
            sampling["max_tokens"] = body.max_completion_tokens
        param = "max_completion_tokens" if body.max_completion_tokens else "max_tokens"
        if (bad := check_budget(body.n, sampling["max_tokens"], param)) is not None:
            return bad
        try:
            mode = body.tool_mode()
            if (constraint := chat_constraint(body, mode)) is not None:
                sampling["structured_output"] = constraint
        except RequestError as exc:
            return error_response(400, exc.message, param=exc.param)
        parser = parser_factory(tokenizer, body, mode)
        try:  # a long conversation takes a while to render: off the event loop
            prompt = await asyncio.to_thread(render_prompt, tokenizer, body, mode)
        except ValueError as exc:
            return error_response(400, str(exc), param="messages")
        except Exception as exc:  # the template choked on what the messages hold (odd extra fields)
            logger.info("chat template failed on a request: %r", exc)
            return error_response(400, "invalid request: messages cannot be rendered with the model's chat "
                                  "template", param="messages")
        want_lp = body.logprobs
        if want_lp:
            sampling["logprobs"] = body.top_logprobs or 0

        def chat_logprobs(entries: list[dict[str, float]]) -> dict[str, Any] | None:
            if not want_lp:
                return None
            rows = _token_entries(decode_token, entries)
            return {"content": [{"token": tok, "logprob": lp, "bytes": list(tok.encode()),
                                 "top_logprobs": [{"token": a, "logprob": alp, "bytes": list(a.encode())}
                                                  for a, alp in alts[: body.top_logprobs or 0]]}
                                for tok, lp, alts in rows]}

        if body.stream:
            include = bool(body.stream_options and body.stream_options.include_usage)
            return await stream_response(request, "chat", [prompt], sampling, body.n, want_lp, include,
                                         ChatStream(parser, chat_logprobs).delta)
        choices = await run_collect(request, [prompt], sampling, body.n, want_lp)
        if isinstance(choices, JSONResponse):
            return choices

        def choice(index: int, c: dict[str, Any]) -> dict[str, Any]:
            message, reason = chat_message(c["text"], c["finish_reason"], parser)
            return {"index": index, "message": message, "logprobs": chat_logprobs(c["logprobs"]),
                    "finish_reason": reason}

        def build() -> dict[str, Any]:
            return {
                "id": f"chatcmpl-{uuid.uuid4().hex}", "object": "chat.completion", "created": int(time.time()),
                "model": model, "choices": [choice(i, c) for i, c in sorted(choices.items())],
                "usage": usage(choices, body.n),
            }

        return await asyncio.to_thread(build) if want_lp else build()

    return app


def model_max_len(folder: Any) -> int | None:
    """The model's context length (config.json's max_position_embeddings), the engine's default max_model_len."""
    from pathlib import Path

    try:
        value = json.loads((Path(folder) / "config.json").read_text()).get("max_position_embeddings")
    except (OSError, ValueError):
        return None
    return value if isinstance(value, int) else None


def serve_openai(upstreams: list[str], host: str, port: int, api_key: str | None, model: str,
                 tokenizer_path: str | None, max_concurrency: int = DEFAULT_MAX_CONCURRENCY,
                 metrics_urls: list[str] | None = None, expose_model_path: bool = False) -> None:
    """Serve the endpoint. `metrics_urls`: one per upstream, in order; without them an upstream on Triton's
    default gRPC port 8001 is read at its host's port 8002, others not at all (their load is then counted
    from this endpoint's own requests). `expose_model_path`: /model_info names the local model folder."""
    import uvicorn

    from tritium.backend.models.registry import resolve_model

    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    folder = resolve_model(tokenizer_path)
    tokenizer = Tokenizer(folder)
    if metrics_urls and len(metrics_urls) != len(upstreams):
        raise SystemExit(f"error: {len(metrics_urls)} --upstream-metrics for {len(upstreams)} --upstream: give one "
                         "per upstream, in the same order")
    urls: list[str | None] = list(metrics_urls) if metrics_urls else [default_metrics_url(u) for u in upstreams]
    app = create_app(upstreams, api_key=api_key, model=model, tokenizer=tokenizer, max_concurrency=max_concurrency,
                     metrics_urls=urls, model_path=str(folder) if expose_model_path else None,
                     max_model_len=model_max_len(folder))
    print(f"tritium OpenAI endpoint on http://{host}:{port}/v1 -> {', '.join(upstreams)}", flush=True)
    uvicorn.run(app, host=host, port=port, log_level="warning")
