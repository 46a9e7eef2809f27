"""The model-server protocol on the OpenAI endpoint (client/openai/replica_routes.py) against a real tritonserver:
health, model facts, load, vLLM-shaped tokenize/detokenize and render, `/metrics` with the `vllm:*` gauges
moving under load, and the extra fields routers add to requests."""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from pathlib import Path

import pytest
import requests

from tritium.backend.tokenizer import Tokenizer
from tritium.client.cluster.replica_load import EngineLoad, engine_load, parse_samples
from tritium.client.cluster.router import prefix_score
from tritium.client.triton.repository import write_model

from support.serving import Served, metric_value, raw_http_request, start_openai_with, start_serve, wait_for

pytestmark = pytest.mark.slow
PROMPT = "Once upon a time, in a small village,"
LONG = {"model": "tritium", "prompt": PROMPT, "max_tokens": 4000, "ignore_eos": True, "stream": True}
SEATS = 2  # max_num_seqs of the served engine: a third request waits


@pytest.fixture(scope="module")
def replica(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Served]:
    repo = tmp_path_factory.mktemp("model-repository")
    write_model(repo, {"max_num_seqs": SEATS, "max_pending_requests": 16, "request_timeout_s": 600})
    served = start_serve(f"--model-repository={repo}", "--model-control=explicit", "--load-model=tritium")
    yield served
    served.stop()


@pytest.fixture(scope="module")
def base(replica: Served) -> Iterator[str]:
    """The endpoint's root URL (not /v1)."""
    proc, url = start_openai_with([replica.grpc], f"--upstream-metrics={replica.metrics}", "--expose-model-path")
    yield url.removesuffix("/v1")
    proc.terminate()
    proc.wait(10)


@pytest.fixture(scope="module")
def tok(default_model_path: Path) -> Tokenizer:
    return Tokenizer(default_model_path)


def gauges(base: str) -> dict[str, float]:
    """The endpoint's vllm:* samples by name (label sets summed)."""
    out: dict[str, float] = {}
    for name, _, value in parse_samples(requests.get(f"{base}/metrics", timeout=5).text):
        if name.startswith("vllm:"):
            out[name] = out.get(name, 0.0) + value
    return out


def test_metrics_show_vllm_gauges_that_rise_under_load_and_return_to_zero(base: str, replica: Served) -> None:
    text = requests.get(f"{base}/metrics", timeout=5).text
    samples = {name: labels for name, labels, _ in parse_samples(text)}
    for name in ("vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:kv_cache_usage_perc",
                 "vllm:cache_config_info", "vllm:lora_requests_info"):
        assert samples[name]["model_name"] == "tritium", name
    assert int(samples["vllm:cache_config_info"]["block_size"]) == 16
    assert int(samples["vllm:cache_config_info"]["num_gpu_blocks"]) > 0
    assert samples["vllm:lora_requests_info"]["max_lora"] == "0"
    assert any(line.startswith("tritium_num_requests_running{") for line in text.splitlines())  # passed through
    streams = [raw_http_request(base + "/v1", "/v1/completions", LONG) for _ in range(SEATS + 2)]
    try:
        assert wait_for(lambda: (g := gauges(base))["vllm:num_requests_running"] == SEATS
                        and g["vllm:num_requests_waiting"] == 2 and g["vllm:kv_cache_usage_perc"] > 0, 60), gauges(base)
        load = requests.get(f"{base}/get_load", timeout=5).json()
        assert load["num_requests_running"] == SEATS and load["load"] == SEATS + 2, load
    finally:
        for conn in streams:
            conn.close()
    assert wait_for(lambda: all(gauges(base)[name] == 0 for name in (
        "vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:kv_cache_usage_perc")), 30), gauges(base)
    assert requests.get(f"{base}/get_load", timeout=5).json()["load"] == 0


def test_without_the_engines_metrics_the_endpoint_counts_its_own_requests(replica: Served) -> None:
    """An upstream on other ports than 8001/8002 and no --upstream-metrics: the load is the endpoint's own
    requests there (streaming ones run, the others wait); KV usage cannot be known and is left out."""
    proc, url = start_openai_with([replica.grpc])
    blind = url.removesuffix("/v1")
    streams = [raw_http_request(url, "/v1/completions", LONG) for _ in range(SEATS + 4)]
    try:
        assert wait_for(lambda: (g := gauges(blind)).get("vllm:num_requests_running") == SEATS
                        and g.get("vllm:num_requests_waiting") == 4, 60), gauges(blind)
        assert "vllm:kv_cache_usage_perc" not in gauges(blind)
        load = requests.get(f"{blind}/get_load", timeout=5).json()
        assert (load["load"], load["num_requests_running"], load["num_requests_waiting"]) == (SEATS + 4, SEATS, 4)
        assert "kv_cache_usage_perc" not in load, load
    finally:
        for conn in streams:
            conn.close()
        proc.terminate()
        proc.wait(10)


