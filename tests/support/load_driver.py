"""Many concurrent streams against a running server (gRPC, HTTP SSE, OpenAI), each optionally dropped at
a chosen point, recording every response so tests can check that each request ended exactly once."""

from __future__ import annotations

import asyncio
import json
import time
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from tritium.client.triton.remote import grpc_inputs

PROMPTS = [
    "Once upon a time, in a small village,",
    "The three most important things about databases are",
    "Write a short poem about the sea:",
    "Explain how a paged KV cache works in an inference engine. It",
    "Q: What is the capital of France?\nA:",
    "def fibonacci(n):",
    "In the year 2050, cities will",
    "A recipe for bread needs flour, water, salt and",
]


@dataclass
class Outcome:
    """What one request saw. `finals` counts final responses (must be 1 unless the client dropped it)."""

    kind: str
    sent_at: float
    arrivals: list[float] = field(default_factory=list)  # one per response that carried text
    finals: int = 0
    errors: list[str] = field(default_factory=list)
    dropped: bool = False

    @property
    def ttft_s(self) -> float | None:
        return self.arrivals[0] - self.sent_at if self.arrivals else None

    @property
    def gaps_s(self) -> list[float]:
        return list(np.diff(self.arrivals)) if len(self.arrivals) > 1 else []


async def grpc_request(client: Any, prompt: str, sampling: dict[str, Any], drop_after: int | None = None,
                       drop_delay_s: float = 0.0, headers: dict[str, str] | None = None) -> Outcome:
    """One gRPC stream, read to its end (so a second final response would be seen). With `drop_after`
    the client cancels the call after that many text responses (0: after `drop_delay_s`)."""
    inputs = grpc_inputs({"text_input": prompt, "stream": True, "sampling_parameters": json.dumps(sampling),
                          "return_finish_reason": True})

    async def one() -> Any:
        yield {"model_name": "tritium", "inputs": inputs, "enable_empty_final_response": True}

    out = Outcome("grpc", time.monotonic())
    call = client.stream_infer(one(), headers=headers)
    if drop_after == 0:
        await asyncio.sleep(drop_delay_s)
        call.cancel()
        out.dropped = True
        return out
    try:
        async for result, error in call:
            if error is not None:
                out.errors.append(str(error))
                continue
            if result.as_numpy("text_output") is not None:
                out.arrivals.append(time.monotonic())
            if result.get_response().parameters["triton_final_response"].bool_param:
                out.finals += 1
            if drop_after is not None and len(out.arrivals) >= drop_after:
                call.cancel()
                out.dropped = True
                break
    except asyncio.CancelledError:
        out.dropped = True
    return out


async def http_request(session: Any, base: str, prompt: str, sampling: dict[str, Any],
                       drop_after: int | None = None, drop_delay_s: float = 0.0) -> Outcome:
    """One `generate_stream` (SSE); the response with a finish_reason is the final one. With
    `drop_after` the client closes the connection after that many events."""
    body = {"text_input": prompt, "stream": True, "sampling_parameters": json.dumps(sampling),
            "return_finish_reason": True}
    out = Outcome("http", time.monotonic())
    async with session.post(f"{base}/v2/models/tritium/generate_stream", json=body) as resp:
        if drop_after == 0:
            await asyncio.sleep(drop_delay_s)
            resp.close()
            out.dropped = True
            return out
        if resp.status != 200:
            out.errors.append(f"HTTP {resp.status}: {await resp.text()}")
            return out
        async for raw in resp.content:
            line = raw.decode().strip()
            if not line.startswith("data:"):
                continue
            event = json.loads(line[5:])
            if "error" in event:
                out.errors.append(event["error"])
                continue
            out.arrivals.append(time.monotonic())
            if event.get("finish_reason"):
                out.finals += 1
            if drop_after is not None and len(out.arrivals) >= drop_after:
                resp.close()
                out.dropped = True
                break
    return out


async def openai_request(client: Any, prompt: str, sampling: dict[str, Any], drop_after: int | None = None,
                         drop_delay_s: float = 0.0) -> Outcome:
    """One streamed completion with the official client; with `drop_after` the client closes the stream."""
    out = Outcome("openai", time.monotonic())
    stream = await client.completions.create(model="tritium", prompt=prompt, stream=True, **sampling)
    if drop_after == 0:
        await asyncio.sleep(drop_delay_s)
        await stream.close()
        out.dropped = True
        return out
    async for chunk in stream:
        out.arrivals.append(time.monotonic())
        if chunk.choices and chunk.choices[0].finish_reason:
            out.finals += 1
        if drop_after is not None and len(out.arrivals) >= drop_after:
            await stream.close()
            out.dropped = True
            break
    return out


def percentile(values: list[float], q: float) -> float | None:
    return float(np.percentile(values, q)) if values else None
