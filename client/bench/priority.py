"""Request priority under a mixed load (`tritium bench priority`), in-process.

The same open-loop load runs twice on an engine of its own: Poisson arrivals at `request_rate`, a
`high_fraction` of them marked high priority (0, the others 1). Under scheduling_policy "priority" the high
requests should get their first token much sooner than the rest (the goal: TTFT p50 at least 3x lower) while
the total throughput stays within 5% of the same load under "fcfs" (where every request is sent with
priority 0, the high ones only counted apart). With `repeats` > 1 the policies alternate in ABBA order (fcfs,
priority, priority, fcfs, ...: a later run in one process is not systematically the slower or faster one) and
each policy's figures pool its runs: TTFTs together, throughput = all its tokens / all its run time. Writes
`priority.json` and `priority.png`.
"""

from __future__ import annotations

import gc
import random
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from tritium.client.bench.report import MS, distribution, machine_info, pyplot, save_figure, write_report
from tritium.client.bench.workload import random_token_prompts

HIGH, LOW = 0, 1


@dataclass
class Arrival:
    """One request of the load: when it arrives (seconds after the start), its prompt, whether it is high."""

    at_s: float
    prompt_token_ids: list[int]
    high: bool


@dataclass
class PolicyRun:
    """One policy's run: TTFT distributions (ms) of the high requests and of the rest, and the throughput."""

    policy: str
    ttft_high: dict[str, Any]
    ttft_rest: dict[str, Any]
    output_tokens: int
    duration_s: float
    preemptions: int
    ttfts_high_s: list[float] = field(default_factory=list)
    ttfts_rest_s: list[float] = field(default_factory=list)

    @property
    def throughput(self) -> float:
        """Output tokens per second, first arrival to last finish."""
        return self.output_tokens / self.duration_s if self.duration_s > 0 else 0.0

    def pooled(self, other: PolicyRun) -> PolicyRun:
        """This run and `other` (the same policy) as one: TTFTs together, tokens, time and preemptions summed."""
        high, rest = self.ttfts_high_s + other.ttfts_high_s, self.ttfts_rest_s + other.ttfts_rest_s
        return PolicyRun(self.policy, distribution((v * 1000 for v in high), MS),
                         distribution((v * 1000 for v in rest), MS), self.output_tokens + other.output_tokens,
                         self.duration_s + other.duration_s, self.preemptions + other.preemptions, high, rest)


