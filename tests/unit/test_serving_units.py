"""Request parsing, the Triton models' front door and sinks, and the ensemble's text codec, without a server."""

from __future__ import annotations

import json
import re
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tritium.backend.detokenizer import IncrementalDetokenizer
from tritium.backend.outputs import RequestOutput
from tritium.backend.sampling_params import SAMPLING_FIELDS, SamplingField, SamplingParams
from tritium.backend.serving import ids_model, text_model
from tritium.backend.serving.ids_model import SCALAR_INPUTS, IdsSink, parse_ids_request
from tritium.backend.serving.request import FLAG_INPUTS, TextRequest, parse_text_request
from tritium.backend.serving.text_codec_models import decode_delta, encode_prompt
from tritium.backend.serving.text_model import TextSink
from tritium.backend.structured_output.constraint import StructuredOutput
from tritium.backend.tokenizer import Tokenizer
from tritium.client.openai import protocol as openai_protocol
from tritium.client.triton.launcher import PACKAGE_REPOSITORY


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
        if detok.add_token(t):
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


# --- sampling fields: declared once on SamplingParams ------------------------------------------------------


def _valid_value(spec: SamplingField) -> Any:
    """A valid value of the field other than its default, derived from its declared type and bounds."""
    lo, hi = spec.bounds.get("ge", spec.bounds.get("gt")), spec.bounds.get("le")
    if spec.type is bool:
        return not spec.default
    if spec.type is int:
        return (lo if lo is not None else 0) + 1
    if spec.type is float:
        return (lo + hi) / 2 if lo is not None and hi is not None else (lo or 0.0) + 0.5
    if spec.type is StructuredOutput:
        return StructuredOutput(regex="[a-z]+")
    assert spec.type is list, f"{spec.name}: add its kind to this test"
    return ["a"] if spec.item is str else [1]


def _as_string(value: Any) -> str:
    """How a loosely typed client (genai-perf) sends it: every value a string."""
    if isinstance(value, list):
        return json.dumps(value)
    if isinstance(value, StructuredOutput):
        return json.dumps(value.to_dict())
    return str(value).lower() if isinstance(value, bool) else str(value)


@pytest.mark.parametrize("name", list(SAMPLING_FIELDS))
def test_every_sampling_field_is_accepted_by_the_triton_parser_with_its_type_coerced(name: str) -> None:
    spec = SAMPLING_FIELDS[name]
    value = _valid_value(spec)
    for sent in (value.to_dict() if isinstance(value, StructuredOutput) else value, _as_string(value)):
        from_json = parse_text_request(text_inputs(sampling_parameters=json.dumps({name: sent}).encode()), {})
        from_parameters = parse_text_request(text_inputs(), {name: sent})
        for parsed in (from_json, from_parameters):
            got = getattr(parsed.params, name)
            assert got == value and type(got) is spec.type, (name, sent, got)


def test_sampling_fields_describe_sampling_params() -> None:
    assert list(SAMPLING_FIELDS) == list(SamplingParams.__dataclass_fields__)
    assert SAMPLING_FIELDS["seed"].optional and SAMPLING_FIELDS["stop"].item is str
    assert SAMPLING_FIELDS["top_p"].rule == "in (0, 1]" and SAMPLING_FIELDS["max_tokens"].rule == ">= 1"
    for spec in SAMPLING_FIELDS.values():  # the declared bounds are what construction enforces
        assert getattr(SamplingParams(), spec.name) == spec.default
        for key, bound in spec.bounds.items():
            if spec.type is float:
                outside = bound - 0.5 if key != "le" else bound + 0.5
                with pytest.raises(ValueError, match=re.escape(f"{spec.name} must be {spec.rule}")):
                    SamplingParams(**{spec.name: outside})
            else:
                outside = bound - 1 if key == "ge" else bound + 1
                with pytest.raises(ValueError, match=f"{spec.name} must be"):
                    SamplingParams(**{spec.name: outside})


def _config_inputs(model: str) -> dict[str, str]:
    text = (PACKAGE_REPOSITORY / model / "config.pbtxt").read_text()
    return dict(re.findall(r'\{ name: "(\w+)", data_type: TYPE_(\w+)', text.split("output [")[0]))


