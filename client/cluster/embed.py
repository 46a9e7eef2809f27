"""One embedding from the upstream tritonservers' `tritium_embed` model: a non-streamed gRPC infer on the replica the
router picks, retried elsewhere only when the replica failed or was overloaded (client/cluster/router.py's rules)."""

from __future__ import annotations

from typing import Any

import numpy as np

from tritium.client.cluster.router import Router, classify_error, transport_error
from tritium.client.cluster.upstream import UpstreamError

EMBED_MODEL = "tritium_embed"


def embed_inputs(item: str | list[int]) -> list[Any]:
    """tritonclient gRPC inputs: `text_input` for a text, `input_ids` for token ids."""
    import tritonclient.grpc as grpcclient

    if isinstance(item, str):
        tensor = grpcclient.InferInput("text_input", [1], "BYTES")
        tensor.set_data_from_numpy(np.array([item.encode("utf-8")], dtype=np.object_))
    else:
        tensor = grpcclient.InferInput("input_ids", [len(item)], "INT32")
        tensor.set_data_from_numpy(np.array(item, dtype=np.int32))
    return [tensor]


async def embed_one(router: Router, item: str | list[int], request_id: str, model: str = EMBED_MODEL
                    ) -> tuple[np.ndarray, int]:
    """(the fp32 vector, its input tokens). Raises UpstreamError: 400 the model refused the input (its words), 404 no
    replica tried serves `model`, 503 no replica up or every one overloaded, 500 otherwise."""
    tried: set[str] = set()
    prompt = item if isinstance(item, str) else " ".join(map(str, item[:64]))
    last: UpstreamError | None = None
    unserved = 0  # replicas that answered they have no such model
    while (replica := router.pick(prompt, tried)) is not None:
        tried.add(replica.url)
        replica.in_flight += 1
        try:
            result = await replica.client.infer(model_name=model, inputs=embed_inputs(item), request_id=request_id,
                                                headers=router.headers)
        except Exception as exc:
            last = upstream_failure(exc, replica.url, request_id)
            if "unknown model" in str(last).lower():
                unserved += 1
                continue
            if not last.retryable:
                raise last from exc
            if replica_down(exc) and not last.overloaded:
                replica.healthy = False  # the health loop brings it back
            continue
        finally:
            replica.in_flight -= 1
        vector = result.as_numpy("embedding")
        tokens = result.as_numpy("num_input_tokens")
        if vector is None or tokens is None:
            raise UpstreamError(f"{replica.url} ({request_id}): the response has no embedding", 500)
        return vector.reshape(-1).astype(np.float32), int(tokens.reshape(-1)[0])
    if tried and unserved == len(tried):
        raise UpstreamError(f"no replica serves {model} ({request_id})", 404)
    raise last or UpstreamError("no replica is up", 503, overloaded=False)


def upstream_failure(exc: Exception, url: str, request_id: str) -> UpstreamError:
    """A failed infer as an UpstreamError: the model's refusal of the input is a 400 in its own words; a replica
    that is down (gRPC UNAVAILABLE, not overloaded) or does not serve the model (now) is a 502, tried elsewhere."""
    from tritonclient.utils import InferenceServerException

    if not isinstance(exc, InferenceServerException):
        return transport_error(exc, url, request_id, True)
    message = exc.message() or str(exc)
    status, overloaded = classify_error(message)
    if status == 400:
        return UpstreamError(message.removeprefix("invalid request: "), 400)
    if overloaded:
        return UpstreamError(f"{url} ({request_id}): {message}", 503, True, True)
    down = replica_down(exc)
    return UpstreamError(f"{url} ({request_id}): {message}", 502 if down or status == 502 else 500)


def replica_down(exc: Exception) -> bool:
    """Whether the call failed because the replica is unreachable (gRPC UNAVAILABLE)."""
    return "UNAVAILABLE" in str(getattr(exc, "status", lambda: "")() or "")
