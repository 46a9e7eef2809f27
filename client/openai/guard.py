"""What stands between an OpenAI client and the endpoint's handlers: the API key and the body size
(`RequestGuard`, ASGI middleware that also turns any escaped exception into a 500 with a request id), the
seats for upstream requests (`Admission`) and watching for a client that goes away (`unless_disconnected`)."""

from __future__ import annotations

import asyncio
import hmac
import logging
import uuid
from collections.abc import Awaitable
from contextlib import suppress
from dataclasses import dataclass
from typing import TypeVar

from fastapi import Request
from fastapi.responses import JSONResponse
from starlette.datastructures import Headers
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from tritium.client.openai.protocol import error_response

logger = logging.getLogger(__name__)
T = TypeVar("T")
KEYED_PATHS = ("/v1/", "/tokenize", "/detokenize")  # health, load, model facts and metrics stay open
ADMIN_PATHS = frozenset({"/v1/load_lora_adapter", "/v1/unload_lora_adapter"})  # the admin key's, not the API key's


def new_request_id() -> str:
    """A fresh id for a request's log lines, quoted to the client in errors."""
    return uuid.uuid4().hex[:16]


def internal_error(request_id: str) -> JSONResponse:
    """The 500 of a request that failed here, naming its request id (the log has the details)."""
    return error_response(500, f"internal error (request id {request_id})", kind="server_error")


@dataclass
class Admission:
    """Seats for upstream requests in flight (one per choice: prompts x n): a request that does not find all
    of its seats free is refused at once instead of queued."""

    limit: int
    in_flight: int = 0

    def try_acquire(self, seats: int) -> bool:
        """Take `seats` seats; False, taking none, when fewer are free."""
        if self.in_flight + seats > self.limit:
            return False
        self.in_flight += seats
        return True

    def release(self, seats: int = 1) -> None:
        """Give back `seats` seats."""
        self.in_flight -= seats


class RequestGuard:
    """ASGI middleware: the API key on KEYED_PATHS first (the admin key, never the API key, on ADMIN_PATHS: 404
    saying why when the endpoint has none, as vLLM without runtime LoRA updating; 401 a wrong or missing one),
    then the request body, read whole and counted as it arrives (a chunked body has no Content-Length): 413
    once it passes `max_bytes`, 400 for a malformed Content-Length. The app then gets the body in one message."""

    def __init__(self, app: ASGIApp, api_key: str | None, max_bytes: int, admin_key: str | None = None) -> None:
        self.app = app
        self.expected_auth = f"Bearer {api_key}".encode() if api_key is not None else None
        self.expected_admin_auth = f"Bearer {admin_key}".encode() if admin_key is not None else None
        self.max_bytes = max_bytes

    def refusal(self, path: str, authorization: bytes) -> JSONResponse | None:
        """The error for a request whose key does not open `path`; None when it may go on."""
        if path in ADMIN_PATHS:
            if self.expected_admin_auth is None:
                return error_response(404, "runtime LoRA updating is off: start the endpoint with --admin-key "
                                      "(or $TRITIUM_ADMIN_KEY) to load and unload adapters", code="not_found")
            if not hmac.compare_digest(authorization, self.expected_admin_auth):
                return error_response(401, "Incorrect or missing admin key (Authorization: Bearer <admin key>; "
                                      "the API key does not open this route)", code="invalid_api_key")
            return None
        if (self.expected_auth is not None and path.startswith(KEYED_PATHS)
                and not hmac.compare_digest(authorization, self.expected_auth)):
            return error_response(401, "Incorrect or missing API key (Authorization: Bearer ...)",
                                  code="invalid_api_key")
        return None

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        headers = Headers(scope=scope)
        if (refused := self.refusal(scope["path"], headers.get("authorization", "").encode("latin-1"))) is not None:
            await refused(scope, receive, send)
            return
        length = headers.get("content-length")
        if length is not None and not (length.isascii() and length.isdigit()):
            await error_response(400, "Content-Length must be a number of bytes")(scope, receive, send)
            return
        too_large = error_response(413, f"request body over {self.max_bytes} bytes")
        if length is not None and int(length) > self.max_bytes:
            await too_large(scope, receive, send)
            return
        chunks: list[bytes] = []
        size = 0
        while True:
            message = await receive()
            if message["type"] != "http.request":  # the client went away
                return
            chunks.append(message.get("body", b""))
            size += len(chunks[-1])
            if size > self.max_bytes:
                await too_large(scope, receive, send)
                return
            if not message.get("more_body", False):
                break
        body: Message | None = {"type": "http.request", "body": b"".join(chunks), "more_body": False}

        async def replay() -> Message:
            nonlocal body
            if body is None:
                return await receive()  # later calls wait for the disconnect
            message, body = body, None
            return message

        started = False

        async def watch_send(message: Message) -> None:
            nonlocal started
            started = True
            await send(message)

        try:
            await self.app(scope, replay, watch_send)
        except Exception:  # the catch-all: the client gets an id to quote, the log gets the traceback
            request_id = new_request_id()
            logger.exception("request %s (%s %s) failed", request_id, scope.get("method"), scope["path"])
            if not started:
                await internal_error(request_id)(scope, receive, send)


async def _until_disconnected(request: Request) -> None:
    """Returns when the client goes away (RequestGuard forwards receive() calls after the body)."""
    while (await request.receive())["type"] != "http.disconnect":
        pass


async def unless_disconnected(request: Request, work: Awaitable[T]) -> tuple[bool, T | None]:
    """(True, result of `work`), or (False, None) when the client disconnected first: `work` is then
    cancelled (and with it the upstream requests)."""
    task = asyncio.ensure_future(work)
    watcher = asyncio.ensure_future(_until_disconnected(request))
    try:
        await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    finally:  # also when this handler is cancelled
        watcher.cancel()
        if not task.done():
            task.cancel()
            with suppress(asyncio.CancelledError):
                await task
    if task.cancelled():
        return False, None
    return True, task.result()