@pytest.mark.parametrize("model", ["tritium_ids", "tritium_ensemble"])
def test_ids_scalar_inputs_are_sampling_fields_with_matching_tensor_types(model: str) -> None:
    inputs = _config_inputs(model)
    others = {"input_ids", "text_input", "apply_chat_template", "stream", "stop_words", "lora_name",
              "return_num_cached_tokens"}
    assert set(inputs) - others == set(SCALAR_INPUTS)
    tensor_types = {int: {"INT32", "INT64", "UINT32", "UINT64"}, float: {"FP32", "FP64"}}
    for name, kind in SCALAR_INPUTS.items():
        assert kind is SAMPLING_FIELDS[name].type and inputs[name] in tensor_types[kind], (name, inputs[name])


def test_ids_request_scalars_get_their_declared_types() -> None:
    dtypes = {"INT32": np.int32, "UINT64": np.uint64, "FP32": np.float32}
    inputs = {name: np.array([_valid_value(SAMPLING_FIELDS[name])], dtype=dtypes[dtype])
              for name, dtype in _config_inputs("tritium_ids").items() if name in SCALAR_INPUTS}
    _, sampling, _ = parse_ids_request({"input_ids": np.array([1], dtype=np.int32), **inputs})
    assert set(sampling) == set(SCALAR_INPUTS)
    for name, value in sampling.items():
        assert type(value) is SCALAR_INPUTS[name], (name, value)
    SamplingParams.from_dict(sampling)


def _pydantic_bounds(field: Any) -> dict[str, float]:
    return {key: getattr(m, key) for m in field.metadata for key in ("ge", "gt", "le") if hasattr(m, key)}


@pytest.mark.parametrize("model", [openai_protocol.CompletionRequest, openai_protocol.ChatRequest])
def test_openai_sampling_fields_accept_only_what_sampling_params_accepts(model: Any) -> None:
    engine_names = {"max_completion_tokens": "max_tokens", "top_logprobs": "logprobs"}
    if model is openai_protocol.ChatRequest:
        engine_names["logprobs"] = ""  # chat's logprobs is a flag; top_logprobs is the engine's logprobs
    checked = set()
    for name, field in model.model_fields.items():
        engine_name = engine_names.get(name, name)
        if engine_name not in SAMPLING_FIELDS:
            continue
        spec, ours = SAMPLING_FIELDS[engine_name], _pydantic_bounds(field)
        lo = spec.bounds.get("ge", spec.bounds.get("gt"))
        ours_lo = ours.get("ge", ours.get("gt"))
        if lo is not None:
            assert ours_lo is not None and (ours_lo > lo or (ours_lo == lo and ("gt" in ours or "ge" in spec.bounds)))
        if "le" in spec.bounds:
            assert "le" in ours and ours["le"] <= spec.bounds["le"], (name, ours)
        checked.add(name)
    assert {"temperature", "top_p", "seed", "presence_penalty", "frequency_penalty", "max_tokens",
            *openai_protocol.VLLM_EXTRA_FIELDS} <= checked
    for name in openai_protocol.VLLM_EXTRA_FIELDS:  # generated from SamplingParams: same default
        assert model.model_fields[name].default == SAMPLING_FIELDS[name].default


def test_openai_extremes_are_valid_sampling_params() -> None:
    body = openai_protocol.CompletionRequest(model="m", prompt="p", max_tokens=3, temperature=2, top_p=1e-9,
                                             seed=openai_protocol.MAX_SEED, presence_penalty=-2, frequency_penalty=2,
                                             ignore_eos=True, min_tokens=3, stop=["x"], logprobs=20)
    sampling = body.sampling(16) | {"logprobs": body.logprobs}
    assert sampling["ignore_eos"] is True and sampling["min_tokens"] == 3
    SamplingParams.from_dict(sampling)
    assert "ignore_eos" not in openai_protocol.CompletionRequest(model="m", prompt="p").sampling(16)


# --- the Triton models' front door and sinks, with a stand-in for triton_python_backend_utils ------------------


