"""The official `openai` client against `tritium openai` in front of real tritonservers."""

from __future__ import annotations

import asyncio
import json
import re
import socket
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import openai
import pytest
import requests
from fastapi.responses import JSONResponse
from starlette.types import Message, Receive, Scope, Send

from tritium.backend.tokenizer import Tokenizer
from tritium.client.cluster.router import prefix_score
from tritium.client.openai.guard import RequestGuard

from support.serving import API_KEY as KEY
from support.serving import Served, metric_value, start_openai, start_serve, wait_for, wait_until_idle

pytestmark = pytest.mark.slow
PROMPT = "Once upon a time, in a small village,"


@pytest.fixture(scope="module")
def triton() -> Iterator[Served]:
    served = start_serve("--model-control=explicit", "--load-model=tritium")
    yield served
    served.stop()


@pytest.fixture(scope="module")
def client(triton: Served) -> Iterator[openai.OpenAI]:
    proc, base = start_openai([triton.grpc], api_key=KEY)
    yield openai.OpenAI(base_url=base, api_key=KEY, max_retries=0)
    proc.terminate()
    proc.wait(10)


@pytest.fixture(scope="module")
def tok(default_model_path: Path) -> Tokenizer:
    return Tokenizer(default_model_path)


def test_completions_stream_equals_non_stream_and_usage_counts(client: openai.OpenAI, tok: Tokenizer) -> None:
    whole = client.completions.create(model="tritium", prompt=PROMPT, max_tokens=12, temperature=0)
    chunks = list(client.completions.create(model="tritium", prompt=PROMPT, max_tokens=12, temperature=0,
                                            stream=True, stream_options={"include_usage": True}))
    streamed = "".join(c.choices[0].text for c in chunks if c.choices)
    assert streamed == whole.choices[0].text and len(streamed) > 10
    assert whole.choices[0].finish_reason == "length"
    assert whole.usage.prompt_tokens == len(tok.encode(PROMPT))
    assert whole.usage.completion_tokens == 12
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == 12


def test_chat_completions_stream_and_not(client: openai.OpenAI, tok: Tokenizer) -> None:
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    whole = client.chat.completions.create(model="tritium", messages=messages, max_tokens=24, temperature=0)
    assert "Paris" in whole.choices[0].message.content and whole.choices[0].finish_reason == "stop"
    stream = client.chat.completions.create(model="tritium", messages=messages, max_tokens=24, temperature=0,
                                            stream=True)
    assert "".join(c.choices[0].delta.content or "" for c in stream if c.choices) == whole.choices[0].message.content
    expected_prompt = tok.encode(tok.apply_chat_template(messages), add_special_tokens=False)
    assert whole.usage.prompt_tokens == len(expected_prompt)


def test_stop_string_n_and_logprobs(client: openai.OpenAI) -> None:
    free = client.completions.create(model="tritium", prompt=PROMPT, max_tokens=16, temperature=0).choices[0].text
    word = free.split()[2]
    cut = client.completions.create(model="tritium", prompt=PROMPT, max_tokens=16, temperature=0, stop=[word])
    assert cut.choices[0].text == free[: free.index(word)] and cut.choices[0].finish_reason == "stop"
    many = client.completions.create(model="tritium", prompt=PROMPT, max_tokens=4, temperature=0, n=3, logprobs=2)
    assert [c.index for c in many.choices] == [0, 1, 2]
    assert len({c.text for c in many.choices}) == 1  # greedy: all the same
    assert len(many.choices[0].logprobs.tokens) == 4 and many.usage.completion_tokens == 12


