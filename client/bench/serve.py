"""`tritium bench serve`: load a running server and report what genai-perf / AIPerf report, defined as they do.

Workload: `num_requests` prompts of ~`input_len` random ordinary tokens (workload.synthetic_prompts), greedy,
`output_len` tokens each (ignore_eos), swept over closed-loop concurrencies (`--concurrency N`: N clients
back to back) or open-loop rates (`--request-rate R`: Poisson arrivals). Targets: tritonserver gRPC
(`--backend triton`) or any OpenAI-compatible endpoint (`--backend openai`), so other engines can be measured
the same way. Per load point the summary of report.summarize (AIPerf's names and units); writes `serve.json`
and `serve.png`.
"""

from __future__ import annotations

import asyncio
from dataclasses import asdict
from pathlib import Path
from typing import Any

from tritium.client.bench.load import Backend, connect, run_load
from tritium.client.bench.report import RequestRecord, pyplot, save_figure, stat, summarize, write_report
from tritium.client.bench.workload import synthetic_prompts


def plot(results: list[dict[str, Any]], raw: dict[str, list[RequestRecord]], path: Path) -> None:
    """TTFT and ITL histograms per load point, and throughput / TTFT p50 against the load."""
    plt = pyplot()
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
    axes[2].plot(xs, [stat(r, "output_token_throughput") for r in results], "o-", label="output tok/s")
    twin = axes[2].twinx()
    twin.plot(xs, [stat(r, "time_to_first_token", "p50") for r in results], "s--", color="tab:red",
              label="TTFT p50 (ms)")
    axes[2].set_xlabel("concurrency" if results and results[0]["mode"] == "concurrency" else "request rate (req/s)")
    axes[2].set_ylabel("output tokens / s")
    twin.set_ylabel("TTFT p50 (ms)")
    axes[2].legend(loc="upper left")
    twin.legend(loc="lower right")
    save_figure(fig, path)


async def _sweep(target: dict[str, Any]) -> tuple[list[dict[str, Any]], dict[str, list[RequestRecord]]]:
    prompts = synthetic_prompts(target["num_requests"], target["input_len"])
    mode = "request_rate" if target["request_rates"] else "concurrency"
    results, raw = [], {}
    async with connect(target["backend"], target["url"], target["model"], target["output_len"],
                       target["api_key"]) as send:
        await send(prompts[0])  # warm-up
        for load in target["request_rates"] or target["concurrency"]:
            label = f"{mode}={load}"
            records, duration = await run_load(send, prompts, None if mode == "request_rate" else int(load),
                                               float(load) if mode == "request_rate" else None, label)
            results.append(summarize(records, duration) | {"mode": mode, "load": load})
            raw[label] = records
    return results, raw


def print_table(results: list[dict[str, Any]]) -> None:
    """One line per load point: TTFT, ITL and latency percentiles, throughputs, errors."""
    print(f"{'load':>10}{'TTFT p50':>10}{'TTFT p99':>10}{'ITL p50':>9}{'ITL p99':>9}{'lat p50':>9}"
          f"{'out tok/s':>11}{'req/s':>8}{'errors':>8}")
    for r in results:
        print(f"{r['load']:>10}{stat(r, 'time_to_first_token', 'p50'):>8.0f}ms"
              f"{stat(r, 'time_to_first_token', 'p99'):>8.0f}ms{stat(r, 'inter_token_latency', 'p50'):>7.0f}ms"
              f"{stat(r, 'inter_token_latency', 'p99'):>7.0f}ms{stat(r, 'request_latency', 'p50') / 1e3:>8.2f}s"
              f"{stat(r, 'output_token_throughput'):>11.1f}{stat(r, 'request_throughput'):>8.2f}"
              f"{stat(r, 'error_request_count'):>8.0f}")


def has_errors(report: dict[str, Any]) -> bool:
    """Whether any request of any load point failed."""
    return any(stat(r, "error_request_count") for r in report["results"])


def run_serve_benchmark(url: str, backend: Backend = "triton", model: str = "tritium",
                        concurrency: list[int] | None = None, request_rates: list[float] | None = None,
                        num_requests: int = 32, input_len: int = 128, output_len: int = 64,
                        api_key: str | None = None, out_dir: str | Path = "bench_results") -> dict[str, Any]:
    """Run the sweep, print a table, write `serve.json` and `serve.png` into `out_dir`; returns the JSON dict:
    `target`, `results` (a summary per load point, with `mode` and `load`) and `requests` (the records per
    load point). Raises what the client raises when the target cannot be reached at all."""
    target = {"url": url, "backend": backend, "model": model, "concurrency": concurrency or [1, 8, 32],
              "request_rates": request_rates, "num_requests": num_requests, "input_len": input_len,
              "output_len": output_len, "api_key": api_key}
    results, raw = asyncio.run(_sweep(target))
    print(f"\n{backend} {url} model={model}, {num_requests} requests, ~{input_len} in / {output_len} out tokens")
    print_table(results)
    report = {"target": {k: v for k, v in target.items() if k != "api_key"}, "results": results,
              "requests": {k: [asdict(r) for r in v] for k, v in raw.items()}}
    write_report(out_dir, "serve", report, lambda path: plot(results, raw, path))
    return report
