"""End-to-end: `tritium serve` runs a real tritonserver; tritonclient (gRPC) and HTTP talk to it."""

from __future__ import annotations

import json
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

from tritium.backend import LLM, SamplingParams
from tritium.client.triton.repository import write_model

from support.serving import (
    Served,
    grpc_stream,
    http_generate,
    http_stream,
    metric_value,
    start_serve,
    wait_for,
    wait_until_idle,
)

pytestmark = pytest.mark.slow
PROMPT = "Once upon a time, in a small village,"


@pytest.fixture(scope="module")
def local() -> LLM:
    return LLM(None, kv_cache_bytes=128 << 20, max_model_len=2048)


def local_text(llm: LLM, prompt: str, max_tokens: int) -> str:
    return llm.generate(prompt, SamplingParams(temperature=0, max_tokens=max_tokens))[0].text


def test_grpc_stream_arrives_token_by_token_and_matches_in_process(server: Served, local: LLM) -> None:
    sent = time.monotonic()
    result = grpc_stream(server.grpc, PROMPT, {"max_tokens": 24, "temperature": 0})
    assert not result.errors and result.finals == 1
    assert "".join(result.texts) == local_text(local, PROMPT, 24)
    assert len(result.texts) >= 12  # about one response per token, not a few big chunks
    # Spread over the generation, not held until the end: a good share of the texts arrive in the first half of
    # the time between the first and the last (buffered, they would all arrive at once). Measured from the first
    # arrival, not from sending: a prefill slowed by a busy machine must not count against the stream.
    first, last = result.times[0], result.times[-1]
    early = [t for t in result.times if t < first + (last - first) / 2]
    assert len(early) >= len(result.times) // 4, (sent, result.times)


def test_http_generate_stream_sse_matches(server: Served, local: LLM) -> None:
    events = list(http_stream(server.http, {"text_input": PROMPT, "max_tokens": 20, "temperature": 0,
                                            "stream": True}))
    assert len(events) >= 5
    assert "".join(e["text_output"] for e in events) == local_text(local, PROMPT, 20)


def test_non_streaming_returns_one_response_with_the_whole_text(server: Served, local: LLM) -> None:
    body = {"text_input": PROMPT, "max_tokens": 12, "temperature": 0, "return_finish_reason": True,
            "return_num_input_tokens": True, "return_num_output_tokens": True}
    resp = http_generate(server.http, body)
    assert resp.status_code == 200, resp.text
    out = resp.json()
    expected = local_text(local, PROMPT, 12)
    assert out["text_output"] == PROMPT + expected
    assert out["finish_reason"] == "length" and out["num_output_tokens"] == 12
    assert out["num_input_tokens"] == len(local.tokenizer.encode(PROMPT))
    resp = http_generate(server.http, body | {"exclude_input_in_output": True})
    assert resp.json()["text_output"] == expected


def test_the_example_serve_prints_gets_an_answer(server: Served) -> None:
    """The first request a newcomer copies: a question through the chat template, answered in a sentence (a
    bare question makes the instruct model end at once, echoing the prompt)."""
    from tritium.client.cli.serve import EXAMPLE_REQUEST

    resp = http_generate(server.http, EXAMPLE_REQUEST)
    assert resp.status_code == 200, resp.text
    answer = resp.json()["text_output"]
    assert "Paris" in answer and "What is" not in answer, answer  # the answer alone, not the question
    echoed = http_generate(server.http, EXAMPLE_REQUEST | {"exclude_input_in_output": False}).json()["text_output"]
    assert echoed.startswith("<|im_start|>") and echoed.endswith(answer)


def test_genai_perf_style_sampling_parameters(server: Served, local: LLM) -> None:
    sampling = json.dumps({"max_tokens": "16", "temperature": "0"})
    resp = http_generate(server.http, {"text_input": PROMPT, "sampling_parameters": sampling,
                                       "exclude_input_in_output": True})
    assert resp.status_code == 200, resp.text
    assert resp.json()["text_output"] == local_text(local, PROMPT, 16)
    streamed = grpc_stream(server.grpc, PROMPT, {"max_tokens": "16", "temperature": "0"})
    assert "".join(streamed.texts) == resp.json()["text_output"]