def make_load(num_requests: int, input_len: int, request_rate: float, high_fraction: float,
              seed: int = 0) -> list[Arrival]:
    """The load: Poisson arrivals at `request_rate` per second (all at once when it is 0), random prompts of
    `input_len` tokens, each request high with probability `high_fraction` (at least one high one)."""
    rng = random.Random(seed)
    prompts = random_token_prompts(num_requests, input_len, input_len, seed=seed)
    at, load = 0.0, []
    for i, prompt in enumerate(prompts):
        load.append(Arrival(at, prompt, rng.random() < high_fraction))
        if request_rate > 0:
            at += rng.expovariate(request_rate)
        if i == num_requests - 1 and not any(a.high for a in load):
            load[len(load) // 2].high = True
    return load


def run_policy(policy: str, load: list[Arrival], output_len: int, engine_kwargs: dict[str, Any]) -> PolicyRun:
    """Build an engine with scheduling_policy `policy`, warm it up, replay `load` against it in real time and
    measure. Raises RuntimeError when a request fails."""
    from tritium.backend.config import EngineConfig
    from tritium.backend.engine import LLMEngine
    from tritium.backend.sampling_params import SamplingParams

    engine = LLMEngine(EngineConfig(scheduling_policy=policy, **engine_kwargs))
    params = SamplingParams(max_tokens=output_len, temperature=0, ignore_eos=True)
    engine.add_request("warm-up", None, SamplingParams(max_tokens=2), prompt_token_ids=load[0].prompt_token_ids)
    while engine.has_unfinished_requests():
        engine.step()
    sent: dict[str, float] = {}
    first: dict[str, float] = {}
    tokens = 0
    next_i, start = 0, time.perf_counter()
    last_end = start
    while next_i < len(load) or engine.has_unfinished_requests():
        now = time.perf_counter() - start
        while next_i < len(load) and load[next_i].at_s <= now:
            a = load[next_i]
            rid = f"{'high' if a.high else 'rest'}-{next_i}"
            priority = HIGH if a.high or policy == "fcfs" else LOW
            engine.add_request(rid, None, params, prompt_token_ids=a.prompt_token_ids, priority=priority)
            sent[rid] = start + a.at_s
            next_i += 1
        if not engine.has_unfinished_requests():
            time.sleep(max(0.0, load[next_i].at_s - (time.perf_counter() - start)))
            continue
        for out in engine.step():
            if out.finish_reason == "error":
                raise RuntimeError(f"{out.request_id} failed: {out.error}")
            if out.delta_token_ids and out.request_id not in first:
                first[out.request_id] = time.perf_counter()
            tokens += len(out.delta_token_ids)
            if out.finished:
                last_end = time.perf_counter()
    ttft = {rid: first[rid] - sent[rid] for rid in sent}
    high = [v for rid, v in ttft.items() if rid.startswith("high")]
    rest = [v for rid, v in ttft.items() if rid.startswith("rest")]
    run = PolicyRun(policy, distribution((v * 1000 for v in high), MS), distribution((v * 1000 for v in rest), MS),
                    tokens, last_end - start, engine.scheduler.num_preemptions, high, rest)
    del engine
    gc.collect()
    _empty_device_cache()
    return run


def _empty_device_cache() -> None:
    import torch

    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def run_priority_benchmark(num_requests: int = 400, input_len: int = 256, output_len: int = 128,
                           request_rate: float = 32.0, high_fraction: float = 0.1, max_num_seqs: int = 32,
                           model: str | None = None, kv_cache_bytes: int | None = None,
                           out_dir: str | Path | None = "bench_results", repeats: int = 1) -> dict[str, Any]:
    """Run the load under "fcfs" and "priority" (`repeats` times each, ABBA order, pooled); print each policy's
    TTFT p50 (high vs rest) and throughput, the TTFT ratio (rest / high, under priority; goal >= 3) and the
    throughput ratio (priority / fcfs; goal >= 0.95), and (with `out_dir`) write priority.json and priority.png.
    Returns the report."""
    load = make_load(num_requests, input_len, request_rate, high_fraction)
    engine_kwargs: dict[str, Any] = {"model": model, "max_num_seqs": max_num_seqs,
                                     "max_num_batched_tokens": max(1024, max_num_seqs)}
    if kv_cache_bytes is not None:
        engine_kwargs["kv_cache_bytes"] = kv_cache_bytes
    runs: dict[str, PolicyRun] = {}
    order: list[str] = []
    for i in range(repeats):
        order += ["fcfs", "priority"] if i % 2 == 0 else ["priority", "fcfs"]
    single: list[PolicyRun] = []
    for policy in order:
        run = run_policy(policy, load, output_len, engine_kwargs)
        single.append(run)
        runs[policy] = runs[policy].pooled(run) if policy in runs else run
    runs = {policy: runs[policy] for policy in ("fcfs", "priority")}
    prio, fcfs = runs["priority"], runs["fcfs"]
    ttft_ratio = prio.ttft_rest.get("p50", 0.0) / max(prio.ttft_high.get("p50", 0.0), 1e-9)
    throughput_ratio = prio.throughput / fcfs.throughput if fcfs.throughput > 0 else 0.0
    n_high = sum(a.high for a in load)
    print(f"{num_requests} requests ({n_high} high priority) of {input_len} + {output_len} tokens at "
          f"{request_rate} req/s, max_num_seqs {max_num_seqs}")
    for run in runs.values():
        print(f"  {run.policy:8s} TTFT p50 high {run.ttft_high.get('p50', 0):8.1f} ms  rest "
              f"{run.ttft_rest.get('p50', 0):8.1f} ms  throughput {run.throughput:8.1f} tok/s  "
              f"preemptions {run.preemptions}")
    print(f"  priority: TTFT p50 rest / high {ttft_ratio:.2f}x (goal >= 3); throughput vs fcfs "
          f"{throughput_ratio:.3f}x (goal >= 0.95)")
    report = {
        "settings": {"num_requests": num_requests, "high_requests": n_high, "input_len": input_len,
                     "output_len": output_len, "request_rate": request_rate, "high_fraction": high_fraction,
                     "max_num_seqs": max_num_seqs, "model": model, "repeats": repeats, "order": order},
        "runs": {p: {k: v for k, v in asdict(r).items() if not k.startswith("ttfts_")} | {"throughput": r.throughput}
                 for p, r in runs.items()},
        "single_runs": [{"policy": r.policy, "throughput": r.throughput, "duration_s": r.duration_s,
                         "preemptions": r.preemptions, "ttft_p50_high_ms": r.ttft_high.get("p50", 0.0),
                         "ttft_p50_rest_ms": r.ttft_rest.get("p50", 0.0)} for r in single],
        "ttft_p50_ratio_rest_over_high": ttft_ratio, "throughput_ratio_priority_over_fcfs": throughput_ratio,
        "goals_met": ttft_ratio >= 3 and throughput_ratio >= 0.95, "machine": machine_info(),
    }
    if out_dir:
        write_report(out_dir, "priority", report, lambda path: _plot(runs, path))
    return report


def _plot(runs: dict[str, PolicyRun], path: Path) -> None:
    plt = pyplot()
    fig, (ax_ttft, ax_tput) = plt.subplots(1, 2, figsize=(10, 4))
    for i, run in enumerate(runs.values()):
        data = [[v * 1000 for v in run.ttfts_high_s] or [0.0], [v * 1000 for v in run.ttfts_rest_s] or [0.0]]
        ax_ttft.boxplot(data, positions=[i * 3, i * 3 + 1], widths=0.8)
    ax_ttft.set_xticks([0, 1, 3, 4], [f"{p}\n{c}" for p in runs for c in ("high", "rest")])
    ax_ttft.set_ylabel("TTFT (ms)")
    ax_ttft.set_title("time to first token")
    ax_tput.bar(list(runs), [r.throughput for r in runs.values()])
    ax_tput.set_ylabel("output tokens / s")
    ax_tput.set_title("throughput")
    save_figure(fig, path)
