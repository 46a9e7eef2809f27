"""Streamed responses: a request's merged choices as server-sent events, one `data: {json}` per chunk choice,
then the usage when asked for, then `data: [DONE]`. A request refused before anything streams gets a proper
status instead; a failure once the stream has begun is sent as an error event that ends it."""

from __future__ import annotations

import json
import logging
import time
import uuid
from collections.abc import AsyncIterator, Callable
from types import MappingProxyType
from typing import Any, Literal

from fastapi import Request
from fastapi.responses import JSONResponse, StreamingResponse

from tritium.client.cluster.upstream import Chunk, UpstreamError
from tritium.client.openai.errors import client_gone, upstream_error, upstream_response
from tritium.client.openai.guard import new_request_id, unless_disconnected
from tritium.client.openai.service import ChoiceResult, OpenAIService, usage

logger = logging.getLogger(__name__)

DeltaMaker = Callable[[int, Chunk, bool], dict[str, Any] | None]
"""(choice index, chunk, first of its choice) -> the choice's entry in an event; None: no event for it yet."""
UsageDetails = Callable[[], dict[str, Any]]
"""What a route adds to a stream's final usage (the reasoning tokens), asked once every choice has ended."""

_KINDS = MappingProxyType({"completion": ("cmpl", "text_completion"), "chat": ("chatcmpl", "chat.completion.chunk")})


def sse(payload: dict[str, Any]) -> str:
    """One server-sent event holding `payload` as JSON."""
    return f"data: {json.dumps(payload)}\n\n"


async def stream_response(service: OpenAIService, request: Request, kind: Literal["completion", "chat"],
                          prompts: list[str], sampling: dict[str, Any], n: int, logprobs: bool, include_usage: bool,
                          make_delta: DeltaMaker, usage_details: UsageDetails | None = None
                          ) -> StreamingResponse | JSONResponse:
    """The streamed response of a request's choices (`OpenAIService.run_choices`), each chunk made into a
    choice by `make_delta`; `usage_details` adds to the usage once the choices have ended. It waits for the
    first chunk, so that a request refused upstream gets its error response (503 overloaded, 400 invalid)
    rather than a stream; 499 when the client left first."""
    id_prefix, obj = _KINDS[kind]
    head = {"id": f"{id_prefix}-{uuid.uuid4().hex}", "object": obj, "created": int(time.time()),
            "model": sampling.get("lora_name", service.model)}
    request_id = new_request_id()
    chunks = service.run_choices(prompts, sampling, n, logprobs)
    try:
        connected, first = await unless_disconnected(request, _first(chunks))
    except UpstreamError as exc:
        return upstream_response(exc, request_id)
    if not connected:
        return client_gone()
    events = _events(_prepend(first, chunks), head, n, include_usage, make_delta, request_id, usage_details)
    return StreamingResponse(events, media_type="text/event-stream")


async def _first(chunks: AsyncIterator[tuple[int, Chunk]]) -> tuple[int, Chunk] | None:
    """The first item of `chunks`; None when there is none."""
    try:
        return await chunks.__anext__()
    except StopAsyncIteration:
        return None


async def _prepend(first: tuple[int, Chunk] | None, rest: AsyncIterator[tuple[int, Chunk]]
                   ) -> AsyncIterator[tuple[int, Chunk]]:
    """`first` (unless None), then `rest`; closes `rest` when done or closed."""
    try:
        if first is not None:
            yield first
        async for item in rest:
            yield item
    finally:
        await rest.aclose()


async def _events(chunks: AsyncIterator[tuple[int, Chunk]], head: dict[str, Any], n: int, include_usage: bool,
                  make_delta: DeltaMaker, request_id: str, usage_details: UsageDetails | None = None
                  ) -> AsyncIterator[str]:
    """The SSE events of a stream whose every event starts with `head` (id, object, created, model)."""
    totals: dict[int, ChoiceResult] = {}
    started: set[int] = set()
    try:
        async for index, chunk in chunks:
            totals.setdefault(index, ChoiceResult()).count(chunk)
            choice = make_delta(index, chunk, index not in started)
            if choice is None:
                continue
            started.add(index)
            yield sse(head | {"choices": [choice]})
    except Exception as exc:  # the status line is sent: the error goes in the stream
        if isinstance(exc, UpstreamError):
            _, message, error_type = upstream_error(exc, request_id)
        else:
            logger.exception("request %s: stream failed", request_id)
            message, error_type = f"internal error (request id {request_id})", "server_error"
        yield sse({"error": {"message": message, "type": error_type, "param": None, "code": None}})
        return
    finally:
        await chunks.aclose()
    if include_usage:
        counts = usage(totals, n)
        if usage_details is not None:
            counts |= usage_details()
        yield sse(head | {"choices": [], "usage": counts})
    yield "data: [DONE]\n\n"
