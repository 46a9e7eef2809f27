"""`tritium bench cluster` on the tiny model: two replicas, three setups, every number in the report sane."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tritium.client.bench.cluster import SETUPS, find_vllm_router, run_cluster_benchmark

# Starts two tritonservers, three OpenAI endpoints and vllm-router: ~1-2 minutes on a 2-vCPU machine.
pytestmark = pytest.mark.slow


def test_smoke_run_measures_three_setups(tmp_path: Path, tiny_llama_path: Path) -> None:
    assert find_vllm_router() is not None, "vllm-router (the test extra) is not installed"
    run_cluster_benchmark(tmp_path, model=str(tiny_llama_path), concurrency=2, num_requests=6, output_len=4,
                          prefix_tokens=64, groups=2)
    report = json.loads((tmp_path / "cluster.json").read_text())
    assert (tmp_path / "cluster.png").stat().st_size > 0
    setups = {s["key"]: s for s in report["setups"]}
    assert sorted(setups) == sorted(SETUPS) and report["skipped"] == []
    for s in setups.values():
        summary = s["summary"]
        assert summary["error_request_count"]["avg"] == 0 and summary["request_count"]["avg"] == 6, s["error_samples"]
        assert summary["output_token_throughput"]["avg"] > 0 and summary["request_throughput"]["avg"] > 0
        assert s["hit_rate"] is not None and 0 <= s["hit_rate"] <= 1
        assert sum(v["requests"] for v in s["per_replica"].values()) == 6
    assert setups["a"]["per_replica"]["replica2"]["requests"] == 0  # setup a uses replica 1 only
    assert setups["c"]["hit_rate"] > 0
    machine = report["machine"]
    assert machine["cpu_count"] and len(machine["loadavg_before"]) == 3 and len(machine["loadavg_after"]) == 3
