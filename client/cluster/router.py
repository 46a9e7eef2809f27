"""Choose the tritonserver replica for a request, and stream from it over gRPC (tritonclient asyncio).

A request goes to the least busy healthy replica, except that requests sharing a prompt prefix prefer one
replica (rendezvous hashing over the first PREFIX_CHARS characters) as long as it is not more than
AFFINITY_SLACK tokens busier than the least busy one, so its prefix cache hits. Busy: the tokens this router
has outstanding there, plus EXTERNAL_REQUEST_TOKENS for each request the replica's engine reports
(`EngineLoad`, from its metrics port, the numbers the endpoint's `/get_load` and `vllm:*` gauges serve) beyond
this router's own: requests another router or client sent it.

Health, every HEALTH_INTERVAL_S: the model is ready (Triton's model-ready call) and, where the metrics port
answers, an engine of it reports serving (`tritium_engine_healthy`). A probe that fails in any way counts
for its round only (not ready, or load unknown); the loop runs as long as the router.

Only what is safe is retried on another replica, and only before the first token: a transport failure
(connection refused, gRPC UNAVAILABLE, a replica that went down; the replica is marked down) and a replica
that refused the request as overloaded (it stays up). A request's own error (invalid request, a failed
model step) is answered as is, once.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import logging
from collections.abc import AsyncIterator
from collections.abc import Set as AbstractSet
from dataclasses import dataclass
from itertools import count
from typing import Any

from tritium.client.cluster.replica_load import EngineLoad, scrape_async
from tritium.client.cluster.upstream import SPEC_FIGURES, Chunk, UpstreamError
from tritium.client.triton.remote import grpc_inputs

logger = logging.getLogger(__name__)
PREFIX_CHARS = 256
AFFINITY_SLACK = 2048
HEALTH_INTERVAL_S = 1.0
EXTERNAL_REQUEST_TOKENS = 256


def classify_error(message: str) -> tuple[int, bool]:
    """(status, overloaded) for an error the replica sent in the stream (the model's or Triton's)."""
    text = message.split("] ", 1)[1] if message.startswith("[StatusCode.") else message
    if text.startswith("overloaded"):
        return 503, True
    if "invalid request" in text:
        return 400, False
    if any(words in text for words in ("unknown model", "is not ready", "no available versions", "shutting down",
                                       "not serving")):
        return 502, False  # this replica does not serve the model (now): another one may
    return 500, False


@dataclass(eq=False)
class Replica:
    """One upstream tritonserver as the router sees it: its gRPC client (None until `Router.start`), its
    health, and what this router has in flight there."""

    url: str
    client: Any
    metrics_url: str | None = None
    healthy: bool = True
    outstanding_tokens: int = 0
    in_flight: int = 0
    streaming: int = 0  # of in_flight, those that streamed a token
    requests_served: int = 0
    load: EngineLoad | None = None  # the last scrape of its metrics port (None: unknown)

    @property
    def known_load(self) -> EngineLoad:
        """The engine's load from its metrics, or, when they are unknown, this router's own requests there."""
        if self.load is not None:
            return self.load
        return EngineLoad.in_flight(self.streaming, self.in_flight - self.streaming)

    @property
    def busy_tokens(self) -> int:
        """The tokens this router has outstanding here, plus EXTERNAL_REQUEST_TOKENS per request its engine
        reports beyond this router's own."""
        external = self.load.requests - self.in_flight if self.load is not None else 0
        return self.outstanding_tokens + max(0, external) * EXTERNAL_REQUEST_TOKENS


def default_metrics_url(grpc_url: str) -> str | None:
    """For a tritonserver on Triton's default ports (gRPC 8001), its metrics URL (port 8002); else None."""
    host, _, port = grpc_url.rpartition(":")
    return f"http://{host}:8002/metrics" if port == "8001" and host else None


def prefix_score(prefix: str, url: str) -> int:
    """The rendezvous-hash weight of replica `url` for a prompt prefix: the highest-scoring replica is
    the prefix's preferred one."""
    return int.from_bytes(hashlib.blake2b(f"{url}\0{prefix}".encode(), digest_size=8).digest(), "big")


