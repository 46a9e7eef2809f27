"""LoRA adapters on the OpenAI endpoint, as vLLM serves them: which adapters the upstream tritonservers hold
(`AdapterCatalog`, from each replica's `list` admin action, cached for LIST_MAX_AGE_S), and vLLM's runtime
routes `POST /v1/load_lora_adapter` and `/v1/unload_lora_adapter` (`add_lora_routes`), which RequestGuard
keeps behind the admin key and which go to every replica.

An adapter is served when every replica that answered lists it (requests may go to any replica). A load that
fails on some replica is undone on the others, so the replicas keep agreeing; the client learns which replica
(by its index in `--upstream` order, never its address) failed and why.
"""

from __future__ import annotations

import asyncio
import json
import logging
import math
import time
from collections.abc import AsyncIterator
from collections.abc import Set as AbstractSet
from dataclasses import dataclass, field
from itertools import count
from typing import Any, Literal

from fastapi import FastAPI
from fastapi.responses import JSONResponse, PlainTextResponse
from pydantic import BaseModel, ConfigDict, Field, field_validator

from tritium.client.cluster.router import Replica, Router, classify_error
from tritium.client.cluster.upstream import UpstreamError
from tritium.client.openai.protocol import error_response, utf8_text
from tritium.client.triton.remote import grpc_inputs

logger = logging.getLogger(__name__)
LIST_MAX_AGE_S = 5.0  # adapters loaded on a tritonserver directly show up within this
MISS_REFRESH_S = 1.0  # an unknown model name re-reads the lists at most this often
ADMIN_TIMEOUT_S = 60.0  # a load reads and checks the adapter's weights
LIST_TIMEOUT_S = 2.0
_REFUSED = ("forbidden:", "lora_admin refused:")  # how the model's refusal of a wrong, missing or unset key begins


@dataclass(frozen=True)
class Adapter:
    """One adapter as a replica lists it: `path` is the folder it was loaded from."""

    name: str
    path: str
    rank: int | None = None


@dataclass
class AdapterList:
    """What one replica's `list` action answered (`max_loras` 0: LoRA is off there)."""

    adapters: dict[str, Adapter] = field(default_factory=dict)
    max_loras: int = 0


def parse_list(text: str) -> AdapterList:
    """The `list` action's reply `{"adapters": [{"name", "path", "rank", "targets"}], "max_loras": N}`.
    Raises ValueError when it is not that shape."""
    reply = json.loads(text)
    if not isinstance(reply, dict) or not isinstance(reply.get("adapters"), list):
        raise ValueError("not an adapter list")
    adapters = {}
    for entry in reply["adapters"]:
        if not isinstance(entry, dict) or not isinstance(entry.get("name"), str):
            raise ValueError("an adapter entry without a name")
        rank = entry.get("rank")
        adapters[entry["name"]] = Adapter(entry["name"], str(entry.get("path", "")),
                                          rank if isinstance(rank, int) else None)
    max_loras = reply.get("max_loras")
    return AdapterList(adapters, max_loras if isinstance(max_loras, int) else 0)


def common_adapters(lists: list[AdapterList]) -> dict[str, Adapter]:
    """The adapters every list holds (as the first list has them), in the first list's order."""
    if not lists:
        return {}
    return {name: a for name, a in lists[0].adapters.items() if all(name in other.adapters for other in lists[1:])}


def admin_status(message: str) -> int:
    """The status of a replica's error for an admin action: 403 a refused admin key, else the router's
    classification (400 the adapter or the request, 502 the replica does not serve the model, 500 other)."""
    if (message.split("] ", 1)[1] if message.startswith("[StatusCode.") else message).startswith(_REFUSED):
        return 403
    return classify_error(message)[0]


