"""Bad requests through a real tritonserver, over HTTP and gRPC: each gets one error naming the field and
the rule, and the server goes on serving. (The OpenAI endpoint's are in test_openai.py.)"""

from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import numpy as np
import pytest
import requests

from support.serving import Served, grpc_stream, grpc_stream_inputs, http_generate, metric_value, wait_for

pytestmark = pytest.mark.slow
LIMIT = "1048576 bytes"

# (name, text_input, sampling_parameters as sent: a dict is JSON-encoded, a str is sent as is, expected error)
CASES = [
    ("empty prompt", "", None, "text_input must not be empty"),
    ("prompt over the context", "word " * 9000, None, "the model's context is 8192 tokens"),
    ("max_tokens 0", "hi", {"max_tokens": 0}, "max_tokens must be >= 1"),
    ("max_tokens negative", "hi", {"max_tokens": -5}, "max_tokens must be >= 1"),
    ("max_tokens huge", "hi", {"max_tokens": 10**9}, "max_tokens (1000000000) + prompt"),
    ("temperature negative", "hi", {"temperature": -0.5}, "temperature must be in [0, 100]"),
    ("temperature NaN", "hi", '{"temperature": NaN}', "temperature must be in [0, 100], got nan"),
    ("top_p 0", "hi", {"top_p": 0}, "top_p must be in (0, 1]"),
    ("top_p over 1", "hi", {"top_p": 1.5}, "top_p must be in (0, 1]"),
    ("top_k below -1", "hi", {"top_k": -2}, "top_k must be >= -1"),
    ("seed negative", "hi", {"seed": -1}, "seed must be >= 0"),
    ("seed over 64 bits", "hi", {"seed": 2**64}, "seed must be <="),
    ("sampling not JSON", "hi", "{max_tokens: 3", "sampling_parameters must be a JSON object"),
    ("sampling not an object", "hi", "[1, 2]", "sampling_parameters must be a JSON object, got list"),
    ("sampling unknown key", "hi", {"max_token": 3}, "unknown sampling field(s): max_token"),
    ("sampling wrong type", "hi", {"max_tokens": "lots"}, "max_tokens must be an integer"),
    ("sampling wrong type list", "hi", {"temperature": [1]}, "temperature must be a number"),
    ("1000 stop strings", "hi", {"stop": [f"s{i}" for i in range(1000)]}, "stop may hold at most 64 strings"),
    ("logprobs over the limit", "hi", {"logprobs": 21}, "logprobs must be <= 20"),
    ("10 MB prompt", "x" * (10 << 20), None, LIMIT),
    ("prompt that cannot fit, refused before tokenizing", "x" * (800 << 10), None, "could hold"),
]
IDS = [c[0] for c in CASES]


def assert_still_serving(server: Served) -> None:
    ok = http_generate(server.http, {"text_input": "Hello", "max_tokens": 2})
    assert ok.status_code == 200 and ok.json()["text_output"].startswith("Hello"), ok.text


def _sampling_text(sampling: dict | str | None) -> str | None:
    return sampling if isinstance(sampling, str) or sampling is None else json.dumps(sampling)


@pytest.mark.parametrize("name,prompt,sampling,message", CASES, ids=IDS)
def test_http(server: Served, name: str, prompt: str, sampling: dict | str | None, message: str) -> None:
    body: dict = {"text_input": prompt}
    if (text := _sampling_text(sampling)) is not None:
        body["sampling_parameters"] = text
    resp = http_generate(server.http, body)
    assert resp.status_code == 400, resp.text[:300]
    assert message in resp.json()["error"], resp.text[:300]
    assert_still_serving(server)


@pytest.mark.parametrize("name,prompt,sampling,message", CASES, ids=IDS)
def test_grpc(server: Served, name: str, prompt: str, sampling: dict | str | None, message: str) -> None:
    result = grpc_stream(server.grpc, prompt, sampling)
    assert len(result.errors) == 1 and not result.texts and result.finals == 0
    assert "invalid request" in result.errors[0] and message in result.errors[0], result.errors[0][:300]
    assert_still_serving(server)


def _tensor(module: Any, datatype: str, value: np.ndarray) -> Any:
    tensor = module.InferInput("text_input", list(value.shape), datatype)
    tensor.set_data_from_numpy(value)
    return tensor


