"""Structured output and tool calling through `tritium openai` in front of a real tritonserver, with the official
`openai` client: JSON schemas, json_object, regex and choice hold on the default model (SmolLM2-135M) at
temperature 1; forced tool calls validate; `auto` tool calls are parsed from a Hermes-template checkpoint."""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import jsonschema
import openai
import pytest

from tritium.client.bench.schemas import SCHEMAS, UNSUPPORTED
from tritium.client.triton.repository import write_model

from support.serving import Served, start_openai, start_serve
from support.tools import TIME, WEATHER, assembled, write_hermes_model

pytestmark = pytest.mark.slow
FORMATS = jsonschema.FormatChecker()
TOOLS = [WEATHER, TIME]
PARAMETERS = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}


@pytest.fixture(scope="module")
def client(server: Served) -> Iterator[openai.OpenAI]:
    proc, base = start_openai([server.grpc])
    yield openai.OpenAI(base_url=base, api_key="unused", max_retries=0, timeout=300)
    proc.terminate()
    proc.wait(10)


def _schema_request(client: openai.OpenAI, index: int, stream: bool) -> tuple[str, str | None]:
    """(output, finish_reason) of the index-th sample schema asked for in a chat at temperature 1."""
    name, schema = SCHEMAS[index]
    body: dict[str, Any] = {
        "model": "tritium", "messages": [{"role": "user", "content": f"Write a {name.replace('_', ' ')} as JSON."}],
        "max_tokens": 512, "temperature": 1.0, "seed": index,
        "response_format": {"type": "json_schema", "json_schema": {"name": name, "schema": schema, "strict": True}}}
    if not stream:
        out = client.chat.completions.create(**body)
        return out.choices[0].message.content, out.choices[0].finish_reason
    text, reason = "", None
    for chunk in client.chat.completions.create(**body, stream=True):
        text += chunk.choices[0].delta.content or ""
        reason = chunk.choices[0].finish_reason or reason
    return text, reason


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_every_sample_schema_holds_at_temperature_1(client: openai.OpenAI, stream: bool) -> None:
    with ThreadPoolExecutor(len(SCHEMAS)) as pool:
        results = list(pool.map(lambda i: _schema_request(client, i, stream), range(len(SCHEMAS))))
    for (name, schema), (text, reason) in zip(SCHEMAS, results, strict=True):
        assert reason == "stop", (name, text)
        jsonschema.validate(json.loads(text), schema, format_checker=FORMATS)


def test_json_object_is_parseable_json(client: openai.OpenAI) -> None:
    chat = client.chat.completions.create(
        model="tritium", messages=[{"role": "user", "content": "Describe a cat as a JSON object."}],
        response_format={"type": "json_object"}, max_tokens=512, temperature=1.0, seed=1)
    assert isinstance(json.loads(chat.choices[0].message.content), dict), chat.choices[0].message.content
    assert chat.choices[0].finish_reason == "stop"
    text = "".join(c.choices[0].text for c in client.completions.create(
        model="tritium", prompt="A user record in JSON:", max_tokens=512, temperature=1.0, seed=2, stream=True,
        extra_body={"response_format": {"type": "json_object"}}))
    assert isinstance(json.loads(text), dict), text


@pytest.mark.parametrize(("name", "schema", "keyword"), UNSUPPORTED, ids=[u[0] for u in UNSUPPORTED])
def test_a_schema_llguidance_refuses_is_a_400_naming_the_keyword(client: openai.OpenAI, name: str, schema: dict,
                                                                  keyword: str) -> None:
    fmt = {"type": "json_schema", "json_schema": {"name": name, "schema": schema}}
    with pytest.raises(openai.BadRequestError) as err:
        client.chat.completions.create(model="tritium", messages=[{"role": "user", "content": "hi"}],
                                       response_format=fmt, max_tokens=8, stream=name == "not")
    message = err.value.response.json()["error"]["message"]
    assert f'"{keyword}"' in message and "Traceback" not in message, message


def test_guided_regex_and_choice_hold(client: openai.OpenAI) -> None:
    pattern = r"[A-Z][a-z]{2,8} is [0-9]{1,2} years old\."
    for seed in range(3):
        out = client.completions.create(model="tritium", prompt="A sentence:", max_tokens=40, temperature=1.0,
                                        seed=seed, extra_body={"guided_regex": pattern})
        assert re.fullmatch(pattern, out.choices[0].text) and out.choices[0].finish_reason == "stop"
    choices = ["Paris", "Rome", "somewhere far away"]
    chat = client.chat.completions.create(model="tritium", messages=[{"role": "user", "content": "Capital of Italy?"}],
                                          max_tokens=16, temperature=1.0, n=4, seed=3,
                                          extra_body={"guided_choice": choices})
    assert all(c.message.content in choices and c.finish_reason == "stop" for c in chat.choices)
    streamed = "".join(c.choices[0].delta.content or "" for c in client.chat.completions.create(
        model="tritium", messages=[{"role": "user", "content": "Pick one."}], max_tokens=16, stream=True,
        extra_body={"structured_outputs": {"choice": choices}}))
    assert streamed in choices


