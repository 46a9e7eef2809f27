"""`tritium bench overhead`: what serving through tritonserver costs, against the engine in this process.

Workload, per scenario: `num_requests` prompts of ~48 tokens (random ordinary tokens of the default
tokenizer, fixed seed), 128 output tokens each, greedy, ignore_eos, in a closed loop at concurrency C
(C requests in flight; when one finishes the next starts). Scenarios: the tiny model (a random 2-layer
Llama, hidden 64, the default tokenizer's 49,152-token vocabulary; its forward pass costs almost nothing,
so what is left is scheduling, sampling, detokenizing and serving) at C = 64 and 1, and the default model
(SmolLM2-135M) at C = 1 and 32. Both paths use the same engine settings: max_num_seqs = C, the same
max_num_batched_tokens and kv_cache_bytes.

In-process: `llm.engine` driven directly (add_request / step). Served: the same engine in a tritonserver
of its own (a temporary repository with only the `tritium` model), streamed over gRPC (`bench serve`'s
client). Both report what `bench_serve.summarize` reports, defined as genai-perf does: per request,
TTFT = first output with tokens - send (in-process: add_request) time, latency = final output - send
time, ITL = (latency - TTFT) / (output tokens - 1); output token throughput = tokens / wall time.

Ratios: throughput served / in-process, ITL in-process p50 / served p50 (both >= 0.90 on the tiny model
and >= 0.95 on the default one is the goal). In-process host time per step = (engine step time - model
forward time) / steps, against the goal 1 ms + 15 us per running sequence. Writes overhead.json and
overhead.png. The file imports only long-standing parts of tritium, so that it also measures older commits.

On a small CPU run it with nothing else busy: torch's intra-op threads make the forward pass many times
slower when another process holds a core. OMP_NUM_THREADS (the server inherits it) sets them in both paths.
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import json
import os
import platform
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
from tritium.client.bench.serve import RequestRecord, run_load, summarize, synthetic_prompts, triton_request
from tritium.client.triton.launcher import PACKAGE_REPOSITORY, ServerOptions, TritonServer

INPUT_LEN = 48
OUTPUT_LEN = 128
KV_CACHE_BYTES = 1 << 30
PORT_BASE = 18200
GOALS = {"tiny": 0.90, "default": 0.95}
HOST_STEP_BASE_MS, HOST_STEP_PER_SEQ_MS = 1.0, 0.015


@dataclass
class Scenario:
    kind: str  # "tiny" or "default"
    concurrency: int
    num_requests: int

    @property
    def name(self) -> str:
        return f"{self.kind} c={self.concurrency}"


@dataclass
class InProcessRun:
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
    steps = max(run.steps, 1)
    running = sum(run.running_per_step) / len(run.running_per_step) if run.running_per_step else 0.0
    host_ms = 1e3 * (run.step_s - run.model_s) / steps
    goal_ms = HOST_STEP_BASE_MS + HOST_STEP_PER_SEQ_MS * running
    return summarize(run.records, run.duration_s) | {
        "engine_steps": run.steps, "step_ms_per_step": 1e3 * run.step_s / steps,
        "model_ms_per_step": 1e3 * run.model_s / steps, "host_ms_per_step": host_ms,
        "mean_running_per_step": running, "host_goal_ms_per_step": goal_ms, "host_goal_met": host_ms <= goal_ms,
    }


def write_repository(dest: Path, model: str | None, concurrency: int, max_pending: int) -> Path:
    """A Triton model repository with only the packaged `tritium` model, its model.json set for a scenario."""
    src, version = PACKAGE_REPOSITORY / "tritium", dest / "tritium" / "1"
    version.mkdir(parents=True)
    shutil.copy(src / "config.pbtxt", dest / "tritium" / "config.pbtxt")
    shutil.copy(src / "1" / "model.py", version / "model.py")
    settings = json.loads((src / "1" / "model.json").read_text(encoding="utf-8"))
    settings |= {"model": model, "max_pending_requests": max_pending, **engine_limits(concurrency)}
    (version / "model.json").write_text(json.dumps(settings, indent=2), encoding="utf-8")
    return dest


async def _served_load(grpc_url: str, prompts: list[str], output_len: int, concurrency: int,
                       label: str) -> tuple[list[RequestRecord], float]:
    import tritonclient.grpc.aio as grpcaio

    client = grpcaio.InferenceServerClient(grpc_url)
    try:
        warm = await triton_request(client, "tritium", prompts[0], 4, None)
        if not warm.ok:
            raise RuntimeError(f"warm-up request failed: {warm.error}")

        async def send(prompt: str) -> RequestRecord:
            return await triton_request(client, "tritium", prompt, output_len, None)

        return await run_load(send, prompts, concurrency, None, label)
    finally:
        await client.close()


def run_served(scenario: Scenario, model: str | None, prompts: list[str], output_len: int,
               port: int) -> tuple[list[RequestRecord], float]:
    with tempfile.TemporaryDirectory(prefix="tritium-overhead-") as tmp:
        repo = write_repository(Path(tmp), model, scenario.concurrency, max(256, 2 * len(prompts)))
        options = ServerOptions(model_repository=repo, http_port=port, grpc_port=port + 1, metrics_port=port + 2,
                                model_control="explicit", load_models=["tritium"])
        with TritonServer(options) as server:
            return asyncio.run(_served_load(server.grpc_url, prompts, output_len, scenario.concurrency,
                                            f"served {scenario.name}"))


def run_scenario(scenario: Scenario, model: str | None, output_len: int, port: int) -> dict[str, Any]:
    prompts = synthetic_prompts(scenario.num_requests, INPUT_LEN)
    load_before = os.getloadavg()[0]
    llm = LLM(model, **engine_limits(scenario.concurrency))
    llm.generate([prompts[0]], SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))  # warm-up
    local = run_in_process(llm, prompts, output_len, scenario.concurrency, f"in-process {scenario.name}")
    del llm
    gc.collect()
    served_records, served_s = run_served(scenario, model, prompts, output_len, port)
    inp, srv = in_process_summary(local), summarize(served_records, served_s)
    itl_in, itl_srv = inp["inter_token_latency_s"].get("p50"), srv["inter_token_latency_s"].get("p50")
    return {
        **asdict(scenario), "name": scenario.name, "model": model, "output_len": output_len, "input_len": INPUT_LEN,
        "engine": engine_limits(scenario.concurrency), "goal": GOALS[scenario.kind],
        "throughput_ratio": srv["output_token_throughput_per_s"] / max(inp["output_token_throughput_per_s"], 1e-9),
        "itl_ratio": itl_in / itl_srv if itl_in and itl_srv else None,
        "in_process": inp, "served": srv, "load_average_1m": [load_before, os.getloadavg()[0]],
        "requests": {"in_process": [asdict(r) for r in local.records], "served": [asdict(r) for r in served_records]},
    }


def machine_info() -> dict[str, Any]:
    import torch

    try:
        lines = Path("/proc/cpuinfo").read_text(encoding="utf-8", errors="replace").splitlines()
    except OSError:
        lines = []
    cpu_model = next((line.split(":", 1)[1].strip() for line in lines if line.startswith("model name")), None)
    return {"processor": platform.processor(), "cpu_model": cpu_model, "machine": platform.machine(),
            "platform": platform.platform(),
            "cpu_count": os.cpu_count(), "python": platform.python_version(), "torch": torch.__version__,
            "cuda": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None,
            "torch_threads": torch.get_num_threads(), "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS"),
            "tritium_backend": tritium.backend.__file__, "model_repository": str(PACKAGE_REPOSITORY)}


def print_table(results: list[dict[str, Any]]) -> None:
    def ms(summary: dict[str, Any], key: str, stat: str = "p50") -> float:
        return 1e3 * summary[key].get(stat, 0.0)

    print(f"\n{'scenario':<13}{'in tok/s':>10}{'srv tok/s':>10}{'ratio':>7}{'in ITL p50/p99':>16}"
          f"{'srv ITL p50/p99':>17}{'ITL ratio':>10}{'in TTFT p50':>12}{'srv TTFT p50':>13}{'host ms/step':>13}"
          f"{'srv tok/resp':>13}")
    for r in results:
        inp, srv = r["in_process"], r["served"]
        itl = "n/a" if r["itl_ratio"] is None else f"{r['itl_ratio']:.3f}"
        in_itl = f"{ms(inp, 'inter_token_latency_s'):.2f}/{ms(inp, 'inter_token_latency_s', 'p99'):.2f}"
        srv_itl = f"{ms(srv, 'inter_token_latency_s'):.2f}/{ms(srv, 'inter_token_latency_s', 'p99'):.2f}"
        ttft = f"{ms(inp, 'time_to_first_token_s'):>10.1f}ms{ms(srv, 'time_to_first_token_s'):>11.1f}ms"
        print(f"{r['name']:<13}{inp['output_token_throughput_per_s']:>10.1f}"
              f"{srv['output_token_throughput_per_s']:>10.1f}{r['throughput_ratio']:>7.3f}{in_itl:>16}{srv_itl:>17}"
              f"{itl:>10}{ttft}{inp['host_ms_per_step']:>13.3f}{srv.get('tokens_per_response', 0):>13.2f}")
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
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    names = [r["name"] for r in results]
    x, width = np.arange(len(results)), 0.38
    fig, axes = plt.subplots(1, 2, figsize=(12, 4.5))
    for ax, key, stat, scale, label in (
        (axes[0], "output_token_throughput_per_s", None, 1.0, "output tokens / s"),
        (axes[1], "inter_token_latency_s", "p50", 1e3, "ITL p50 (ms)"),
    ):
        for offset, path_name, color in ((-width / 2, "in_process", "tab:blue"), (width / 2, "served", "tab:orange")):
            values = [(r[path_name][key] if stat is None else r[path_name][key].get(stat, 0.0)) * scale
                      for r in results]
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
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def scenarios(quick: bool, skip_tiny: bool, skip_default: bool, num_requests: int | None) -> list[Scenario]:
    counts = {("tiny", 64): 128, ("tiny", 1): 16, ("default", 1): 4, ("default", 32): 64}
    if quick:
        counts = {("tiny", 64): 16, ("tiny", 1): 2, ("default", 1): 1, ("default", 32): 4}
    skipped = {"tiny"} if skip_tiny else set()
    skipped |= {"default"} if skip_default else set()
    return [Scenario(kind, c, num_requests or n) for (kind, c), n in counts.items() if kind not in skipped]


def run_overhead_benchmark(out_dir: str = "bench_results", quick: bool = False, skip_tiny: bool = False,
                           skip_default: bool = False, tiny_model: str | None = None, num_requests: int | None = None,
                           output_len: int | None = None) -> dict[str, Any]:
    """Run every scenario in both paths, print the table and the goals, write overhead.json and .png."""
    output_len = output_len or (16 if quick else OUTPUT_LEN)
    todo = scenarios(quick, skip_tiny, skip_default, num_requests)
    print(f"tritium.backend: {tritium.backend.__file__}; served model.py from {PACKAGE_REPOSITORY}")
    print(f"{len(todo)} scenarios, ~{INPUT_LEN} prompt / {output_len} output tokens, greedy, ignore_eos; load "
          f"average {os.getloadavg()[0]:.2f} on {os.cpu_count()} CPUs (anything else running skews the figures)")
    started = time.perf_counter()
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
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    report = {"machine": machine_info(), "quick": quick, "wall_s": time.perf_counter() - started,
              "scenarios": results}
    (out / "overhead.json").write_text(json.dumps(report, indent=2), encoding="utf-8")
    plot(results, out / "overhead.png")
    print(f"wrote {out / 'overhead.json'} and {out / 'overhead.png'} ({report['wall_s']:.0f} s)")
    return report


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--out-dir", default="bench_results")
    p.add_argument("--quick", action="store_true", help="few requests, short outputs: checks the script itself")
    p.add_argument("--skip-tiny", action="store_true", help="leave out the tiny-model scenarios")
    p.add_argument("--skip-default", action="store_true", help="leave out the default-model scenarios")
    p.add_argument("--tiny-model", default=None, help="an existing tiny checkpoint folder (else one is written)")
    p.add_argument("--num-requests", type=int, default=None,
                   help="requests in every scenario (default: tiny 128 at c=64, 16 at c=1; default 64 / 4)")
    p.add_argument("--output-len", type=int, default=None, help=f"output tokens per request (default {OUTPUT_LEN})")


def has_errors(report: dict[str, Any]) -> bool:
    return any(r[path]["errors"] for r in report["scenarios"] for path in ("in_process", "served"))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    add_arguments(parser)
    a = parser.parse_args(argv)
    report = run_overhead_benchmark(a.out_dir, a.quick, a.skip_tiny, a.skip_default, a.tiny_model, a.num_requests,
                                    a.output_len)
    return 1 if has_errors(report) else 0


if __name__ == "__main__":
    sys.exit(main())