def test_cancel_mid_stream_frees_the_kv_cache(server: Served) -> None:
    result = grpc_stream(server.grpc, PROMPT, {"max_tokens": 4000, "ignore_eos": True, "temperature": 0},
                         cancel_after=3)
    assert len(result.texts) >= 3 and result.finals == 0
    assert wait_until_idle(server, 60)
    assert http_generate(server.http, {"text_input": "Hello", "max_tokens": 3}).status_code == 200


@pytest.mark.parametrize("body,message", [
    ({"max_tokens": 4}, "text_input"),
    ({"text_input": "hi", "sampling_parameters": "{not json"}, "sampling_parameters must be a JSON object"),
    ({"text_input": "hi", "temperature": -1}, "temperature must be in [0, 100]"),
    ({"text_input": "hi", "top_p": 0}, "top_p must be in (0, 1]"),
    ({"text_input": "hi", "bogus": 1}, "unknown request parameter 'bogus'"),
    ({"text_input": "word " * 9000}, "the model's context is 8192 tokens"),
])
def test_bad_requests_get_an_error_naming_the_problem(server: Served, body: dict, message: str) -> None:
    resp = http_generate(server.http, body)
    assert resp.status_code == 400 or "error" in resp.json(), resp.text
    assert message in resp.json()["error"]
    ok = http_generate(server.http, {"text_input": "Hello", "max_tokens": 2})
    assert ok.status_code == 200 and "text_output" in ok.json()


def model_metric(served: Served, name: str, model: str = "tritium") -> float:
    """The sum of `name`'s samples labelled with `model` (the shared server runs other engines too)."""
    text = urllib.request.urlopen(served.metrics, timeout=5).read().decode()
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith(name + "{") and f'model="{model}"' in line)


def test_custom_metrics_are_plausible(server: Served) -> None:
    """The cumulative counters of a shared server grow by exactly what one request did."""
    names = ("tritium_generation_tokens_total", "tritium_prompt_tokens_total",
             "tritium_time_to_first_token_seconds_count", "tritium_e2e_request_latency_seconds_count",
             "tritium_e2e_request_latency_seconds_sum", "tritium_inter_token_latency_seconds_count",
             "tritium_prefix_cache_queried_tokens_total")
    assert wait_until_idle(server)
    before = {name: model_metric(server, name) for name in names}
    started = time.monotonic()
    resp = http_generate(server.http, {"text_input": PROMPT, "max_tokens": 8, "ignore_eos": True,
                                       "return_num_input_tokens": True})
    elapsed = time.monotonic() - started
    assert resp.status_code == 200, resp.text
    prompt_tokens = resp.json()["num_input_tokens"]

    def delta(name: str) -> float:
        return model_metric(server, name) - before[name]

    # Pushed to Triton every 0.5 s and when the engine goes idle; one request's values in one push.
    assert wait_for(lambda: delta("tritium_e2e_request_latency_seconds_count") >= 1, 10)
    assert delta("tritium_e2e_request_latency_seconds_count") == 1
    assert delta("tritium_time_to_first_token_seconds_count") == 1
    assert delta("tritium_generation_tokens_total") == 8
    assert delta("tritium_prompt_tokens_total") == prompt_tokens > 0
    assert delta("tritium_inter_token_latency_seconds_count") == 7  # one per token after the first
    assert 0 < delta("tritium_e2e_request_latency_seconds_sum") <= elapsed
    assert 0 < delta("tritium_prefix_cache_queried_tokens_total") <= prompt_tokens
    assert 0 <= metric_value(server, "tritium_kv_cache_usage_ratio") <= 1


