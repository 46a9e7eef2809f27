"""`tritium bench overhead`: what serving through tritonserver costs, against the engine in this process.

Workload, per scenario: `num_requests` prompts of ~48 tokens (workload.synthetic_prompts), 128 output tokens
each, greedy, ignore_eos, in a closed loop at concurrency C (C requests in flight; when one finishes the next
starts). Scenarios: the tiny model (a random 2-layer Llama, hidden 64, the default tokenizer's 49,152-token
vocabulary; its forward pass costs almost nothing, so what is left is scheduling, sampling, detokenizing and
serving) at C = 64 and 1, and the default model (SmolLM2-135M) at C = 1 and 32. Both paths use the same
engine settings: max_num_seqs = C, the same max_num_batched_tokens and kv_cache_bytes.

In-process: `llm.engine` driven directly (add_request / step). Served: the same engine in a tritonserver
of its own (a temporary repository with only the `tritium` model), streamed over gRPC (`bench serve`'s
client, bench/load.py). Both are summarized by report.summarize, with genai-perf's / AIPerf's definitions:
per request, TTFT = first output with tokens - send (in-process: add_request) time, latency = final output -
send time, ITL = (latency - TTFT) / (output tokens - 1); output token throughput = tokens / wall time.

Ratios: throughput served / in-process, ITL in-process p50 / served p50 (both >= 0.90 on the tiny model
and >= 0.95 on the default one is the goal). In-process host time per step = (engine step time - model
forward time) / steps, against the goal 1 ms + 15 us per running sequence. Writes overhead.json and
overhead.png.

On a small CPU run it with nothing else busy: torch's intra-op threads make the forward pass many times
slower when another process holds a core. OMP_NUM_THREADS (the server inherits it) sets them in both paths;
without it both use every usable core (backend/worker/threads.py).
"""

from __future__ import annotations

import asyncio
import gc
import os
import shutil
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from tqdm import tqdm

import tritium.backend
from tritium.backend import LLM, SamplingParams
from tritium.backend.models.registry import resolve_model
from tritium.client.bench.load import connect, run_load
from tritium.client.bench.report import (
    RequestRecord,
    load_average,
    machine_info,
    pyplot,
    save_figure,
    stat,
    summarize,
    write_report,
)
from tritium.client.bench.workload import synthetic_prompts
from tritium.client.triton.launcher import ServerOptions, TritonServer
from tritium.client.triton.repository import PACKAGE_REPOSITORY, one_model_repository

INPUT_LEN = 48
OUTPUT_LEN = 128
QUICK_OUTPUT_LEN = 16
KV_CACHE_BYTES = 1 << 30
PORT_BASE = 18200
GOALS = {"tiny": 0.90, "default": 0.95}
HOST_STEP_BASE_MS, HOST_STEP_PER_SEQ_MS = 1.0, 0.015
# requests per scenario (kind, concurrency), in full and --quick runs
REQUESTS = {("tiny", 64): 128, ("tiny", 1): 16, ("default", 1): 4, ("default", 32): 64}
QUICK_REQUESTS = {("tiny", 64): 16, ("tiny", 1): 2, ("default", 1): 1, ("default", 32): 4}


@dataclass
class Scenario:
    """One measured setting: the model (`kind`: "tiny" or "default"), the concurrency and the request count."""

    kind: str
    concurrency: int
    num_requests: int

    @property
    def name(self) -> str:
        """`kind c=concurrency`."""
        return f"{self.kind} c={self.concurrency}"


@dataclass
class InProcessRun:
    """The in-process path's requests and wall time, and the engine's step / model time over the run."""

    records: list[RequestRecord]
    duration_s: float
    steps: int = 0
    step_s: float = 0.0
    model_s: float = 0.0
    running_per_step: list[int] = field(default_factory=list)


def engine_limits(concurrency: int) -> dict[str, int]:
    """Engine settings of a scenario, the same in both paths: a whole wave of prompts fits in one step."""
    return {"max_num_seqs": concurrency, "max_num_batched_tokens": max(2048, concurrency * (INPUT_LEN + 16)),
            "kv_cache_bytes": KV_CACHE_BYTES}


