"""Stream text from a running tritium server: gRPC (`host:port`) or HTTP (`http://host:port`)."""

from __future__ import annotations

import json
import queue
from collections.abc import Iterator
from typing import Any

import numpy as np


def grpc_inputs(values: dict[str, str | bytes | bool]) -> list[Any]:
    """Shape-[1] tritonclient gRPC inputs (also what the asyncio client takes): a bool becomes a BOOL
    tensor, a str (UTF-8) or bytes a BYTES tensor."""
    import tritonclient.grpc as grpcclient

    inputs = []
    for name, value in values.items():
        if isinstance(value, bool):
            dtype, array = "BOOL", np.array([value], dtype=bool)
        else:
            data = value.encode("utf-8") if isinstance(value, str) else value
            dtype, array = "BYTES", np.array([data], dtype=np.object_)
        tensor = grpcclient.InferInput(name, [1], dtype)
        tensor.set_data_from_numpy(array)
        inputs.append(tensor)
    return inputs


def stream_text(url: str, prompt: str, sampling: dict[str, Any], api_key: str | None = None,
                model: str = "tritium", timeout: float = 600.0) -> Iterator[str]:
    """Yield text deltas as the server sends them. Raises RuntimeError with the server's error."""
    if url.startswith(("http://", "https://")):
        yield from _stream_http(url.rstrip("/"), prompt, sampling, api_key, model, timeout)
    else:
        yield from _stream_grpc(url, prompt, sampling, api_key, model, timeout)


def _stream_http(base: str, prompt: str, sampling: dict[str, Any], api_key: str | None, model: str,
                 timeout: float) -> Iterator[str]:
    import requests

    headers = {"x-api-key": api_key} if api_key else {}
    body = {"text_input": prompt, "stream": True, "sampling_parameters": json.dumps(sampling)}
    with requests.post(f"{base}/v2/models/{model}/generate_stream", json=body, headers=headers, stream=True,
                       timeout=timeout) as resp:
        if resp.status_code != 200:
            raise RuntimeError(f"HTTP {resp.status_code}: {resp.text.strip()}")
        for line in resp.iter_lines(decode_unicode=True):
            if line and line.startswith("data:"):
                event = json.loads(line[5:])
                if "error" in event:
                    raise RuntimeError(event["error"])
                yield event.get("text_output", "")


def _stream_grpc(url: str, prompt: str, sampling: dict[str, Any], api_key: str | None, model: str,
                 timeout: float) -> Iterator[str]:
    import tritonclient.grpc as grpcclient

    results: queue.Queue[tuple[Any, Any]] = queue.Queue()
    client = grpcclient.InferenceServerClient(url)
    headers = {"triton-grpc-protocol-x-api-key": api_key} if api_key else None
    inputs = grpc_inputs({"text_input": prompt, "stream": True, "sampling_parameters": json.dumps(sampling)})
    client.start_stream(callback=lambda result, error: results.put((result, error)), headers=headers)
    try:
        client.async_stream_infer(model, inputs, enable_empty_final_response=True)
        while True:
            result, error = results.get(timeout=timeout)
            if error is not None:
                raise RuntimeError(str(error))
            text = result.as_numpy("text_output")
            if text is not None:
                yield b"".join(text.reshape(-1)).decode("utf-8")
            if result.get_response().parameters["triton_final_response"].bool_param:
                return
    finally:
        client.stop_stream(cancel_requests=True)
        client.close()
