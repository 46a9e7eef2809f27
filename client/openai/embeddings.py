"""`/v1/embeddings`: one upstream `tritium_embed` request per input, sent together (the model batches them)."""

from __future__ import annotations

import asyncio
import base64
import uuid
from typing import Any, Literal

import numpy as np
from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict, StrictInt

from tritium.client.cluster.embed import EMBED_MODEL, embed_one
from tritium.client.cluster.upstream import UpstreamError
from tritium.client.openai.errors import upstream_response
from tritium.client.openai.protocol import MAX_PROMPTS, error_response
from tritium.client.openai.service import OpenAIService


class EmbeddingRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")

    input: str | list[str] | list[StrictInt] | list[list[StrictInt]]  # token ids: integers, not booleans
    model: str | None = None
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: int | None = None
    user: str | None = None  # accepted, ignored


MAX_TOKEN_ID = 2**31  # what an INT32 input can carry; the model then checks its vocabulary


def embedding_inputs(value: str | list[str] | list[int] | list[list[int]]) -> list[str | list[int]]:
    """The request's inputs, one per vector. Raises ValueError naming `input`: empty, too many, text that is not
    UTF-8, token ids out of range."""
    items: list[str | list[int]]
    if isinstance(value, str):
        items = [value]
    elif value and all(isinstance(v, int) for v in value):
        items = [[int(v) for v in value]]  # type: ignore[union-attr]
    else:
        items = list(value)  # type: ignore[arg-type]
    if not items:
        raise ValueError("input must not be empty")
    if len(items) > MAX_PROMPTS:
        raise ValueError(f"input may hold at most {MAX_PROMPTS} items, got {len(items)}")
    for i, item in enumerate(items):
        if not item:
            raise ValueError(f"input[{i}] must not be empty")
        if isinstance(item, str):
            try:
                item.encode("utf-8")
            except UnicodeEncodeError:
                raise ValueError(f"input[{i}] cannot be sent as UTF-8 text (a lone surrogate)") from None
        elif not all(0 <= t < MAX_TOKEN_ID for t in item):
            raise ValueError(f"input[{i}]: token ids must be integers in [0, {MAX_TOKEN_ID})")
    return items


def encode_vector(vector: np.ndarray, encoding_format: str) -> list[float] | str:
    """A list of floats, or OpenAI's base64 of the little-endian float32 bytes."""
    if encoding_format == "base64":
        return base64.b64encode(vector.astype("<f4").tobytes()).decode("ascii")
    return [float(x) for x in vector]


async def embeddings(service: OpenAIService, body: EmbeddingRequest) -> dict[str, Any] | JSONResponse:
    """The list object of the inputs' embeddings, or an error response (400 a field, 404 the model, 503)."""
    lora_name, bad = await service.resolve_model(body.model)
    if bad is not None:
        return bad
    if lora_name is not None:
        return error_response(400, f"model {lora_name!r} is a LoRA adapter; embeddings run on the base model only",
                              param="model")
    try:
        items = embedding_inputs(body.input)
    except ValueError as exc:
        return error_response(400, str(exc), param="input")
    if body.dimensions is not None and body.dimensions < 1:
        return error_response(400, f"dimensions must be >= 1, got {body.dimensions}", param="dimensions")
    request_id = f"embd-{uuid.uuid4().hex}"
    try:
        results = await asyncio.gather(*(embed_one(service.router, item, f"{request_id}-{i}")
                                         for i, item in enumerate(items)))
    except UpstreamError as exc:
        if exc.status == 400 and len(items) > 1:
            return error_response(400, str(exc), param="input")
        if exc.status == 404:
            return error_response(404, f"no upstream serves embeddings: load the {EMBED_MODEL} model (`tritium "
                                  "serve --embeddings`)", param="model", code="model_not_found")
        return upstream_response(exc, request_id)
    size = len(results[0][0])
    if body.dimensions is not None and body.dimensions != size:
        return error_response(400, f"dimensions must be {size}, the model's embedding size (got {body.dimensions}); "
                              "this model is not a matryoshka model, so it cannot return shorter vectors",
                              param="dimensions")
    tokens = sum(n for _, n in results)
    return {
        "object": "list",
        "data": [{"object": "embedding", "index": i, "embedding": encode_vector(v, body.encoding_format)}
                 for i, (v, _) in enumerate(results)],
        "model": service.served_name(body.model),
        "usage": {"prompt_tokens": tokens, "total_tokens": tokens},
    }
