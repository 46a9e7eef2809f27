"""What large and many JSON schemas cost the engine: memory and the wait they put on other requests.

1. Memory: the engine's RSS while its grammar compiler compiles `num_schemas` distinct schemas of ~`kib` KiB
   each (many optional string properties: the shape whose compiled grammar is largest per byte), sampled every
   `sample_every` schemas. A cache bounded by bytes plateaus; one bounded by entries grows with every schema.
2. Head-of-line blocking: an `EngineLoop` (the serving threads, no server) gets `num_large` requests with large
   distinct schemas (nested objects, not cached: ~0.5 s to compile each here) and right after them one
   unconstrained request; its time to first token, against the same request alone. Compiles that hold the
   tokenizer thread delay it by all of them.

Results: `grammar_load.json` and `grammar_load.png` in `out_dir`, a summary on stdout.
"""

from __future__ import annotations

import threading
import time
from pathlib import Path
from typing import Any

from tqdm import tqdm

from tritium.backend import LLM, SamplingParams
from tritium.backend.outputs import RequestOutput
from tritium.backend.serving.engine_loop import EngineLoop
from tritium.backend.serving.jobs import ErrorKind, Job
from tritium.backend.structured_output.constraint import StructuredOutput
from tritium.client.bench.report import pyplot, save_figure, write_report
from tritium.client.bench.workload import nested_schema, wide_schema


def rss_mib() -> float:
    """This process's resident set size in MiB (Linux: /proc/self/statm)."""
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * 4096 / 2**20


class TimedSink:
    """Records when the first output and the final one (or an error) came."""

    def __init__(self) -> None:
        self.started = time.monotonic()
        self.first: float | None = None  # seconds from submission to the first output
        self.end: float | None = None  # ... to the final output or the error
        self.done = threading.Event()
        self.error: str | None = None

    def send_output(self, output: RequestOutput) -> None:
        """Note the first output's time, and the final one's."""
        if self.first is None:
            self.first = time.monotonic() - self.started
        if output.finished:
            self.end = time.monotonic() - self.started
            self.done.set()

    def send_error(self, message: str, kind: ErrorKind = ErrorKind.INTERNAL) -> None:
        """Note the error and its time (the request is over)."""
        self.error = message
        self.end = time.monotonic() - self.started
        self.done.set()

    def is_cancelled(self) -> bool:
        """Never: the benchmark waits for every request."""
        return False


def measure_memory(llm: LLM, num_schemas: int, kib: int, sample_every: int) -> list[tuple[int, float]]:
    """Compile `num_schemas` distinct wide schemas of `kib` KiB through the engine's grammar compiler;
    returns (schemas compiled, RSS MiB) samples, the first before any."""
    compiler = llm.engine.grammars
    compiler.ll_tokenizer  # noqa: B018  (built before the baseline)
    samples = [(0, rss_mib())]
    for i in tqdm(range(num_schemas), desc=f"compiling {kib} KiB schemas", unit="schema"):
        compiler.compile(StructuredOutput.from_value({"json": wide_schema(kib, tag=f"m{i}")}))
        if (i + 1) % sample_every == 0:
            samples.append((i + 1, rss_mib()))
    return samples


def measure_blocking(llm: LLM, num_large: int, kib: int) -> dict[str, Any]:
    """TTFT of an unconstrained request alone and right behind `num_large` requests with large distinct
    schemas, through an EngineLoop; also when the last large one was answered and their errors."""
    loop = EngineLoop(llm.engine)
    loop.start()
    plain = SamplingParams(max_tokens=4, temperature=0)
    try:
        for name in ("warm-up", "alone"):
            alone = TimedSink()
            loop.submit(Job(request_id=name, params=plain, sink=alone, prompt="Once upon a time"))
            alone.done.wait(120)
        schemas = [nested_schema(kib, tag=f"b{i}") for i in range(num_large)]
        large = []
        for i, schema in enumerate(schemas):
            sink = TimedSink()
            params = SamplingParams(max_tokens=2, structured_output={"json": schema})
            loop.submit(Job(request_id=f"large{i}", params=params, sink=sink, prompt="Fill the form"))
            large.append(sink)
        behind = TimedSink()
        loop.submit(Job(request_id="behind", params=plain, sink=behind, prompt="Once upon a time"))
        behind.done.wait(600)
        for sink in large:
            sink.done.wait(600)
    finally:
        loop.stop()
    last_large = max((s.end or 0.0) for s in large)
    return {"ttft_alone_s": alone.first, "ttft_behind_large_s": behind.first,
            "large_requests_answered_s": last_large, "large_errors": [s.error for s in large if s.error]}


def plot(report: dict[str, Any], path: Path) -> None:
    """RSS against schemas compiled; TTFT alone against behind the large schemas."""
    plt = pyplot()
    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4))
    xs, ys = zip(*report["memory"]["rss_mib"], strict=True)
    left.plot(xs, ys, marker=".")
    left.set(xlabel="distinct schemas compiled", ylabel="RSS (MiB)",
             title=f"engine RSS, {report['memory']['kib']} KiB schemas")
    b = report["blocking"]
    right.bar(["alone", f"behind {report['blocking']['num_large']} large"],
              [b["ttft_alone_s"] or 0, b["ttft_behind_large_s"] or 0])
    right.set(ylabel="time to first token (s)", title="an unconstrained request")
    save_figure(fig, path)


def run_grammar_load_benchmark(model: str | None = None, num_schemas: int = 1000, kib: int = 100,
                               sample_every: int = 50, num_large: int = 10, large_kib: int = 120,
                               out_dir: str | Path = "bench_results") -> dict[str, Any]:
    """Measure blocking, then memory, on `model` (None: the default model); print the findings, write
    `grammar_load.json` and `grammar_load.png` into `out_dir`; returns the JSON dict."""
    llm = LLM(model, kv_cache_bytes=64 << 20, max_model_len=1024)
    blocking = measure_blocking(llm, num_large, large_kib) | {"num_large": num_large, "kib": large_kib}
    samples = measure_memory(llm, num_schemas, kib, sample_every)
    report = {"memory": {"num_schemas": num_schemas, "kib": kib, "rss_mib": samples,
                         "growth_mib": samples[-1][1] - samples[0][1]},
              "blocking": blocking}
    write_report(out_dir, "grammar_load", report, lambda path: plot(report, path))
    print(f"RSS: {samples[0][1]:.0f} MiB -> {samples[-1][1]:.0f} MiB after {num_schemas} distinct {kib} KiB schemas")
    print(f"TTFT of an unconstrained request: alone {blocking['ttft_alone_s']:.3f} s, behind {num_large} "
          f"{large_kib} KiB schemas {blocking['ttft_behind_large_s']:.3f} s (the last of them answered after "
          f"{blocking['large_requests_answered_s']:.1f} s)")
    return report