class FakeTensor:
    def __init__(self, name: str, array: np.ndarray) -> None:
        self.name, self.array = name, array

    def as_numpy(self) -> np.ndarray:
        return self.array


class FakeResponse:
    def __init__(self, output_tensors: list[FakeTensor] | None = None, error: Any = None) -> None:
        self.tensors = {t.name: t.array for t in output_tensors or []}
        self.error = error


class FakeError:
    def __init__(self, message: str, code: Any = None) -> None:
        self.message = message


FAKE_PB = SimpleNamespace(Tensor=FakeTensor, InferenceResponse=FakeResponse, TritonError=FakeError,
                          TRITONSERVER_RESPONSE_COMPLETE_FINAL=1,
                          get_input_tensor_by_name=lambda request, name: request.inputs.get(name))


class FakeSender:
    def __init__(self) -> None:
        self.sent: list[tuple[FakeResponse, int]] = []

    def send(self, response: FakeResponse, flags: int = 0) -> None:
        self.sent.append((response, flags))

    def is_cancelled(self) -> bool:
        return False


class FakeRequest:
    def __init__(self, inputs: dict[str, np.ndarray], parameters: dict[str, Any] | None = None) -> None:
        self.inputs = {name: FakeTensor(name, array) for name, array in inputs.items()}
        self.params = json.dumps(parameters or {})
        self.sender = FakeSender()

    def parameters(self) -> str:
        return self.params

    def get_response_sender(self) -> FakeSender:
        return self.sender


def delta_outputs(logprobs: bool = True) -> list[RequestOutput]:
    """A 3-token generation as the engine reports it: delta-only, the totals on the final output. The
    second token releases no text (a character still incomplete)."""
    lps = [{5: -0.5, 9: -1.0}, {6: -0.25}, {7: -0.125, 2: -3.0}]
    steps = [("Hel", [5]), ("", [6]), ("lo!", [7])]
    outs = []
    for i, (text, ids) in enumerate(steps):
        final = i == len(steps) - 1
        outs.append(RequestOutput(
            request_id="r", delta_text=text, delta_token_ids=ids, finished=final, finish_reason="length" if final
            else None, num_input_tokens=4, num_output_tokens=i + 1, num_cached_tokens=0,
            delta_logprobs=[lps[i]] if logprobs else None, text="Hello!" if final else "",
            token_ids=[5, 6, 7] if final else [], logprobs=lps if final and logprobs else None))
    return outs


def _text_request(**flags: bool) -> TextRequest:
    return TextRequest(params=SamplingParams(), prompt="Say:", return_finish_reason=True,
                       return_num_input_tokens=True, return_num_output_tokens=True, return_logprobs=True, **flags)


def _responses(sender: FakeSender) -> list[dict[str, Any]]:
    out = []
    for response, flags in sender.sent:
        t = response.tensors
        out.append({"text": t["text_output"][0].decode(), "finish_reason": t["finish_reason"][0].decode(),
                    "num_input_tokens": int(t["num_input_tokens"][0]),
                    "num_output_tokens": int(t["num_output_tokens"][0]),
                    "logprobs": json.loads(t["logprobs"][0]), "final": flags == 1})
    return out


def test_text_sink_streams_each_delta() -> None:
    sender = FakeSender()
    sink = TextSink(FAKE_PB, sender, _text_request(stream=True))
    for out in delta_outputs():
        sink.send_output(out)
    assert _responses(sender) == [
        {"text": "Hel", "finish_reason": "", "num_input_tokens": 4, "num_output_tokens": 1,
         "logprobs": [{"5": -0.5, "9": -1.0}], "final": False},
        {"text": "", "finish_reason": "", "num_input_tokens": 4, "num_output_tokens": 2,
         "logprobs": [{"6": -0.25}], "final": False},
        {"text": "lo!", "finish_reason": "length", "num_input_tokens": 4, "num_output_tokens": 3,
         "logprobs": [{"7": -0.125, "2": -3.0}], "final": True},
    ]
    assert not sink.is_cancelled()  # the FINAL flag was sent: the sender is never asked again


