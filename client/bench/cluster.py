"""`tritium bench cluster`: one replica vs two behind tritium's router vs two behind vllm-router, in one run.

What runs, all on this machine: two tritonservers (`tritium serve`, one temporary model repository holding
only the `tritium` model, `--model`'s weights), one `tritium openai` endpoint per replica (one `--upstream`
each) and one `tritium openai` with both upstreams (tritium's own router inside). They are started once and
reused by three setups, measured one after the other:

  a) "1 replica": clients -> replica 1's own endpoint -> tritonserver 1;
  b) "2 replicas, tritium router": clients -> the two-upstream `tritium openai` -> both tritonservers;
  c) "2 replicas, vllm-router cache_aware": clients -> `vllm-router --policy cache_aware` (fast health
     flags) -> each replica's own endpoint (with --skip-vllm-router: skipped, with a note in the report;
     without it a missing binary is an error).

Workload, per setup: `num_requests` streamed completions (`/v1/completions`, temperature 0, ignore_eos,
`output_len` tokens) in a closed loop at `concurrency` (that many in flight; when one ends the next starts).
Prompt i = the shared "system" text of group i % `groups` (~`prefix_tokens` random ordinary tokens of the
model's tokenizer, after a line naming the group) + a short unique question. Each setup draws its own
prefixes (seed = the setup's index), so every setup starts with a cold prefix cache for its prefixes while
the earlier setups' blocks may still sit in the caches. Two warm-up requests (another seed, sharing no prefix
with the measured ones) go through each setup first and are not counted.

Reported per setup, as `bench serve` defines them (genai-perf's definitions): output tokens/s and requests/s
(over the closed loop's wall time), TTFT p50/p90 (first streamed text - send), ITL p50 ((latency - TTFT) /
(output tokens - 1)), errors. From each tritonserver's metrics port, read before and after the setup once the
counters have settled (the engine pushes them every 0.5 s): the prefix-cache hit rate = sum over the replicas
of the delta of tritium_prefix_cache_hit_tokens_total / sum of the delta of
tritium_prefix_cache_queried_tokens_total, and the requests each replica served (delta of
tritium_e2e_request_latency_seconds_count). Writes cluster.json and cluster.png (throughput, TTFT p50, hit
rate per setup) into `out_dir`. Everything the run started is stopped at the end, also on errors and Ctrl-C.

The replicas, endpoints, router and clients all share this machine's CPUs: on a small CPU machine two
replicas do not have twice the compute of one, so compare routing (hit rate, TTFT) more than throughput.
"""

from __future__ import annotations

import asyncio
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager, suppress
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

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
from tritium.client.bench.workload import SharedPrefixWorkload
from tritium.client.cluster.replica_load import engine_load, fetch_metrics, parse_samples
from tritium.client.triton.launcher import free_ports
from tritium.client.triton.repository import one_model_repository, packaged_settings

MODEL_NAME = "tritium"  # the Triton model, also the OpenAI model id
SERVE_TIMEOUT_S = 300.0
ENDPOINT_TIMEOUT_S = 60.0
SETTLE_TIMEOUT_S = 30.0
SETTLE_INTERVAL_S = 0.7  # > the engine's 0.5 s metrics push
WARMUP_REQUESTS = 2
# From /tmp/router_facts.md: a worker found at once at start-up, a dead one dropped within seconds.
VLLM_ROUTER_FAST_FLAGS = [
    "--health-check-interval-secs", "1", "--health-failure-threshold", "1", "--health-check-timeout-secs", "1",
    "--cb-failure-threshold", "1", "--cb-timeout-duration-secs", "2", "--retry-max-retries", "3",
    "--retry-initial-backoff-ms", "10", "--worker-startup-timeout-secs", "10", "--worker-startup-check-interval", "1",
]
SETUPS = {
    "a": "1 replica",
    "b": "2 replicas, tritium router",
    "c": "2 replicas, vllm-router cache_aware",
}


@dataclass
class Process:
    """A process this run started, in its own session (its group is killed at the end), logging to `log`."""

    name: str
    popen: subprocess.Popen[bytes]
    log: Path

    def tail(self, chars: int = 3000) -> str:
        """The last `chars` characters of its log ("" when unreadable)."""
        try:
            return self.log.read_text(errors="replace")[-chars:]
        except OSError:
            return ""


@dataclass
class Replica:
    """A `tritium serve` replica: its gRPC address, metrics URL and its own `tritium openai` endpoint."""

    name: str
    grpc: str  # host:port
    metrics_url: str
    endpoint: str = ""  # its own `tritium openai`, base URL without /v1


