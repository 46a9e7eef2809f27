"""Reasoning parsers at the OpenAI endpoint, without a server: the deepseek_r1 and qwen3 splits of a thinking
model's text (whole, and fed in pieces split at every position), the registry and `--reasoning-parser`, and the
endpoint's answers through the official openai client with the upstream replaced by canned text: reasoning
fields whole and streamed, `reasoning_tokens`, tool calls read from the answer only, structured output."""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import openai
import pytest
from fastapi.testclient import TestClient

from tritium.backend.tokenizer import Tokenizer
from tritium.client.cli.main import build_parser
from tritium.client.openai.app import create_app
from tritium.client.openai.reasoning import (
    REASONING_PARSERS,
    DeepSeekR1ReasoningParser,
    Qwen3ReasoningParser,
    reasoning_parser,
    split_reasoning,
)

from support.canned_upstream import CannedUpstream
from support.tools import WEATHER, assembled

# --- the parsers -------------------------------------------------------------------------------------------------

CASES = [
    # deepseek_r1: everything before </think> is reasoning, <think> or not
    ("deepseek_r1", "<think>\nLet me see.\n</think>\n\nParis.", "\nLet me see.\n", "\n\nParis."),
    ("deepseek_r1", "Let me see.</think>Paris.", "Let me see.", "Paris."),
    ("deepseek_r1", " \n<think>x</think>y </think> z <think>", "x", "y </think> z <think>"),
    ("deepseek_r1", "a < b </thin k <think></think>ok", "a < b </thin k <think>", "ok"),
    ("deepseek_r1", "Thinking, cut short by max_tokens", "Thinking, cut short by max_tokens", None),
    ("deepseek_r1", "<think>cut short", "cut short", None),
    ("deepseek_r1", "Thought it through.</think>", "Thought it through.", None),
    ("deepseek_r1", "</think>Straight to it.", None, "Straight to it."),
    ("deepseek_r1", "<thi", "<thi", None),
    ("deepseek_r1", "", None, None),
    # qwen3: reasoning only inside <think>...</think> at the start
    ("qwen3", "<think>\nHmm, 2+2.\n</think>\n\n4", "\nHmm, 2+2.\n", "\n\n4"),
    ("qwen3", "\n<think></think>\nAnswer <think>x</think>", None, "\nAnswer <think>x</think>"),
    ("qwen3", "Hello there, no thinking here.", None, "Hello there, no thinking here."),
    ("qwen3", "Hmm</think>Hello", None, "Hmm</think>Hello"),
    ("qwen3", "<think>cut off by max_tokens", "cut off by max_tokens", None),
    ("qwen3", "<think>all done</think>", "all done", None),
    ("qwen3", " <thin", None, " <thin"),
    ("qwen3", "  ", None, "  "),
    ("qwen3", "", None, ""),
]


def _pieces(name: str, pieces: list[str]) -> tuple[str, str, bool]:
    """(reasoning, content, opened) of `pieces` fed one by one to a fresh parser, then finish."""
    parser = REASONING_PARSERS[name]()
    reasoning = content = ""
    for piece in pieces:
        delta = parser.feed(piece)
        reasoning, content = reasoning + delta.reasoning, content + delta.content
    delta = parser.finish()
    return reasoning + delta.reasoning, content + delta.content, parser.opened


@pytest.mark.parametrize(("name", "text", "reasoning", "content"), CASES)
def test_whole_text_split(name: str, text: str, reasoning: str | None, content: str | None) -> None:
    assert split_reasoning(REASONING_PARSERS[name](), text) == (reasoning, content)


@pytest.mark.parametrize(("name", "text", "reasoning", "content"), CASES)
def test_same_split_however_the_text_is_cut(name: str, text: str, reasoning: str | None, content: str | None) -> None:
    whole = _pieces(name, [text])
    assert (whole[0] or None, whole[1] or (None if whole[2] else whole[1])) == (reasoning, content)
    for i in range(len(text) + 1):
        assert _pieces(name, [text[:i], text[i:]]) == whole, i
        for j in range(i, len(text) + 1):
            assert _pieces(name, [text[:i], text[i:j], text[j:]]) == whole, (i, j)
    assert _pieces(name, list(text)) == whole


def test_only_a_possible_marker_is_held_back() -> None:
    r1 = DeepSeekR1ReasoningParser()
    assert r1.feed("Let me think <") == ("Let me think ", "")
    assert r1.feed("/thi") == ("", "")
    assert r1.feed("s over") == ("</this over", "")
    assert r1.feed("</think>\n\nIt is") == ("", "\n\nIt is")
    assert r1.feed(" <think>") == ("", " <think>")  # after the block: all content
    assert r1.finish() == ("", "")
    qwen = Qwen3ReasoningParser()
    assert qwen.feed("\n") == ("", "") and qwen.feed("<thi") == ("", "")  # may still open a block
    assert qwen.feed("nk>A") == ("A", "") and qwen.opened
    plain = Qwen3ReasoningParser()
    assert plain.feed("\nHi") == ("", "\nHi") and not plain.opened  # decided at once: content as it comes
    assert plain.feed("</think>") == ("", "</think>")