def _check_calls(calls: list[tuple[str, str]]) -> None:
    assert calls
    for name, arguments in calls:
        jsonschema.validate(json.loads(arguments), PARAMETERS[name])


@pytest.mark.parametrize("tool_choice", ["required", {"type": "function", "function": {"name": "get_time"}}],
                         ids=["required", "named"])
def test_forced_tool_calls_validate_streamed_and_not(client: openai.OpenAI, tool_choice: Any) -> None:
    body = {"model": "tritium", "messages": [{"role": "user", "content": "What is the weather in Paris and the time "
                                              "in Tokyo?"}], "tools": TOOLS, "tool_choice": tool_choice,
            "max_tokens": 200, "temperature": 0}
    whole = client.chat.completions.create(**body)
    message = whole.choices[0].message
    calls = [(c.function.name, c.function.arguments) for c in message.tool_calls]
    _check_calls(calls)
    assert message.content is None and whole.choices[0].finish_reason == "tool_calls"
    assert all(c.id.startswith("call_") and c.type == "function" for c in message.tool_calls)
    if isinstance(tool_choice, dict):
        assert [name for name, _ in calls] == ["get_time"]
    assert assembled(client, **body) == (None, calls, "tool_calls")
    for seed in range(3):  # sampled, the arguments still validate
        out = client.chat.completions.create(**body | {"temperature": 1.0, "seed": seed})
        _check_calls([(c.function.name, c.function.arguments) for c in out.choices[0].message.tool_calls])


def test_a_tool_round_trip_ends_in_an_answer(client: openai.OpenAI) -> None:
    messages: list[dict[str, Any]] = [{"role": "user", "content": "What is the weather in Paris?"}]
    first = client.chat.completions.create(model="tritium", messages=messages, tools=TOOLS, max_tokens=100,
                                           temperature=0, tool_choice={"type": "function",
                                                                       "function": {"name": "get_weather"}})
    call = first.choices[0].message.tool_calls[0]
    messages.append(first.choices[0].message.model_dump(exclude_none=True))
    messages.append({"role": "tool", "tool_call_id": call.id, "content": "18 degrees celsius and sunny"})
    final = client.chat.completions.create(model="tritium", messages=messages, tools=TOOLS, tool_choice="none",
                                           max_tokens=48, temperature=0)
    assert isinstance(final.choices[0].message.content, str) and final.choices[0].message.content
    assert final.choices[0].finish_reason in ("stop", "length") and not final.choices[0].message.tool_calls
    auto = client.chat.completions.create(model="tritium", messages=messages, tools=TOOLS, max_tokens=48,
                                          temperature=0)
    choice = auto.choices[0]
    # The reason says what happened: calls parsed <-> "tool_calls"; "length" <-> max_tokens spent; else "stop".
    assert (choice.finish_reason == "tool_calls") == bool(choice.message.tool_calls), choice
    assert (choice.finish_reason == "length") == (auto.usage.completion_tokens == 48), (choice, auto.usage)
    if choice.finish_reason != "tool_calls":
        assert choice.message.content, choice


# --- `auto` with a checkpoint whose template takes tools (Hermes format) ------------------------------------------

HERMES_CALL = (r'<tool_call>\n\{"name": "get_weather", "arguments": \{"city": "[A-Z][a-z]{2,8}", "unit": '
               r'"(celsius|fahrenheit)"\}\}\n</tool_call>')


@pytest.fixture(scope="module")
def hermes_client(tiny_llama_path: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[openai.OpenAI]:
    folder = write_hermes_model(tiny_llama_path, tmp_path_factory.mktemp("tiny-hermes"))
    repo = tmp_path_factory.mktemp("hermes-repository")
    write_model(repo, {"model": str(folder), "kv_cache_bytes": 16 << 20, "max_model_len": 1024,
                       "request_timeout_s": 120})
    served = start_serve(f"--model-repository={repo}", "--model-control=explicit", "--load-model=tritium")
    proc, base = start_openai([served.grpc], tokenizer=str(folder))
    try:
        yield openai.OpenAI(base_url=base, api_key="unused", max_retries=0, timeout=300)
    finally:
        proc.terminate()
        proc.wait(10)
        served.stop()


def test_auto_tool_calls_in_hermes_format_are_parsed(hermes_client: openai.OpenAI) -> None:
    body = {"model": "tritium", "messages": [{"role": "user", "content": "Weather in Oslo?"}], "tools": TOOLS,
            "tool_choice": "auto", "max_tokens": 100, "temperature": 1.0, "seed": 5,
            "extra_body": {"guided_regex": HERMES_CALL}}
    whole = hermes_client.chat.completions.create(**body)
    message = whole.choices[0].message
    assert message.content is None and whole.choices[0].finish_reason == "tool_calls", message
    calls = [(c.function.name, c.function.arguments) for c in message.tool_calls]
    assert [name for name, _ in calls] == ["get_weather"]
    _check_calls(calls)
    assert assembled(hermes_client, **body) == (None, calls, "tool_calls")
    plain = hermes_client.chat.completions.create(**body | {"extra_body": {"guided_regex": "[a-z]{3,10}"}})
    assert re.fullmatch("[a-z]{3,10}", plain.choices[0].message.content) and not plain.choices[0].message.tool_calls
