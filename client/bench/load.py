"""How the serving benchmarks load a server: one streamed request, timed, over Triton's gRPC or an
OpenAI-compatible endpoint, and the closed or open loop that sends a prompt list through it.

Every request asks for greedy output of exactly `output_len` tokens (ignore_eos) and is timed from send to
its first output with text and to its final output (`report.RequestRecord`).
"""

from __future__ import annotations

import asyncio
import json
import random
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any, Literal, Protocol

from tqdm import tqdm

from tritium.client.bench.report import RequestRecord
from tritium.client.triton.remote import grpc_inputs

Backend = Literal["triton", "openai"]


class Send(Protocol):
    """Sends one prompt and returns its record (`output_len`: that request's own, else the target's)."""

    async def __call__(self, prompt: str, output_len: int | None = None) -> RequestRecord:
        """Send `prompt`; returns its record."""
        ...


async def triton_request(client: Any, model: str, prompt: str, output_len: int,
                         headers: dict[str, str] | None = None) -> RequestRecord:
    """One streamed request through a `tritonclient.grpc.aio` client; a stream error is a failed record
    (never raised). Counts the responses that carried text."""
    sampling = json.dumps({"max_tokens": output_len, "ignore_eos": True, "temperature": 0})
    inputs = grpc_inputs({"text_input": prompt, "stream": True, "sampling_parameters": sampling,
                          "return_num_output_tokens": True})

    async def requests_iter() -> AsyncIterator[dict[str, Any]]:
        yield {"model_name": model, "inputs": inputs, "enable_empty_final_response": True}

    start = time.perf_counter()
    first: float | None = None
    tokens = responses = 0
    async for result, error in client.stream_infer(requests_iter(), headers=headers):
        now = time.perf_counter()
        if error is not None:
            return RequestRecord(0, now - start, 0, None, False, str(error))
        text = result.as_numpy("text_output")
        if text is not None:
            first = now if first is None else first
            responses += bool(text.size and len(text.reshape(-1)[0]))
        count = result.as_numpy("num_output_tokens")
        if count is not None:
            tokens = int(count.reshape(-1)[0])
        if result.get_response().parameters["triton_final_response"].bool_param:
            break
    return _record(start, first, time.perf_counter(), tokens, responses)


async def openai_request(client: Any, model: str, prompt: str, output_len: int) -> RequestRecord:
    """One streamed `/v1/completions` request through an `openai.AsyncOpenAI` client (token count from the
    final usage chunk); any failure is a failed record with its text (never raised). Counts the chunks that
    carried text, so that a hop which re-batches the stream shows as tokens per response > 1."""
    start = time.perf_counter()
    first: float | None = None
    tokens = chunks = 0
    try:
        stream = await client.completions.create(model=model, prompt=prompt, max_tokens=output_len, temperature=0,
                                                 stream=True, stream_options={"include_usage": True},
                                                 extra_body={"ignore_eos": True})
        async for chunk in stream:
            if chunk.choices and chunk.choices[0].text:
                first = time.perf_counter() if first is None else first
                chunks += 1
            if chunk.usage is not None:
                tokens = chunk.usage.completion_tokens
    except Exception as exc:  # any failure is a failed request, reported with its text
        return RequestRecord(0, time.perf_counter() - start, 0, None, False, f"{type(exc).__name__}: {exc}")
    return _record(start, first, time.perf_counter(), tokens, chunks)


def _record(start: float, first: float | None, end: float, tokens: int, responses: int) -> RequestRecord:
    ttft = (first or end) - start
    itl = (end - start - ttft) / (tokens - 1) if tokens > 1 else None
    return RequestRecord(ttft, end - start, tokens, itl, True, responses=responses)


@asynccontextmanager
async def connect(backend: Backend, url: str, model: str, output_len: int,
                  api_key: str | None = None) -> AsyncIterator[Send]:
    """A `Send` to the target, its client closed on exit. `triton`: `url` is a gRPC host:port (the key goes in
    x-api-key); `openai`: a base URL ending in /v1 (the key as the bearer token)."""
    if backend == "triton":
        import tritonclient.grpc.aio as grpcaio

        client = grpcaio.InferenceServerClient(url)
        headers = {"triton-grpc-protocol-x-api-key": api_key} if api_key else None

        async def send(prompt: str, length: int | None = None) -> RequestRecord:
            return await triton_request(client, model, prompt, length or output_len, headers)
    else:
        from openai import AsyncOpenAI

        client = AsyncOpenAI(base_url=url, api_key=api_key or "none", max_retries=0)

        async def send(prompt: str, length: int | None = None) -> RequestRecord:
            return await openai_request(client, model, prompt, length or output_len)
    try:
        yield send
    finally:
        await client.close()


async def run_load(send: Send, prompts: list[str], concurrency: int | None, rate: float | None,
                   label: str) -> tuple[list[RequestRecord], float]:
    """Send every prompt once; returns the records (in completion order) and the wall time. Closed loop when
    `rate` is None (`concurrency` clients back to back), else open loop (Poisson arrivals at `rate` req/s,
    seeded)."""
    records: list[RequestRecord] = []
    bar = tqdm(total=len(prompts), desc=label, unit="req")
    start = time.perf_counter()
    if rate is None:
        queue: asyncio.Queue[str] = asyncio.Queue()
        for p in prompts:
            queue.put_nowait(p)

        async def worker() -> None:
            while not queue.empty():
                records.append(await send(queue.get_nowait()))
                bar.update(1)

        await asyncio.gather(*(worker() for _ in range(concurrency or 1)))
    else:
        rng = random.Random(1)
        tasks = []

        async def one(p: str) -> None:
            records.append(await send(p))
            bar.update(1)

        for p in prompts:
            tasks.append(asyncio.create_task(one(p)))
            await asyncio.sleep(rng.expovariate(rate))
        await asyncio.gather(*tasks)
    bar.close()
    return records, time.perf_counter() - start