def test_registry_and_cli_option() -> None:
    assert reasoning_parser("deepseek_r1") is DeepSeekR1ReasoningParser
    assert reasoning_parser("qwen3") is Qwen3ReasoningParser
    with pytest.raises(ValueError, match="deepseek_r1, qwen3"):
        reasoning_parser("granite")
    cli = build_parser()
    base = ["openai", "--upstream", "127.0.0.1:8001"]
    assert cli.parse_args(base).reasoning_parser is None
    assert cli.parse_args([*base, "--reasoning-parser", "qwen3"]).reasoning_parser == "qwen3"
    with pytest.raises(SystemExit):
        cli.parse_args([*base, "--reasoning-parser", "granite"])


# --- the endpoint, with canned model output ----------------------------------------------------------------------


Endpoint = tuple[openai.OpenAI, CannedUpstream]


@pytest.fixture(scope="module")
def tok(default_model_path: Path) -> Tokenizer:
    return Tokenizer(default_model_path)


@pytest.fixture(scope="module")
def endpoints(tok: Tokenizer) -> Iterator[Callable[[str | None], Endpoint]]:
    """An endpoint per reasoning parser (None: without one), made on first use."""
    made: dict[str | None, Endpoint] = {}
    clients: list[TestClient] = []

    def get(name: str | None) -> Endpoint:
        if name not in made:
            app = create_app(["127.0.0.1:1"], tokenizer=tok, reasoning_parser=name)
            upstream = CannedUpstream()
            app.state.router.generate = upstream.generate
            http = TestClient(app)
            http.__enter__()
            clients.append(http)
            made[name] = (openai.OpenAI(base_url="http://testserver/v1", api_key="x", http_client=http,
                                        max_retries=0), upstream)
        return made[name]

    yield get
    for http in clients:
        http.__exit__(None, None, None)


BODY = {"model": "tritium", "messages": [{"role": "user", "content": "Capital of France?"}]}


def _events(client: openai.OpenAI, body: dict[str, Any]) -> list[dict[str, Any]]:
    """The JSON events of a streamed chat completion, as sent."""
    resp = client._client.post(f"{client.base_url}chat/completions",  # type: ignore[attr-defined]
                               json=body | {"stream": True})
    assert resp.status_code == 200, resp.text
    lines = [line.removeprefix("data: ") for line in resp.text.split("\n\n") if line]
    assert lines[-1] == "[DONE]"
    return [json.loads(line) for line in lines[:-1]]


def _streamed(events: list[dict[str, Any]]) -> tuple[str | None, str | None, dict[str, Any] | None]:
    """(reasoning, content, usage) that a stream's deltas add up to; every delta carries something."""
    reasoning = content = None
    for event in events:
        for choice in event["choices"]:
            delta = choice["delta"]
            assert delta.get("reasoning_content") == delta.get("reasoning")
            if "reasoning_content" in delta:
                assert delta["reasoning_content"]
                reasoning = (reasoning or "") + delta["reasoning_content"]
            if "content" in delta:
                content = (content or "") + delta["content"]
            shown = {k: v for k, v in delta.items() if k != "role"}
            assert shown or "role" in delta or choice["finish_reason"], event  # no empty deltas
    return reasoning, content, events[-1].get("usage")


def _count(tok: Tokenizer, text: str | None) -> int:
    return len(tok.encode(text, add_special_tokens=False)) if text else 0


R1_PIECES = ["<thi", "nk>\nThe user asks", " for France's capital. It is Paris.\n</th", "ink>\n\nThe capital ",
             "is Paris."]


def test_reasoning_is_split_out_whole_and_streamed(endpoints: Callable[[str | None], Endpoint],
                                                   tok: Tokenizer) -> None:
    client, upstream = endpoints("deepseek_r1")
    upstream.pieces = R1_PIECES
    reasoning, content = "\nThe user asks for France's capital. It is Paris.\n", "\n\nThe capital is Paris."
    whole = client.chat.completions.create(**BODY)
    message = whole.choices[0].message
    assert (message.reasoning_content, message.reasoning, message.content) == (reasoning, reasoning, content)
    assert whole.choices[0].finish_reason == "stop"
    assert whole.usage.completion_tokens_details.reasoning_tokens == _count(tok, reasoning) > 0
    assert whole.usage.completion_tokens == len(R1_PIECES)
    events = _events(client, BODY | {"stream_options": {"include_usage": True}})
    streamed_reasoning, streamed_content, usage = _streamed(events)
    assert (streamed_reasoning, streamed_content) == (reasoning, content)
    assert usage is not None and usage["completion_tokens_details"] == {"reasoning_tokens": _count(tok, reasoning)}
    # the official client's stream helper adds the deltas up to the same message
    with client.chat.completions.stream(**BODY) as stream:
        final = stream.get_final_completion().choices[0].message
    assert (final.content, final.reasoning_content) == (content, reasoning)