@pytest.mark.parametrize("exclude,text", [(False, "Say:Hello!"), (True, "Hello!")])
def test_text_sink_answers_once_at_the_end_with_the_totals(exclude: bool, text: str) -> None:
    sender = FakeSender()
    sink = TextSink(FAKE_PB, sender, _text_request(exclude_input_in_output=exclude))
    for out in delta_outputs():
        sink.send_output(out)
    assert _responses(sender) == [{
        "text": text, "finish_reason": "length", "num_input_tokens": 4, "num_output_tokens": 3,
        "logprobs": [{"5": -0.5, "9": -1.0}, {"6": -0.25}, {"7": -0.125, "2": -3.0}], "final": True}]


def test_text_sink_sends_only_what_was_asked() -> None:
    sender = FakeSender()
    sink = TextSink(FAKE_PB, sender, TextRequest(params=SamplingParams(), prompt="Say:", stream=True))
    for out in delta_outputs(logprobs=False):
        sink.send_output(out)
    assert [set(r.tensors) for r, _ in sender.sent] == [{"text_output"}] * 3
    assert [f for _, f in sender.sent] == [0, 0, 1]


@pytest.mark.parametrize("stream,expected", [
    (True, [([5], [1, 2, 3], 0), ([6, 7], [1, 2, 3, 5], 1)]),  # the second token waits for its text
    (False, [([5, 6, 7], [1, 2, 3], 1)]),
])
def test_ids_sink_cuts_responses_where_text_is_released(stream: bool, expected: list) -> None:
    sender = FakeSender()
    sink = IdsSink(FAKE_PB, sender, [1, 2, 3], stream)
    for out in delta_outputs():
        sink.send_output(out)
    got = [(r.tensors["output_ids"].tolist(), r.tensors["context_ids"].tolist(), f) for r, f in sender.sent]
    assert got == expected


class FakeLoop:
    def __init__(self) -> None:
        self.jobs: list[Any] = []

    def submit(self, job: Any) -> None:
        self.jobs.append(job)


def _model(module: Any, engine: Any, input_names: list[str], timeout_s: float | None) -> Any:
    """A model as `initialize` leaves it, with a fake loop (initialize needs Triton's stub)."""
    from itertools import count

    model = module.TritonPythonModel()
    model.pb, model.engine, model.loop, model.input_names = FAKE_PB, engine, FakeLoop(), input_names
    model.timeout_s, model._ids = timeout_s, count()
    return model


def test_text_model_execute_submits_good_requests_and_answers_bad_ones(default_model_path: Path) -> None:
    tokenizer = Tokenizer(default_model_path)
    model = _model(text_model, SimpleNamespace(tokenizer=tokenizer), ["text_input", *FLAG_INPUTS], None)
    plain = FakeRequest({"text_input": np.array([b"Once upon a time"], dtype=object)}, {"max_tokens": "5"})
    bad = FakeRequest({"text_input": np.array([b"hi"], dtype=object)}, {"max_tokens": 0})
    chat = FakeRequest({"text_input": np.array([b"What is 2+2?"], dtype=object),
                        "apply_chat_template": np.array([True])})
    model.execute([plain, bad, chat])
    assert [j.request_id for j in model.loop.jobs] == ["req-0", "req-2"]
    assert model.loop.jobs[0].prompt == "Once upon a time" and model.loop.jobs[0].params.max_tokens == 5
    assert model.loop.jobs[0].timeout_s is None
    (error, flags), = bad.sender.sent
    assert flags == 1 and "max_tokens must be >= 1, got 0 (request id req-1)" in error.error.message
    job = model.loop.jobs[1]
    assert job.prompt == tokenizer.apply_chat_template([{"role": "user", "content": "What is 2+2?"}])
    assert job.prompt.startswith("<|im_start|>") and job.prompt_token_ids is None
    assert job.sink.request.exclude_input_in_output  # a chat reply comes alone unless asked otherwise


