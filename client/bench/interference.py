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

from tritium.client.triton.remote import grpc_inputs

BIG_PROMPT_VARIANTS = 4
WORDS = ["the", "quick", "brown", "fox", "jumps", "over", "a", "lazy", "dog", "while", "seven", "wizards"]


@dataclass
class Phase:
    itl_p50_ms: float
    itl_p99_ms: float
    itl_max_ms: float
    tokens: int
    big_prompts_sent: int


@dataclass
class InterferenceReport:
    streams: int
    output_len: int
    big_prompt_kib: int
    alone: Phase
    with_big_prompts: Phase

    @property
    def p99_ratio(self) -> float:
        return self.with_big_prompts.itl_p99_ms / self.alone.itl_p99_ms


def big_prompt(kib: int, salt: int) -> str:
    words, size, i = [], 0, salt
    while size < kib * 1024:
        word = WORDS[i % len(WORDS)] + str(i % 97)
        words.append(word)
        size += len(word) + 1
        i += 7
    return " ".join(words)


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
    return Phase(float(np.percentile(gaps, 50)), float(np.percentile(gaps, 99)), float(gaps.max()),
                 sum(len(a) for a in arrivals), sent)


def run_interference_benchmark(grpc_url: str = "127.0.0.1:8001", http_url: str = "http://127.0.0.1:8000",
                               streams: int = 16, output_len: int = 64, big_prompt_kib: int = 500,
                               out_dir: str | None = "bench_results") -> InterferenceReport:
    asyncio.run(_phase(grpc_url, http_url, 2, 4, None))  # warm-up
    alone = asyncio.run(_phase(grpc_url, http_url, streams, output_len, None))
    loaded = asyncio.run(_phase(grpc_url, http_url, streams, output_len, big_prompt_kib))
    report = InterferenceReport(streams, output_len, big_prompt_kib, alone, loaded)
    print(f"{streams} streams x {output_len} tokens; big prompts of {big_prompt_kib} KiB arriving back to back")
    for name, phase in (("alone", alone), ("with big prompts", loaded)):
        print(f"  {name:17s} ITL p50 {phase.itl_p50_ms:7.1f} ms  p99 {phase.itl_p99_ms:7.1f} ms  "
              f"max {phase.itl_max_ms:7.1f} ms  ({phase.big_prompts_sent} big prompts)")
    print(f"  ITL p99 with / without: {report.p99_ratio:.2f}x")
    if out_dir:
        path = Path(out_dir)
        path.mkdir(parents=True, exist_ok=True)
        data = asdict(report) | {"p99_ratio": report.p99_ratio}
        (path / "interference.json").write_text(json.dumps(data, indent=2))
    return report