class AdminClient:
    """Sends admin actions (`lora_admin` request parameter) to the router's replicas."""

    def __init__(self, router: Router) -> None:
        self.router = router
        self._ids = count()

    async def call(self, replica: Replica, action: dict[str, Any], admin_key: str | None = None,
                   timeout: float = ADMIN_TIMEOUT_S) -> str:
        """The text_output of one admin action on `replica`. Raises UpstreamError (its message may name the
        replica: log it, never show it) with the status of `admin_status`, 502 when the replica cannot be
        reached, 504 past `timeout` seconds."""
        if replica.client is None:
            raise UpstreamError(f"{replica.url}: not connected", 502)
        parameters: dict[str, str] = {"lora_admin": json.dumps(action)}
        if admin_key is not None:
            parameters["admin_key"] = admin_key
        request = {"model_name": self.router.model, "inputs": grpc_inputs({"text_input": ""}),
                   "request_id": f"oai-admin-{next(self._ids)}", "parameters": parameters,
                   "enable_empty_final_response": True}

        async def one_request() -> AsyncIterator[dict[str, Any]]:
            yield request

        async def run(client: Any) -> str:
            text = ""
            stream = client.stream_infer(one_request(), headers=self.router.headers)
            try:
                async for result, error in stream:
                    if error is not None:
                        message = str(error)
                        raise UpstreamError(message.split("] ", 1)[1] if message.startswith("[StatusCode.") else
                                            message, admin_status(message))
                    out = result.as_numpy("text_output")
                    if out is not None:
                        text += b"".join(out.reshape(-1)).decode("utf-8")
                    if result.get_response().parameters["triton_final_response"].bool_param:
                        break
            finally:  # the request is over (or failed): close its gRPC stream now, not when it is collected
                stream.cancel()
            return text

        try:
            return await asyncio.wait_for(run(replica.client), timeout)
        except UpstreamError:
            raise
        except TimeoutError:
            raise UpstreamError(f"{replica.url}: no answer within {timeout:g} s", 504) from None
        except Exception as exc:
            raise UpstreamError(f"{replica.url}: {type(exc).__name__}: {exc}", 502) from exc


class AdapterCatalog:
    """The adapters the upstreams serve, read with the `list` action at most every LIST_MAX_AGE_S (and at
    most every MISS_REFRESH_S when a request names an unknown model)."""

    def __init__(self, router: Router, admin: AdminClient) -> None:
        self.router = router
        self.admin = admin
        self.adapters: dict[str, Adapter] = {}
        self.max_loras = 0
        self._fetched_at = -math.inf
        self._lock = asyncio.Lock()

    async def current(self, max_age: float = LIST_MAX_AGE_S) -> dict[str, Adapter]:
        """The served adapters by name, re-read when the last reading is older than `max_age`."""
        async with self._lock:
            if time.monotonic() - self._fetched_at > max_age:
                await self._refresh()
        return self.adapters

    async def lookup(self, name: str) -> Adapter | None:
        """The served adapter `name`; None when no replica serves it (after a fresh reading, at most every
        MISS_REFRESH_S, in case it was loaded on a tritonserver directly)."""
        adapters = await self.current()
        if name not in adapters:
            adapters = await self.current(MISS_REFRESH_S)
        return adapters.get(name)

    def invalidate(self) -> None:
        """Make the next `current` re-read the lists (after a load or an unload)."""
        self._fetched_at = -math.inf

    async def _refresh(self) -> None:
        """Read every healthy replica's list; those that fail are left out (logged). When none answers, the
        last reading is kept."""
        replicas = [r for r in self.router.replicas if r.healthy]
        replies = await asyncio.gather(
            *(self.admin.call(r, {"action": "list"}, timeout=LIST_TIMEOUT_S) for r in replicas),
            return_exceptions=True)
        lists = []
        for replica, reply in zip(replicas, replies, strict=True):
            try:
                if isinstance(reply, BaseException):
                    raise reply
                lists.append(parse_list(reply))
            except Exception as exc:  # an upstream without LoRA admin, or down: it lists nothing this round
                logger.info("listing the LoRA adapters of %s failed: %s", replica.url, exc)
        self._fetched_at = time.monotonic()
        if lists:
            self.adapters = common_adapters(lists)
            self.max_loras = max(item.max_loras for item in lists)


class _AdminBody(BaseModel):
    model_config = ConfigDict(extra="forbid")

    lora_name: str = Field(min_length=1, max_length=256)

    _check_utf8 = field_validator("lora_name")(utf8_text)


class LoadLoraAdapter(_AdminBody):
    """vLLM's LoadLoRAAdapterRequest (`load_inplace` only false: unload first to replace an adapter)."""

    lora_path: str = Field(min_length=1, max_length=4096)
    load_inplace: Literal[False] = False

    _check_path_utf8 = field_validator("lora_path")(utf8_text)


class UnloadLoraAdapter(_AdminBody):
    """vLLM's UnloadLoRAAdapterRequest (`lora_int_id` accepted and ignored)."""

    lora_int_id: int | None = None


