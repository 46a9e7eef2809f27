"""`tritium bench serve`: load a running server and report what genai-perf reports, defined as it does.

Per request: TTFT = first streamed response - send time; request latency = final response - send time;
ITL = (latency - TTFT) / (output tokens - 1). Run-wide: output token throughput = output tokens /
duration; request throughput = requests / duration. Closed loop (`--concurrency N`: N clients back to
back) or open loop (`--request-rate R`: Poisson arrivals). Targets: tritonserver gRPC (`--backend triton`)
or any OpenAI-compatible endpoint (`--backend openai`), so other engines can be measured the same way.
"""

from __future__ import annotations

import asyncio
import json
import random
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np
from tqdm import tqdm

from tritium.client.triton.remote import grpc_inputs


@dataclass
class RequestRecord:
    ttft_s: float
    latency_s: float
    output_tokens: int
    itl_s: float | None
    ok: bool
    error: str | None = None
    responses: int = 0  # streamed responses that carried text


def percentiles(values: list[float]) -> dict[str, float]:
    if not values:
        return {}
    arr = np.asarray(values)
    return {"avg": float(arr.mean()), "p50": float(np.percentile(arr, 50)), "p90": float(np.percentile(arr, 90)),
            "p99": float(np.percentile(arr, 99)), "min": float(arr.min()), "max": float(arr.max())}


def synthetic_prompts(n: int, input_len: int, seed: int = 0) -> list[str]:
    """Prompts of about `input_len` tokens of the default tokenizer (random ordinary tokens)."""
    from tritium.backend.models.registry import resolve_model
    from tritium.backend.tokenizer import Tokenizer

    tok = Tokenizer(resolve_model(None))
    rng = random.Random(seed)
    return [tok.decode([rng.randrange(17, tok.vocab_size) for _ in range(input_len)]) for _ in range(n)]


async def triton_request(client: Any, model: str, prompt: str, output_len: int, headers: dict | None) -> RequestRecord:
    sampling = json.dumps({"max_tokens": output_len, "ignore_eos": True, "temperature": 0})
    inputs = grpc_inputs({"text_input": prompt, "stream": True, "sampling_parameters": sampling,
                          "return_num_output_tokens": True})

    async def requests_iter() -> Any:
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
    end = time.perf_counter()
    ttft = (first or end) - start
    itl = (end - start - ttft) / (tokens - 1) if tokens > 1 else None
    return RequestRecord(ttft, end - start, tokens, itl, True, responses=responses)


async def openai_request(client: Any, model: str, prompt: str, output_len: int) -> RequestRecord:
    start = time.perf_counter()
    first: float | None = None
    tokens = 0
    try:
        stream = await client.completions.create(model=model, prompt=prompt, max_tokens=output_len, temperature=0,
                                                 stream=True, stream_options={"include_usage": True},
                                                 extra_body={"ignore_eos": True})
        async for chunk in stream:
            if chunk.choices and chunk.choices[0].text and first is None:
                first = time.perf_counter()
            if chunk.usage is not None:
                tokens = chunk.usage.completion_tokens
    except Exception as exc:
        return RequestRecord(0, time.perf_counter() - start, 0, None, False, str(exc))
    end = time.perf_counter()
    ttft = (first or end) - start
    return RequestRecord(ttft, end - start, tokens, (end - start - ttft) / (tokens - 1) if tokens > 1 else None, True)


async def run_load(send: Any, prompts: list[str], concurrency: int | None, rate: float | None,
                   label: str) -> tuple[list[RequestRecord], float]:
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


def summarize(records: list[RequestRecord], duration: float) -> dict[str, Any]:
    ok = [r for r in records if r.ok]
    tokens = sum(r.output_tokens for r in ok)
    return {
        "requests": len(records), "errors": len(records) - len(ok), "duration_s": duration,
        "time_to_first_token_s": percentiles([r.ttft_s for r in ok]),
        "inter_token_latency_s": percentiles([r.itl_s for r in ok if r.itl_s is not None]),
        "request_latency_s": percentiles([r.latency_s for r in ok]),
        "output_token_throughput_per_s": tokens / duration,
        "request_throughput_per_s": len(ok) / duration,
        "output_tokens": tokens,
        "tokens_per_response": tokens / max(1, sum(getattr(r, "responses", 0) for r in ok)),
    }


