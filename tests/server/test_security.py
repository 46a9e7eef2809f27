"""Two keys: the inference key (x-api-key) opens inference, metadata, model config and statistics; the admin
key (x-admin-key) opens model load/unload, logging, trace and shared memory; with only an inference key the
admin APIs stay closed. Health and metrics answer without a key; keys stay out of every log; servers listen
on loopback only."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import openai
import pytest
import requests

from support.serving import (
    Served,
    fake_repository,
    grpc_stream,
    listening_addresses,
    restricted_keys,
    server_log,
    start_openai,
    start_serve,
)

pytestmark = pytest.mark.slow
KEY = "tritium-secret-4f9c2a"
ADMIN_KEY = "tritium-admin-8b31d7"
LOOPBACK_V4 = "0100007F"  # 127.0.0.1 as /proc/net/tcp writes it
# 127.0.0.1, ::ffff:127.0.0.1 and ::1
LOOPBACK = {LOOPBACK_V4, "0000000000000000FFFF00000100007F", "00000000000000000000000001000000"}
INFERENCE, ADMIN = "inference", "admin"
OPEN_HTTP = ["/v2/health/live", "/v2/health/ready", "/v2/models/tritium/ready"]
UNKNOWN = object()  # a key the test does not know (the launcher's own admin secret)
# What a client sends: (x-api-key, x-admin-key); HTTP headers and gRPC metadata alike.
SENT: dict[str, tuple[str | None, str | None]] = {
    "no key": (None, None),
    "inference key": (KEY, None),
    "admin key": (None, ADMIN_KEY),
    "both keys": (KEY, ADMIN_KEY),
    "swapped keys": (ADMIN_KEY, KEY),
    "wrong case": (KEY.upper(), ADMIN_KEY.upper()),
}


def http_apis(model: str) -> list[tuple[str, str, str, Any]]:
    """(group, method, path, body) of every Triton HTTP API but health."""
    text = {"text_input": "Hello", "max_tokens": 2}
    return [
        (INFERENCE, "POST", f"/v2/models/{model}/generate", text),
        (INFERENCE, "POST", f"/v2/models/{model}/generate_stream", text),
        (INFERENCE, "POST", f"/v2/models/{model}/infer", {"inputs": []}),
        (INFERENCE, "GET", "/v2", None),
        (INFERENCE, "GET", f"/v2/models/{model}", None),
        (INFERENCE, "GET", f"/v2/models/{model}/config", None),
        (INFERENCE, "GET", "/v2/models/stats", None),
        (ADMIN, "POST", "/v2/repository/index", {}),
        (ADMIN, "POST", "/v2/repository/models/no-such-model/load", {}),
        (ADMIN, "POST", "/v2/repository/models/no-such-model/unload", {}),
        (ADMIN, "GET", "/v2/trace/setting", None),
        (ADMIN, "GET", "/v2/logging", None),
        (ADMIN, "POST", "/v2/logging", {"log_verbose_level": 1}),
        (ADMIN, "GET", "/v2/systemsharedmemory/status", None),
        (ADMIN, "POST", "/v2/systemsharedmemory/region/x/register", {"key": "/x", "offset": 0, "byte_size": 8}),
        (ADMIN, "POST", "/v2/systemsharedmemory/unregister", {}),
    ]


def grpc_apis(url: str, model: str) -> list[tuple[str, str, Callable[[dict[str, str]], Any]]]:
    """(group, name, call(headers)) of every Triton gRPC API but health; a call raises when it fails."""
    import tritonclient.grpc as grpcclient

    client = grpcclient.InferenceServerClient(url)

    def stream(headers: dict[str, str]) -> None:
        result = grpc_stream(url, "Hello", {"max_tokens": 2}, model=model, headers=headers, timeout=60)
        if result.errors:
            raise RuntimeError(result.errors[0])

    return [
        (INFERENCE, "stream infer", stream),
        (INFERENCE, "infer", lambda h: client.infer(model, inputs=[], headers=h)),
        (INFERENCE, "server metadata", lambda h: client.get_server_metadata(headers=h)),
        (INFERENCE, "model metadata", lambda h: client.get_model_metadata(model, headers=h)),
        (INFERENCE, "model config", lambda h: client.get_model_config(model, headers=h)),
        (INFERENCE, "statistics", lambda h: client.get_inference_statistics(model, headers=h)),
        (ADMIN, "repository index", lambda h: client.get_model_repository_index(headers=h)),
        (ADMIN, "load", lambda h: client.load_model("no-such-model", headers=h)),
        (ADMIN, "unload", lambda h: client.unload_model("no-such-model", headers=h)),
        (ADMIN, "log settings", lambda h: client.get_log_settings(headers=h)),
        (ADMIN, "update log settings", lambda h: client.update_log_settings({"log_verbose_level": 1}, headers=h)),
        (ADMIN, "trace settings", lambda h: client.get_trace_settings(headers=h)),
        (ADMIN, "shared memory status", lambda h: client.get_system_shared_memory_status(headers=h)),
        (ADMIN, "shared memory register", lambda h: client.register_system_shared_memory("x", "/x", 8, headers=h)),
        (ADMIN, "shared memory unregister", lambda h: client.unregister_system_shared_memory(headers=h)),
    ]


def expected(group: str, sent: tuple[str | None, str | None], api_key: str | None, admin_key: object) -> str:
    """"allowed" or "refused": each group checks its own header only; a group without a key is open."""
    key, header_value = (api_key, sent[0]) if group == INFERENCE else (admin_key, sent[1])
    return "allowed" if key is None or header_value == key else "refused"


def headers_for(sent: tuple[str | None, str | None], prefix: str = "") -> dict[str, str]:
    names = (f"{prefix}x-api-key", f"{prefix}x-admin-key")
    return {name: value for name, value in zip(names, sent, strict=True) if value is not None}


def http_table(served: Served, model: str, api_key: str | None, admin_key: object) -> list[str]:
    """Every HTTP API with every key set: the calls whose outcome is not the expected one."""
    wrong = []
    for group, method, path, body in http_apis(model):
        for name, sent in SENT.items():
            resp = requests.request(method, served.http + path, json=body, headers=headers_for(sent), timeout=60)
            got = "refused" if resp.status_code == 403 and "restricted" in resp.text else "allowed"
            if got != expected(group, sent, api_key, admin_key):
                wrong.append(f"{method} {path} with {name}: {got} ({resp.status_code} {resp.text[:120]})")
    return wrong


def grpc_table(served: Served, model: str, api_key: str | None, admin_key: object) -> list[str]:
    """Every gRPC API with every key set: the calls whose outcome is not the expected one."""
    wrong = []
    for group, api, call in grpc_apis(served.grpc, model):
        for name, sent in SENT.items():
            try:
                call(headers_for(sent, "triton-grpc-protocol-"))
                got, detail = "allowed", "ok"
            except Exception as exc:  # any failure but "restricted" got past the key check
                got, detail = ("refused" if "restricted" in str(exc) else "allowed"), str(exc)[:120]
            if got != expected(group, sent, api_key, admin_key):
                wrong.append(f"{api} with {name}: {got} ({detail})")
    return wrong


@pytest.fixture(scope="module")
def keyed() -> Iterator[Served]:
    served = start_serve("--model-control=explicit", "--load-model=tritium", "--log-verbose=1",
                         env={"TRITIUM_API_KEY": KEY, "TRITIUM_ADMIN_KEY": ADMIN_KEY})
    yield served
    served.stop()


@pytest.fixture(scope="module")
def fake_repo(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return fake_repository(tmp_path_factory.mktemp("fake-repo"), ["well"])


def test_http_apis_need_their_own_key(keyed: Served) -> None:
    assert http_table(keyed, "tritium", KEY, ADMIN_KEY) == []


def test_grpc_apis_need_their_own_key(keyed: Served) -> None:
    assert grpc_table(keyed, "tritium", KEY, ADMIN_KEY) == []
    allowed = grpc_stream(keyed.grpc, "Hello", {"max_tokens": 2}, headers={"triton-grpc-protocol-x-api-key": KEY})
    assert not allowed.errors and allowed.finals == 1


def test_with_only_an_inference_key_the_admin_apis_stay_closed(fake_repo: Path) -> None:
    served = start_serve(f"--model-repository={fake_repo}", env={"TRITIUM_API_KEY": KEY, "TRITIUM_ADMIN_KEY": ""})
    try:
        assert http_table(served, "well", KEY, UNKNOWN) == []
        assert grpc_table(served, "well", KEY, UNKNOWN) == []
        secret = restricted_keys(served.server_pid)["x-admin-key"]
        log = server_log(served.server_pid)
    finally:
        output = "".join(served.output) + served.stop()
    assert len(secret) >= 32 and secret not in log and secret not in output
    assert "shared memory: closed (no --admin-key)" in output


def test_without_keys_every_api_is_open(fake_repo: Path) -> None:
    served = start_serve(f"--model-repository={fake_repo}", env={"TRITIUM_API_KEY": "", "TRITIUM_ADMIN_KEY": ""})
    try:
        assert restricted_keys(served.server_pid) == {}
        assert http_table(served, "well", None, None) == []
        assert grpc_table(served, "well", None, None) == []
    finally:
        served.stop()


def test_health_and_metrics_are_open(keyed: Served) -> None:
    for path in OPEN_HTTP:
        assert requests.get(keyed.http + path, timeout=10).status_code == 200, path
    assert "tritium_kv_cache_used_blocks" in requests.get(keyed.metrics, timeout=10).text


KEYED_ROUTES = [("GET", "/v1/models", None),
                ("POST", "/v1/completions", {"model": "tritium", "prompt": "Hi", "max_tokens": 1}),
                ("POST", "/v1/chat/completions",
                 {"model": "tritium", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 1}),
                ("POST", "/tokenize", {"prompt": "Hi"}),
                ("POST", "/detokenize", {"tokens": [1, 2]}),
                ("POST", "/v1/completions/render", {"model": "tritium", "prompt": "Hi"}),
                ("POST", "/v1/chat/completions/render",
                 {"model": "tritium", "messages": [{"role": "user", "content": "Hi"}]})]
OPEN_ROUTES = ["/health", "/model_info", "/server_info", "/get_load", "/metrics"]


def test_openai_endpoint_needs_the_key_and_forwards_it(keyed: Served) -> None:
    proc, base = start_openai([keyed.grpc], api_key=KEY)
    root = base.removesuffix("/v1")
    try:
        for method, path, body in KEYED_ROUTES:
            for headers in ({}, {"Authorization": f"Bearer {ADMIN_KEY}"}, {"Authorization": f"Bearer {KEY.upper()}"},
                            {"Authorization": KEY}, {"x-api-key": KEY}):
                resp = requests.request(method, root + path, json=body, headers=headers, timeout=10)
                assert resp.status_code == 401, (path, headers, resp.status_code)
            resp = requests.request(method, root + path, json=body, headers={"Authorization": f"Bearer {KEY}"},
                                    timeout=60)
            assert resp.status_code == 200, (path, resp.status_code, resp.text[:200])
        for path in OPEN_ROUTES:
            resp = requests.get(root + path, timeout=10)
            assert resp.status_code == 200, (path, resp.status_code)
            if path.endswith("_info"):  # no filesystem path unless --expose-model-path
                assert "/" not in resp.text, resp.text
        client = openai.OpenAI(base_url=base, api_key=KEY, max_retries=0)
        out = client.completions.create(model="tritium", prompt="Hello", max_tokens=3)
        assert out.choices[0].finish_reason in ("length", "stop")  # Triton accepted the forwarded key
        assert LOOPBACK_V4 in listening_addresses(int(base.rsplit(":", 1)[1].split("/")[0]))
    finally:
        proc.terminate()
        output = proc.communicate(timeout=10)[0]
    assert KEY not in output


def test_the_keys_are_in_no_log(keyed: Served) -> None:
    both = headers_for((KEY, ADMIN_KEY))
    requests.post(keyed.http + "/v2/models/tritium/generate", json={"text_input": "Hello", "max_tokens": 2},
                  headers=both, timeout=60)
    requests.get(keyed.http + "/v2/logging", headers=both, timeout=10)
    requests.get(keyed.http + "/v2/logging", headers={"x-admin-key": "not-the-key"}, timeout=10)
    log = server_log(keyed.server_pid)
    assert "HTTP request: 0 /v2/logging" in log  # verbose logging saw the requests
    assert KEY not in log and ADMIN_KEY not in log
    assert KEY not in "".join(keyed.output) and ADMIN_KEY not in "".join(keyed.output)


def test_servers_listen_on_loopback_only(keyed: Served) -> None:
    for url in (keyed.http, keyed.grpc, keyed.metrics):
        port = int(url.removeprefix("http://").split(":")[1].split("/")[0])
        addresses = listening_addresses(port)
        assert addresses and addresses <= LOOPBACK, f"{url}: {addresses}"


@pytest.mark.parametrize("command", [["serve", "--host=0.0.0.0"], ["openai", "--host=0.0.0.0", "--upstream=x:8001"],
                                     ["serve", "--host=::"], ["openai", "--host=10.1.2.3", "--upstream=x:8001"]])
def test_a_non_loopback_address_without_keys_is_refused(command: list[str]) -> None:
    env = {k: v for k, v in os.environ.items() if k not in ("TRITIUM_API_KEY", "TRITIUM_ADMIN_KEY")}
    out = subprocess.run([sys.executable, "-m", "tritium.client.cli", *command], env=env, capture_output=True,
                         text=True, timeout=60)
    assert out.returncode == 2 and "--unsafe-no-auth" in out.stderr and "without keys" in out.stderr, out


def test_the_bind_policy_knows_loopback_and_the_unsafe_flag() -> None:
    from tritium.client.cli.bind_policy import is_loopback, open_bind_refusal

    assert all(is_loopback(h) for h in ("127.0.0.1", "127.8.0.1", "::1", "[::1]", "localhost"))
    assert not any(is_loopback(h) for h in ("0.0.0.0", "::", "10.0.0.1", "example.com", ""))
    assert open_bind_refusal("0.0.0.0", keyed=False, unsafe=False) is not None
    assert open_bind_refusal("0.0.0.0", keyed=True, unsafe=False) is None
    assert open_bind_refusal("0.0.0.0", keyed=False, unsafe=True) is None
    assert open_bind_refusal("127.0.0.1", keyed=False, unsafe=False) is None
