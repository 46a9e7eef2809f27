"""AIPerf (PyPI `aiperf`) against both doors of a keyed tritium: the OpenAI endpoint's /v1/chat/completions and
tritonserver's HTTP generate_stream, offline with the default model's tokenizer folder."""

from __future__ import annotations

import http.server
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest

from tritium.client.bench.aiperf import AiperfResult, AiperfRun, aiperf_command, run_aiperf

from support.serving import API_KEY, Served, metric_value, start_openai, start_serve, wait_until_idle

NUM_REQUESTS, OUTPUT_TOKENS, CONCURRENCY = 4, 16, 2


@pytest.fixture(scope="module")
def triton() -> Iterator[Served]:
    served = start_serve("--model-control=explicit", "--load-model=tritium", env={"TRITIUM_API_KEY": API_KEY})
    yield served
    served.stop()


@pytest.fixture(scope="module")
def openai_url(triton: Served) -> Iterator[str]:
    proc, base = start_openai([triton.grpc], api_key=API_KEY)
    yield base
    proc.terminate()
    proc.wait(10)


@pytest.fixture
def hub() -> Iterator[tuple[str, list[str]]]:
    """A stand-in for the Hugging Face hub (HF_ENDPOINT) that records every request it gets and answers 404."""
    seen: list[str] = []

    class Recorder(http.server.BaseHTTPRequestHandler):
        def _any(self) -> None:
            seen.append(f"{self.command} {self.path}")
            self.send_response(404)
            self.end_headers()

        do_GET = do_HEAD = do_POST = _any

        def log_message(self, *args: object) -> None:
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Recorder)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{server.server_address[1]}", seen
    server.shutdown()
    server.server_close()


def check(result: AiperfResult) -> None:
    assert result.ok, f"{result.door}: aiperf exit {result.returncode}, errors {result.errors}\n{result.log[-4000:]}"
    assert result.request_count == NUM_REQUESTS and result.error_count == 0, result.summary()
    f = result.figures
    assert f["ttft_ms"]["avg"] > 0 and f["ttft_ms"]["count"] == NUM_REQUESTS, f
    assert f["itl_ms"]["avg"] > 0, f
    assert f["request_latency_ms"]["avg"] > f["ttft_ms"]["avg"], f
    assert f["output_token_throughput"]["avg"] > 0 and f["request_throughput"]["avg"] > 0, f
    # ignore_eos: OUTPUT_TOKENS tokens each; aiperf counts them by re-encoding the text, which may merge a few
    assert OUTPUT_TOKENS - 3 <= f["output_sequence_length"]["avg"] <= OUTPUT_TOKENS + 3, f
    assert API_KEY not in (result.artifact_dir / "profile_export_aiperf.json").read_text()
    assert API_KEY not in " ".join(result.command)


def test_aiperf_against_both_doors(triton: Served, openai_url: str, default_model_path: Path, tmp_path: Path,
                                   hub: tuple[str, list[str]]) -> None:
    hub_url, hub_requests = hub
    # the offline switch is set as a user would set it; the wrapper drops it for a tokenizer folder, which
    # aiperf 0.13.0 would otherwise look up as a hub repo id
    env = {"HF_ENDPOINT": hub_url, "HF_HUB_OFFLINE": "1"}
    common = dict(tokenizer=default_model_path, api_key=API_KEY, input_tokens=32, output_tokens=OUTPUT_TOKENS,
                  num_requests=NUM_REQUESTS, concurrency=CONCURRENCY)
    runs = [AiperfRun(door="openai", url=openai_url, artifact_dir=tmp_path / "openai", **common),
            AiperfRun(door="triton", url=triton.http, artifact_dir=tmp_path / "triton", **common)]
    assert "/v2/models/tritium/generate_stream" in aiperf_command(runs[1])
    finished = metric_value(triton, "tritium_e2e_request_latency_seconds_count")
    for run in runs:
        result = run_aiperf(run, timeout=240, capture=True, env=env)
        check(result)
        assert wait_until_idle(triton, 60)
        now = metric_value(triton, "tritium_e2e_request_latency_seconds_count")
        assert now - finished == NUM_REQUESTS, f"{run.door}: the server finished {now - finished} requests"
        finished = now
    assert hub_requests == [], f"aiperf reached for the hub: {hub_requests}"