def test_r1_without_a_start_marker_and_cut_off_reasoning(endpoints: Callable[[str | None], Endpoint],
                                                        tok: Tokenizer) -> None:
    client, upstream = endpoints("deepseek_r1")
    upstream.pieces = ["Okay, France", ".</think>", "Paris."]
    message = client.chat.completions.create(**BODY).choices[0].message
    assert (message.reasoning_content, message.content) == ("Okay, France.", "Paris.")
    assert _streamed(_events(client, BODY))[:2] == ("Okay, France.", "Paris.")
    upstream.pieces = ["Still thinking about", " it when max_tokens ran out <"]
    whole = client.chat.completions.create(**BODY)
    thought = "Still thinking about it when max_tokens ran out <"
    assert (whole.choices[0].message.reasoning_content, whole.choices[0].message.content) == (thought, None)
    assert whole.usage.completion_tokens_details.reasoning_tokens == _count(tok, thought)
    assert _streamed(_events(client, BODY))[:2] == (thought, None)


def test_qwen3_text_without_markers_is_all_content(endpoints: Callable[[str | None], Endpoint]) -> None:
    client, upstream = endpoints("qwen3")
    upstream.pieces = ["Paris", " is the capital. </think> stays."]
    whole = client.chat.completions.create(**BODY)
    message = whole.choices[0].message
    assert (message.reasoning_content, message.reasoning) == (None, None)
    assert message.content == "Paris is the capital. </think> stays."
    assert whole.usage.completion_tokens_details.reasoning_tokens == 0
    events = _events(client, BODY | {"stream_options": {"include_usage": True}})
    assert _streamed(events) == (None, message.content, whole.usage.model_dump(exclude_none=True))
    upstream.pieces = ["<think>", "\nA cut-off thought"]
    message = client.chat.completions.create(**BODY).choices[0].message
    assert (message.reasoning_content, message.content) == ("\nA cut-off thought", None)
    assert _streamed(_events(client, BODY))[:2] == ("\nA cut-off thought", None)


def test_tool_calls_are_read_from_the_answer_only(endpoints: Callable[[str | None], Endpoint]) -> None:
    client, upstream = endpoints("deepseek_r1")
    mention = '<tool_call>{"name": "get_weather", "arguments": {"city": "Rome", "unit": "celsius"}}</tool_call>'
    upstream.pieces = [f"Maybe {mention[:20]}", f"{mention[20:]}? No: Paris.</thi", "nk>\n\n<tool_call>\n",
                       '{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}\n</tool_call>']
    body = BODY | {"tools": [WEATHER]}
    whole = client.chat.completions.create(**body)
    message = whole.choices[0].message
    assert message.reasoning_content == f"Maybe {mention}? No: Paris."  # the reasoning is never read for calls
    assert [(c.function.name, json.loads(c.function.arguments)) for c in message.tool_calls] == [
        ("get_weather", {"city": "Paris", "unit": "celsius"})]
    assert message.content is None and whole.choices[0].finish_reason == "tool_calls"
    assert assembled(client, **body) == (None, [("get_weather", message.tool_calls[0].function.arguments)],
                                         "tool_calls")
    assert _streamed(_events(client, body))[0] == message.reasoning_content
    upstream.pieces = [f"Only thinking of {mention}", " and done.</think>It is sunny."]
    message = client.chat.completions.create(**body).choices[0].message
    assert message.tool_calls is None and message.content == "It is sunny."
    assert message.reasoning_content == f"Only thinking of {mention} and done."


def test_constrained_output_is_all_content(endpoints: Callable[[str | None], Endpoint]) -> None:
    """The grammar applies from the first token, so a constrained reply holds no reasoning: the parser is off."""
    client, upstream = endpoints("deepseek_r1")
    upstream.pieces = ['{"a":', "1}"]
    whole = client.chat.completions.create(**BODY, response_format={"type": "json_object"})
    assert upstream.sent[-1][1]["structured_output"] == {"json_object": True}
    message = whole.choices[0].message
    assert (message.content, message.reasoning_content) == ('{"a":1}', None)
    assert whole.usage.completion_tokens_details.reasoning_tokens == 0
    upstream.pieces = ['[{"name":"get_weather","arguments":{"city":"Oslo","unit":"celsius"}}]']
    body = BODY | {"tools": [WEATHER], "tool_choice": "required"}
    message = client.chat.completions.create(**body).choices[0].message
    assert [(c.function.name, c.function.arguments) for c in message.tool_calls] == [
        ("get_weather", '{"city":"Oslo","unit":"celsius"}')]
    assert assembled(client, **body)[1] == [("get_weather", '{"city":"Oslo","unit":"celsius"}')]


def test_without_a_parser_the_text_is_all_content(endpoints: Callable[[str | None], Endpoint]) -> None:
    client, upstream = endpoints(None)
    upstream.pieces = R1_PIECES
    whole = client.chat.completions.create(**BODY)
    assert whole.choices[0].message.content == "".join(R1_PIECES)
    assert whole.choices[0].message.model_extra == {} and whole.usage.completion_tokens_details is None
