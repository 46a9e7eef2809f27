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

import json
import threading
import time
from pathlib import Path
from typing import Any

from tqdm import tqdm

from tritium.backend import LLM, SamplingParams
from tritium.backend.config import RequestOutput
from tritium.backend.serving.engine_loop import EngineLoop, ErrorKind, Job
from tritium.backend.structured_output.constraint import StructuredOutput


def wide_schema(kib: int, tag: str) -> dict[str, Any]:
    """About `kib` KiB of schema: optional string properties named apart by `tag`."""
    n = kib * 1024 // 40
    return {"type": "object", "properties": {f"p{tag}_{i:05d}_xxxx": {"type": "string"} for i in range(n)}}


def nested_schema(kib: int, tag: str) -> dict[str, Any]:
    """About `kib` KiB of schema: objects of ten integers (two required), named apart by `tag`."""
    n = kib * 1024 // 340
    fields = {f"a{k}": {"type": "integer"} for k in range(10)}
    return {"type": "object", "properties": {f"o{tag}_{i}": {"type": "object", "properties": fields,
                                                              "required": ["a0", "a1"]} for i in range(n)}}


def rss_mib() -> float:
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
        if self.first is None:
            self.first = time.monotonic() - self.started
        if output.finished:
            self.end = time.monotonic() - self.started
            self.done.set()

    def send_error(self, message: str, kind: ErrorKind = ErrorKind.INTERNAL) -> None:
        self.error = message
        self.end = time.monotonic() - self.started
        self.done.set()

    def is_cancelled(self) -> bool:
        return False


def measure_memory(llm: LLM, num_schemas: int, kib: int, sample_every: int) -> list[tuple[int, float]]:
    compiler = llm.engine.grammars
    compiler.ll_tokenizer  # noqa: B018  (built before the baseline)
    samples = [(0, rss_mib())]
    for i in tqdm(range(num_schemas), desc=f"compiling {kib} KiB schemas", unit="schema"):
        compiler.compile(StructuredOutput.from_value({"json": wide_schema(kib, tag=f"m{i}")}))
        if (i + 1) % sample_every == 0:
            samples.append((i + 1, rss_mib()))
    return samples


def measure_blocking(llm: LLM, num_large: int, kib: int) -> dict[str, Any]:
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
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4))
    xs, ys = zip(*report["memory"]["rss_mib"], strict=True)
    left.plot(xs, ys, marker=".")
    left.set(xlabel="distinct schemas compiled", ylabel="RSS (MiB)",
             title=f"engine RSS, {report['memory']['kib']} KiB schemas")
    b = report["blocking"]
    right.bar(["alone", f"behind {report['blocking']['num_large']} large"],
              [b["ttft_alone_s"] or 0, b["ttft_behind_large_s"] or 0])
    right.set(ylabel="time to first token (s)", title="an unconstrained request")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def run_grammar_load_benchmark(model: str | None = None, num_schemas: int = 1000, kib: int = 100,
                               sample_every: int = 50, num_large: int = 10, large_kib: int = 120,
                               out_dir: str = "bench_results") -> dict[str, Any]:
    llm = LLM(model, kv_cache_bytes=64 << 20, max_model_len=1024)
    blocking = measure_blocking(llm, num_large, large_kib) | {"num_large": num_large, "kib": large_kib}
    samples = measure_memory(llm, num_schemas, kib, sample_every)
    report = {"memory": {"num_schemas": num_schemas, "kib": kib, "rss_mib": samples,
                         "growth_mib": samples[-1][1] - samples[0][1]},
              "blocking": blocking}
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    (out / "grammar_load.json").write_text(json.dumps(report, indent=2))
    plot(report, out / "grammar_load.png")
    print(f"RSS: {samples[0][1]:.0f} MiB -> {samples[-1][1]:.0f} MiB after {num_schemas} distinct {kib} KiB schemas")
    print(f"TTFT of an unconstrained request: alone {blocking['ttft_alone_s']:.3f} s, behind {num_large} "
          f"{large_kib} KiB schemas {blocking['ttft_behind_large_s']:.3f} s (the last of them answered after "
          f"{blocking['large_requests_answered_s']:.1f} s)")
    return report