def test_non_utf8_prompt_over_http_and_grpc(server: Served) -> None:
    import tritonclient.grpc as grpcclient

    bad = np.array([b"caf\xc3(\xff"], dtype=np.object_)
    message = "text_input is not valid UTF-8 (byte 3)"
    resp = requests.post(f"{server.http}/v2/models/tritium/generate", data=b'{"text_input": "caf\xc3(\xff"}',
                         timeout=60)
    assert resp.status_code == 400 and "text_input" in resp.json()["error"], resp.text
    result = grpc_stream_inputs(server.grpc, [_tensor(grpcclient, "BYTES", bad)])
    assert len(result.errors) == 1 and message in result.errors[0]
    assert_still_serving(server)


@pytest.mark.parametrize("datatype,value,message", [
    ("INT32", np.array([7], dtype=np.int32), "data-type is 'INT32', but model 'tritium' expects 'BYTES'"),
    ("BYTES", np.array([b"a", b"b"], dtype=np.object_), "unexpected shape for input 'text_input'"),
    ("BYTES", np.array([[b"a"]], dtype=np.object_), "unexpected shape for input 'text_input'"),
])
def test_wrong_tensor_datatype_or_shape_over_grpc(server: Served, datatype: str, value: np.ndarray,
                                                  message: str) -> None:
    import tritonclient.grpc as grpcclient

    result = grpc_stream_inputs(server.grpc, [_tensor(grpcclient, datatype, value)])
    assert len(result.errors) == 1 and message in result.errors[0], result.errors
    assert_still_serving(server)


@pytest.mark.parametrize("value,message", [
    (7, "attempt to access JSON non-string as string"),
    (["a", "b"], "can not convert input 'text_input' to tensor with proper shape"),
])
def test_wrong_tensor_datatype_or_shape_over_http(server: Served, value: Any, message: str) -> None:
    # Triton's generate endpoint maps JSON to tensors and answers these itself (a type error with a 500).
    resp = http_generate(server.http, {"text_input": value})
    assert resp.status_code in (400, 500) and message in resp.json()["error"], resp.text
    assert_still_serving(server)


def test_bad_request_in_a_stream_does_not_disturb_the_others(server: Served) -> None:
    """Bad requests sent while good ones are generating: each bad one gets its error at once, the good ones
    go on undisturbed to their full text."""
    good_sampling = {"max_tokens": 96, "temperature": 0, "ignore_eos": True}
    with ThreadPoolExecutor(4) as pool:
        goods = [pool.submit(grpc_stream, server.grpc, "Once upon a time", good_sampling, timeout=300,
                             return_num_output_tokens=True) for _ in range(3)]
        assert wait_for(lambda: metric_value(server, "tritium_num_requests_running") >= 3, 60)
        bad_grpc = grpc_stream(server.grpc, "Once upon a time", {"max_tokens": 4, "top_p": 7})
        bad_http = http_generate(server.http, {"text_input": "Once upon a time", "max_tokens": 0})
        assert not all(g.done() for g in goods), "the good requests finished before the bad ones were sent"
        results = [g.result() for g in goods]
    assert bad_grpc.errors and "top_p must be in (0, 1]" in bad_grpc.errors[0] and not bad_grpc.texts
    assert bad_http.status_code == 400 and "max_tokens must be >= 1" in bad_http.json()["error"]
    for good in results:
        assert not good.errors and good.finals == 1
        assert int(good.outputs[-1]["num_output_tokens"].reshape(-1)[0]) == 96
    assert len({"".join(g.texts) for g in results}) == 1  # same prompt, greedy: the same text for each



@pytest.mark.parametrize("prompt,message", [("x" * (10 << 20), LIMIT), ("x" * (800 << 10), "could hold")],
                         ids=["10 MB", "800 KB"])
def test_ensemble_refuses_oversized_prompts_before_tokenizing(server: Served, prompt: str, message: str) -> None:
    resp = http_generate(server.http, {"text_input": prompt, "max_tokens": 4}, model="tritium_ensemble")
    assert resp.status_code == 400 and message in resp.json()["error"], resp.text[:300]
    assert_still_serving(server)
