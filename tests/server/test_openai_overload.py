"""`tritium openai` under load, against a real tritonserver that runs one sequence at a time: overload is
refused at once (503 + Retry-After) instead of queued, and a request whose client left is cancelled upstream,
non-streamed or streamed before its first chunk, its KV blocks freed within seconds."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import requests

from tritium.client.cluster.router import prefix_score
from tritium.client.triton.repository import write_model

from support.serving import (
    Served,
    metric_value,
    raw_http_request,
    start_openai_with,
    start_serve,
    wait_for,
    wait_until_idle,
)

pytestmark = pytest.mark.slow
PROMPT = "Once upon a time, in a small village,"
LONG = {"model": "tritium", "prompt": PROMPT, "max_tokens": 4000, "ignore_eos": True}
SHORT = {"model": "tritium", "prompt": PROMPT, "max_tokens": 2}
FREED_WITHIN_S = 5.0  # cancelled within ~1 s, and the gauges are pushed every 0.5 s; a 4000-token run takes minutes


def start_narrow(repo: Path) -> Served:
    """The default model, one sequence at a time: a second request waits in the engine's queue, and a third
    one is refused as overloaded (max_pending_requests 1)."""
    write_model(repo, {"max_num_seqs": 1, "max_pending_requests": 1, "request_timeout_s": 600})
    return start_serve(f"--model-repository={repo}", "--model-control=explicit", "--load-model=tritium")


@pytest.fixture(scope="module")
def narrow(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Served]:
    served = start_narrow(tmp_path_factory.mktemp("model-repository"))
    yield served
    served.stop()


@pytest.fixture(scope="module")
def base(narrow: Served) -> Iterator[str]:
    proc, url = start_openai_with([narrow.grpc], "--max-concurrency=2")
    yield url
    proc.terminate()
    proc.wait(10)


def running(served: Served) -> float:
    return metric_value(served, "tritium_num_requests_running")


def waiting(served: Served) -> float:
    return metric_value(served, "tritium_num_requests_waiting")


def test_non_streamed_request_whose_client_left_is_cancelled(narrow: Served, base: str) -> None:
    conn = raw_http_request(base, "/v1/completions", LONG)
    try:
        assert wait_for(lambda: running(narrow) >= 1 and metric_value(narrow, "tritium_kv_cache_used_blocks") > 0, 60)
    finally:
        conn.close()
    assert wait_until_idle(narrow, FREED_WITHIN_S), "the request of a client that left still holds KV blocks"


def test_streamed_request_whose_client_left_before_its_first_chunk_is_cancelled(narrow: Served, base: str) -> None:
    holder = raw_http_request(base, "/v1/completions", LONG)  # takes the only sequence slot
    try:
        assert wait_for(lambda: running(narrow) >= 1, 60)
        queued = raw_http_request(base, "/v1/completions", LONG | {"stream": True})
        try:
            assert wait_for(lambda: waiting(narrow) >= 1, 30)
        finally:
            queued.close()  # before its first chunk: it never ran
        assert wait_for(lambda: waiting(narrow) == 0, FREED_WITHIN_S), "the queued request of a client that left"
        assert running(narrow) == 1  # the other one goes on
    finally:
        holder.close()
    assert wait_until_idle(narrow, FREED_WITHIN_S)


def test_over_max_concurrency_is_refused_at_once_with_retry_after(narrow: Served, base: str) -> None:
    first = raw_http_request(base, "/v1/completions", LONG | {"stream": True})
    second = raw_http_request(base, "/v1/chat/completions", {
        "model": "tritium", "messages": [{"role": "user", "content": PROMPT}], "max_tokens": 4000, "ignore_eos": True})
    try:
        assert wait_for(lambda: running(narrow) + waiting(narrow) >= 2, 60)  # both seats taken
        for path, body in [("completions", SHORT), ("chat/completions", {
                "model": "tritium", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2, "stream": True})]:
            resp = requests.post(f"{base}/{path}", json=body, timeout=10)
            assert resp.status_code == 503, resp.text
            assert int(resp.headers["Retry-After"]) >= 1
            error = resp.json()["error"]
            assert error["type"] == "server_error" and error["code"] == "overloaded", error
            assert resp.elapsed.total_seconds() < 5  # refused, not queued
    finally:
        first.close()
        second.close()
    assert wait_until_idle(narrow, FREED_WITHIN_S)
    resp = requests.post(f"{base}/completions", json=SHORT, timeout=60)  # the seats are free again
    assert resp.status_code == 200 and resp.json()["choices"][0]["finish_reason"] in ("length", "stop")


def test_one_request_cannot_take_every_seat(base: str) -> None:
    resp = requests.post(f"{base}/completions", json=SHORT | {"n": 16, "max_tokens": 5000}, timeout=10)
    assert resp.status_code == 400 and resp.json()["error"]["param"] == "max_tokens", resp.text
    resp = requests.post(f"{base}/completions", json=SHORT | {"prompt": ["Hi"] * 8, "n": 5}, timeout=10)
    assert resp.status_code == 400 and resp.json()["error"]["param"] == "n", resp.text


def test_a_replica_that_refuses_as_overloaded_is_skipped_not_marked_down(
        narrow: Served, base: str, tmp_path_factory: pytest.TempPathFactory) -> None:
    other = start_narrow(tmp_path_factory.mktemp("model-repository"))
    alone_proc, alone = start_openai_with([narrow.grpc])
    both_proc, both = start_openai_with([narrow.grpc, other.grpc])
    holder = raw_http_request(base, "/v1/completions", LONG)  # `base` fronts `narrow` only: fill it up
    queued = None
    try:
        assert wait_for(lambda: running(narrow) >= 1, 60)
        queued = raw_http_request(base, "/v1/completions", LONG | {"stream": True})
        assert wait_for(lambda: waiting(narrow) >= 1, 30)
        # Its one replica refuses (gRPC UNAVAILABLE "overloaded ..."): 503 + Retry-After, and it stays up.
        resp = requests.post(f"{alone}/completions", json=SHORT, timeout=30)
        assert resp.status_code == 503, resp.text
        assert int(resp.headers["Retry-After"]) >= 1 and resp.json()["error"]["code"] == "overloaded", resp.text
        assert "127.0.0.1" not in resp.text and "max_pending_requests" not in resp.text
        assert requests.get(alone.removesuffix("/v1") + "/health", timeout=10).json()["healthy_replicas"] == 1
        # With two replicas, a prompt whose prefix prefers the full one is tried there first, then elsewhere.
        prompt = next(p for k in range(100) if prefix_score((p := f"Tale {k}: {PROMPT}")[:256], narrow.grpc)
                      > prefix_score(p[:256], other.grpc))
        before = metric_value(other, "tritium_prompt_tokens_total")
        refused = metric_value(narrow, "tritium_num_requests_refused_total")
        resp = requests.post(f"{both}/completions", json=SHORT | {"prompt": prompt}, timeout=60)
        assert resp.status_code == 200, resp.text
        assert wait_for(lambda: metric_value(other, "tritium_prompt_tokens_total") > before, 5)
        # ... and the full one was tried first: it refused this request.
        assert wait_for(lambda: metric_value(narrow, "tritium_num_requests_refused_total") == refused + 1, 5)
        assert requests.get(both.removesuffix("/v1") + "/health", timeout=10).json()["healthy_replicas"] == 2
    finally:
        holder.close()
        if queued is not None:
            queued.close()
        for proc in (alone_proc, both_proc):
            proc.terminate()
            proc.wait(10)
        other.stop()
    assert wait_until_idle(narrow, FREED_WITHIN_S)
