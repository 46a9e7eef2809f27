"""`bench overhead`'s in-process driver: a closed loop on the engine that measures what `bench serve` does."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from tritium.backend import LLM
from tritium.backend.models.random_checkpoint import write_random_llama
from tritium.client.bench.overhead import in_process_summary, run_in_process
from tritium.client.bench.workload import synthetic_prompts


def test_in_process_closed_loop(tmp_path: Path, default_model_path: Path, make_llm: Callable[..., LLM]) -> None:
    model = write_random_llama(tmp_path / "tiny", tokenizer_from=default_model_path)
    llm = make_llm(str(model), max_num_seqs=4, max_num_batched_tokens=2048, kv_cache_bytes=16 << 20)
    run = run_in_process(llm, synthetic_prompts(8, 16), output_len=8, concurrency=4)

    assert len(run.records) == 8
    for r in run.records:
        assert r.ok and r.error is None
        assert r.output_tokens == 8
        assert 0 < r.ttft_s <= r.latency_s
        assert r.itl_s is not None and r.itl_s > 0
    summary = in_process_summary(run)
    assert summary["total_output_tokens"]["avg"] == 64 and summary["error_request_count"]["avg"] == 0
    assert summary["output_token_throughput"]["avg"] > 0
    assert run.steps >= 8 and summary["host_ms_per_step"] > 0
    assert 1 <= summary["mean_running_per_step"] <= 4  # never more than the concurrency in flight
