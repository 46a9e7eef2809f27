"""`tritium bench lora` at tiny sizes: the JSON has every field, the throughput ratio is a positive number, and
the PNG is written. Its figures mean nothing here (a busy CPU); the script must run."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from tritium.backend.lora.adapter import MODULES
from tritium.client.bench.lora import NUM_ADAPTERS, RANK, run_lora_benchmark
from tritium.client.cli.main import build_parser


@pytest.mark.slow  # one of the fast tier's longest (~6-10 s); the full suite runs it
def test_smoke_run_reports_throughput_load_and_memory(tmp_path: Path) -> None:
    returned = run_lora_benchmark(tmp_path, num_requests=NUM_ADAPTERS + 1, output_len=3, input_len=8, repeats=2,
                                  kv_cache_bytes=8 << 20, max_model_len=128)
    report = json.loads((tmp_path / "lora.json").read_text())
    assert (tmp_path / "lora.png").stat().st_size > 0
    assert report["workload"]["num_requests"] == NUM_ADAPTERS + 1 and report["workload"]["rank"] == RANK
    assert report["workload"]["targets"] == list(MODULES)
    tp = report["throughput"]
    assert math.isfinite(tp["ratio"]) and tp["ratio"] > 0
    assert tp["base_tokens_per_s"] > 0 and tp["lora_tokens_per_s"] > 0
    assert [r["mode"] for r in tp["runs"]] == ["base", "lora-mix", "lora-mix", "base"]  # ABBA
    assert len(tp["pairwise_ratios"]) == 2 and all(r > 0 for r in tp["pairwise_ratios"])
    assert tp["ratio"] == tp["median_pairwise_ratio"] == pytest.approx(sum(tp["pairwise_ratios"]) / 2)
    assert tp["best_of_ratio"] == tp["lora_tokens_per_s"] / tp["base_tokens_per_s"]
    assert all(r["output_tokens"] == (NUM_ADAPTERS + 1) * 3 for r in tp["runs"])
    load = report["load"]
    assert len(load["load_s"]) == len(load["slot_write_s"]) == NUM_ADAPTERS
    assert load["load_s_median"] > 0 and load["slot_write_s_median"] > 0
    memory = report["memory"]
    assert 0 < memory["host_bytes"] <= memory["device_slot_bytes"]  # rank 16 = max_lora_rank: the slot's size
    assert memory["device_slot_bytes"] * memory["max_loras"] >= memory["device_stacks_bytes"]
    assert returned["throughput"]["ratio"] == tp["ratio"]


def test_the_cli_registers_bench_lora() -> None:
    args = build_parser().parse_args(["bench", "lora", "--num-requests", "5", "--output-len", "2"])
    assert args.num_requests == 5 and args.output_len == 2 and args.func.__name__ == "run_lora"