class Router:
    """The replicas of one model and the choice among them (see the module's docstring)."""

    def __init__(self, urls: list[str], model: str = "tritium", api_key: str | None = None,
                 metrics_urls: list[str | None] | None = None) -> None:
        """`metrics_urls[i]`: replica i's tritonserver metrics (None: no load or engine health from it)."""
        if metrics_urls is not None and len(metrics_urls) != len(urls):
            raise ValueError(f"{len(metrics_urls)} metrics URLs for {len(urls)} replicas: give one per replica")
        self.model = model
        self.headers = {"triton-grpc-protocol-x-api-key": api_key} if api_key else None
        self.replicas = [Replica(url, None, metrics_urls[i] if metrics_urls else None) for i, url in enumerate(urls)]
        self._ids = count()
        self._health_task: asyncio.Task[None] | None = None

    async def start(self) -> None:
        """Connect (gRPC aio channels belong to the running event loop) and start health checks."""
        import tritonclient.grpc.aio as grpcaio

        for replica in self.replicas:
            replica.client = grpcaio.InferenceServerClient(replica.url)
        await self.check_health()
        self._health_task = asyncio.create_task(self._health_loop())

    async def close(self) -> None:
        """Stop the health checks and close every replica's connection."""
        if self._health_task:
            self._health_task.cancel()
        for r in self.replicas:
            await r.client.close()

    async def check_health(self) -> None:
        """Probe every replica once: its model's readiness and, where it has a metrics URL, its engines'
        load and health. Never raises: what fails is unknown (load) or not ready (health) this round."""
        async def probe(replica: Replica) -> None:
            try:
                replica.load = await scrape_async(replica.metrics_url, self.model) if replica.metrics_url else None
            except Exception:
                logger.exception("reading the load of %s failed", replica.url)
                replica.load = None
            try:
                ready = bool(await asyncio.wait_for(
                    replica.client.is_model_ready(self.model, headers=self.headers), 2.0))
            except Exception:
                ready = False
            load = replica.load
            replica.healthy = ready and (load is None or load.healthy)

        await asyncio.gather(*(probe(r) for r in self.replicas))

    async def _health_loop(self) -> None:
        while True:
            await asyncio.sleep(HEALTH_INTERVAL_S)
            try:
                await self.check_health()
            except Exception:  # never: check_health does not raise; the loop must outlive any surprise
                logger.exception("the health check failed")

    def pick(self, prompt: str, exclude: AbstractSet[str] = frozenset()) -> Replica | None:
        """The replica for `prompt` among the healthy ones not in `exclude` (URLs); None when there is none."""
        healthy = [r for r in self.replicas if r.healthy and r.url not in exclude]
        if not healthy:
            return None
        least = min(healthy, key=lambda r: r.busy_tokens)
        prefix = prompt[:PREFIX_CHARS]
        preferred = max(healthy, key=lambda r: prefix_score(prefix, r.url))
        if preferred.busy_tokens - least.busy_tokens <= AFFINITY_SLACK:
            return preferred
        return least

    async def generate(self, prompt: str, sampling: dict[str, Any], want_logprobs: bool = False
                       ) -> AsyncIterator[Chunk]:
        """Stream a request, retrying on another replica when one fails before its first token.
        Raises UpstreamError (status 503 when no replica is up)."""
        tried: set[str] = set()
        overloaded: list[str] = []
        while True:
            replica = self.pick(prompt, tried)
            if replica is None:
                if overloaded:
                    raise UpstreamError(f"every replica tried is overloaded: {'; '.join(overloaded)}", 503,
                                        overloaded=True)
                raise UpstreamError("no healthy tritonserver replica", status=503)
            tried.add(replica.url)
            cost = min(int(sampling.get("max_tokens", 16)), 1 << 20) + len(prompt) // 4
            replica.outstanding_tokens += cost
            replica.in_flight += 1
            started = False
            try:
                async for chunk in self._stream(replica, prompt, sampling, want_logprobs):
                    if not started:
                        started = True
                        replica.streaming += 1
                    yield chunk
                replica.requests_served += 1
                return
            except UpstreamError as exc:
                if not exc.retryable:
                    raise
                if exc.overloaded:
                    overloaded.append(str(exc))
                    logger.info("%s; trying another replica", exc)
                else:
                    replica.healthy = False
                    logger.warning("%s (before the first token); marked down, retrying elsewhere", exc)
            finally:
                replica.outstanding_tokens -= cost
                replica.in_flight -= 1
                replica.streaming -= started

    async def _stream(self, replica: Replica, prompt: str, sampling: dict[str, Any], want_logprobs: bool
                      ) -> AsyncIterator[Chunk]:
        if want_logprobs:
            sampling = {"logprobs": 0} | sampling
        values: dict[str, str | bool] = {
            "text_input": prompt, "stream": True, "sampling_parameters": json.dumps(sampling),
            "exclude_input_in_output": True, "return_finish_reason": True, "return_num_input_tokens": True,
            "return_num_output_tokens": True, "return_num_cached_tokens": True,
        }
        if want_logprobs:
            values["return_logprobs"] = True
        inputs = grpc_inputs(values)
        request = {"model_name": self.model, "inputs": inputs, "request_id": f"oai-{next(self._ids)}",
                   "enable_empty_final_response": True}

        async def one_request() -> AsyncIterator[dict[str, Any]]:
            yield request

        stream = None
        got_any = False
        try:
            stream = replica.client.stream_infer(one_request(), headers=self.headers)
            async for result, error in stream:
                if error is not None:
                    message = str(error)
                    status, overloaded = classify_error(message)
                    if status == 400:  # the engine's own words about the request: for the client
                        message = message.removeprefix("[StatusCode.INVALID_ARGUMENT] ")
                    else:
                        message = f"{replica.url} ({request['request_id']}): {message}"
                    raise UpstreamError(message, status, not got_any, overloaded)
                response = result.get_response()
                final = response.parameters["triton_final_response"].bool_param
                text = result.as_numpy("text_output")
                if text is None:
                    if final:
                        return
                    continue
                got_any = True
                chunk = Chunk(text=b"".join(text.reshape(-1)).decode("utf-8"), final=final)
                reason = result.as_numpy("finish_reason")
                if reason is not None:
                    chunk.finish_reason = reason.reshape(-1)[0].decode() or None
                for name in ("num_input_tokens", "num_output_tokens", "num_cached_tokens"):
                    value = result.as_numpy(name)
                    if value is not None:
                        setattr(chunk, name, int(value.reshape(-1)[0]))
                lp = result.as_numpy("logprobs")
                if lp is not None:
                    chunk.logprobs = json.loads(lp.reshape(-1)[0].decode())
                figures = {name: result.as_numpy(f"spec_{name}") for name in SPEC_FIGURES}
                if all(v is not None for v in figures.values()):
                    chunk.spec_decoding = {k: int(v.reshape(-1)[0]) for k, v in figures.items() if v is not None}
                yield chunk
                if final:
                    return
        except UpstreamError:
            raise
        except (asyncio.CancelledError, GeneratorExit):  # the client went away: cancel upstream too
            if stream is not None:
                stream.cancel()
            raise
        except Exception as exc:
            raise transport_error(exc, replica.url, request["request_id"], not got_any) from exc


def transport_error(exc: Exception, url: str, request_id: str, before_first_token: bool) -> UpstreamError:
    """An exception from the gRPC call itself. UNAVAILABLE (connection refused or lost, replica down) is the
    replica's failure, 502, retried elsewhere, unless it says the replica is overloaded; any other status
    (or a bad response) fails only this request, 500."""
    import grpc
    from grpc.aio import AioRpcError

    code = exc.code() if isinstance(exc, AioRpcError) else None
    details = (exc.details() or "") if isinstance(exc, AioRpcError) else str(exc)
    if code == grpc.StatusCode.UNAVAILABLE:
        overloaded = details.startswith("overloaded")
        return UpstreamError(f"{url} ({request_id}): {code}: {details}", 503 if overloaded else 502,
                             before_first_token, overloaded)
    status, overloaded = classify_error(details)
    if status == 400 and code == grpc.StatusCode.INVALID_ARGUMENT:  # the engine refused the request itself
        return UpstreamError(details, 400, before_first_token)
    return UpstreamError(f"{url} ({request_id}): {code or type(exc).__name__}: {details}",
                         500 if status in (400, 502) else status, before_first_token, overloaded)