@dataclass
class Counters:
    """One tritonserver's cumulative counters for the `tritium` model."""

    hit_tokens: int = 0
    queried_tokens: int = 0
    requests: int = 0
    in_flight: int = 0


@dataclass
class SetupResult:
    """One measured setup: its summary (report.summarize), prefix-cache hits and per-replica deltas."""

    key: str
    name: str
    url: str
    seed: int
    replicas: list[str]
    summary: dict[str, Any]
    hit_rate: float | None
    hit_tokens: int
    queried_tokens: int
    per_replica: dict[str, dict[str, int]]
    error_samples: list[str] = field(default_factory=list)
    records: list[RequestRecord] = field(default_factory=list)  # per request, in completion order


# ---------------------------------------------------------------- processes


def _child_env() -> dict[str, str]:
    return {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}


def spawn(name: str, cmd: list[str], logs: Path) -> Process:
    """Start `cmd` in a session of its own (without TRITON_INTERPRET), logging to `logs/name.log`."""
    log = logs / f"{name}.log"
    with log.open("wb") as out:
        popen = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=_child_env(),
                                 start_new_session=True)
    return Process(name, popen, log)


def stop(process: Process, grace_s: float = 60.0) -> None:
    """SIGINT the process (a `tritium serve` then stops its tritonserver), SIGKILL its group if it lingers."""
    if process.popen.poll() is None:
        try:
            os.kill(process.popen.pid, signal.SIGINT)
            process.popen.wait(grace_s)
        except subprocess.TimeoutExpired:
            pass
        except ProcessLookupError:
            return
    with suppress(ProcessLookupError, PermissionError):
        os.killpg(process.popen.pid, signal.SIGKILL)
    process.popen.wait()


def wait_for_line(process: Process, text: str, timeout: float) -> None:
    """Wait until `process` logs `text`. Raises RuntimeError (with its log tail) when it exits or times out."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if text in process.tail(1 << 20):
            return
        if process.popen.poll() is not None:
            raise RuntimeError(f"{process.name} exited with {process.popen.returncode}:\n{process.tail()}")
        time.sleep(0.3)
    raise RuntimeError(f"{process.name} did not print {text!r} within {timeout:.0f} s:\n{process.tail()}")


def http_ok(url: str) -> bool:
    """Whether GET `url` answers 200 within 2 s."""
    try:
        with urllib.request.urlopen(url, timeout=2) as response:
            return response.status == 200
    except (OSError, urllib.error.URLError):
        return False


def wait_for_health(process: Process, url: str, timeout: float) -> None:
    """Wait until `url` answers 200. Raises RuntimeError (with the log tail) when `process` exits or it times
    out."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if http_ok(url):
            return
        if process.popen.poll() is not None:
            raise RuntimeError(f"{process.name} exited with {process.popen.returncode}:\n{process.tail()}")
        time.sleep(0.3)
    raise RuntimeError(f"{process.name}: {url} did not answer 200 within {timeout:.0f} s:\n{process.tail()}")


def write_repository(dest: Path, model: str | None, concurrency: int) -> Path:
    """A Triton model repository at `dest` with only the packaged `tritium` model serving `model` (None: the
    default model), room for `concurrency` sequences and 4x that many pending requests; returns `dest`."""
    packaged = packaged_settings(MODEL_NAME)
    return one_model_repository(dest, {
        "model": model,
        "max_num_seqs": max(int(packaged.get("max_num_seqs") or 0), concurrency),
        "max_pending_requests": max(int(packaged.get("max_pending_requests") or 0), 4 * concurrency),
    }, name=MODEL_NAME)


def cli(*args: str) -> list[str]:
    """The command line of `tritium ARGS` run by this interpreter."""
    return [sys.executable, "-m", "tritium.client.cli", *args]


def start_replicas(repo: Path, logs: Path, started: list[Process], n: int = 2) -> list[Replica]:
    """`tritium serve` twice at once (they load in parallel), then wait for both."""
    replicas, processes = [], []
    for i in range(1, n + 1):
        http, grpc, metrics = free_ports(3)
        processes.append(spawn(f"replica{i}", cli("serve", f"--http-port={http}", f"--grpc-port={grpc}",
                                                  f"--metrics-port={metrics}", f"--model-repository={repo}"), logs))
        started.append(processes[-1])
        replicas.append(Replica(f"replica{i}", f"127.0.0.1:{grpc}", f"http://127.0.0.1:{metrics}/metrics"))
    for process in processes:
        wait_for_line(process, "tritium is serving", SERVE_TIMEOUT_S)
    return replicas


