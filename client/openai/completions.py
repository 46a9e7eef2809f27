"""`/v1/completions`: one upstream request per (prompt, sample), answered whole or streamed."""

from __future__ import annotations

import asyncio
import functools
import time
import uuid
from typing import Any

from fastapi import Request
from fastapi.responses import JSONResponse, StreamingResponse

from tritium.client.cluster.upstream import Chunk
from tritium.client.openai.errors import budget_error
from tritium.client.openai.protocol import MAX_CHOICES, MAX_PROMPTS, CompletionRequest, RequestError, error_response
from tritium.client.openai.service import ChoiceResult, OpenAIService, TokenEntry, usage
from tritium.client.openai.streaming import stream_response


def completion_logprobs(rows: list[TokenEntry], top: int) -> dict[str, Any]:
    """OpenAI's (legacy) completion `logprobs` of generated tokens (`OpenAIService.token_entries`), `top`
    alternatives each; `text_offset` is left empty."""
    return {"tokens": [r[0] for r in rows], "token_logprobs": [r[1] for r in rows],
            "top_logprobs": [dict(r[2][:top]) for r in rows], "text_offset": []}


class _CompletionChoices:
    """Makes a completion request's choices (whole or as stream deltas) out of the engine's output."""

    def __init__(self, service: OpenAIService, body: CompletionRequest, prompts: list[str]) -> None:
        self.service = service
        self.body = body
        self.prompts = prompts

    def logprobs(self, entries: list[dict[str, float]]) -> dict[str, Any] | None:
        """A choice's `logprobs`: None unless the request asked for them."""
        if self.body.logprobs is None:
            return None
        return completion_logprobs(self.service.token_entries(entries), self.body.logprobs)

    def delta(self, index: int, chunk: Chunk, first: bool) -> dict[str, Any]:
        """The stream's choice entry for one chunk of choice `index`."""
        return {"index": index, "text": chunk.text, "logprobs": self.logprobs(chunk.logprobs),
                "finish_reason": chunk.finish_reason if chunk.final else None}

    def body_of(self, choices: dict[int, ChoiceResult]) -> dict[str, Any]:
        """The text_completion object of the request's whole choices (the prompt first where `echo`)."""
        n = self.body.n
        return {
            "id": f"cmpl-{uuid.uuid4().hex}", "object": "text_completion", "created": int(time.time()),
            "model": self.service.served_name(self.body.model),
            "choices": [{"index": i, "text": (self.prompts[i // n] if self.body.echo else "") + c.text,
                         "logprobs": self.logprobs(c.logprobs), "finish_reason": c.finish_reason}
                        for i, c in sorted(choices.items())],
            "usage": usage(choices, n),
        }


async def completion(service: OpenAIService, body: CompletionRequest, request: Request
                     ) -> dict[str, Any] | JSONResponse | StreamingResponse:
    """The answer to a completion request: the text_completion object, its stream, or an error response
    (400 a field, 404 the model, 503 overloaded or no replica, 499 client gone)."""
    lora_name, bad = await service.resolve_model(body.model)
    if bad is not None:
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
    sampling = body.sampling(service.default_max_tokens)
    if lora_name is not None:
        sampling["lora_name"] = lora_name
    if (bad := budget_error(len(prompts) * body.n, sampling["max_tokens"], "max_tokens")) is not None:
        return bad
    try:
        if (constraint := body.structured_output()) is not None:
            sampling["structured_output"] = constraint
    except RequestError as exc:
        return error_response(400, exc.message, param=exc.param)
    want_lp = body.logprobs is not None
    if want_lp:
        sampling["logprobs"] = body.logprobs
    made = _CompletionChoices(service, body, prompts)
    if body.stream:
        include = bool(body.stream_options and body.stream_options.include_usage)
        return await stream_response(service, request, "completion", prompts, sampling, body.n, want_lp, include,
                                     made.delta)
    choices = await service.collect_or_error(request, prompts, sampling, body.n, want_lp)
    if isinstance(choices, JSONResponse):
        return choices
    build = functools.partial(made.body_of, choices)
    return await asyncio.to_thread(build) if want_lp else build()  # decoding many logprobs takes a while
