"""Tool calling and structured output at the OpenAI endpoint, without a server: the tool-call parsers (whole and
streamed, split anywhere), the schemas of forced calls, message conversion and chat templates with tools, the
translation of response_format / guided_* / structured_outputs, and the endpoint's answers (through the
official openai client, with the upstream replaced by canned text)."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import jsonschema
import llguidance
import openai
import pytest
from fastapi.testclient import TestClient

from tritium.backend.tokenizer import Tokenizer
from tritium.client.bench.schemas import SCHEMAS, UNSUPPORTED
from tritium.client.openai.app import create_app
from tritium.client.openai.protocol import ChatRequest, CompletionRequest, RequestError
from tritium.client.openai.tool_calls import (
    HermesParser,
    Llama3JsonParser,
    NamedCallParser,
    Parsed,
    RequiredCallsParser,
    ToolParser,
    generic_system_prompt,
    named_schema,
    parse_text,
    required_schema,
    template_messages,
    tool_format,
)

from support.canned_upstream import CannedUpstream
from support.tools import HERMES_TEMPLATE, TIME, WEATHER, assembled, write_hermes_model

# A Hermes-style chat template that takes tools (written for these tests, in the ChatML shape of the default
# model's template); test_openai_structured.py serves a tiny checkpoint with it.

NO_ARGS = {"type": "function", "function": {"name": "ping"}}




@pytest.fixture(scope="module")
def default_tok(default_model_path: Path) -> Tokenizer:
    return Tokenizer(default_model_path)


@pytest.fixture(scope="module")
def hermes_tok(default_model_path: Path, tmp_path_factory: pytest.TempPathFactory) -> Tokenizer:
    folder = write_hermes_model(default_model_path, tmp_path_factory.mktemp("hermes"),
                                ("tokenizer.json", "tokenizer_config.json"))
    return Tokenizer(folder)


# --- parsers -----------------------------------------------------------------------------------------------------


def _run(parser: ToolParser, pieces: list[str]) -> tuple[str, list[tuple[int, str | None, str | None, str]]]:
    out = Parsed()
    for piece in pieces:
        out += parser.feed(piece)
    out += parser.finish()
    return out.content, [(d.index, d.id is not None, d.name, d.arguments) for d in out.tool_calls]


def _merged(deltas: list[tuple[int, Any, Any, str]]) -> list[tuple[str | None, str]]:
    calls: dict[int, list[Any]] = {}
    for index, _, name, arguments in deltas:
        call = calls.setdefault(index, [name, ""])
        call[1] += arguments
    return [tuple(c) for _, c in sorted(calls.items())]  # type: ignore[misc]


def _every_split(make: Any, text: str) -> tuple[str, list[tuple[str | None, str]]]:
    """The result of parsing `text` whole, checked equal for the text split at every position (and fed one
    character at a time)."""
    content, deltas = _run(make(), [text])
    whole = (content, _merged(deltas))
    for cut in range(len(text) + 1):
        content, deltas = _run(make(), [text[:cut], text[cut:]])
        assert (content, _merged(deltas)) == whole, cut
        assert all(has_id == (name is not None) for _, has_id, name, _ in deltas)
    content, deltas = _run(make(), list(text))
    assert (content, _merged(deltas)) == whole
    return whole


HERMES_CASES = [
    ('Let me look.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}\n'
     '</tool_call>\n<tool_call>{"name": "get_time", "arguments": "{\\"timezone\\": \\"CET\\"}"}</tool_call>\n',
     "Let me look.", [("get_weather", '{"city":"Paris","unit":"celsius"}'), ("get_time", '{"timezone":"CET"}')]),
    ('<tool_call>{"name": "ping", "parameters": {}}</tool_call>', "", [("ping", "{}")]),
    ('<tool_call>{"name": "ping"}', "", [("ping", "{}")]),  # cut short, but whole JSON: a call
    ("A plain answer, with a < sign and <tool ending.  \n", "A plain answer, with a < sign and <tool ending.  \n", []),
    ('Before <tool_call>{not json}</tool_call> after', "Before <tool_call>{not json}</tool_call> after", []),
    ('x <tool_call>{"name": "f", "arguments": [1]}</tool_call>', 'x <tool_call>{"name": "f", "arguments": [1]}'
     "</tool_call>", []),
    ('Cut <tool_call>{"name": "get_weather", "argu', 'Cut <tool_call>{"name": "get_weather", "argu', []),
    ('<tool_call>{"name": "ping", "arguments": {}}</tool_call> and text after', "and text after", [("ping", "{}")]),
    # The text around a call is content, separated by the whitespace before the call (else after it).
    ('a <tool_call>{"name": "f", "arguments": {}}</tool_call> b', "a b", [("f", "{}")]),
    ('a<tool_call>{"name": "f", "arguments": {}}</tool_call>\nb', "a\nb", [("f", "{}")]),
    ('a\n<tool_call>{"name": "f", "arguments": {}}</tool_call> <tool_call>{"name": "g", "arguments": {}}'
     '</tool_call>\n\nb c  ', "a\nb c", [("f", "{}"), ("g", "{}")]),
]


@pytest.mark.parametrize(("text", "content", "calls"), HERMES_CASES)
def test_hermes_parser_same_result_however_the_text_is_split(text: str, content: str, calls: list) -> None:
    assert _every_split(HermesParser, text) == (content, calls)
    whole_content, whole_calls = parse_text(HermesParser(), text)
    assert whole_content == (content or None)
    assert [(c.name, c.arguments) for c in whole_calls] == calls
    assert all(c.id.startswith("call_") and len(c.id) == 29 for c in whole_calls)


def test_hermes_parser_streams_text_before_a_call_and_holds_a_possible_tag() -> None:
    parser = HermesParser()
    assert parser.feed("Sure, I will check <tool").content == "Sure, I will check"
    assert parser.feed("_call>").content == ""
    parsed = parser.feed('{"name": "ping", "arguments": {}}</tool_call>')
    assert parsed.content == "" and [(d.name, d.arguments) for d in parsed.tool_calls] == [("ping", "{}")]
    assert parser.finish() == Parsed()


LLAMA3_CASES = [
    ('<|python_tag|>{"name": "get_weather", "parameters": {"city": "Paris", "unit": "celsius"}}', "",
     [("get_weather", '{"city":"Paris","unit":"celsius"}')]),
    (' {"name": "get_time", "parameters": {"timezone": "UTC"}}; {"name": "ping", "parameters": {}}', "",
     [("get_time", '{"timezone":"UTC"}'), ("ping", "{}")]),
    ('{"name": "ping", "arguments": {}}', "", [("ping", "{}")]),
    ('{"answer": 42}', '{"answer": 42}', []),
    ('{"name": "ping", "parameters": {}} and more', '{"name": "ping", "parameters": {}} and more', []),
    ("The weather is fine. {\"name\": 1}", "The weather is fine. {\"name\": 1}", []),
    ("<|python", "<|python", []),
]


@pytest.mark.parametrize(("text", "content", "calls"), LLAMA3_CASES)
def test_llama3_json_parser_same_result_however_the_text_is_split(text: str, content: str, calls: list) -> None:
    assert _every_split(Llama3JsonParser, text) == (content, calls)


def test_llama3_json_parser_streams_plain_text_at_once() -> None:
    parser = Llama3JsonParser()
    assert parser.feed("  ").content == ""
    assert parser.feed("Hello").content == "  Hello"
    assert parser.feed(" world").content == " world"


REQUIRED_CASES = [
    ('[{"name":"get_weather","arguments":{"city":"a]}\\"{","unit":"celsius"}},{"name":"ping","arguments":{}}]', "",
     [("get_weather", '{"city":"a]}\\"{","unit":"celsius"}'), ("ping", "{}")]),
    ('[ {"name": "ping", "arguments": {}} ]', "", [("ping", "{}")]),
    ('[{"name":"ping","arguments":{}},{"name":"get_time","arguments":{"timezone":"Europe/Par',
     '{"name":"get_time","arguments":{"timezone":"Europe/Par', [("ping", "{}")]),
]


@pytest.mark.parametrize(("text", "content", "calls"), REQUIRED_CASES)
def test_required_calls_parser_same_result_however_the_text_is_split(text: str, content: str, calls: list) -> None:
    assert _every_split(RequiredCallsParser, text) == (content, calls)


def test_required_calls_parser_gives_each_call_when_its_object_closes() -> None:
    parser = RequiredCallsParser()
    assert parser.feed('[{"name":"ping","arguments":{}').tool_calls == []
    assert [d.name for d in parser.feed('},{"name":"ping"').tool_calls] == ["ping"]


def test_named_call_parser_streams_the_arguments() -> None:
    assert _every_split(lambda: NamedCallParser("get_time"), '{"timezone":"UTC"}') == (
        "", [("get_time", '{"timezone":"UTC"}')])
    parser = NamedCallParser("ping")
    first = parser.feed("")
    assert first.tool_calls[0].name == "ping" and first.tool_calls[0].id
    assert parser.feed("{").tool_calls[0].arguments == "{" and parser.feed("}").tool_calls[0].name is None
    assert parse_text(NamedCallParser("ping"), "")[1][0].arguments == ""


# --- schemas of forced calls -------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def ll_tokenizer(default_model_path: Path) -> llguidance.LLTokenizer:
    return llguidance.LLTokenizer((default_model_path / "tokenizer.json").read_text(), eos_token=2)


def _compiles(schema: dict[str, Any], tok: llguidance.LLTokenizer) -> str:
    return llguidance.LLMatcher.validate_grammar(llguidance.LLMatcher.grammar_from_json_schema(schema), tok)


def test_required_schema_takes_calls_of_the_tools_only(ll_tokenizer: llguidance.LLTokenizer) -> None:
    schema = required_schema([WEATHER, TIME, NO_ARGS], parallel=True)
    assert _compiles(schema, ll_tokenizer) == ""
    good = [{"name": "get_weather", "arguments": {"city": "Oslo", "unit": "celsius"}},
            {"name": "ping", "arguments": {}}]
    jsonschema.validate(good, schema)
    for bad in ([], [{"name": "get_weather", "arguments": {"timezone": "UTC"}}],
                [{"name": "nope", "arguments": {}}], [{"name": "ping", "arguments": {}, "extra": 1}]):
        with pytest.raises(jsonschema.ValidationError):
            jsonschema.validate(bad, schema)
    single = required_schema([WEATHER], parallel=False)
    assert single["maxItems"] == 1 and single["items"]["properties"]["name"] == {"const": "get_weather"}
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate([{"name": "get_weather", "arguments": {"city": "a", "unit": "celsius"}}] * 2, single)


def test_named_schema_is_the_functions_parameters(ll_tokenizer: llguidance.LLTokenizer) -> None:
    assert named_schema(WEATHER) == WEATHER["function"]["parameters"]
    assert named_schema(NO_ARGS) == {"type": "object", "properties": {}, "additionalProperties": False}
    assert _compiles(named_schema(NO_ARGS), ll_tokenizer) == ""


def test_sample_schemas_compile_and_unsupported_ones_are_refused_naming_the_keyword(
        ll_tokenizer: llguidance.LLTokenizer) -> None:
    assert len(SCHEMAS) == 20 and len({name for name, _ in SCHEMAS}) == 20
    for name, schema in SCHEMAS:
        jsonschema.Draft202012Validator.check_schema(schema)
        assert _compiles(schema, ll_tokenizer) == "", name
    for name, schema, keyword in UNSUPPORTED:
        error = _compiles(schema, ll_tokenizer)
        assert f'"{keyword}"' in error, (name, error)


# --- messages and templates --------------------------------------------------------------------------------------

CONVERSATION = [
    {"role": "user", "content": "Weather in Paris?"},
    {"role": "assistant", "content": None, "tool_calls": [
        {"id": "call_1", "type": "function",
         "function": {"name": "get_weather", "arguments": '{"city": "Paris", "unit": "celsius"}'}},
        {"id": "call_2", "type": "function", "function": {"name": "get_time", "arguments": '{"timezone": "CET"}'}}]},
    {"role": "tool", "tool_call_id": "call_1", "content": "18 C, sunny"},
    {"role": "tool", "tool_call_id": "call_2", "content": "14:05"},
]


def test_generic_messages_show_calls_and_results_as_text_and_add_the_tool_prompt() -> None:
    out = template_messages(CONVERSATION, generic=True, tools=[WEATHER, TIME])
    assert [m["role"] for m in out] == ["system", "user", "assistant", "user"]
    assert out[0]["content"] == generic_system_prompt([WEATHER, TIME])
    assert '"name": "get_weather"' in out[0]["content"] and "<tool_call>" in out[0]["content"]
    assert out[2]["content"] == ('<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "unit": '
                                 '"celsius"}}\n</tool_call>\n<tool_call>\n{"name": "get_time", "arguments": '
                                 '{"timezone": "CET"}}\n</tool_call>')
    assert out[3]["content"] == ("<tool_response>\n18 C, sunny\n</tool_response>\n"
                                 "<tool_response>\n14:05\n</tool_response>")
    with_system = template_messages([{"role": "system", "content": "Be brief."}, *CONVERSATION[:1]], True, [TIME])
    assert with_system[0]["content"] == generic_system_prompt([TIME]) + "\n\nBe brief."
    assert template_messages(CONVERSATION[:1], generic=True) == CONVERSATION[:1]
    assert CONVERSATION[1]["content"] is None  # the input is not changed


def test_messages_for_a_template_with_tools_get_arguments_as_objects() -> None:
    out = template_messages(CONVERSATION, generic=False)
    assert out[1]["tool_calls"][0]["function"]["arguments"] == {"city": "Paris", "unit": "celsius"}
    assert out[1]["content"] is None and out[2] == CONVERSATION[2]
    odd = [{"role": "assistant", "content": "", "tool_calls": [
        {"id": "c", "type": "function", "function": {"name": "f", "arguments": "[1, 2"}}]}]
    assert template_messages(odd, generic=False)[0]["tool_calls"][0]["function"]["arguments"] == "[1, 2"


def test_default_template_renders_a_tool_conversation_as_text(default_tok: Tokenizer) -> None:
    assert not default_tok.supports_tools
    assert tool_format(default_tok.chat_template, default_tok.supports_tools) == "generic"
    prompt = default_tok.apply_chat_template(template_messages(CONVERSATION, generic=True, tools=[WEATHER]))
    assert prompt.startswith("<|im_start|>system\nYou may call one or more functions")
    assert "<|im_start|>assistant\n<tool_call>\n{\"name\": \"get_weather\"" in prompt
    assert "<|im_start|>user\n<tool_response>\n18 C, sunny\n</tool_response>" in prompt
    assert prompt.endswith("<|im_start|>assistant\n")


def test_hermes_template_gets_the_tools_and_object_arguments(hermes_tok: Tokenizer, default_model_path: Path) -> None:
    assert hermes_tok.supports_tools
    assert tool_format(hermes_tok.chat_template, hermes_tok.supports_tools) == "hermes"
    messages = template_messages(CONVERSATION, generic=False)
    prompt = hermes_tok.apply_chat_template(messages, tools=[WEATHER])
    assert '<tools>\n{"type": "function", "function": {"name": "get_weather"' in prompt
    assert '{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}' in prompt  # not a string
    assert "<tool_response>\n14:05\n</tool_response>" in prompt
    from transformers import AutoTokenizer  # the same text as transformers renders

    theirs = AutoTokenizer.from_pretrained(default_model_path)
    theirs.chat_template = HERMES_TEMPLATE
    assert prompt == theirs.apply_chat_template(messages, tools=[WEATHER], tokenize=False, add_generation_prompt=True)
    plain = [{"role": "user", "content": "Hi <b> & 'you'"}]
    expected = "<|im_start|>user\nHi <b> & 'you'<|im_end|>\n<|im_start|>assistant\n"
    assert hermes_tok.apply_chat_template(plain) == expected


def test_tool_format_follows_the_template() -> None:
    assert tool_format("{{ '<|python_tag|>' }}{{ tools }}", True) == "llama3_json"
    assert tool_format("Environment: ipython {{ tools }}", True) == "llama3_json"
    assert tool_format("<tool_call> {{ tools }}", True) == "hermes"
    assert tool_format("{{ messages }}", False) == "generic"


# --- request translation -----------------------------------------------------------------------------------------


def _completion(**fields: Any) -> CompletionRequest:
    return CompletionRequest(model="m", prompt="p", **fields)


def _chat(**fields: Any) -> ChatRequest:
    return ChatRequest(model="m", messages=[{"role": "user", "content": "hi"}], **fields)


SCHEMA = {"type": "object", "properties": {"a": {"type": "integer"}}}


@pytest.mark.parametrize(("fields", "expected"), [
    ({}, None),
    ({"response_format": {"type": "text"}}, None),
    ({"response_format": {"type": "json_object"}}, {"json_object": True}),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": SCHEMA, "strict": True}}},
     {"json": SCHEMA}),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}}, {"json_object": True}),
    ({"guided_json": SCHEMA, "guided_whitespace_pattern": " ?"}, {"json": SCHEMA, "whitespace_pattern": " ?"}),
    ({"guided_json": json.dumps(SCHEMA), "guided_decoding_backend": "xgrammar"}, {"json": SCHEMA}),
    ({"guided_regex": "[ab]+"}, {"regex": "[ab]+"}),
    ({"guided_choice": ["yes", "no"]}, {"choice": ["yes", "no"]}),
    ({"guided_grammar": 'start: "a"'}, {"grammar": 'start: "a"'}),
    ({"guided_whitespace_pattern": " "}, None),
    ({"structured_outputs": {"json": SCHEMA, "disable_any_whitespace": True, "backend": "guidance"}},
     {"json": SCHEMA, "disable_any_whitespace": True}),
    ({"structured_outputs": {"json_object": True, "json": None}}, {"json_object": True}),
    ({"structured_outputs": {"choice": ["a"], "json_object": False}}, {"choice": ["a"]}),
    ({"structured_outputs": {"regex": "x", "whitespace_pattern": " "}}, {"regex": "x", "whitespace_pattern": " "}),
])
def test_output_constraints_become_the_engines_structured_output(fields: dict, expected: Any) -> None:
    assert _completion(**fields).structured_output() == expected
    assert _chat(**fields).structured_output() == expected


@pytest.mark.parametrize(("fields", "names"), [
    ({"response_format": {"type": "json_object"}, "guided_regex": "a"}, ["response_format", "guided_regex"]),
    ({"guided_json": SCHEMA, "guided_choice": ["a"]}, ["guided_json", "guided_choice"]),
    ({"structured_outputs": {"json": SCHEMA, "regex": "a"}}, ["structured_outputs.json", "structured_outputs.regex"]),
    ({"guided_grammar": "x", "structured_outputs": {"regex": "a"}}, ["guided_grammar", "structured_outputs.regex"]),
    ({"structured_outputs": {}}, ["structured_outputs"]),
    ({"guided_json": "[1, 2]"}, ["guided_json"]),
    ({"guided_json": "{not json"}, ["guided_json"]),
    ({"guided_json": "[" * 100_000}, ["guided_json"]),
    ({"structured_outputs": {"json": "3"}}, ["structured_outputs.json"]),
    ({"response_format": {"type": "json_schema"}}, ["response_format.json_schema"]),
])
def test_conflicting_or_bad_constraints_are_refused_naming_the_fields(fields: dict, names: list[str]) -> None:
    with pytest.raises(RequestError) as err:
        _completion(**fields).structured_output()
    assert all(name in err.value.message for name in names), err.value.message
    assert err.value.param == names[0]


@pytest.mark.parametrize(("fields", "mode"), [
    ({}, "none"),
    ({"tools": [WEATHER]}, "auto"),
    ({"tools": [WEATHER], "tool_choice": "none"}, "none"),
    ({"tool_choice": "auto"}, "none"),
    ({"tools": [WEATHER], "tool_choice": "required"}, "required"),
    ({"tools": [WEATHER, TIME], "tool_choice": {"type": "function", "function": {"name": "get_time"}}}, "named"),
    ({"tools": [WEATHER], "guided_regex": "<tool_call>.*"}, "auto"),
])
def test_tool_mode(fields: dict, mode: str) -> None:
    assert _chat(**fields).tool_mode() == mode


@pytest.mark.parametrize(("fields", "names"), [
    ({"tool_choice": "required"}, ["tool_choice", "tools"]),
    ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "nope"}}},
     ["tool_choice.function.name", "'nope'"]),
    ({"tools": [WEATHER], "tool_choice": "required", "response_format": {"type": "json_object"}},
     ["tool_choice", "response_format"]),
    ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "get_weather"}},
      "guided_json": SCHEMA}, ["tool_choice", "guided_json"]),
])
def test_tool_choices_that_cannot_be_honoured_are_refused(fields: dict, names: list[str]) -> None:
    with pytest.raises(RequestError) as err:
        _chat(**fields).tool_mode()
    assert all(name in err.value.message for name in names), err.value.message


# --- the endpoint, with canned model output ---------------------------------------------------------------------


@pytest.fixture(scope="module")
def canned(default_tok: Tokenizer) -> Iterator[tuple[openai.OpenAI, CannedUpstream]]:
    app = create_app(["127.0.0.1:1"], tokenizer=default_tok)
    upstream = CannedUpstream()
    app.state.router.generate = upstream.generate
    with TestClient(app) as http:
        yield openai.OpenAI(base_url="http://testserver/v1", api_key="x", http_client=http, max_retries=0), upstream






def _ask(client: openai.OpenAI, upstream: CannedUpstream, pieces: list[str], **fields: Any) -> tuple[Any, Any]:
    upstream.pieces = pieces
    body = {"model": "tritium", "messages": [{"role": "user", "content": "Weather in Paris?"}]} | fields
    return client.chat.completions.create(**body), assembled(client, **body)


def test_auto_tool_calls_are_parsed_from_the_generic_format(canned: tuple[openai.OpenAI, CannedUpstream]) -> None:
    client, upstream = canned
    pieces = ["Checking.\n<tool", '_call>\n{"name": "get_weather", "arguments": {"city": "Paris", ',
              '"unit": "celsius"}}\n</tool_call>']
    whole, streamed = _ask(client, upstream, pieces, tools=[WEATHER])
    message = whole.choices[0].message
    assert message.content == "Checking." and whole.choices[0].finish_reason == "tool_calls"
    assert [(c.function.name, json.loads(c.function.arguments)) for c in message.tool_calls] == [
        ("get_weather", {"city": "Paris", "unit": "celsius"})]
    assert message.tool_calls[0].id.startswith("call_") and message.tool_calls[0].type == "function"
    assert streamed == ("Checking.", [("get_weather", message.tool_calls[0].function.arguments)], "tool_calls")
    prompt, sampling = upstream.sent[-1]
    assert prompt.startswith("<|im_start|>system\nYou may call one or more functions")
    assert "structured_output" not in sampling


def test_text_that_is_no_tool_call_stays_content(canned: tuple[openai.OpenAI, CannedUpstream]) -> None:
    client, upstream = canned
    pieces = ["I would <tool_call>", "{broken</tool_call> rather", " not."]
    whole, streamed = _ask(client, upstream, pieces, tools=[WEATHER])
    assert whole.choices[0].message.content == "".join(pieces) and whole.choices[0].message.tool_calls is None
    assert whole.choices[0].finish_reason == "stop"
    assert streamed == ("".join(pieces), [], "stop")
    whole, streamed = _ask(client, upstream, pieces, tools=[WEATHER], tool_choice="none")
    assert whole.choices[0].message.content == "".join(pieces)
    assert not upstream.sent[-1][0].startswith("<|im_start|>system\nYou may call")  # none: no tool prompt


def test_an_empty_reply_is_empty_content(canned: tuple[openai.OpenAI, CannedUpstream]) -> None:
    client, upstream = canned
    whole, streamed = _ask(client, upstream, ["", " "], tools=[WEATHER])
    assert whole.choices[0].message.content == " " and streamed == (" ", [], "stop")
    whole, streamed = _ask(client, upstream, [""], tools=[WEATHER])
    assert whole.choices[0].message.content == "" and streamed == ("", [], "stop")


def test_required_and_named_tool_choice_are_enforced_by_a_schema(canned: tuple[openai.OpenAI, CannedUpstream]) -> None:
    client, upstream = canned
    output = ["[", '{"name":"get_time","arguments":{"timezone":"UTC"}},', '{"name":"ping","arguments":{}}]']
    whole, streamed = _ask(client, upstream, output, tools=[WEATHER, TIME, NO_ARGS], tool_choice="required",
                           parallel_tool_calls=False)
    assert upstream.sent[-1][1]["structured_output"] == {"json": required_schema([WEATHER, TIME, NO_ARGS], False)}
    calls = [(c.function.name, c.function.arguments) for c in whole.choices[0].message.tool_calls]
    assert calls == [("get_time", '{"timezone":"UTC"}'), ("ping", "{}")]
    assert whole.choices[0].message.content is None and whole.choices[0].finish_reason == "tool_calls"
    assert streamed == (None, calls, "tool_calls")
    named = {"type": "function", "function": {"name": "get_weather"}}
    whole, streamed = _ask(client, upstream, ['{"city":', '"Oslo","unit":"celsius"}'], tools=[WEATHER, TIME],
                           tool_choice=named)
    assert upstream.sent[-1][1]["structured_output"] == {"json": WEATHER["function"]["parameters"]}
    call = whole.choices[0].message.tool_calls[0]
    assert (call.function.name, call.function.arguments) == ("get_weather", '{"city":"Oslo","unit":"celsius"}')
    assert streamed == (None, [("get_weather", '{"city":"Oslo","unit":"celsius"}')], "tool_calls")


def test_a_tool_round_trip_is_rendered_for_the_model(canned: tuple[openai.OpenAI, CannedUpstream]) -> None:
    client, upstream = canned
    upstream.pieces = ["It is 18 C and sunny."]
    messages = [{"role": "system", "content": [{"type": "text", "text": "Be brief."}]}, *CONVERSATION[:3],
                {"role": "user", "content": [{"type": "text", "text": "Thanks."}, {"type": "text", "text": "So?"}]}]
    out = client.chat.completions.create(model="tritium", messages=messages, tools=[WEATHER, TIME])
    assert out.choices[0].message.content == "It is 18 C and sunny." and out.choices[0].finish_reason == "stop"
    prompt = upstream.sent[-1][0]
    assert "</tools>\n" in prompt and "\n\nBe brief.<|im_end|>" in prompt
    assert "<tool_response>\n18 C, sunny\n</tool_response>" in prompt and "Thanks.\nSo?<|im_end|>" in prompt


def test_response_format_reaches_the_engine(canned: tuple[openai.OpenAI, CannedUpstream]) -> None:
    client, upstream = canned
    upstream.pieces = ['{"a":', "1}"]
    fmt = {"type": "json_schema", "json_schema": {"name": "a", "schema": SCHEMA}}
    out = client.chat.completions.create(model="tritium", messages=[{"role": "user", "content": "hi"}],
                                         response_format=fmt)
    assert out.choices[0].message.content == '{"a":1}'
    assert upstream.sent[-1][1]["structured_output"] == {"json": SCHEMA}
    text = "".join(c.choices[0].text for c in client.completions.create(
        model="tritium", prompt="x", stream=True, extra_body={"guided_regex": "[a-z]+"}))
    assert text == '{"a":1}' and upstream.sent[-1][1]["structured_output"] == {"regex": "[a-z]+"}


def _post(client: openai.OpenAI, path: str, body: dict[str, Any]) -> Any:
    return client._client.post(f"{client.base_url}{path}", json=body)  # type: ignore[attr-defined]


CHAT = {"model": "tritium", "messages": [{"role": "user", "content": "hi"}]}


@pytest.mark.parametrize(("path", "body", "names"), [
    ("chat/completions", CHAT | {"tool_choice": "sometimes"}, "tool_choice"),
    ("chat/completions", CHAT | {"tools": [WEATHER], "tool_choice": {"type": "function", "function": {}}},
     "tool_choice.function.name"),
    ("chat/completions", CHAT | {"tools": [{"type": "function", "function": {"name": "get weather"}}]},
     "tools.0.function.name"),
    ("chat/completions", CHAT | {"tools": [WEATHER, WEATHER]}, "get_weather"),
    ("chat/completions", CHAT | {"tools": [{"type": "retrieval"}]}, "tools.0.type"),
    ("chat/completions", CHAT | {"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "x"}}},
     "tool_choice.function.name"),
    ("chat/completions", CHAT | {"tool_choice": "required"}, "tools"),
    ("chat/completions", CHAT | {"tools": [WEATHER], "tool_choice": "required", "guided_choice": ["a"]},
     "guided_choice"),
    ("chat/completions", CHAT | {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]},
     "messages.0.content.0.type"),
    ("chat/completions", CHAT | {"messages": [{"role": "user", "content": None}]}, "messages.0"),
    ("chat/completions", CHAT | {"messages": [{"role": "assistant", "content": None, "tool_calls": [{"id": "c"}]}]},
     "messages.0.tool_calls.0.function"),
    ("chat/completions", CHAT | {"messages": [{"role": "user", "content": "hi", "tool_calls": {"a": 1}}]},
     "messages.0.tool_calls"),
    ("chat/completions", CHAT | {"response_format": {"type": "xml"}}, "response_format.type"),
    ("chat/completions", CHAT | {"response_format": {"type": "json_schema", "json_schema": {"schema": {}}}},
     "response_format.json_schema.name"),
    ("completions", {"model": "tritium", "prompt": "x", "guided_json": 3}, "guided_json"),
    ("completions", {"model": "tritium", "prompt": "x", "guided_choice": []}, "guided_choice"),
    ("completions", {"model": "tritium", "prompt": "x", "structured_outputs": {"regex": "a", "foo": 1}},
     "structured_outputs.foo"),
    ("completions", {"model": "tritium", "prompt": "x", "guided_regex": "a", "guided_grammar": "b"},
     "guided_regex and guided_grammar"),
    ("completions", {"model": "tritium", "prompt": "x", "tools": [WEATHER]}, "tools"),
])
def test_bad_tool_and_format_fields_are_a_400_naming_the_field(
        canned: tuple[openai.OpenAI, CannedUpstream], path: str, body: dict[str, Any], names: str) -> None:
    client, upstream = canned
    sent = len(upstream.sent)
    resp = _post(client, path, body)
    assert resp.status_code == 400, resp.text
    message = resp.json()["error"]["message"]
    assert names in message, message
    assert "Traceback" not in message and "[" not in message.split(":")[0]  # no union member in the field's name
    assert len(upstream.sent) == sent