def start_endpoint(name: str, upstreams: list[Replica], tokenizer: str | None, logs: Path,
                   started: list[Process]) -> str:
    """A `tritium openai` in front of `upstreams`; returns its base URL (without /v1) once /health is 200."""
    (port,) = free_ports(1)
    args = ["openai", f"--port={port}", f"--model={MODEL_NAME}"]
    for r in upstreams:
        args += [f"--upstream={r.grpc}", f"--upstream-metrics={r.metrics_url}"]
    if tokenizer:
        args.append(f"--tokenizer={tokenizer}")
    process = spawn(name, cli(*args), logs)
    started.append(process)
    base = f"http://127.0.0.1:{port}"
    wait_for_health(process, base + "/health", ENDPOINT_TIMEOUT_S)
    return base


def find_vllm_router() -> str | None:
    """The vllm-router binary beside this python, else on PATH; None when there is none."""
    beside = Path(sys.executable).parent / "vllm-router"
    return str(beside) if beside.is_file() else shutil.which("vllm-router")


def start_vllm_router(binary: str, workers: list[str], logs: Path, started: list[Process]) -> str:
    """vllm-router (cache_aware, fast health flags) over `workers`; returns its base URL once /health is 200.
    Raises RuntimeError when it exits or does not get healthy in time."""
    port, prometheus = free_ports(2)
    cmd = [binary, "--worker-urls", *workers, "--policy", "cache_aware", "--host", "127.0.0.1",
           "--port", str(port), "--prometheus-port", str(prometheus), *VLLM_ROUTER_FAST_FLAGS]
    process = spawn("vllm-router", cmd, logs)
    started.append(process)
    base = f"http://127.0.0.1:{port}"
    wait_for_health(process, base + "/health", ENDPOINT_TIMEOUT_S)
    return base


def _terminated(signum: int, frame: Any) -> None:
    raise SystemExit(128 + signum)


@contextmanager
def cleanup(started: list[Process]) -> Iterator[None]:
    """Stop everything in `started` on the way out (routers and endpoints first, then the replicas), also on
    Ctrl-C and SIGTERM (turned into SystemExit while the cluster runs)."""
    main_thread = threading.current_thread() is threading.main_thread()
    previous = signal.signal(signal.SIGTERM, _terminated) if main_thread else None
    try:
        yield
    finally:
        if main_thread:
            signal.signal(signal.SIGTERM, previous)
        for process in reversed(started):
            if not process.name.startswith("replica"):
                stop(process, grace_s=10)
        for process in started:  # SIGINT both replicas first, so they shut down in parallel
            if process.name.startswith("replica") and process.popen.poll() is None:
                with suppress(ProcessLookupError):
                    os.kill(process.popen.pid, signal.SIGINT)
        for process in started:
            if process.name.startswith("replica"):
                stop(process)


# ---------------------------------------------------------------- metrics


def read_counters(metrics_url: str) -> Counters:
    """One tritonserver's counters for the `tritium` model, read from its metrics page."""
    text = fetch_metrics(metrics_url, timeout=5)
    load = engine_load(text, MODEL_NAME)
    requests = sum(value for name, labels, value in parse_samples(text)
                   if name == "tritium_e2e_request_latency_seconds_count"
                   and labels.get("model", MODEL_NAME) == MODEL_NAME)
    return Counters(load.prefix_hit_tokens, load.prefix_queried_tokens, int(requests), load.requests)


def settled_counters(replicas: list[Replica]) -> dict[str, Counters]:
    """Every replica's counters once nothing runs and two reads SETTLE_INTERVAL_S apart agree."""
    deadline = time.monotonic() + SETTLE_TIMEOUT_S
    last = {r.name: read_counters(r.metrics_url) for r in replicas}
    while time.monotonic() < deadline:
        time.sleep(SETTLE_INTERVAL_S)
        now = {r.name: read_counters(r.metrics_url) for r in replicas}
        if now == last and not any(c.in_flight for c in now.values()):
            return now
        last = now
    return last


# ---------------------------------------------------------------- load


async def _run_load(url: str, prompts: list[str], output_len: int, concurrency: int,
                    label: str) -> tuple[list[RequestRecord], float]:
    """`prompts` through `url`'s OpenAI API (`url` without /v1) in a closed loop at `concurrency`."""
    async with connect("openai", url + "/v1", MODEL_NAME, output_len) as send:
        return await run_load(send, prompts, concurrency, None, label)