def test_tokenize_and_detokenize_in_vllm_shapes(base: str, tok: Tokenizer) -> None:
    resp = requests.post(f"{base}/tokenize", json={"model": "tritium", "prompt": PROMPT, "return_token_strs": True},
                         timeout=10)
    assert resp.status_code == 200, resp.text
    body = resp.json()
    assert body["tokens"] == tok.encode(PROMPT) and body["count"] == len(body["tokens"])
    assert body["max_model_len"] == 8192 and len(body["token_strs"]) == body["count"]
    back = requests.post(f"{base}/detokenize", json={"model": "tritium", "tokens": body["tokens"]}, timeout=10)
    assert back.json() == {"prompt": PROMPT}
    chat = requests.post(f"{base}/tokenize", json={"messages": [{"role": "user", "content": "Hi"}]}, timeout=10).json()
    rendered = tok.apply_chat_template([{"role": "user", "content": "Hi"}])
    assert chat["tokens"] == tok.encode(rendered, add_special_tokens=False)
    bad = requests.post(f"{base}/detokenize", json={"tokens": [0, 10**9]}, timeout=10)
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "tokens"
    other = requests.post(f"{base}/tokenize", json={"model": "gpt-4", "prompt": "x"}, timeout=10)
    assert other.status_code == 404
    hi = [{"role": "user", "content": "Hi"}]
    bare = requests.post(f"{base}/tokenize", json={"messages": hi, "add_generation_prompt": False}, timeout=10).json()
    assert bare["tokens"] == tok.encode(tok.apply_chat_template(hi, add_generation_prompt=False),
                                        add_special_tokens=False)
    assert bare["count"] < chat["count"]


TOOL = {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}


@pytest.mark.parametrize(("body", "param"), [
    ({"prompt": "a\ud800b"}, "prompt"),
    ({"messages": [{"role": "user", "content": "a\udfffb"}]}, "messages.0.content"),
    ({"messages": [{"role": "user", "content": "Hi"}], "tools": [TOOL, TOOL]}, "tools"),
])
def test_tokenize_answers_bad_input_with_400_naming_the_field(base: str, body: dict, param: str) -> None:
    resp = requests.post(f"{base}/tokenize", data=json.dumps(body), headers={"Content-Type": "application/json"},
                         timeout=10)
    assert resp.status_code == 400, resp.text
    assert resp.json()["error"]["param"] == param, resp.text


def test_render_gives_the_engine_request_without_generating(base: str, tok: Tokenizer, replica: Served) -> None:
    done_before = metric_value(replica, "tritium_e2e_request_latency_seconds_count")
    resp = requests.post(f"{base}/v1/completions/render", json={
        "model": "tritium", "prompt": [PROMPT, "Hello"], "max_tokens": 5, "no_stop_trim": False}, timeout=10)
    assert resp.status_code == 200, resp.text
    first, second = resp.json()
    assert first["token_ids"] == tok.encode(PROMPT) and second["token_ids"] == tok.encode("Hello")
    assert first["sampling_params"]["max_tokens"] == 5 and first["model"] == "tritium"
    messages = [{"role": "user", "content": "Hi"}]
    chat = requests.post(f"{base}/v1/chat/completions/render", json={
        "model": "tritium", "messages": messages, "response_format": {"type": "json_object"}}, timeout=10).json()
    assert chat["token_ids"] == tok.encode(tok.apply_chat_template(messages))
    assert chat["sampling_params"]["structured_output"] == {"json_object": True}
    bad = requests.post(f"{base}/v1/completions/render", json={"model": "tritium", "prompt": "x", "top_p": 7},
                        timeout=10)
    assert bad.status_code == 400
    assert metric_value(replica, "tritium_e2e_request_latency_seconds_count") == done_before  # nothing generated


def test_health_model_info_and_models(base: str, default_model_path: Path) -> None:
    health = requests.get(f"{base}/health", timeout=5)
    assert health.status_code == 200 and health.json()["healthy_replicas"] == 1
    for path in ("/model_info", "/get_model_info", "/server_info", "/get_server_info"):
        info = requests.get(base + path, timeout=5).json()
        assert info["is_generation"] is True and info["model_path"] == str(default_model_path)
    models = requests.get(f"{base}/v1/models", timeout=5).json()
    assert [m["id"] for m in models["data"]] == ["tritium"]