def plot(results: list[dict[str, Any]], raw: dict[str, list[RequestRecord]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(15, 4))
    for label, records in raw.items():
        axes[0].hist([r.ttft_s * 1000 for r in records if r.ok], bins=30, alpha=0.5, label=label)
        axes[1].hist([r.itl_s * 1000 for r in records if r.ok and r.itl_s], bins=30, alpha=0.5, label=label)
    axes[0].set_xlabel("TTFT (ms)")
    axes[1].set_xlabel("ITL (ms)")
    for ax in axes[:2]:
        ax.set_ylabel("requests")
        ax.legend()
    xs = [r["load"] for r in results]
    axes[2].plot(xs, [r["output_token_throughput_per_s"] for r in results], "o-", label="output tok/s")
    twin = axes[2].twinx()
    twin.plot(xs, [r["time_to_first_token_s"].get("p50", 0) * 1000 for r in results], "s--", color="tab:red",
              label="TTFT p50 (ms)")
    axes[2].set_xlabel("concurrency" if results and results[0]["mode"] == "concurrency" else "request rate (req/s)")
    axes[2].set_ylabel("output tokens / s")
    twin.set_ylabel("TTFT p50 (ms)")
    axes[2].legend(loc="upper left")
    twin.legend(loc="lower right")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


async def _bench(args: dict[str, Any]) -> dict[str, Any]:
    prompts_all = synthetic_prompts(args["num_requests"], args["input_len"])
    if args["backend"] == "triton":
        import tritonclient.grpc.aio as grpcaio

        client = grpcaio.InferenceServerClient(args["url"])
        headers = {"triton-grpc-protocol-x-api-key": args["api_key"]} if args["api_key"] else None

        async def send(p: str) -> RequestRecord:
            return await triton_request(client, args["model"], p, args["output_len"], headers)
    else:
        from openai import AsyncOpenAI

        client = AsyncOpenAI(base_url=args["url"], api_key=args["api_key"] or "none", max_retries=0)

        async def send(p: str) -> RequestRecord:
            return await openai_request(client, args["model"], p, args["output_len"])

    await send(prompts_all[0])  # warm-up
    results, raw = [], {}
    loads = args["request_rates"] or args["concurrency"]
    mode = "request_rate" if args["request_rates"] else "concurrency"
    for load in loads:
        label = f"{mode}={load}"
        records, duration = await run_load(send, prompts_all, None if mode == "request_rate" else int(load),
                                           float(load) if mode == "request_rate" else None, label)
        summary = summarize(records, duration) | {"mode": mode, "load": load}
        results.append(summary)
        raw[label] = records
    await client.close()
    return {"results": results, "raw": raw}


def run_serve_benchmark(url: str, backend: str = "triton", model: str = "tritium", concurrency: list[int] | None = None,
                        request_rates: list[float] | None = None, num_requests: int = 32, input_len: int = 128,
                        output_len: int = 64, api_key: str | None = None, out_dir: str = "bench_results") -> dict:
    """Run the sweep, print a table, write `serve.json` and `serve.png`; returns the JSON dict."""
    args = {"url": url, "backend": backend, "model": model, "concurrency": concurrency or [1, 8, 32],
            "request_rates": request_rates, "num_requests": num_requests, "input_len": input_len,
            "output_len": output_len, "api_key": api_key}
    outcome = asyncio.run(_bench(args))
    results = outcome["results"]
    print(f"\n{backend} {url} model={model}, {num_requests} requests, ~{input_len} in / {output_len} out tokens")
    print(f"{'load':>10}{'TTFT p50':>10}{'TTFT p99':>10}{'ITL p50':>9}{'ITL p99':>9}{'lat p50':>9}"
          f"{'out tok/s':>11}{'req/s':>8}{'errors':>8}")
    for r in results:
        t, i, lat = r["time_to_first_token_s"], r["inter_token_latency_s"], r["request_latency_s"]
        print(f"{r['load']:>10}{t.get('p50', 0) * 1e3:>8.0f}ms{t.get('p99', 0) * 1e3:>8.0f}ms"
              f"{i.get('p50', 0) * 1e3:>7.0f}ms{i.get('p99', 0) * 1e3:>7.0f}ms{lat.get('p50', 0):>8.2f}s"
              f"{r['output_token_throughput_per_s']:>11.1f}{r['request_throughput_per_s']:>8.2f}{r['errors']:>8}")
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    report = {"target": {k: v for k, v in args.items() if k != "api_key"}, "results": results,
              "requests": {k: [asdict(r) for r in v] for k, v in outcome["raw"].items()}}
    (out / "serve.json").write_text(json.dumps(report, indent=2))
    plot(results, outcome["raw"], out / "serve.png")
    print(f"wrote {out / 'serve.json'} and {out / 'serve.png'}")
    return report