def run_setup(key: str, url: str, used: list[Replica], everyone: list[Replica], tokenizer: Any,
              w: SharedPrefixWorkload, seed: int) -> SetupResult:
    """Measure one setup: WARMUP_REQUESTS one at a time (not counted), then the closed loop, the replicas'
    counters read (settled) before and after. Raises RuntimeError when a warm-up request fails."""
    prompts = w.prompts(tokenizer, seed)
    warmup = w.prompts(tokenizer, 1000 + seed, groups=1, n=WARMUP_REQUESTS)
    label = f"{key}) {SETUPS[key]}"

    warm, _ = asyncio.run(_run_load(url, warmup, w.output_len, 1, f"{label} warm-up"))
    if not all(r.ok for r in warm):
        raise RuntimeError(f"{label}: warm-up failed: {[r.error for r in warm if not r.ok]}")
    before = settled_counters(everyone)
    records, duration = asyncio.run(_run_load(url, prompts, w.output_len, w.concurrency, label))
    after = settled_counters(everyone)
    per_replica = {r.name: {"requests": after[r.name].requests - before[r.name].requests,
                            "hit_tokens": after[r.name].hit_tokens - before[r.name].hit_tokens,
                            "queried_tokens": after[r.name].queried_tokens - before[r.name].queried_tokens}
                   for r in everyone}
    hits = sum(per_replica[r.name]["hit_tokens"] for r in used)
    queried = sum(per_replica[r.name]["queried_tokens"] for r in used)
    return SetupResult(key, SETUPS[key], url, seed, [r.name for r in used], summarize(records, duration),
                       hits / queried if queried else None, hits, queried, per_replica,
                       sorted({r.error or "" for r in records if not r.ok})[:5], records)


# ---------------------------------------------------------------- report


def plot(results: list[dict[str, Any]], path: Path, title: str) -> None:
    """Throughput, TTFT p50 and prefix-cache hit rate per setup."""
    plt = pyplot()
    names = [f"{r['key']}) {r['name']}".replace(", ", "\n") for r in results]
    colors = ["#7f8c8d", "#c0392b", "#2980b9"][:len(results)]
    panels = [("output tokens / s", [stat(r["summary"], "output_token_throughput") for r in results], "Throughput"),
              ("ms", [stat(r["summary"], "time_to_first_token", "p50") for r in results], "TTFT p50"),
              ("hit tokens / queried tokens", [r["hit_rate"] or 0 for r in results], "Prefix-cache hit rate")]
    fig, axes = plt.subplots(1, 3, figsize=(15, 4.5))
    for ax, (ylabel, values, panel_title) in zip(axes, panels, strict=True):
        bars = ax.bar(range(len(values)), values, color=colors)
        ax.bar_label(bars, fmt="%.2f" if panel_title.startswith("Prefix") else "%.0f", fontsize=8)
        ax.set_xticks(range(len(values)), names, fontsize=8)
        ax.set_ylabel(ylabel)
        ax.set_title(panel_title)
        ax.set_ylim(0, (1.0 if panel_title.startswith("Prefix") else max([*values, 1e-9])) * 1.2)
    fig.suptitle(title, fontsize=10)
    save_figure(fig, path)


def print_summary(report: dict[str, Any]) -> None:
    """The workload, then a line per setup (and one per skipped setup)."""
    w, m = report["workload"], report["machine"]
    print(f"\n{w['num_requests']} requests per setup at concurrency {w['concurrency']}, {w['groups']} prefix groups "
          f"of ~{w['prefix_tokens']} tokens, {w['output_len']} output tokens; {m['cpu_count']} CPUs shared by "
          f"everything; load average before/after: {m['loadavg_before']} / {m['loadavg_after']}")
    print(f"{'setup':<40}{'out tok/s':>10}{'req/s':>8}{'TTFT p50':>10}{'TTFT p90':>10}{'ITL p50':>9}"
          f"{'errors':>8}{'hit rate':>10}{'tok/chunk':>10}  requests per replica")
    for r in report["setups"]:
        s = r["summary"]
        hit = f"{r['hit_rate']:.3f}" if r["hit_rate"] is not None else "-"
        served = " ".join(f"{name}={v['requests']}" for name, v in r["per_replica"].items())
        print(f"{r['key'] + ') ' + r['name']:<40}{stat(s, 'output_token_throughput'):>10.1f}"
              f"{stat(s, 'request_throughput'):>8.2f}{stat(s, 'time_to_first_token', 'p50'):>8.0f}ms"
              f"{stat(s, 'time_to_first_token', 'p90'):>8.0f}ms{stat(s, 'inter_token_latency', 'p50'):>7.0f}ms"
              f"{stat(s, 'error_request_count'):>8.0f}{hit:>10}{stat(s, 'tokens_per_response'):>10.2f}  {served}")
        for error in r["error_samples"]:
            print(f"    error: {error[:200]}")
    for skipped in report["skipped"]:
        print(f"{skipped['key']}) {skipped['name']}: skipped: {skipped['reason']}")