def test_two_versions_and_explicit_load_unload(tmp_path: Path, tiny_llama_path: Path) -> None:
    import tritonclient.http as httpclient

    repo = tmp_path / "repo"
    write_model(repo, versions={1: {}, 2: {"model": str(tiny_llama_path), "kv_cache_bytes": 16 << 20}})
    served = start_serve(f"--model-repository={repo}", "--model-control=explicit", "--load-model=tritium")
    try:
        body = {"text_input": PROMPT, "max_tokens": 6, "temperature": 0, "exclude_input_in_output": True}
        v1 = http_generate(served.http, body, version="1").json()
        v2 = http_generate(served.http, body, version="2").json()
        assert (v1["model_version"], v2["model_version"]) == ("1", "2")
        assert v1["text_output"] != v2["text_output"]  # two different checkpoints
        client = httpclient.InferenceServerClient(served.http.removeprefix("http://"), connection_timeout=300,
                                                 network_timeout=300)  # loading two engines on a busy host
        client.unload_model("tritium")
        deadline = time.monotonic() + 60
        while client.is_model_ready("tritium", "1") and time.monotonic() < deadline:
            time.sleep(0.5)
        assert not client.is_model_ready("tritium", "1")
        assert http_generate(served.http, body, version="1").status_code != 200
        client.load_model("tritium")
        assert client.is_model_ready("tritium", "1") and client.is_model_ready("tritium", "2")
        assert http_generate(served.http, body, version="1").json()["text_output"] == v1["text_output"]
    finally:
        served.stop()


def test_ensemble_streams_the_same_text(server: Served, local: LLM) -> None:
    body = {"text_input": PROMPT, "max_tokens": 16, "temperature": 0, "stream": True}
    events = list(http_stream(server.http, body, model="tritium_ensemble"))
    assert len(events) >= 5
    assert "".join(e["text_output"] for e in events) == local_text(local, PROMPT, 16)
    whole = http_generate(server.http, body | {"stream": False}, model="tritium_ensemble")
    assert whole.status_code == 200 and whole.json()["text_output"] == local_text(local, PROMPT, 16)
    chat = list(http_stream(server.http, {"text_input": "What is the capital of France?", "apply_chat_template": True,
                                          "max_tokens": 16, "temperature": 0, "stream": True},
                            model="tritium_ensemble"))
    assert "Paris" in "".join(e["text_output"] for e in chat)


def test_cli_generate_and_chat_stream_from_the_server(server: Served, local: LLM) -> None:
    expected = local_text(local, PROMPT, 12)
    for url in (server.grpc, server.http):
        out = subprocess.run([sys.executable, "-m", "tritium.client.cli", "generate", "--url", url, "--temperature",
                              "0", "--max-tokens", "12", PROMPT], capture_output=True, text=True, check=True)
        assert out.stdout.rstrip("\n") == expected
    chat = subprocess.run([sys.executable, "-m", "tritium.client.cli", "chat", "--url", server.grpc, "--temperature",
                           "0", "--max-tokens", "24"], input="What is the capital of France?\n",
                          capture_output=True, text=True, check=True)
    assert "Paris" in chat.stdout


def test_bench_serve_reports_consistent_metrics(server: Served, tmp_path: Path) -> None:
    from tritium.client.bench.serve import run_serve_benchmark

    report = run_serve_benchmark(server.grpc, concurrency=[1, 3], num_requests=4, input_len=16, output_len=6,
                                 out_dir=str(tmp_path))
    assert (tmp_path / "serve.png").stat().st_size > 1000 and (tmp_path / "serve.json").is_file()
    for result in report["results"]:
        assert result["error_request_count"]["avg"] == 0 and result["total_output_tokens"]["avg"] == 4 * 6
        assert result["time_to_first_token"]["max"] <= result["request_latency"]["max"]
        assert result["time_to_first_token"]["p50"] <= result["request_latency"]["p50"]
        assert result["output_token_throughput"]["avg"] > 0
    for records in report["requests"].values():
        assert all(r["ttft_s"] <= r["latency_s"] and r["output_tokens"] == 6 for r in records)
