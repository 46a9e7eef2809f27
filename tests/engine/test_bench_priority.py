"""`tritium bench priority` runs end to end on tiny sizes and writes its report (no timing is judged)."""

from __future__ import annotations

import json
from itertools import pairwise
from pathlib import Path

from tritium.client.bench.priority import make_load, run_priority_benchmark


def test_load_marks_a_share_of_requests_high_and_spaces_arrivals() -> None:
    load = make_load(200, 8, request_rate=10.0, high_fraction=0.1)
    assert 5 <= sum(a.high for a in load) <= 40
    assert all(b.at_s >= a.at_s for a, b in pairwise(load)) and load[-1].at_s > 5
    assert sum(a.high for a in make_load(3, 8, request_rate=0, high_fraction=0.0)) == 1


def test_priority_benchmark_smoke(tiny_llama_path: Path, tmp_path: Path) -> None:
    report = run_priority_benchmark(num_requests=10, input_len=12, output_len=3, request_rate=0, max_num_seqs=2,
                                    model=str(tiny_llama_path), kv_cache_bytes=16 << 20, out_dir=tmp_path,
                                    repeats=2)
    saved = json.loads((tmp_path / "priority.json").read_text())
    assert (tmp_path / "priority.png").stat().st_size > 0
    assert saved["settings"]["order"] == ["fcfs", "priority", "priority", "fcfs"]
    for policy in ("fcfs", "priority"):
        run = saved["runs"][policy]  # two runs pooled
        assert run["output_tokens"] == 2 * 10 * 3 and run["ttft_high"]["p50"] > 0 and run["ttft_rest"]["p50"] > 0
        assert len(run["ttft_high"]) and sum(r["policy"] == policy for r in saved["single_runs"]) == 2
    assert saved["runs"]["fcfs"]["preemptions"] == 0
    assert report["settings"]["high_requests"] == saved["settings"]["high_requests"] >= 1