def test_router_fields_are_accepted_and_wrong_ones_still_refused(base: str) -> None:
    plain = {"model": "tritium", "prompt": PROMPT, "max_tokens": 4, "temperature": 0}
    expected = requests.post(f"{base}/v1/completions", json=plain, timeout=60).json()["choices"][0]["text"]
    extras = {"no_stop_trim": False, "return_hidden_states": False, "separate_reasoning": True,
              "stream_reasoning": True, "rid": "abc", "top_k": -1, "min_p": 0.0, "repetition_penalty": 1.0}
    resp = requests.post(f"{base}/v1/completions", json=plain | extras, timeout=60)
    assert resp.status_code == 200, resp.text
    assert resp.json()["choices"][0]["text"] == expected
    chat = {"model": "tritium", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4}
    chat_extras = {"include_reasoning": True, "continue_final_message": False, "logprobs": False}
    assert requests.post(f"{base}/v1/chat/completions", json=chat | extras | chat_extras, timeout=60).status_code == 200
    unsupported = requests.post(f"{base}/v1/chat/completions", json=chat | {"continue_final_message": True}, timeout=10)
    assert unsupported.status_code == 400 and unsupported.json()["error"]["param"] == "continue_final_message"
    wrong = requests.post(f"{base}/v1/completions", json=plain | {"temprature": 0.5}, timeout=10)
    assert wrong.status_code == 400 and "temprature" in wrong.json()["error"]["message"]
    assert requests.post(f"{base}/v1/completions", json=plain | {"top_k": -5}, timeout=10).status_code == 400


def test_engine_load_sums_versions_and_reads_health() -> None:
    text = "\n".join([
        '# TYPE tritium_num_requests_running gauge',
        'tritium_num_requests_running{model="tritium",version="1"} 3',
        'tritium_num_requests_running{model="tritium",version="2"} 2',
        'tritium_num_requests_running{model="tritium_ids",version="1"} 7',
        'tritium_num_requests_waiting{model="tritium",version="1"} 4',
        'tritium_kv_cache_blocks{model="tritium",version="1"} 100',
        'tritium_kv_cache_blocks{model="tritium",version="2"} 300',
        'tritium_kv_cache_used_blocks{model="tritium",version="1"} 50',
        'tritium_kv_cache_used_blocks{model="tritium",version="2"} 50',
        'tritium_engine_healthy{model="tritium",version="1"} 0',
        'tritium_engine_healthy{model="tritium",version="2"} 1',
        'malformed line',
    ])
    load = engine_load(text, "tritium")
    assert (load.running, load.waiting, load.requests, load.engines, load.healthy) == (5, 4, 9, 2, True)
    assert load.kv_cache_usage == pytest.approx(0.25)
    assert not engine_load(text.replace('version="2"} 1', 'version="2"} 0'), "tritium").healthy


def test_router_counts_requests_other_clients_sent() -> None:
    from tritium.client.cluster.router import (
        AFFINITY_SLACK,
        EXTERNAL_REQUEST_TOKENS,
        Replica,
        Router,
        default_metrics_url,
    )

    router = Router(["a:8001", "b:8001"], metrics_urls=["http://a:8002/metrics", "http://b:8002/metrics"])
    a, b = router.replicas
    a.outstanding_tokens, a.in_flight = 100, 1
    a.load = EngineLoad(running=1, engines=1, healthy=True)  # only our own request
    b.load = EngineLoad(running=4, waiting=3, engines=1, healthy=True)  # seven requests from elsewhere
    assert a.busy_tokens == 100 and b.busy_tokens == 7 * EXTERNAL_REQUEST_TOKENS
    # A prompt whose prefix prefers b goes there while b is within the slack of the least busy ...
    prompt = next(p for i in range(100) if prefix_score((p := f"prompt {i}")[:256], "b:8001")
                  > prefix_score(p[:256], "a:8001"))
    assert router.pick(prompt) is b
    # ... and to a once the requests b's engine reports from elsewhere put it beyond the slack.
    b.load = EngineLoad(running=40, waiting=30, engines=1, healthy=True)
    assert b.busy_tokens - a.busy_tokens > AFFINITY_SLACK and router.pick(prompt) is a
    assert router.pick(prompt, exclude={"a:8001"}) is b
    b.healthy = False
    assert router.pick(prompt, exclude={"a:8001"}) is None
    assert Replica("c", None).busy_tokens == 0  # no metrics: only what this router sent
    assert default_metrics_url("10.0.0.5:8001") == "http://10.0.0.5:8002/metrics"
    assert default_metrics_url("10.0.0.5:9101") is None
    with pytest.raises(ValueError, match="one per replica"):
        Router(["a:8001"], metrics_urls=[])


def test_passed_through_metrics_name_replicas_by_index_not_address() -> None:
    from tritium.client.openai.replica_routes import upstream_tritium_metrics

    page = '# TYPE tritium_num_requests_running gauge\ntritium_num_requests_running{model="tritium",version="1"} 2\n' \
        'nv_inference_count{model="tritium"} 9\n'
    one = upstream_tritium_metrics([page])
    assert one.splitlines() == page.splitlines()[:2]  # tritium_* only, unchanged
    two = upstream_tritium_metrics([page, None, page])
    assert two.count("# TYPE tritium_num_requests_running gauge") == 1
    assert 'tritium_num_requests_running{upstream="0",model="tritium",version="1"} 2' in two
    assert 'upstream="2"' in two
    assert set(re.findall(r'upstream="([^"]*)"', two)) == {"0", "2"}  # an index, never an address
