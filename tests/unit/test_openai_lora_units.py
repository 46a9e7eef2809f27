"""The OpenAI endpoint's LoRA parts without a tritonserver: the adapter lists, the admin key on vLLM's runtime
routes, error classification and wording (no internal address reaches a client), `vllm:lora_requests_info` made
from tritium's metrics, and `tritium serve --lora`."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import pytest
from fastapi.testclient import TestClient

from tritium.backend.tokenizer import Tokenizer
from tritium.client.cli.serve import engine_settings, lora_settings
from tritium.client.cluster.replica_load import EngineLoad, LoraInfo, engine_load, vllm_metrics
from tritium.client.cluster.upstream import UpstreamError
from tritium.client.openai.app import create_app
from tritium.client.openai.lora import (
    Adapter,
    AdapterList,
    ReplicaOutcome,
    admin_status,
    common_adapters,
    failure_response,
    parse_list,
)
from tritium.client.triton.launcher import PACKAGE_REPOSITORY, free_ports

ADMIN = "admin-secret"
KEY = "api-secret"


def test_parse_list_reads_the_list_action_and_refuses_other_shapes() -> None:
    reply = {"adapters": [{"name": "sql", "path": "/a/sql", "rank": 8, "targets": ["q_proj"]},
                          {"name": "chat", "path": "/a/chat", "rank": 16, "targets": []}], "max_loras": 4}
    parsed = parse_list(json.dumps(reply))
    assert parsed.max_loras == 4
    assert parsed.adapters == {"sql": Adapter("sql", "/a/sql", 8), "chat": Adapter("chat", "/a/chat", 16)}
    for bad in ("[]", '{"max_loras": 1}', '{"adapters": [{"path": "/x"}]}', "not json"):
        with pytest.raises(ValueError):
            parse_list(bad)


def test_an_adapter_is_served_only_when_every_replica_lists_it() -> None:
    a, b, c = Adapter("a", "/a"), Adapter("b", "/b"), Adapter("c", "/c")
    lists = [AdapterList({"a": a, "b": b}, 4), AdapterList({"b": b, "c": c, "a": a}, 4)]
    assert list(common_adapters(lists)) == ["a", "b"]
    assert common_adapters([]) == {}


@pytest.mark.parametrize(("message", "status"), [
    ("[StatusCode.INVALID_ARGUMENT] forbidden: lora_admin load/unload needs the request parameter admin_key", 403),
    ("forbidden: runtime LoRA updates are disabled: set admin_key in model.json", 403),
    ("[StatusCode.INVALID_ARGUMENT] invalid request: lora_admin: action 'load' needs lora_path", 400),
    ("invalid request: unknown LoRA adapter 'x' (loaded: a)", 400),
    ("[StatusCode.UNAVAILABLE] Request for unknown model: 'tritium' is not found", 502),
    ("something broke", 500),
])
def test_admin_errors_are_classified(message: str, status: int) -> None:
    assert admin_status(message) == status


def test_failures_name_replicas_by_index_and_pass_only_the_engines_own_words() -> None:
    address = "10.1.2.3:8001"
    outcomes = [ReplicaOutcome(0), ReplicaOutcome(1, UpstreamError(f"{address}: connection refused", 502)),
                ReplicaOutcome(2, UpstreamError("invalid request: no adapter_config.json in /x", 400))]
    response = failure_response(outcomes, 3, "loading LoRA adapter 'x' failed")
    body = json.loads(response.body)["error"]
    assert response.status_code == 502 and address not in body["message"]
    assert "replica 1 of 3: it cannot be reached" in body["message"]
    assert "replica 2 of 3: invalid request: no adapter_config.json in /x" in body["message"]
    alone = failure_response([ReplicaOutcome(0, UpstreamError("invalid request: bad rank", 400))], 1, "loading")
    assert alone.status_code == 400
    assert json.loads(alone.body)["error"]["message"] == "loading: invalid request: bad rank"
    refused = failure_response([ReplicaOutcome(0, UpstreamError("forbidden: wrong key", 403))], 1, "loading")
    assert refused.status_code == 502 and "TRITIUM_ADMIN_KEY" in json.loads(refused.body)["error"]["message"]


def info_line(model: str, version: str, max_lora: str, running: str, waiting: str, value: str) -> str:
    return (f'tritium_lora_requests_info{{max_lora="{max_lora}",model="{model}",running_lora_adapters="{running}",'
            f'version="{version}",waiting_lora_adapters="{waiting}"}} {value}')


METRICS = "\n".join([
    "# TYPE tritium_lora_requests_info gauge",
    info_line("tritium", "1", "4", "", "", "1700000000.5"),
    info_line("tritium", "1", "4", "sql,chat", "poem", "1700000009.25"),
    info_line("tritium", "2", "2", "x", "", "1700000001"),
    info_line("other", "1", "8", "y", "", "1800000000"),
    'tritium_engine_healthy{model="tritium",version="1"} 1',
    'tritium_engine_healthy{model="tritium",version="2"} 1',
]) + "\n"


def test_lora_info_takes_each_engines_newest_series_and_joins_engines() -> None:
    load = engine_load(METRICS, "tritium")
    assert load.lora == LoraInfo(4, frozenset({"sql", "chat", "x"}), frozenset({"poem"}), 1700000009.25)
    text = vllm_metrics(load, "tritium")
    assert ('vllm:lora_requests_info{max_lora="4",running_lora_adapters="chat,sql,x",waiting_lora_adapters="poem",'
            'engine="0",model_name="tritium"} 1700000009.250') in text


def test_lora_info_without_lora_metrics_says_no_lora() -> None:
    assert 'max_lora="0",running_lora_adapters="",waiting_lora_adapters=""' in vllm_metrics(EngineLoad(), "m")
    odd = 'tritium_lora_requests_info{max_lora="many",model="m",version="1"} 1\ntritium_engine_healthy{model="m"} 1\n'
    assert engine_load(odd, "m").lora.max_lora == 0
    both = engine_load(METRICS, "tritium").add(EngineLoad.in_flight(1, 0))
    assert both.lora.running == frozenset({"sql", "chat", "x"})


def test_serve_lora_options_become_model_json_settings(tmp_path: Path) -> None:
    (tmp_path / "sql").mkdir()
    assert lora_settings([], False) == {}
    assert lora_settings([], True) == {"enable_lora": True, "lora_modules": {}}
    assert lora_settings([f"sql={tmp_path / 'sql'}"], False) == {
        "enable_lora": True, "lora_modules": {"sql": str((tmp_path / "sql").resolve())}}
    for bad, words in ((["sql"], "NAME=PATH"), ([f"sql={tmp_path}/none"], "no such folder"),
                       ([f"sql={tmp_path / 'sql'}"] * 2, "given twice")):
        with pytest.raises(ValueError, match=words):
            lora_settings(bad, False)
    lora = lora_settings([], True)
    per_model = engine_settings(PACKAGE_REPOSITORY, {"dtype": "bfloat16"}, lora)
    assert per_model == {"tritium": {"dtype": "bfloat16", **lora}, "tritium_ids": {"dtype": "bfloat16", **lora},
                         "tritium_embed": {"dtype": "bfloat16"}}  # the embedding engine: no adapters


@pytest.fixture(scope="module")
def tok(default_model_path: Path) -> Tokenizer:
    return Tokenizer(default_model_path)


@pytest.fixture
def dead_upstream() -> str:
    (port,) = free_ports(1)
    return f"127.0.0.1:{port}"  # nothing listens there: every replica call fails as a transport error


@pytest.fixture
def http(tok: Tokenizer, dead_upstream: str) -> Iterator[TestClient]:
    with TestClient(create_app([dead_upstream], api_key=KEY, tokenizer=tok, admin_key=ADMIN)) as client:
        yield client


def test_runtime_lora_routes_answer_404_without_an_admin_key(tok: Tokenizer, dead_upstream: str) -> None:
    with TestClient(create_app([dead_upstream], api_key=KEY, tokenizer=tok)) as client:
        r = client.post("/v1/load_lora_adapter", json={"lora_name": "a", "lora_path": "/x"},
                        headers={"Authorization": f"Bearer {KEY}"})
        assert r.status_code == 404 and "--admin-key" in r.json()["error"]["message"]


def test_runtime_lora_routes_take_the_admin_key_only(http: TestClient) -> None:
    body = {"lora_name": "a", "lora_path": "/x"}
    for headers in ({}, {"Authorization": f"Bearer {KEY}"}, {"Authorization": "Bearer wrong"}):
        r = http.post("/v1/load_lora_adapter", json=body, headers=headers)
        assert r.status_code == 401 and "admin key" in r.json()["error"]["message"]
    r = http.post("/v1/unload_lora_adapter", json={"lora_name": "a"}, headers={"Authorization": f"Bearer {KEY}"})
    assert r.status_code == 401
    # the admin key is no API key either
    assert http.get("/v1/models", headers={"Authorization": f"Bearer {ADMIN}"}).status_code == 401


def test_runtime_lora_bodies_are_checked_and_transport_failures_hide_the_address(
        http: TestClient, dead_upstream: str) -> None:
    admin = {"Authorization": f"Bearer {ADMIN}"}
    r = http.post("/v1/load_lora_adapter", json={"lora_name": "a"}, headers=admin)
    assert r.status_code == 400 and r.json()["error"]["param"] == "lora_path"
    r = http.post("/v1/load_lora_adapter", json={"lora_name": "tritium", "lora_path": "/x"}, headers=admin)
    assert r.status_code == 400 and "base model" in r.json()["error"]["message"]
    r = http.post("/v1/load_lora_adapter", json={"lora_name": "a", "lora_path": "/x", "extra": 1}, headers=admin)
    assert r.status_code == 400 and r.json()["error"]["param"] == "extra"
    r = http.post("/v1/load_lora_adapter", json={"lora_name": "a", "lora_path": "/x"}, headers=admin)
    assert r.status_code == 502 and dead_upstream not in r.text, r.text
    assert r.json()["error"]["message"] == "loading LoRA adapter 'a' failed: it cannot be reached"
    r = http.post("/v1/unload_lora_adapter", json={"lora_name": "a"}, headers=admin)
    assert r.status_code == 404 and r.json()["error"]["message"] == "The lora adapter 'a' cannot be found."


def test_models_lists_the_base_and_unknown_models_get_404(http: TestClient) -> None:
    key = {"Authorization": f"Bearer {KEY}"}
    models = http.get("/v1/models", headers=key).json()["data"]
    assert [m["id"] for m in models] == ["tritium"] and models[0]["parent"] is None
    r = http.post("/v1/completions", json={"model": "sql", "prompt": "hi"}, headers=key)
    assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found"