def run_in_process(llm: LLM, prompts: list[str], output_len: int, concurrency: int,
                   label: str = "in-process") -> InProcessRun:
    """Closed loop on `llm.engine`: `concurrency` requests in flight, the next added when one finishes;
    every output is timestamped when step() returns. Also the engine's step/model time over the run."""
    engine = llm.engine
    params = SamplingParams(temperature=0, max_tokens=output_len, ignore_eos=True)
    added: dict[str, float] = {}
    first: dict[str, float] = {}
    tokens: dict[str, int] = {}
    records: list[RequestRecord] = []
    run = InProcessRun(records, 0.0)
    next_index = 0

    def add_next() -> None:
        nonlocal next_index
        rid = f"{label}-{next_index}"
        added[rid] = time.perf_counter()
        tokens[rid] = 0
        engine.add_request(rid, prompts[next_index], params)
        next_index += 1

    stats = engine.stats
    steps0, step_s0, model_s0 = stats.steps, stats.step_s, stats.model_s
    bar = tqdm(total=len(prompts), desc=label, unit="req")
    start = time.perf_counter()
    while next_index < min(concurrency, len(prompts)):
        add_next()
    while added and engine.has_unfinished_requests():
        steps_before = stats.steps
        outputs = engine.step()
        now = time.perf_counter()
        finished = 0
        for out in outputs:
            rid = out.request_id
            if rid not in added:
                continue
            if out.delta_token_ids:
                tokens[rid] += len(out.delta_token_ids)
                first.setdefault(rid, now)
            if out.finished:
                finished += 1
                sent = added.pop(rid)
                n = tokens.pop(rid)
                ttft = first.pop(rid, now) - sent
                latency = now - sent
                itl = (latency - ttft) / (n - 1) if n > 1 else None
                records.append(RequestRecord(ttft, latency, n, itl, out.error is None, out.error))
                bar.update(1)
                if next_index < len(prompts):
                    add_next()
        if stats.steps > steps_before:  # sequences that ran in this step: still running + just finished
            run.running_per_step.append(len(engine.scheduler.running) + finished)
    run.duration_s = time.perf_counter() - start
    bar.close()
    run.steps, run.step_s, run.model_s = stats.steps - steps0, stats.step_s - step_s0, stats.model_s - model_s0
    return run


def in_process_summary(run: InProcessRun) -> dict[str, Any]:
    """report.summarize of the run plus the engine's figures (plain numbers): `engine_steps`,
    `step_ms_per_step`, `model_ms_per_step`, `host_ms_per_step`, `mean_running_per_step`,
    `host_goal_ms_per_step` and `host_goal_met`."""
    steps = max(run.steps, 1)
    running = sum(run.running_per_step) / len(run.running_per_step) if run.running_per_step else 0.0
    host_ms = 1e3 * (run.step_s - run.model_s) / steps
    goal_ms = HOST_STEP_BASE_MS + HOST_STEP_PER_SEQ_MS * running
    return summarize(run.records, run.duration_s) | {
        "engine_steps": run.steps, "step_ms_per_step": 1e3 * run.step_s / steps,
        "model_ms_per_step": 1e3 * run.model_s / steps, "host_ms_per_step": host_ms,
        "mean_running_per_step": running, "host_goal_ms_per_step": goal_ms, "host_goal_met": host_ms <= goal_ms,
    }


async def _served_load(grpc_url: str, prompts: list[str], output_len: int, concurrency: int,
                       label: str) -> tuple[list[RequestRecord], float]:
    async with connect("triton", grpc_url, "tritium", output_len) as send:
        warm = await send(prompts[0], 4)
        if not warm.ok:
            raise RuntimeError(f"warm-up request failed: {warm.error}")
        return await run_load(send, prompts, concurrency, None, label)


def run_served(scenario: Scenario, model: str | None, prompts: list[str], output_len: int,
               port: int) -> tuple[list[RequestRecord], float]:
    """The served path: a tritonserver of its own on ports port..port+2 (a temporary one-model repository with
    the scenario's engine settings), the closed loop over gRPC; returns the records and the wall time. Raises
    RuntimeError when the server does not start or the warm-up request fails."""
    with tempfile.TemporaryDirectory(prefix="tritium-overhead-") as tmp:
        settings = {"model": model, "max_pending_requests": max(256, 2 * len(prompts)),
                    **engine_limits(scenario.concurrency)}
        repo = one_model_repository(Path(tmp), settings)
        options = ServerOptions(model_repository=repo, http_port=port, grpc_port=port + 1, metrics_port=port + 2,
                                model_control="explicit", load_models=["tritium"])
        with TritonServer(options) as server:
            return asyncio.run(_served_load(server.grpc_url, prompts, output_len, scenario.concurrency,
                                            f"served {scenario.name}"))


