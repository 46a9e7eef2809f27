"""Structured output through the Triton text model, as clients of Triton's vLLM backend send it: the
`structured_outputs` (JSON text) and `guided_decoding` (object or text) fields of `sampling_parameters`, or
`guided_decoding` as a request parameter."""

from __future__ import annotations

import json
import re
from concurrent.futures import ThreadPoolExecutor

import pytest

from support.serving import Served, grpc_stream, http_generate

pytestmark = pytest.mark.slow
REGEXES = [r"[A-Z][a-z]{2,8} [0-9]{1,3}", r"(red|green|blue)-[0-9]{2}", r"\d{3}-\d{4}",
           r"[a-z]{1,12}@[a-z]{1,12}\.(com|org)", r"(yes|no), because [a-z ]{1,20}\.", r"#[0-9a-f]{6}"]
CHOICES = ["Paris", "London", "Rome", "an island in the sea"]


def test_regex_and_choice_hold_on_every_streamed_output(server: Served) -> None:
    def regex_request(i: int) -> tuple[str, str, list[str]]:
        pattern = REGEXES[i % len(REGEXES)]
        key = "structured_outputs" if i % 2 else "guided_decoding"
        value = json.dumps({"regex": pattern}) if i % 2 else {"regex": pattern}
        result = grpc_stream(server.grpc, f"Example {i}:", {key: value, "temperature": 1.0, "max_tokens": 40,
                                                           "seed": i})
        return pattern, "".join(result.texts), result.errors

    def choice_request(i: int) -> tuple[str, str, list[str]]:
        result = grpc_stream(server.grpc, "The capital of France is", {
            "guided_decoding": json.dumps({"choice": CHOICES}), "temperature": 1.0, "max_tokens": 16, "seed": i})
        return "|".join(map(re.escape, CHOICES)), "".join(result.texts), result.errors

    plain = grpc_stream(server.grpc, "Once upon a time", {"temperature": 0, "max_tokens": 24})
    with ThreadPoolExecutor(16) as pool:  # constrained and unconstrained requests share batches
        jobs = [pool.submit(regex_request, i) for i in range(12)] + [pool.submit(choice_request, i) for i in range(6)]
        beside = pool.submit(grpc_stream, server.grpc, "Once upon a time", {"temperature": 0, "max_tokens": 24})
        results = [j.result() for j in jobs]
    for pattern, text, errors in results:
        assert not errors and re.fullmatch(pattern, text), (pattern, text, errors)
    assert "".join(beside.result().texts) == "".join(plain.texts)


def test_guided_decoding_as_a_request_parameter_over_http(server: Served) -> None:
    resp = http_generate(server.http, {"text_input": "Answer yes or no: is the sky blue?", "max_tokens": 8,
                                       "guided_decoding": json.dumps({"choice": ["yes", "no"]}),
                                       "return_finish_reason": True, "exclude_input_in_output": True})
    assert resp.status_code == 200, resp.text
    body = resp.json()
    assert body["text_output"] in ("yes", "no") and body["finish_reason"] == "stop"


def test_json_schema_through_the_text_model_validates(server: Served) -> None:
    jsonschema = pytest.importorskip("jsonschema")
    schema = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 20},
                                               "population": {"type": "integer", "minimum": 0}},
              "required": ["city", "population"], "additionalProperties": False}
    result = grpc_stream(server.grpc, "A city as JSON:", {"structured_outputs": json.dumps({"json": schema}),
                                                          "temperature": 1.0, "max_tokens": 100, "seed": 3})
    assert not result.errors
    jsonschema.validate(json.loads("".join(result.texts)), schema)


@pytest.mark.parametrize(("sampling", "named"), [
    ({"guided_decoding": {"json": {"type": "array", "uniqueItems": True}}}, "uniqueItems"),
    ({"structured_outputs": json.dumps({"regex": "a(b"})}, "structured_output.regex"),
    ({"guided_decoding": {"regex": "a", "choice": ["b"]}}, "exactly one of"),
    ({"guided_decoding": {"whitespace": "x", "regex": "a"}}, "unsupported key(s) whitespace"),
])
def test_what_cannot_be_enforced_is_a_400_naming_it(server: Served, sampling: dict, named: str) -> None:
    resp = http_generate(server.http, {"text_input": "hi", "max_tokens": 4,
                                       "sampling_parameters": json.dumps(sampling)})
    assert resp.status_code == 400 and named in resp.json()["error"], resp.text
    assert "Traceback" not in resp.text
