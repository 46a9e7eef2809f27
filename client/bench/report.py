"""What every benchmark reports and how it writes it: the per-request record, the summary figures, the machine
a run was on, and the JSON + PNG writer.

Summary figures are named, shaped and in the units AIPerf uses in `profile_export_aiperf.json`, so that a
tritium report and an AIPerf export read the same way: each metric is a block `{"unit": ..., "avg": ...}`;
record metrics (one value per request: `time_to_first_token`, `inter_token_latency`, `request_latency` in ms,
`output_sequence_length` in tokens) add `min`, `max`, `p50`, `p90`, `p99` and `std` (sample standard
deviation); run-wide ones (`output_token_throughput` in tokens/sec, `request_throughput` in requests/sec,
`request_count`, `error_request_count`, `total_output_tokens`, `benchmark_duration` in sec) carry their
single value as `avg`. Definitions are genai-perf's and AIPerf's: TTFT = first streamed output with text -
send; request latency = final output - send; ITL = (latency - TTFT) / (output tokens - 1); throughput =
output tokens of the successful requests / the run's wall time.
"""

from __future__ import annotations

import json
import os
import platform
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

MS, SEC = "ms", "sec"
TOKENS, TOKENS_PER_SEC = "tokens", "tokens/sec"
REQUESTS, REQUESTS_PER_SEC = "requests", "requests/sec"
DEFAULT_DPI = 110


@dataclass
class RequestRecord:
    """One request as its client saw it, in seconds (the summary turns them into AIPerf's ms).

    `ttft_s`: first output carrying text - send; `latency_s`: final output - send; `itl_s`: (latency - TTFT) /
    (output tokens - 1), None with fewer than two tokens; `responses`: streamed outputs that carried text (0
    when not counted)."""

    ttft_s: float
    latency_s: float
    output_tokens: int
    itl_s: float | None
    ok: bool
    error: str | None = None
    responses: int = 0


def distribution(values: Iterable[float], unit: str) -> dict[str, Any]:
    """AIPerf's stats block of a record metric: `unit`, `avg`, `min`, `max`, `p50`, `p90`, `p99` and `std`
    (sample standard deviation; 0 for a single value). Only `{"unit": unit}` when there are no values."""
    import numpy as np

    arr = np.asarray(list(values), dtype=float)
    if arr.size == 0:
        return {"unit": unit}
    p50, p90, p99 = (float(v) for v in np.percentile(arr, [50, 90, 99]))
    return {"unit": unit, "avg": float(arr.mean()), "min": float(arr.min()), "max": float(arr.max()),
            "p50": p50, "p90": p90, "p99": p99, "std": float(arr.std(ddof=1)) if arr.size > 1 else 0.0}


def scalar(value: float, unit: str) -> dict[str, Any]:
    """AIPerf's block of a run-wide (derived or aggregate) metric: its single value as `avg`."""
    return {"unit": unit, "avg": value}


def stat(summary: Mapping[str, Any], metric: str, name: str = "avg", default: float = 0.0) -> float:
    """`summary[metric][name]`, or `default` when the metric had no values (or is absent)."""
    return float(summary.get(metric, {}).get(name, default))


def summarize(records: list[RequestRecord], duration_s: float) -> dict[str, dict[str, Any]]:
    """The run's AIPerf-named metrics (see the module's docstring) from its requests and wall time.
    Latencies and throughputs count the successful requests; `error_request_count` the others."""
    ok = [r for r in records if r.ok]
    tokens = sum(r.output_tokens for r in ok)
    responses = sum(r.responses for r in ok)
    per_s = 1.0 / duration_s if duration_s > 0 else 0.0
    return {
        "request_count": scalar(len(ok), REQUESTS),
        "error_request_count": scalar(len(records) - len(ok), REQUESTS),
        "benchmark_duration": scalar(duration_s, SEC),
        "time_to_first_token": distribution((1e3 * r.ttft_s for r in ok), MS),
        "inter_token_latency": distribution((1e3 * r.itl_s for r in ok if r.itl_s is not None), MS),
        "request_latency": distribution((1e3 * r.latency_s for r in ok), MS),
        "output_sequence_length": distribution((r.output_tokens for r in ok), TOKENS),
        "total_output_tokens": scalar(tokens, TOKENS),
        "output_token_throughput": scalar(tokens * per_s, TOKENS_PER_SEC),
        "request_throughput": scalar(len(ok) * per_s, REQUESTS_PER_SEC),
        # not an AIPerf metric: > 1 when some hop re-batches a stream (0 responses counted: the token count)
        "tokens_per_response": scalar(tokens / max(1, responses), "tokens/response"),
    }


def load_average() -> list[float]:
    """The 1, 5 and 15 minute load averages, rounded to 0.01."""
    return [round(x, 2) for x in os.getloadavg()]


def machine_info(**extra: Any) -> dict[str, Any]:
    """What a run's figures depend on: platform, CPU model and count, python, torch and its threads, the CUDA
    device (None without one), OMP_NUM_THREADS and the load average now (`loadavg_after`); `extra` is added
    (e.g. `loadavg_before`)."""
    import torch

    try:
        lines = Path("/proc/cpuinfo").read_text(encoding="utf-8", errors="replace").splitlines()
    except OSError:
        lines = []
    cpu_model = next((line.split(":", 1)[1].strip() for line in lines if line.startswith("model name")), None)
    return {"platform": platform.platform(), "machine": platform.machine(), "processor": platform.processor(),
            "cpu_model": cpu_model, "cpu_count": os.cpu_count(), "python": platform.python_version(),
            "torch": torch.__version__, "torch_threads": torch.get_num_threads(),
            "cuda": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None,
            "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS"), "loadavg_after": load_average(), **extra}


def pyplot() -> Any:
    """matplotlib.pyplot on the Agg backend (files only, no display)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def save_figure(fig: Any, path: Path, dpi: int = DEFAULT_DPI) -> None:
    """Lay out `fig`, write it to `path` and close it."""
    fig.tight_layout()
    fig.savefig(path, dpi=dpi)
    pyplot().close(fig)


def write_report(out_dir: str | Path, name: str, report: Mapping[str, Any],
                 plot: Callable[[Path], None] | None = None) -> Path:
    """Write `report` as `out_dir/name.json` (the folder is created) and, with `plot`, have it draw
    `out_dir/name.png`; print what was written. Returns the JSON path. A plot that raises propagates (the
    JSON is written first)."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    path = out / f"{name}.json"
    path.write_text(json.dumps(report, indent=2, default=str), encoding="utf-8")
    if plot is None:
        print(f"wrote {path}")
        return path
    plot(out / f"{name}.png")
    print(f"wrote {path} and {out / f'{name}.png'}")
    return path