def test_errors_in_openai_shape(client: openai.OpenAI, triton: Served) -> None:
    with pytest.raises(openai.BadRequestError) as bad:
        client.completions.create(model="tritium", prompt="hi", max_tokens=3, temperature=-1)
    assert "temperature" in str(bad.value)
    with pytest.raises(openai.BadRequestError) as long_prompt:
        client.completions.create(model="tritium", prompt="word " * 9000, max_tokens=3)
    assert "context" in str(long_prompt.value)
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="gpt-4", prompt="hi", max_tokens=3)
    wrong = openai.OpenAI(base_url=str(client.base_url), api_key="nope", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        wrong.models.list()
    assert [m.id for m in client.models.list()] == ["tritium"]


FAULT = "FAULT-7f3a"  # the second replica's $TRITIUM_TEST_FAULT_MARKER: a step holding it fails


def test_router_spreads_keeps_prefixes_together_and_survives_a_replica(triton: Served) -> None:
    second = start_serve("--model-control=explicit", "--load-model=tritium", env={"TRITIUM_TEST_FAULT_MARKER": FAULT})
    proc, base = start_openai([triton.grpc, second.grpc], api_key=None)
    try:
        oai = openai.OpenAI(base_url=base, api_key="unused", max_retries=0)

        def served_counts() -> tuple[float, float]:
            """Finished requests per replica, once the batched metric push has settled."""
            def read() -> tuple[float, float]:
                return (metric_value(triton, "tritium_e2e_request_latency_seconds_count"),
                        metric_value(second, "tritium_e2e_request_latency_seconds_count"))
            previous = read()
            deadline = time.monotonic() + 60
            while time.monotonic() < deadline:
                time.sleep(1.0)
                current = read()
                if current == previous:
                    return current
                previous = current
            raise AssertionError(f"request counters still moving after 60 s: {previous}")

        def healthy_replicas() -> int:
            return requests.get(base.removesuffix("/v1") + "/health", timeout=10).json()["healthy_replicas"]

        before = served_counts()
        for i in range(12):  # distinct prefixes: rendezvous hashing spreads them
            oai.completions.create(model="tritium", prompt=f"Story number {i}: {PROMPT}", max_tokens=2)
        after = served_counts()
        assert after[0] > before[0] and after[1] > before[1]
        # A shared prefix that rendezvous hashing places on the second replica (which this test owns and
        # may stop; the first one is shared with the other tests).
        shared = next(p for k in range(100) if prefix_score((p := f"System prompt {k}. " + "Be careful. " * 20)[:256],
                                                      second.grpc) > prefix_score(p[:256], triton.grpc))
        for i in range(6):
            oai.completions.create(model="tritium", prompt=shared + f"Question {i}?", max_tokens=2)
        final = served_counts()
        assert (final[0] - after[0], final[1] - after[1]) == (0, 6)
        # A request that fails in the model (INTERNAL) or is refused (INVALID_ARGUMENT) on the second replica is
        # answered once, as it is: not replayed on the first (where the faulty one would succeed), and no
        # replica is marked down.
        with pytest.raises(openai.InternalServerError) as failed:
            oai.completions.create(model="tritium", prompt=shared + f"{FAULT}?", max_tokens=2)
        error = failed.value.response.json()["error"]
        assert re.fullmatch(r"internal error \(request id [0-9a-f]+\)", error["message"]), error
        with pytest.raises(openai.BadRequestError):
            oai.completions.create(model="tritium", prompt=shared + "word " * 9000, max_tokens=2)
        assert served_counts()[0] == final[0] and healthy_replicas() == 2
        assert oai.completions.create(model="tritium", prompt=shared + "After?", max_tokens=2).choices[0].text
        assert served_counts()[1] > final[1]
        second.stop()
        for i in range(4):
            out = oai.completions.create(model="tritium", prompt=shared + f"Again {i}?", max_tokens=2)
            assert out.choices[0].finish_reason in ("length", "stop")
    finally:
        proc.terminate()
        proc.wait(10)
        second.stop()


def test_client_disconnect_cancels_the_upstream_request(client: openai.OpenAI, triton: Served) -> None:
    body = {"model": "tritium", "prompt": PROMPT, "max_tokens": 4000, "ignore_eos": True, "stream": True}
    with requests.post(f"{client.base_url}completions", json=body, headers={"Authorization": f"Bearer {KEY}"},
                       stream=True, timeout=60) as resp:
        lines = resp.iter_lines()
        got = [next(lines) for _ in range(6)]
        assert any(line.startswith(b"data:") for line in got)
        assert wait_for(lambda: metric_value(triton, "tritium_num_requests_running") >= 1, 10)
    # The connection is closed mid-stream: the endpoint must cancel the gRPC stream, and Triton the request
    # (within ~1 s; the gauges are pushed every 0.5 s), not generate the rest of the 4000 tokens.
    assert wait_until_idle(triton, 5)
    assert client.completions.create(model="tritium", prompt="Hello", max_tokens=2).choices[0].text is not None


def _completion(**fields: Any) -> dict[str, Any]:
    return {"model": "tritium", "prompt": "Hello", "max_tokens": 2} | fields


def _chat(**fields: Any) -> dict[str, Any]:
    return {"model": "tritium", "messages": [{"role": "user", "content": "Hello"}], "max_tokens": 2} | fields


def _assert_still_serving(client: openai.OpenAI) -> None:
    out = client.completions.create(model="tritium", prompt="Hello", max_tokens=1, temperature=0)
    assert out.choices[0].finish_reason in ("length", "stop")


# (endpoint, body, status, word the error message must hold). Those marked "engine" pass the endpoint's checks
# and are refused by the engine (Triton's "invalid request"), which must still reach the client as 400.
BAD_BODIES = [
    pytest.param("completions", _completion(prompt=""), 400, "prompt", id="empty-prompt"),
    pytest.param("completions", _completion(prompt="word " * 9000), 400, "context", id="prompt-over-context-engine"),
    pytest.param("completions", _completion(max_tokens=0), 400, "max_tokens", id="max-tokens-0"),
    pytest.param("completions", _completion(max_tokens=-1), 400, "max_tokens", id="max-tokens-negative"),
    pytest.param("completions", _completion(max_tokens=10**9), 400, "max_tokens", id="max-tokens-huge-engine"),
    pytest.param("completions", _completion(max_tokens=10**9, stream=True), 400, "max_tokens",
                 id="max-tokens-huge-stream-engine"),
    pytest.param("completions", _completion(temperature=-1), 400, "temperature", id="temperature-negative"),
    pytest.param("completions", _completion(top_p=0), 400, "top_p", id="top-p-0"),
    pytest.param("completions", _completion(top_p=1.5), 400, "top_p", id="top-p-over-1"),
    pytest.param("completions", _completion(seed=-1), 400, "seed", id="seed-negative"),
    pytest.param("completions", _completion(seed=2**64), 400, "seed", id="seed-over-64-bits"),
    pytest.param("completions", _completion(stop=[f"s{i}" for i in range(1000)]), 400, "stop",
                 id="stop-1000-engine"),
    pytest.param("completions", _completion(stop=[f"s{i}" for i in range(1000)], stream=True), 400, "stop",
                 id="stop-1000-stream-engine"),
    pytest.param("completions", _completion(logprobs=21), 400, "logprobs", id="logprobs-21"),
    pytest.param("completions", _completion(n=17), 400, "n", id="n-17"),
    pytest.param("completions", _completion(prompt=["Hello"] * 65), 400, "prompt", id="prompts-65"),
    pytest.param("completions", _completion(prompt=["Hello"] * 8, n=9), 400, "n", id="choices-72"),
    pytest.param("completions", _completion(prompt=["Hello"] * 11, n=3), 400, "n", id="choices-33"),
    pytest.param("completions", _completion(prompt=["Hello"] * 33), 400, "prompt", id="prompts-33"),
    pytest.param("completions", _completion(n=16, max_tokens=4097), 400, "max_tokens", id="choices-x-tokens-over-64k"),
    pytest.param("chat", _chat(n=2, max_completion_tokens=40000), 400, "max_completion_tokens",
                 id="chat-choices-x-tokens-over-64k"),
    pytest.param("completions", _completion(prompt=42), 400, "prompt", id="prompt-a-number"),
    pytest.param("completions", _completion(model="gpt-4"), 404, "model", id="unknown-model"),
    pytest.param("chat", _chat(messages=[]), 400, "messages", id="chat-no-messages"),
    pytest.param("chat", _chat(max_tokens=0), 400, "max_tokens", id="chat-max-tokens-0"),
    pytest.param("chat", _chat(logprobs=True, top_logprobs=21), 400, "top_logprobs", id="chat-top-logprobs-21"),
    pytest.param("chat", _chat(messages=[{"role": "user", "content": "word " * 9000}], stream=True), 400, "context",
                 id="chat-over-context-stream-engine"),
    pytest.param("chat", _chat(model="gpt-4"), 404, "model", id="chat-unknown-model"),
]


@pytest.mark.parametrize(("endpoint", "body", "status", "names"), BAD_BODIES)
def test_bad_request_is_a_clear_4xx_and_the_server_keeps_serving(
        client: openai.OpenAI, endpoint: str, body: dict[str, Any], status: int, names: str) -> None:
    create = client.completions.create if endpoint == "completions" else client.chat.completions.create
    with pytest.raises(openai.APIStatusError) as err:
        result = create(**body)
        if body.get("stream"):
            list(result)
    assert err.value.status_code == status
    error = err.value.response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["type"] == "invalid_request_error"
    assert re.search(rf"\b{re.escape(names)}\b", error["message"]), error
    _assert_still_serving(client)


def _ten_megabytes() -> bytes:
    return json.dumps({"model": "tritium", "prompt": "x" * (10 << 20)}).encode()


def _over_the_limit_in_chunks() -> Iterator[bytes]:
    yield b'{"model": "tritium", "prompt": "'
    for _ in range(50):
        yield b"x" * 100_000
    yield b'"}'


# Raw bodies the `openai` client would not send: (path, text or a function making the body, status, word).
RAW_BODIES = [
    pytest.param("completions", '{"model": "tritium", "prompt": "Hi", "temperature": NaN}', 400, "temperature",
                 id="temperature-nan"),
    pytest.param("completions", '{"model": "tritium", "prompt": "Hi \\ud800"}', 400, "prompt", id="surrogate-prompt"),
    pytest.param("completions", '{"model": "tritium", "prompt": "Hi", "stop": ["\\udc00"]}', 400, "stop",
                 id="surrogate-stop"),
    pytest.param("completions", '{"model": "tritium", "prompt": "Hi", "user": "\\ud800"}', 400, "user",
                 id="surrogate-user"),
    pytest.param("chat/completions", '{"model": "tritium", "messages": [{"role": "user", "content": "\\ud800"}]}',
                 400, "messages.0.content", id="surrogate-chat-content"),
    pytest.param("chat/completions", '{"model": "tritium", "messages": "Hello"}', 400, "messages",
                 id="messages-not-a-list"),
    pytest.param("completions", '{"model": "tritium", "prompt": ', 400, "JSON", id="not-json"),
    pytest.param("completions", '{"model": "tritium", "prompt": ' + "[" * 5000 + "]" * 5000 + "}", 400, "JSON",
                 id="5000-nested-brackets"),
    pytest.param("completions", '{"model": "tritium", "prompt": "Hi", "stop": ' + '{"a": ' * 5000 + "1" + "}" * 5000
                 + "}", 400, "JSON", id="5000-nested-objects"),
    pytest.param("chat/completions", '{"model": "tritium", "messages": [{"role": "user", "content": "Hi", "name": '
                 + "[" * 3000 + "]" * 3000 + "}]}", 400, "JSON", id="nested-extra-message-field"),
    pytest.param("completions", '{"model": "tritium", "prompt": "Hi", "max_tokens": 1' + "0" * 400 + "}", 400,
                 "max_tokens", id="max-tokens-10**400"),
    pytest.param("completions", '{"model": "tritium", "prompt": "Hi", "seed": 1' + "0" * 400 + "}", 400, "seed",
                 id="seed-10**400"),
    pytest.param("completions", '{"model": "tritium", "prompt": "Hi", "temperature": 1' + "0" * 400 + "}", 400,
                 "temperature", id="temperature-10**400"),
    pytest.param("completions", '{"model": "tritium", "prompt": "Hi", "top_p": 1e400}', 400, "top_p",
                 id="top-p-1e400"),
    pytest.param("completions", '{"model": "tritium", "prompt": "Hi", "seed": ' + "9" * 5000 + "}", 400, "JSON",
                 id="5000-digit-number"),
    pytest.param("completions", '{"model": "tritium", "prompt": "Hi", "n": [1]}', 400, "n", id="n-a-list"),
    pytest.param("completions", '{"model": "tritium", "prompt": "Hi", "stream": "yes please"}', 400, "stream",
                 id="stream-a-sentence"),
    pytest.param("completions", '[{"model": "tritium", "prompt": "Hi"}]', 400, "body", id="body-a-list"),
    pytest.param("chat/completions", '{"model": "tritium", "messages": [{"role": "user", "content": "Hi", '
                 '"metadata": {"a": [1, {"b": null}]}, "name": 1e300}]}', 200, "", id="odd-extra-message-fields"),
    pytest.param("chat/completions", '{"model": "tritium", "messages": [{"role": "user", "content": "Hi", '
                 '"tool_calls": {"a": [1, {"b": null}]}}]}', 400, "messages.0.tool_calls", id="tool-calls-not-a-list"),
    pytest.param("completions", _ten_megabytes, 413, "body", id="10-MB-body"),
    pytest.param("completions", _over_the_limit_in_chunks, 413, "body", id="chunked-body-over-the-limit"),
]


@pytest.mark.parametrize(("path", "data", "status", "names"), RAW_BODIES)
def test_bad_raw_body_is_a_clear_4xx(client: openai.OpenAI, path: str, data: str | Callable[[], Any], status: int,
                                     names: str) -> None:
    headers = {"Authorization": f"Bearer {KEY}", "Content-Type": "application/json"}
    resp = requests.post(f"{client.base_url}{path}", data=data() if callable(data) else data.encode(),
                         headers=headers, timeout=60)
    assert resp.status_code == status, resp.text
    if status != 200:
        # Never a traceback, an exception's class name or a replica's address.
        assert not re.search(r"Traceback|[a-z]Error\b|Exception|127\.0\.0\.1", resp.text), resp.text
        error = resp.json()["error"]
        assert names in error["message"], error
    _assert_still_serving(client)


def test_content_length_that_is_not_a_number_is_400(client: openai.OpenAI) -> None:
    with socket.create_connection((client.base_url.host, client.base_url.port), timeout=10) as conn:
        conn.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer " + KEY.encode()
                     + b"\r\nContent-Type: application/json\r\nContent-Length: 12abc\r\n\r\n{}")
        assert conn.recv(4096).startswith(b"HTTP/1.1 400 ")
    _assert_still_serving(client)


