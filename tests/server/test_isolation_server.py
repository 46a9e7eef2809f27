"""No request can fail another, through a real tritonserver: odd requests sent while a long stream runs
leave that stream as it would have been alone, and each odd request gets its own normal end or a clean error."""

from __future__ import annotations

import json
import re
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import pytest

from support.serving import Served, grpc_stream, http_generate, metric_value, wait_for, wait_until_idle

pytestmark = pytest.mark.slow
LONG = {"max_tokens": 64, "temperature": 0, "ignore_eos": True}
PROMPT = "Write a long story about a lighthouse keeper."
ODD_BODIES: list[dict[str, Any]] = [
    {"max_tokens": 6, "stop_token_ids": "[99999999]"},
    {"max_tokens": 6, "stop_token_ids": "[99999999]", "min_tokens": 3},
    {"max_tokens": 6, "temperature": 1e-45},
    {"max_tokens": 6, "min_p": 1},
    {"max_tokens": 6, "top_k": 10**12},
    {"max_tokens": 6, "top_k": "1" + "0" * 40},
    {"max_tokens": 6, "repetition_penalty": 1e30},
    {"max_tokens": 6, "logprobs": 5, "return_logprobs": True},
    {"max_tokens": 6, "min_tokens": 4, "stop_token_ids": json.dumps(list(range(49152)))},
    {"max_tokens": 6, "sampling_parameters": "[" * 5000},
    {"max_tokens": 6, "sampling_parameters": json.dumps({"temperature": 10**400})},
    {"max_tokens": 6, "seed": 2**64, "temperature": 1},
    {"max_tokens": 6, "sampling_parameters": '{"top_p": 1e-300, "temperature": 1e-300}'},
]
# What must never reach a client: exception class names, tracebacks, file paths, addresses.
LEAKS = re.compile(r"Traceback|Error:|Exception|\.py\b|File \"|0x[0-9a-f]{6,}|127\.0\.0\.1")


@pytest.mark.batch_invariant
def test_odd_requests_leave_a_running_stream_as_it_would_have_been_alone(server: Served) -> None:
    alone = grpc_stream(server.grpc, PROMPT, LONG)
    assert alone.finals == 1 and not alone.errors
    with ThreadPoolExecutor(len(ODD_BODIES) + 1) as pool:
        running = pool.submit(grpc_stream, server.grpc, PROMPT, LONG)
        odd = list(pool.map(lambda body: http_generate(server.http, {"text_input": "Hi there"} | body), ODD_BODIES))
        together = running.result(300)
    assert together.finals == 1 and not together.errors
    assert "".join(together.texts) == "".join(alone.texts)
    for body, resp in zip(ODD_BODIES, odd, strict=True):
        payload = resp.json()
        if resp.status_code == 200:
            assert payload["text_output"], body
        else:
            assert resp.status_code == 400, (body, resp.text)
            assert re.search(r"\(request id req-\d+\)$", payload["error"]), payload
            assert not LEAKS.search(payload["error"]), payload
    errors = {json.dumps(b)[:60]: r.json().get("error", "") for b, r in zip(ODD_BODIES, odd, strict=True)}
    assert "stop_token_ids must be token ids in [0, 49152)" in errors[json.dumps(ODD_BODIES[0])[:60]]
    assert "sampling_parameters is nested too deeply" in errors[json.dumps(ODD_BODIES[9])[:60]]
    assert "repetition_penalty must be in [0.01, 100]" in errors[json.dumps(ODD_BODIES[6])[:60]]
    assert wait_until_idle(server)


@pytest.mark.parametrize("body,message", [
    ({"text_input": "hi", "sampling_parameters": "{" * 100000}, "sampling_parameters"),
    ({"text_input": "hi", "sampling_parameters": json.dumps({"max_tokens": 10**400})}, "exceeds the model's context"),
    ({"text_input": "hi", "sampling_parameters": json.dumps({"stop": [[["a"]]]})}, "stop must be"),
    ({"text_input": "hi", "max_tokens": "3x"}, "max_tokens must be an integer"),
])
def test_unparseable_requests_get_invalid_request_with_an_id_and_nothing_internal(server: Served, body: dict,
                                                                                  message: str) -> None:
    resp = http_generate(server.http, body)
    error = resp.json()["error"]
    assert resp.status_code == 400 and error.startswith("invalid request: ") and message in error, error
    assert re.search(r"\(request id req-\d+\)$", error) and not LEAKS.search(error), error


def test_a_big_prompt_being_tokenized_does_not_stall_a_running_stream(server: Served) -> None:
    """Each 500 KiB prompt takes ~0.5-1 s to tokenize before it is refused as too long. Tokenized on the
    engine thread, it would hold every stream for that long; on the tokenizer thread the stream goes on."""
    from tritium.client.bench.workload import big_prompt

    prompts = [big_prompt(500, salt) for salt in range(3)]
    with ThreadPoolExecutor(1) as pool:
        running = pool.submit(grpc_stream, server.grpc, PROMPT, {"max_tokens": 400, "temperature": 0,
                                                                 "ignore_eos": True})
        assert wait_for(lambda: metric_value(server, "tritium_num_requests_running") >= 1, 60)
        windows = []
        for prompt in prompts:
            started = time.monotonic()
            resp = http_generate(server.http, {"text_input": prompt, "max_tokens": 4})
            windows.append((started, time.monotonic()))
            assert resp.status_code == 400 and "the model's context is 8192 tokens" in resp.json()["error"]
        stream = running.result(300)
    assert stream.finals == 1 and not stream.errors
    for started, ended in windows:
        arrivals = [t for t in stream.times if started <= t <= ended]
        gaps = [b - a for a, b in zip([started, *arrivals], [*arrivals, ended], strict=True)]
        assert len(arrivals) >= 2 and max(gaps) < 0.5 * (ended - started), (ended - started, max(gaps))