def run_cluster_benchmark(out_dir: str | Path = "bench_results", model: str | None = None, concurrency: int = 16,
                          num_requests: int = 64, output_len: int = 32, prefix_tokens: int = 256, groups: int = 4,
                          skip_vllm_router: bool = False) -> dict[str, Any]:
    """Start the cluster, measure setups a, b, c, stop everything, print the table, write `cluster.json` and
    `cluster.png` into `out_dir`; returns the JSON dict."""
    from tritium.backend.models.registry import resolve_model
    from tritium.backend.tokenizer import Tokenizer

    w = SharedPrefixWorkload(model, concurrency, num_requests, output_len, prefix_tokens, groups)
    folder = resolve_model(model)
    tokenizer = Tokenizer(folder)
    router_binary = None if skip_vllm_router else find_vllm_router()
    if router_binary is None and not skip_vllm_router:
        raise RuntimeError("no vllm-router binary (beside this python or on PATH): install it, or pass "
                           "--skip-vllm-router to measure setups a and b only")
    skipped = [{"key": "c", "name": SETUPS["c"], "reason": "--skip-vllm-router"}] if skip_vllm_router else []
    loadavg_before = load_average()
    t_start = time.perf_counter()
    started: list[Process] = []
    results: list[SetupResult] = []
    with tempfile.TemporaryDirectory(prefix="tritium-cluster-") as tmp, cleanup(started):
        repo = write_repository(Path(tmp) / "repo", str(folder) if model else None, concurrency)
        logs = Path(tmp) / "logs"
        logs.mkdir()
        print(f"starting 2 replicas of {folder.name} (logs in {logs}) ...", flush=True)
        replicas = start_replicas(repo, logs, started)
        tok_arg = str(folder) if model else None
        for r in replicas:
            r.endpoint = start_endpoint(f"endpoint-{r.name}", [r], tok_arg, logs, started)
        both = start_endpoint("endpoint-both", replicas, tok_arg, logs, started)
        router = start_vllm_router(router_binary, [r.endpoint for r in replicas], logs, started) \
            if router_binary else None
        targets = [("a", replicas[0].endpoint, replicas[:1]), ("b", both, replicas)]
        if router:
            targets.append(("c", router, replicas))
        for seed, (key, url, used) in enumerate(targets):
            results.append(run_setup(key, url, used, replicas, tokenizer, w, seed))
    report: dict[str, Any] = {
        "workload": asdict(w) | {"model_folder": str(folder), "temperature": 0, "ignore_eos": True, "stream": True,
                                 "warmup_requests": WARMUP_REQUESTS,
                                 "prefix_cache": "each setup draws its own prefixes (seed = setup index): every "
                                 "setup starts cold for its prefixes; earlier setups' blocks may stay cached"},
        "machine": machine_info(loadavg_before=loadavg_before, note="both replicas, the three endpoints, "
                                "vllm-router and the clients share this machine's CPUs"),
        "vllm_router": {"binary": router_binary, "flags": ["--policy", "cache_aware", *VLLM_ROUTER_FAST_FLAGS]},
        "setups": [asdict(r) for r in results],
        "skipped": skipped,
        "wall_s": time.perf_counter() - t_start,
    }
    title = (f"{folder.name}, {num_requests} requests at concurrency {concurrency}, {groups} shared prefixes of "
             f"~{prefix_tokens} tokens; all on one {os.cpu_count()}-CPU machine (see JSON for load)")
    print_summary(report)
    write_report(out_dir, "cluster", report, lambda path: plot(report["setups"], path, title))
    return report


def has_errors(report: dict[str, Any]) -> bool:
    """Whether any measured request of any setup failed."""
    return any(stat(r["summary"], "error_request_count") for r in report["setups"])
