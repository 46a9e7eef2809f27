"""`bench spec` with tiny sizes: it runs both workloads on the three engines and writes its report (figures not checked:
this machine is busy)."""

from __future__ import annotations

import json
from pathlib import Path

from tritium.backend.models.random_checkpoint import write_random_llama
from tritium.client.bench.spec import run_spec_benchmark


def test_spec_bench_smoke(tmp_path: Path, default_model_path: Path) -> None:
    model = write_random_llama(tmp_path / "tiny", tokenizer_from=default_model_path)
    report = run_spec_benchmark(out_dir=tmp_path / "out", smoke=True, model=str(model), draft_layers=1,
                                kv_cache_bytes=16 << 20)
    assert set(report["results"]) == {"repeating", "open"}
    for result in report["results"].values():
        assert [result[arm]["output_tokens"] for arm in ("off", "ngram", "draft")] == [8, 8, 8]
        assert result["off"]["draft_tokens"] == 0 and result["draft"]["draft_tokens"] > 0
        assert result["ngram"]["mean_acceptance_length"] >= 1.0 and result["draft_itl_ratio"] > 0
    saved = json.loads((tmp_path / "out" / "spec.json").read_text())
    assert saved["workload"]["smoke"] and (tmp_path / "out" / "spec.png").stat().st_size > 0
    assert len(saved["runs"]) == 6 and saved["workload"]["draft_speculative_config"]["method"] == "draft_model"
    assert json.loads((tmp_path / "out" / "draft-1-layers" / "config.json").read_text())["num_hidden_layers"] == 1