def run_scenario(scenario: Scenario, model: str | None, output_len: int, port: int) -> dict[str, Any]:
    """Both paths of one scenario, one after the other; returns its part of the report (summaries of both
    paths, the ratios, every request's record)."""
    prompts = synthetic_prompts(scenario.num_requests, INPUT_LEN)
    load_before = os.getloadavg()[0]
    llm = LLM(model, **engine_limits(scenario.concurrency))
    llm.generate([prompts[0]], SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))  # warm-up
    local = run_in_process(llm, prompts, output_len, scenario.concurrency, f"in-process {scenario.name}")
    del llm
    gc.collect()
    served_records, served_s = run_served(scenario, model, prompts, output_len, port)
    inp, srv = in_process_summary(local), summarize(served_records, served_s)
    itl_in, itl_srv = stat(inp, "inter_token_latency", "p50"), stat(srv, "inter_token_latency", "p50")
    return {
        **asdict(scenario), "name": scenario.name, "model": model, "output_len": output_len, "input_len": INPUT_LEN,
        "engine": engine_limits(scenario.concurrency), "goal": GOALS[scenario.kind],
        "throughput_ratio": stat(srv, "output_token_throughput") / max(stat(inp, "output_token_throughput"), 1e-9),
        "itl_ratio": itl_in / itl_srv if itl_in and itl_srv else None,
        "in_process": inp, "served": srv, "load_average_1m": [load_before, os.getloadavg()[0]],
        "requests": {"in_process": [asdict(r) for r in local.records], "served": [asdict(r) for r in served_records]},
    }


def print_table(results: list[dict[str, Any]]) -> None:
    """The ratios table, then a line per scenario saying which goals were met."""
    print(f"\n{'scenario':<13}{'in tok/s':>10}{'srv tok/s':>10}{'ratio':>7}{'in ITL p50/p99':>16}"
          f"{'srv ITL p50/p99':>17}{'ITL ratio':>10}{'in TTFT p50':>12}{'srv TTFT p50':>13}{'host ms/step':>13}"
          f"{'srv tok/resp':>13}")
    for r in results:
        inp, srv = r["in_process"], r["served"]
        itl = "n/a" if r["itl_ratio"] is None else f"{r['itl_ratio']:.3f}"
        in_itl = f"{stat(inp, 'inter_token_latency', 'p50'):.2f}/{stat(inp, 'inter_token_latency', 'p99'):.2f}"
        srv_itl = f"{stat(srv, 'inter_token_latency', 'p50'):.2f}/{stat(srv, 'inter_token_latency', 'p99'):.2f}"
        ttft = f"{stat(inp, 'time_to_first_token', 'p50'):>10.1f}ms{stat(srv, 'time_to_first_token', 'p50'):>11.1f}ms"
        print(f"{r['name']:<13}{stat(inp, 'output_token_throughput'):>10.1f}"
              f"{stat(srv, 'output_token_throughput'):>10.1f}{r['throughput_ratio']:>7.3f}{in_itl:>16}{srv_itl:>17}"
              f"{itl:>10}{ttft}{inp['host_ms_per_step']:>13.3f}{stat(srv, 'tokens_per_response'):>13.2f}")
    print()
    for r in results:
        goal, inp = r["goal"], r["in_process"]
        itl_ok = r["itl_ratio"] is not None and r["itl_ratio"] >= goal
        print(f"{r['name']}: throughput served/in-process {r['throughput_ratio']:.3f} "
              f"{'MET' if r['throughput_ratio'] >= goal else 'NOT MET'} (goal >= {goal:.2f}); ITL in-process/served "
              f"{r['itl_ratio'] or 0:.3f} {'MET' if itl_ok else 'NOT MET'}; host time per step "
              f"{inp['host_ms_per_step']:.3f} ms at {inp['mean_running_per_step']:.1f} running "
              f"{'MET' if inp['host_goal_met'] else 'NOT MET'} (goal <= {inp['host_goal_ms_per_step']:.3f} ms)")


