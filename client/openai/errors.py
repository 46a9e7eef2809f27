"""Failures made into OpenAI error responses: invalid bodies (the app's exception handlers), an unknown
model, and upstream failures, whose details are logged with a request id and never sent."""

from __future__ import annotations

import logging
from typing import Any

from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException

from tritium.client.cluster.upstream import UpstreamError
from tritium.client.openai.protocol import MAX_REQUEST_TOKENS, error_response, retry_later_response

logger = logging.getLogger(__name__)
UNION_TYPE_TAGS = frozenset({"str", "int", "float", "bool"})
UNPARSABLE_BODY = "There was an error parsing the body"  # FastAPI's words for a body json.loads raised on


def _is_union_tag(part: Any) -> bool:
    """Whether a pydantic error location part names the member of a union (`str`, `list[TextPart]`,
    `NamedToolChoice`, `literal[...]`) rather than a field: fields are snake_case names."""
    return isinstance(part, str) and (part in UNION_TYPE_TAGS or "[" in part or part[:1].isupper())


def validation_error_response(exc: RequestValidationError) -> JSONResponse:
    """The 400 for a body that failed validation, naming the deepest failing field as `param`."""
    # A value that fits no member of a union fails once per member: the deepest failure says most.
    errors = sorted(exc.errors(), key=lambda e: -len(e.get("loc", ())))
    err = errors[0] if errors else {"loc": (), "msg": "invalid request"}
    if err.get("type") == "json_invalid":
        return error_response(400, f"body is not valid JSON: {err.get('ctx', {}).get('error')}")
    loc = [str(p) for i, p in enumerate(err.get("loc", ())) if p != "body" and not (i >= 1 and _is_union_tag(p))]
    param = ".".join(loc) or None
    return error_response(400, f"{param or 'body'}: {err.get('msg')}", param=param)


def http_error_response(exc: HTTPException) -> JSONResponse:
    """Starlette's HTTP errors in OpenAI's shape, with their headers."""
    detail = str(exc.detail)
    if exc.status_code == 400 and detail == UNPARSABLE_BODY:
        detail = "invalid request: body is not valid JSON (nested too deeply, or a number too long?)"
    response = error_response(exc.status_code, detail)
    response.headers.update(exc.headers or {})
    return response


def model_not_found(name: str) -> JSONResponse:
    """The 404 for a request naming a model this endpoint does not serve."""
    return error_response(404, f"The model '{name}' does not exist", param="model", code="model_not_found")


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
    """`upstream_error` as a response; a 503 carries Retry-After."""
    status, message, kind = upstream_error(exc, request_id)
    if status == 503:
        return retry_later_response(message, "overloaded" if exc.overloaded else None)
    return error_response(status, message, kind=kind)


def client_gone() -> JSONResponse:
    """The 499 for a client that disconnected (nobody reads it: it ends the handler)."""
    return error_response(499, "client closed the request")


def budget_error(choices: int, max_tokens: int, param: str) -> JSONResponse | None:
    """The 400 for a request whose choices x `max_tokens` is over MAX_REQUEST_TOKENS; None when within it."""
    if choices * max_tokens > MAX_REQUEST_TOKENS:
        shown = max_tokens if max_tokens < 10**9 else "over 10^9"
        return error_response(400, f"invalid request: {param} times the number of choices must be at most "
                              f"{MAX_REQUEST_TOKENS}, got {shown} x {choices}", param=param)
    return None