def test_ids_model_execute_submits_token_ids_with_a_timeout() -> None:
    model = _model(ids_model, None, list(_config_inputs("tritium_ids")), ids_model.DEFAULT_TIMEOUT_S)
    request = FakeRequest({"input_ids": np.array([3, 4], dtype=np.int32), "top_k": np.array([2], dtype=np.int32)})
    empty = FakeRequest({})
    model.execute([request, empty])
    (job,) = model.loop.jobs
    assert job.request_id == "ids-0" and job.prompt_token_ids == [3, 4] and job.prompt is None
    assert job.params.top_k == 2 and job.timeout_s == 300
    (error, flags), = empty.sender.sent
    assert flags == 1 and "input_ids is required and must not be empty (request id ids-1)" in error.error.message


def test_chat_flag_defaults_exclude_input_in_output() -> None:
    assert parse_text_request(text_inputs(apply_chat_template=True), {}).exclude_input_in_output
    assert not parse_text_request(text_inputs(apply_chat_template=True), {"exclude_input_in_output": False}
                                  ).exclude_input_in_output
    assert not parse_text_request(text_inputs(), {}).exclude_input_in_output


# --- num_cached_tokens: the prefix-cache hit on the final response ---------------------------------------------


def _cached_outputs(cached: int) -> list[RequestOutput]:
    outs = delta_outputs()
    for out in outs:
        out.num_cached_tokens = cached
    return outs


def test_return_num_cached_tokens_is_a_flag_input_and_parameter() -> None:
    assert not parse_text_request(text_inputs(), {}).return_num_cached_tokens
    assert parse_text_request(text_inputs(return_num_cached_tokens=True), {}).return_num_cached_tokens
    assert parse_text_request(text_inputs(), {"return_num_cached_tokens": "true"}).return_num_cached_tokens
    assert not parse_text_request(text_inputs(return_num_cached_tokens=True), {"return_num_cached_tokens": False}
                                  ).return_num_cached_tokens
    with pytest.raises(ValueError, match="return_num_cached_tokens must be a boolean"):
        parse_text_request(text_inputs(), {"return_num_cached_tokens": "often"})
    assert _config_inputs("tritium")["return_num_cached_tokens"] == "BOOL"
    assert _config_inputs("tritium_ids")["return_num_cached_tokens"] == "BOOL"
    for model in ("tritium", "tritium_ids"):
        outputs = (PACKAGE_REPOSITORY / model / "config.pbtxt").read_text().split("output [")[1]
        assert '{ name: "num_cached_tokens", data_type: TYPE_UINT32, dims: [ 1 ] }' in outputs, model


@pytest.mark.parametrize("stream", [True, False])
def test_text_sink_sends_num_cached_tokens_on_the_final_response_only(stream: bool) -> None:
    sender = FakeSender()
    sink = TextSink(FAKE_PB, sender, TextRequest(params=SamplingParams(), prompt="Say:", stream=stream,
                                                 return_num_cached_tokens=True))
    for out in _cached_outputs(32):
        sink.send_output(out)
    *partial, (final, flags) = sender.sent
    assert flags == 1 and final.tensors["num_cached_tokens"].tolist() == [32]
    assert final.tensors["num_cached_tokens"].dtype == np.uint32
    assert all("num_cached_tokens" not in r.tensors for r, _ in partial) and len(partial) == (2 if stream else 0)
    unasked = FakeSender()
    sink = TextSink(FAKE_PB, unasked, TextRequest(params=SamplingParams(), prompt="Say:", stream=stream))
    for out in _cached_outputs(32):
        sink.send_output(out)
    assert all("num_cached_tokens" not in r.tensors for r, _ in unasked.sent)


@pytest.mark.parametrize("asked", [True, False])
def test_ids_model_sends_num_cached_tokens_when_asked(asked: bool) -> None:
    model = _model(ids_model, None, list(_config_inputs("tritium_ids")), ids_model.DEFAULT_TIMEOUT_S)
    inputs = {"input_ids": np.array([3, 4], dtype=np.int32), "stream": np.array([True])}
    if asked:
        inputs["return_num_cached_tokens"] = np.array([True])
    request = FakeRequest(inputs)
    model.execute([request])
    (job,) = model.loop.jobs
    for out in _cached_outputs(16):
        job.sink.send_output(out)
    *partial, (final, flags) = request.sender.sent
    assert flags == 1 and partial
    assert all("num_cached_tokens" not in r.tensors for r, _ in partial)
    if asked:
        assert final.tensors["num_cached_tokens"].tolist() == [16]
    else:
        assert "num_cached_tokens" not in final.tensors


