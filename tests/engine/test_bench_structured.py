"""`tritium bench structured --smoke`: every section of the report is there, with sane values."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from tritium.client.bench.schemas import SCHEMAS
from tritium.client.bench.structured import MASK_BATCHES, MODES, run_structured_benchmark

# Loads the default model and generates: ~17 s on an idle 2-vCPU machine, ~100 s on a busy one.
pytestmark = pytest.mark.slow


def _positive_timings(t: dict) -> None:
    assert t["n"] > 0
    assert 0 < t["p50_ms"] <= t["p99_ms"] and math.isfinite(t["p99_ms"])


def test_smoke_run_reports_every_section(tmp_path: Path) -> None:
    returned = run_structured_benchmark(tmp_path, smoke=True)
    report = json.loads((tmp_path / "structured.json").read_text())
    assert (tmp_path / "structured.png").stat().st_size > 0
    assert returned["workload"] == report["workload"]

    runs = report["throughput"]["runs"]
    assert sorted({r["mode"] for r in runs}) == sorted(MODES)
    n = report["workload"]["num_requests"]
    for r in runs:
        assert r["output_tokens"] > 0 and r["seconds"] > 0 and r["tokens_per_s"] > 0
        assert 0 < r["model_s"] <= r["step_s"] and r["steps"] > 0
        assert sum(r["finish_reasons"].values()) == n
        assert "error" not in r["finish_reasons"]
    by_mode = {r["mode"]: r for r in runs}
    # the fair baseline generates exactly what the constrained run did
    assert by_mode["matched"]["output_tokens"] == by_mode["constrained"]["output_tokens"]
    summary = report["throughput"]["summary"]
    assert summary["ratio_constrained_vs_matched"] > 0 and summary["ratio_constrained_vs_free"] > 0
    for mode in MODES:
        assert summary["modes"][mode]["step_ms_avg"] >= summary["modes"][mode]["model_ms_avg"] > 0

    libraries = {lib["library"]: lib for lib in report["libraries"]}
    ll = libraries["llguidance"]
    assert sorted(ll["accepted"]) == sorted(name for name, _ in SCHEMAS) and not ll["refused"]
    assert ll["unsupported_accepted"] == []  # each refused, by name
    assert ll["tokenizer_build_s"] > 0
    for key in ("compile_cold", "first_mask", "compile_cached"):
        _positive_timings(ll[key])
    assert ll["compile_cold"]["n"] == len(SCHEMAS)
    assert [m["rows"] for m in ll["masks"]] == list(MASK_BATCHES)
    for m in ll["masks"]:
        _positive_timings(m["timings"])
        assert m["rejected_tokens"] == 0  # the engine's own tokens replay through its own grammars
    _positive_timings(report["mask_apply"]["timings"])

    if report["xgrammar_skipped"] is None:
        xg = libraries["xgrammar"]
        _positive_timings(xg["compile_cold"])
        assert len(xg["accepted"]) + len(xg["refused"]) == len(SCHEMAS)
    else:
        assert "xgrammar" not in libraries and "xgrammar" in report["xgrammar_skipped"]