def plot(results: list[dict[str, Any]], path: Path) -> None:
    """Throughput and ITL p50 of both paths per scenario, the throughput ratio under each pair."""
    import numpy as np

    plt = pyplot()
    names = [r["name"] for r in results]
    x, width = np.arange(len(results)), 0.38
    fig, axes = plt.subplots(1, 2, figsize=(12, 4.5))
    for ax, metric, name, label in (
        (axes[0], "output_token_throughput", "avg", "output tokens / s"),
        (axes[1], "inter_token_latency", "p50", "ITL p50 (ms)"),
    ):
        for offset, path_name, color in ((-width / 2, "in_process", "tab:blue"), (width / 2, "served", "tab:orange")):
            values = [stat(r[path_name], metric, name) for r in results]
            bars = ax.bar(x + offset, values, width, label=path_name.replace("_", "-"), color=color)
            ax.bar_label(bars, fmt="%.1f", fontsize=7)
        ax.set_xticks(x, names)
        ax.set_ylabel(label)
        ax.legend()
    for i, r in enumerate(results):
        axes[0].annotate(f"x{r['throughput_ratio']:.2f}", (i, 0), xytext=(0, -28), textcoords="offset points",
                         ha="center", fontsize=8)
    axes[0].set_title("throughput (served / in-process below)")
    axes[1].set_title("inter-token latency")
    save_figure(fig, path)


def scenarios(quick: bool, skip_tiny: bool, skip_default: bool, num_requests: int | None) -> list[Scenario]:
    """The scenarios to run, in order (`num_requests` replaces every scenario's own count)."""
    skipped = {"tiny"} if skip_tiny else set()
    skipped |= {"default"} if skip_default else set()
    counts = QUICK_REQUESTS if quick else REQUESTS
    return [Scenario(kind, c, num_requests or n) for (kind, c), n in counts.items() if kind not in skipped]


def run_overhead_benchmark(out_dir: str | Path = "bench_results", quick: bool = False, skip_tiny: bool = False,
                           skip_default: bool = False, tiny_model: str | None = None, num_requests: int | None = None,
                           output_len: int | None = None) -> dict[str, Any]:
    """Run every scenario in both paths, print the table and the goals, write overhead.json and .png into
    `out_dir`; returns the JSON dict (`machine`, `quick`, `wall_s`, `scenarios`). Without `tiny_model` a tiny
    checkpoint is written to a temporary folder (removed at the end). Raises RuntimeError when a served path
    cannot start."""
    output_len = output_len or (QUICK_OUTPUT_LEN if quick else OUTPUT_LEN)
    todo = scenarios(quick, skip_tiny, skip_default, num_requests)
    print(f"tritium.backend: {tritium.backend.__file__}; served model.py from {PACKAGE_REPOSITORY}")
    print(f"{len(todo)} scenarios, ~{INPUT_LEN} prompt / {output_len} output tokens, greedy, ignore_eos; load "
          f"average {os.getloadavg()[0]:.2f} on {os.cpu_count()} CPUs (anything else running skews the figures)")
    started = time.perf_counter()
    loadavg_before = load_average()
    tmp_model: str | None = None
    if tiny_model is None and not skip_tiny:
        from tritium.backend.models.random_checkpoint import write_random_llama

        tmp_model = tempfile.mkdtemp(prefix="tritium-tiny-")
        write_random_llama(Path(tmp_model), tokenizer_from=resolve_model(None))
    tiny = str(Path(tiny_model).resolve()) if tiny_model else tmp_model
    results = []
    try:
        for i, scenario in enumerate(todo):
            model = tiny if scenario.kind == "tiny" else None
            results.append(run_scenario(scenario, model, output_len, PORT_BASE + 10 * i))
    finally:
        if tmp_model:
            shutil.rmtree(tmp_model, ignore_errors=True)
    print_table(results)
    report = {"machine": machine_info(loadavg_before=loadavg_before, tritium_backend=tritium.backend.__file__,
                                      model_repository=str(PACKAGE_REPOSITORY)),
              "quick": quick, "wall_s": time.perf_counter() - started, "scenarios": results}
    write_report(out_dir, "overhead", report, lambda path: plot(results, path))
    print(f"({report['wall_s']:.0f} s)")
    return report


def has_errors(report: dict[str, Any]) -> bool:
    """Whether any request failed, in either path of any scenario."""
    return any(stat(r[path], "error_request_count") for r in report["scenarios"] for path in ("in_process", "served"))


if __name__ == "__main__":  # python -m tritium.client.bench.overhead [options] == tritium bench overhead [options]
    from tritium.client.cli.main import main

    sys.exit(main(["bench", "overhead", *sys.argv[1:]]))