@dataclass
class ReplicaOutcome:
    """One replica's answer to an admin action: its index in `--upstream` order, and the error if it failed."""

    index: int
    error: UpstreamError | None = None


def failure_response(outcomes: list[ReplicaOutcome], replicas: int, what: str) -> JSONResponse:
    """The error for an admin action some replica failed: 400 when every failure was the adapter's or the
    request's (the engine's words passed on), else 502 (503 with one replica down; 500 internal); each failed
    replica named by its index, never by its address."""
    failed = [o for o in outcomes if o.error is not None]
    parts = []
    for outcome in failed:
        assert outcome.error is not None
        status = outcome.error.status
        reason = (str(outcome.error) if status == 400 else
                  "it refused the endpoint's admin key (the endpoint's --admin-key must be the tritonservers' "
                  "TRITIUM_ADMIN_KEY)" if status == 403 else
                  "it cannot be reached" if status in (502, 503) else
                  "no answer in time" if status == 504 else "internal error (see the endpoint's log)")
        parts.append(reason if replicas == 1 else f"replica {outcome.index} of {replicas}: {reason}")
    statuses = {o.error.status for o in failed if o.error is not None}
    status = 400 if statuses == {400} else 502 if replicas > 1 or statuses & {403, 502, 503, 504} else 500
    kind = "invalid_request_error" if status == 400 else "server_error"
    return error_response(status, f"{what}: {'; '.join(parts)}", kind=kind, param="lora_name" if status == 400
                          else None)


def add_lora_routes(app: FastAPI, router: Router, catalog: AdapterCatalog, base_names: AbstractSet[str],
                    admin_key: str | None) -> None:
    """vLLM's runtime LoRA routes (an adapter may not take one of the base model's `base_names`). Without an
    admin key they are not added (RequestGuard answers 404 for them, saying why); with one, RequestGuard has
    checked `Authorization: Bearer <admin key>` before they run."""
    if admin_key is None:
        return
    admin = catalog.admin

    async def on_every_replica(action: dict[str, Any]) -> list[ReplicaOutcome]:
        async def one(index: int, replica: Replica) -> ReplicaOutcome:
            try:
                await admin.call(replica, action, admin_key)
            except UpstreamError as exc:
                logger.warning("LoRA %s on %s failed: %s", action["action"], replica.url, exc)
                return ReplicaOutcome(index, exc)
            return ReplicaOutcome(index)

        outcomes = list(await asyncio.gather(*(one(i, r) for i, r in enumerate(router.replicas))))
        catalog.invalidate()
        return outcomes

    @app.post("/v1/load_lora_adapter", response_model=None)
    async def load_lora_adapter(body: LoadLoraAdapter) -> PlainTextResponse | JSONResponse:
        name = body.lora_name
        if name in base_names:
            return error_response(400, f"lora_name: {name!r} is the base model's name", param="lora_name")
        if name in await catalog.current(MISS_REFRESH_S):
            return error_response(400, f"The lora adapter '{name}' has already been loaded.", param="lora_name")
        outcomes = await on_every_replica({"action": "load", "lora_name": name, "lora_path": body.lora_path})
        if any(o.error is not None for o in outcomes):
            loaded = [router.replicas[o.index] for o in outcomes if o.error is None]
            for replica in loaded:  # undo, so that the replicas keep agreeing
                try:
                    await admin.call(replica, {"action": "unload", "lora_name": name}, admin_key)
                except UpstreamError as exc:
                    logger.error("undoing the load of LoRA adapter %s on %s failed: %s", name, replica.url, exc)
            return failure_response(outcomes, len(router.replicas), f"loading LoRA adapter {name!r} failed")
        return PlainTextResponse(f"Success: LoRA adapter '{name}' added successfully.")

    @app.post("/v1/unload_lora_adapter", response_model=None)
    async def unload_lora_adapter(body: UnloadLoraAdapter) -> PlainTextResponse | JSONResponse:
        name = body.lora_name
        if name not in await catalog.current(MISS_REFRESH_S):
            return error_response(404, f"The lora adapter '{name}' cannot be found.", kind="not_found_error",
                                  param="lora_name")
        outcomes = await on_every_replica({"action": "unload", "lora_name": name})
        if any(o.error is not None for o in outcomes):
            return failure_response(outcomes, len(router.replicas), f"unloading LoRA adapter {name!r} failed")
        return PlainTextResponse(f"Success: LoRA adapter '{name}' removed successfully.")