# --- chat_template_kwargs on the text model ------------------------------------------------------------------


def test_chat_template_kwargs_come_as_an_input_or_a_parameter_with_apply_chat_template() -> None:
    kwargs = {"enable_thinking": False, "budget": [1, {"x": None}]}
    chat = {"apply_chat_template": True}
    assert parse_text_request(text_inputs(**chat), {}).chat_template_kwargs is None
    from_input = parse_text_request(text_inputs(chat_template_kwargs=json.dumps(kwargs).encode(), **chat), {})
    from_parameter = parse_text_request(text_inputs(), {"apply_chat_template": True,
                                                        "chat_template_kwargs": json.dumps(kwargs)})
    assert from_input.chat_template_kwargs == from_parameter.chat_template_kwargs == kwargs
    winner = parse_text_request(text_inputs(chat_template_kwargs=b'{"a": 1}', **chat),
                                {"chat_template_kwargs": '{"b": 2}'})
    assert winner.chat_template_kwargs == {"b": 2}  # the parameter wins, as for the flags


@pytest.mark.parametrize("inputs,params,message", [
    (text_inputs(chat_template_kwargs=b'{"enable_thinking": false}'), {},
     "chat_template_kwargs is only used with apply_chat_template"),
    (text_inputs(apply_chat_template=True), {"chat_template_kwargs": "{nope"}, "chat_template_kwargs must be a JSON"),
    (text_inputs(apply_chat_template=True), {"chat_template_kwargs": "[1]"},
     "chat_template_kwargs must be a JSON object, got list"),
    (text_inputs(apply_chat_template=True), {"chat_template_kwargs": 3},
     "chat_template_kwargs must be a JSON object, got int"),
    (text_inputs(apply_chat_template=True), {"chat_template_kwargs": '{"messages": []}'},
     "chat_template_kwargs: 'messages' may not be set"),
    (text_inputs(apply_chat_template=True), {"chat_template_kwargs": '{"add_generation_prompt": false}'},
     "chat_template_kwargs: 'add_generation_prompt' may not be set"),
    (text_inputs(apply_chat_template=True, chat_template_kwargs=b"\xff"), {},
     "chat_template_kwargs is not valid UTF-8"),
])
def test_bad_chat_template_kwargs_are_refused_by_name(inputs: dict, params: dict, message: str) -> None:
    with pytest.raises(ValueError) as err:
        parse_text_request(inputs, params)
    assert message in str(err.value)


def test_text_model_renders_the_user_turn_with_chat_template_kwargs(tmp_path: Path, default_model_path: Path) -> None:
    from support.chat_templates import NO_THINKING, TEMPLATE_SECRET, tokenizer_folder_with_template

    tokenizer = Tokenizer(tokenizer_folder_with_template(tmp_path / "thinking", default_model_path))
    model = _model(text_model, SimpleNamespace(tokenizer=tokenizer), list(_config_inputs("tritium")), None)
    text = np.array([b"What is 2+2?"], dtype=object)
    off = FakeRequest({"text_input": text, "apply_chat_template": np.array([True]),
                       "chat_template_kwargs": np.array([b'{"enable_thinking": false}'], dtype=object)})
    def chat(kwargs: str) -> FakeRequest:
        return FakeRequest({"text_input": text}, {"apply_chat_template": True, "chat_template_kwargs": kwargs})

    on, bad, taken = chat('{"enable_thinking": true}'), chat('{"enable_thinking": 2}'), chat('{"tools": 1}')
    model.execute([off, on, bad, taken])
    plain = tokenizer.user_turn("What is 2+2?")
    assert [j.prompt for j in model.loop.jobs] == [plain + NO_THINKING, plain]
    for request in (bad, taken):
        (error, flags), = request.sender.sent
        assert flags == 1 and "invalid request: chat_template_kwargs" in error.error.message
        assert TEMPLATE_SECRET not in error.error.message
