"""Request parsing and the ensemble's text codec, without a server."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tritium.backend.detokenizer import IncrementalDetokenizer
from tritium.backend.sampling_params import SamplingParams
from tritium.backend.serving.ids_model import parse_ids_request
from tritium.backend.serving.request import FLAG_INPUTS, parse_text_request
from tritium.backend.serving.text_codec_models import decode_delta, encode_prompt
from tritium.backend.tokenizer import Tokenizer


def text_inputs(prompt: bytes | None = b"hi", **extra: object) -> dict[str, np.ndarray | None]:
    inputs: dict[str, np.ndarray | None] = {"text_input": None if prompt is None else np.array([prompt], dtype=object)}
    for name, value in extra.items():
        inputs[name] = np.array([value], dtype=object if isinstance(value, bytes) else None)
    return inputs


def test_sampling_from_json_and_parameters_with_genai_perf_strings() -> None:
    req = parse_text_request(text_inputs(sampling_parameters=json.dumps({"max_tokens": "16", "temperature": "0",
                                                                         "stop": '["a", "b"]'}).encode(),
                                         stream=True),
                             {"top_k": 5, "triton_enable_empty_final_response": True})
    assert (req.params.max_tokens, req.params.temperature, req.params.top_k) == (16, 0.0, 5)
    assert req.params.stop == ["a", "b"] and req.stream is True


@pytest.mark.parametrize("inputs,params,message", [
    (text_inputs(None), {}, "text_input is required"),
    (text_inputs(b""), {}, "text_input must not be empty"),
    (text_inputs(b"\xff\xfe"), {}, "text_input is not valid UTF-8"),
    (text_inputs(b"x" * (2 << 20)), {}, "the limit is"),
    (text_inputs(sampling_parameters=b"[1]"), {}, "must be a JSON object, got list"),
    (text_inputs(sampling_parameters=b'{"max_tokens": "many"}'), {}, "max_tokens must be an integer"),
    (text_inputs(sampling_parameters=b'{"nope": 1}'), {}, "unknown sampling field(s): nope"),
    (text_inputs(), {"max_tokens": 0}, "max_tokens must be >= 1"),
    (text_inputs(), {"whatever": 1}, "unknown request parameter 'whatever'"),
    (text_inputs(stream="yes"), {}, "stream must be a boolean"),
])
def test_bad_text_requests(inputs: dict, params: dict, message: str) -> None:
    with pytest.raises(ValueError) as err:
        parse_text_request(inputs, params)
    assert message in str(err.value)


def test_ids_request_trt_llm_style() -> None:
    ids, sampling, stream = parse_ids_request({
        "input_ids": np.array([1, 2, 3], dtype=np.int32), "max_tokens": np.array([8], dtype=np.int32),
        "top_p": np.array([0.0], dtype=np.float32), "seed": np.array([7], dtype=np.uint64),
        "stop_words": np.array([b"END", b""], dtype=object), "stream": np.array([True]),
    })
    assert ids == [1, 2, 3] and stream
    assert sampling == {"max_tokens": 8, "top_p": 1.0, "seed": 7, "stop": ["END"]}
    with pytest.raises(ValueError, match="input_ids is required"):
        parse_ids_request({"input_ids": None})


def test_codec_round_trip_keeps_spaces_and_multibyte(default_model_path: Path) -> None:
    tok = Tokenizer(default_model_path)
    prompt = encode_prompt(tok, "Say something:", chat=False)
    out = tok.encode(" héllo 日本 🎉 world")
    # Group tokens where the engine's detokenizer releases text, as tritium_ids cuts its responses.
    detok = IncrementalDetokenizer(tok, prompt)
    text, history, pending, groups = "", prompt[-5:], [], 0
    for t in out:
        pending.append(t)
        detok.add_token(t)
        if detok.take_delta(False):
            text += decode_delta(tok, history[-5:], pending)
            history, pending, groups = history + pending, [], groups + 1
    assert text == " héllo 日本 🎉 world" and groups < len(out)  # some characters took several tokens
    chat = encode_prompt(tok, "Hi", chat=True)
    assert chat[0] == tok.token_to_id("<|im_start|>")


FIELD_NAMES = ["max_tokens", "min_tokens", "temperature", "top_p", "top_k", "min_p", "seed", "stop",
               "stop_token_ids", "logprobs", "ignore_eos", "repetition_penalty", "skip_special_tokens"]
JSON_SCALARS = (st.none() | st.booleans() | st.integers() | st.floats(allow_nan=True) | st.text(max_size=20)
                | st.sampled_from(["0", "1", "-1", "16", "0.5", "1e999", "NaN", "true", "[]", '["a"]', "[1]",
                                   2**63, 2**64, 10**400, -(10**400)]))
JSON_VALUES = st.recursive(JSON_SCALARS, lambda inner: st.lists(inner, max_size=4)
                           | st.dictionaries(st.text(max_size=8), inner, max_size=4), max_leaves=12)
SAMPLING_DICTS = st.dictionaries(st.sampled_from(FIELD_NAMES) | st.text(max_size=10), JSON_VALUES, max_size=6)


def _bytes_array(values: list[bytes]) -> np.ndarray:
    return np.array(values, dtype=object)


@st.composite
def triton_requests(draw: st.DrawFn) -> tuple[dict[str, np.ndarray | None], dict[str, object]]:
    """What a Triton request can carry: a text_input of any bytes/shape, sampling_parameters that may or
    may not be JSON, flag tensors of any type, and request parameters of any JSON scalar."""
    prompt = draw(st.none() | st.binary(max_size=40) | st.text(max_size=40).map(lambda t: t.encode("utf-8",
                                                                                                  "surrogatepass")))
    inputs: dict[str, np.ndarray | None] = {"text_input": None}
    if prompt is not None:
        inputs["text_input"] = _bytes_array([prompt] * draw(st.integers(1, 2)))
    sampling = draw(st.none() | st.binary(max_size=30) | SAMPLING_DICTS.map(lambda d: json.dumps(d).encode())
                    | JSON_VALUES.map(lambda v: json.dumps(v).encode()))
    inputs["sampling_parameters"] = None if sampling is None else _bytes_array([sampling])
    for flag in FLAG_INPUTS:
        value = draw(st.none() | st.booleans() | st.integers(-2, 2) | st.binary(max_size=5))
        if value is not None:
            inputs[flag] = _bytes_array([value]) if isinstance(value, bytes) else np.array([value])
    params = draw(st.dictionaries(st.sampled_from([*FIELD_NAMES, *FLAG_INPUTS, "triton_x"]) | st.text(max_size=8),
                                  JSON_SCALARS, max_size=5))
    return inputs, params


@settings(max_examples=500, deadline=None)
@given(triton_requests())
def test_request_parser_accepts_or_raises_value_error(request: tuple[dict[str, np.ndarray | None], dict]) -> None:
    inputs, params = request
    try:
        parsed = parse_text_request(inputs, params)
    except ValueError as exc:
        assert str(exc)  # the documented error, with a message naming the problem
        return
    assert parsed.prompt and isinstance(parsed.params, SamplingParams)
    parsed.params._validate()  # what was accepted is valid
    assert parsed.params.max_tokens >= 1 and 0 < parsed.params.top_p <= 1