def test_request_guard_counts_the_body_as_it_arrives() -> None:
    """Straight at the middleware: a Content-Length an HTTP server let through, and bodies without one."""
    async def app(scope: Scope, receive: Receive, send: Send) -> None:
        message = await receive()
        await JSONResponse({"got": len(message["body"])})(scope, receive, send)

    guard = RequestGuard(app, api_key=None, max_bytes=10)

    async def call(headers: list[tuple[bytes, bytes]], chunks: list[bytes]) -> tuple[int, bytes]:
        messages = [{"type": "http.request", "body": c, "more_body": i + 1 < len(chunks)} for i, c in enumerate(chunks)]
        sent: list[Message] = []

        async def receive() -> Message:
            return messages.pop(0) if messages else {"type": "http.disconnect"}

        async def send(message: Message) -> None:
            sent.append(message)

        await guard({"type": "http", "method": "POST", "path": "/v1/completions", "headers": headers}, receive, send)
        return sent[0]["status"], sent[1]["body"]

    assert asyncio.run(call([(b"content-length", b"1x")], [b"{}"]))[0] == 400
    assert asyncio.run(call([(b"content-length", b"11")], [b"12345678901"]))[0] == 413
    status, body = asyncio.run(call([], [b"12345", b"678901"]))
    assert status == 413 and json.loads(body)["error"]["message"] == "request body over 10 bytes"
    assert asyncio.run(call([], [b"12345", b"67890"])) == (200, b'{"got":10}')


