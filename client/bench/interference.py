"""Do big prompts stall running streams? (`tritium bench interference`)

Against a running server: `streams` greedy streams run alone, then again while large prompts keep arriving
over HTTP (`big_prompt_kib` KiB each, one after the other: their tokenization is the work under test; they
are too long for the context, so the server refuses each once it has tokenized it). Reports the
inter-token latency of the streams in both phases and their ratio.
"""

from __future__ import annotations

import asyncio
import json
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np

from tritium.client.bench.report import MS, distribution, write_report
from tritium.client.bench.workload import big_prompt
from tritium.client.triton.remote import grpc_inputs

BIG_PROMPT_VARIANTS = 4


@dataclass
class Phase:
    """One phase's streams: the gaps between their streamed responses (one token each), as AIPerf's
    `inter_token_latency` block in ms; the responses received and the big prompts sent meanwhile."""

    inter_token_latency: dict[str, Any]
    tokens: int
    big_prompts_sent: int


@dataclass
class InterferenceReport:
    """Both phases of a run and its settings."""

    streams: int
    output_len: int
    big_prompt_kib: int
    alone: Phase
    with_big_prompts: Phase

    @property
    def p99_ratio(self) -> float:
        """ITL p99 with big prompts arriving / alone."""
        return self.with_big_prompts.inter_token_latency["p99"] / self.alone.inter_token_latency["p99"]


async def _stream(client: Any, prompt: str, output_len: int, arrivals: list[float]) -> None:
    sampling = {"max_tokens": output_len, "temperature": 0, "ignore_eos": True}
    inputs = grpc_inputs({"text_input": prompt, "stream": True, "sampling_parameters": json.dumps(sampling)})

    async def one() -> Any:
        yield {"model_name": "tritium", "inputs": inputs, "enable_empty_final_response": True}

    async for result, error in client.stream_infer(one()):
        if error is not None:
            raise RuntimeError(f"stream failed: {error}")
        if result.as_numpy("text_output") is not None:
            arrivals.append(time.monotonic())
        if result.get_response().parameters["triton_final_response"].bool_param:
            return


async def _big_prompts(http_url: str, kib: int, stop: asyncio.Event) -> int:
    import aiohttp

    sent = 0
    # Built before the phase: the client's own CPU time must not be what slows the server's streams.
    prompts = [big_prompt(kib, salt) for salt in range(BIG_PROMPT_VARIANTS)]
    async with aiohttp.ClientSession() as session:
        while not stop.is_set():
            body = {"text_input": prompts[sent % len(prompts)] + f" {sent}", "max_tokens": 4}
            async with session.post(f"{http_url}/v2/models/tritium/generate", json=body) as resp:
                await resp.read()
            sent += 1
    return sent


async def _phase(grpc_url: str, http_url: str, streams: int, output_len: int, kib: int | None) -> Phase:
    import tritonclient.grpc.aio as grpcaio

    client = grpcaio.InferenceServerClient(grpc_url)
    arrivals: list[list[float]] = [[] for _ in range(streams)]
    stop = asyncio.Event()
    flood = asyncio.create_task(_big_prompts(http_url, kib, stop)) if kib else None
    if flood:
        await asyncio.sleep(0.5)  # the first big prompt is being tokenized when the streams start
    try:
        await asyncio.gather(*(_stream(client, f"Story {i}: once upon a time", output_len, arrivals[i])
                               for i in range(streams)))
    finally:
        stop.set()
        sent = await flood if flood else 0
        await client.close()
    gaps = np.concatenate([np.diff(a) for a in arrivals if len(a) > 1]) * 1000
    return Phase(distribution(gaps, MS), sum(len(a) for a in arrivals), sent)


def run_interference_benchmark(grpc_url: str = "127.0.0.1:8001", http_url: str = "http://127.0.0.1:8000",
                               streams: int = 16, output_len: int = 64, big_prompt_kib: int = 500,
                               out_dir: str | Path | None = "bench_results") -> InterferenceReport:
    """Warm up, then both phases against the server at `grpc_url` / `http_url`; print the ITL of each and
    their p99 ratio, and (with `out_dir`) write `interference.json`. Raises RuntimeError when a stream fails."""
    asyncio.run(_phase(grpc_url, http_url, 2, 4, None))  # warm-up
    alone = asyncio.run(_phase(grpc_url, http_url, streams, output_len, None))
    loaded = asyncio.run(_phase(grpc_url, http_url, streams, output_len, big_prompt_kib))
    report = InterferenceReport(streams, output_len, big_prompt_kib, alone, loaded)
    print(f"{streams} streams x {output_len} tokens; big prompts of {big_prompt_kib} KiB arriving back to back")
    for name, phase in (("alone", alone), ("with big prompts", loaded)):
        itl = phase.inter_token_latency
        print(f"  {name:17s} ITL p50 {itl['p50']:7.1f} ms  p99 {itl['p99']:7.1f} ms  "
              f"max {itl['max']:7.1f} ms  ({phase.big_prompts_sent} big prompts)")
    print(f"  ITL p99 with / without: {report.p99_ratio:.2f}x")
    if out_dir:
        write_report(out_dir, "interference", asdict(report) | {"p99_ratio": report.p99_ratio})
    return report
