"""With an API key, nothing but health and metrics answers without it; keys stay out of every log;
servers listen on loopback only."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import openai
import pytest
import requests
from serve_helpers import Served, grpc_stream, listening_addresses, server_log, start_openai, start_serve

pytestmark = pytest.mark.slow
KEY = "tritium-secret-4f9c2a"
LOOPBACK_V4 = "0100007F"  # 127.0.0.1 as /proc/net/tcp writes it
# 127.0.0.1, ::ffff:127.0.0.1 and ::1
LOOPBACK = {LOOPBACK_V4, "0000000000000000FFFF00000100007F", "00000000000000000000000001000000"}

# (method, path, body) of every Triton HTTP API group but health.
RESTRICTED_HTTP = [
    ("POST", "/v2/models/tritium/generate", {"text_input": "Hello", "max_tokens": 2}),
    ("POST", "/v2/models/tritium/generate_stream", {"text_input": "Hello", "max_tokens": 2}),
    ("GET", "/v2", None),
    ("GET", "/v2/models/tritium", None),
    ("GET", "/v2/models/tritium/config", None),
    ("GET", "/v2/models/stats", None),
    ("POST", "/v2/repository/index", {}),
    ("POST", "/v2/repository/models/tritium/unload", {}),
    ("GET", "/v2/trace/setting", None),
    ("GET", "/v2/logging", None),
    ("POST", "/v2/logging", {"log_verbose_level": 1}),
    ("GET", "/v2/systemsharedmemory/status", None),
    ("POST", "/v2/systemsharedmemory/region/x/register", {"key": "/x", "offset": 0, "byte_size": 8}),
]
OPEN_HTTP = ["/v2/health/live", "/v2/health/ready", "/v2/models/tritium/ready"]


@pytest.fixture(scope="module")
def keyed() -> Iterator[Served]:
    served = start_serve("--model-control=explicit", "--load-model=tritium", "--log-verbose=1",
                         env={"TRITIUM_API_KEY": KEY})
    yield served
    served.stop()


def call(served: Served, method: str, path: str, body: Any, key: str | None = None) -> requests.Response:
    headers = {"x-api-key": key} if key else {}
    return requests.request(method, served.http + path, json=body, headers=headers, timeout=60)


@pytest.mark.parametrize("method,path,body", RESTRICTED_HTTP, ids=[f"{m} {p}" for m, p, _ in RESTRICTED_HTTP])
def test_http_apis_need_the_key(keyed: Served, method: str, path: str, body: Any) -> None:
    for key in (None, "wrong", KEY.upper()):
        denied = call(keyed, method, path, body, key)
        assert denied.status_code == 403 and "restricted" in denied.text, denied.text
    if "unload" not in path:  # keep the model loaded for the other tests
        assert call(keyed, method, path, body, KEY).status_code != 403


def test_health_and_metrics_are_open(keyed: Served) -> None:
    for path in OPEN_HTTP:
        assert requests.get(keyed.http + path, timeout=10).status_code == 200, path
    assert "tritium_kv_cache_used_blocks" in requests.get(keyed.metrics, timeout=10).text


def test_grpc_apis_need_the_key(keyed: Served) -> None:
    import tritonclient.grpc as grpcclient
    from tritonclient.utils import InferenceServerException

    client = grpcclient.InferenceServerClient(keyed.grpc)
    headers = {"triton-grpc-protocol-x-api-key": KEY}
    calls: list[Callable[..., Any]] = [
        client.get_server_metadata, lambda **kw: client.get_model_metadata("tritium", **kw),
        lambda **kw: client.get_model_config("tritium", **kw), client.get_model_repository_index,
        lambda **kw: client.get_inference_statistics("tritium", **kw), client.get_log_settings,
        client.get_trace_settings, client.get_system_shared_memory_status,
        lambda **kw: client.unload_model("no-such-model", **kw),
    ]
    for fn in calls:
        with pytest.raises(InferenceServerException, match="restricted"):
            fn()
        with pytest.raises(InferenceServerException, match="restricted"):
            fn(headers={"triton-grpc-protocol-x-api-key": "wrong"})
    for fn in calls[:-1]:
        fn(headers=headers)
    assert client.is_server_live() and client.is_server_ready() and client.is_model_ready("tritium")
    denied = grpc_stream(keyed.grpc, "Hello", {"max_tokens": 2})
    assert denied.errors and "restricted" in denied.errors[0] and not denied.texts
    allowed = grpc_stream(keyed.grpc, "Hello", {"max_tokens": 2}, headers=headers)
    assert not allowed.errors and allowed.finals == 1


def test_openai_endpoint_needs_the_key_and_forwards_it(keyed: Served) -> None:
    proc, base = start_openai([keyed.grpc], api_key=KEY)
    try:
        for path in ("/models", "/completions", "/chat/completions"):
            method = "GET" if path == "/models" else "POST"
            assert requests.request(method, base + path, json={}, timeout=10).status_code == 401
        client = openai.OpenAI(base_url=base, api_key=KEY, max_retries=0)
        out = client.completions.create(model="tritium", prompt="Hello", max_tokens=3)
        assert out.choices[0].finish_reason in ("length", "stop")  # Triton accepted the forwarded key
        assert LOOPBACK_V4 in listening_addresses(int(base.rsplit(":", 1)[1].split("/")[0]))
    finally:
        proc.terminate()
        output = proc.communicate(timeout=10)[0]
    assert KEY not in output


def test_the_key_is_in_no_log(keyed: Served) -> None:
    call(keyed, "POST", "/v2/models/tritium/generate", {"text_input": "Hello", "max_tokens": 2}, KEY)
    call(keyed, "GET", "/v2/logging", None, "not-the-key")
    log = server_log(keyed.server_pid)
    assert "HTTP request: 0 /v2/logging" in log  # verbose logging saw the requests
    assert KEY not in log
    assert KEY not in "".join(keyed.output)


def test_servers_listen_on_loopback_only(keyed: Served) -> None:
    for url in (keyed.http, keyed.grpc, keyed.metrics):
        port = int(url.removeprefix("http://").split(":")[1].split("/")[0])
        addresses = listening_addresses(port)
        assert addresses and addresses <= LOOPBACK, f"{url}: {addresses}"