def test_request_guard_answers_an_unexpected_exception_with_a_request_id(caplog: pytest.LogCaptureFixture) -> None:
    """Whatever escapes the app: a 500 naming a request id, the details only in the log under that id."""
    async def app(scope: Scope, receive: Receive, send: Send) -> None:
        await receive()
        raise KeyError("replica 10.1.2.3:8001 said no")

    sent: list[Message] = []

    async def receive() -> Message:
        return {"type": "http.request", "body": b"{}", "more_body": False}

    async def send(message: Message) -> None:
        sent.append(message)

    scope = {"type": "http", "method": "POST", "path": "/v1/completions", "headers": []}
    asyncio.run(RequestGuard(app, api_key=None, max_bytes=100)(scope, receive, send))
    assert sent[0]["status"] == 500
    message = json.loads(sent[1]["body"])["error"]["message"]
    request_id = re.fullmatch(r"internal error \(request id ([0-9a-f]+)\)", message)
    assert request_id, message
    assert request_id[1] in caplog.text and "10.1.2.3:8001" in caplog.text and "KeyError" in caplog.text


@pytest.mark.parametrize("key", [None, "sk-wrong"])
@pytest.mark.parametrize(("method", "path"), [("GET", "models"), ("POST", "completions"),
                                              ("POST", "chat/completions")])
def test_missing_or_wrong_api_key_is_401(client: openai.OpenAI, key: str | None, method: str, path: str) -> None:
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    resp = requests.request(method, f"{client.base_url}{path}", json=_completion(), headers=headers, timeout=30)
    assert resp.status_code == 401
    assert resp.json()["error"]["code"] == "invalid_api_key"
