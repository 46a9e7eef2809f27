"""Tools and a Hermes-template checkpoint shared by the tool-calling tests, and a helper that assembles a
chat answer streamed and not (and checks the two agree)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import openai

HERMES_TEMPLATE = """{%- set system = messages[0].content if messages[0].role == 'system' else '' -%}
{%- if tools %}<|im_start|>system
{% if system %}{{ system }}

{% endif %}You may call these functions:
<tools>
{% for tool in tools %}{{ tool | tojson }}
{% endfor %}</tools>
Call one with <tool_call>{"name": ..., "arguments": {...}}</tool_call>.<|im_end|>
{% elif system %}<|im_start|>system
{{ system }}<|im_end|>
{% endif %}
{%- for message in messages %}
{%- if message.role == 'tool' %}<|im_start|>user
<tool_response>
{{ message.content }}
</tool_response><|im_end|>
{% elif message.role == 'assistant' and message.tool_calls %}<|im_start|>assistant
{% if message.content %}{{ message.content }}
{% endif %}{% for call in message.tool_calls %}<tool_call>
{{ {"name": call.function.name, "arguments": call.function.arguments} | tojson }}
</tool_call>
{% endfor %}<|im_end|>
{% elif message.role != 'system' %}<|im_start|>{{ message.role }}
{{ message.content }}<|im_end|>
{% endif %}
{%- endfor %}
{%- if add_generation_prompt %}<|im_start|>assistant
{% endif %}"""


WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city.",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 20},
                                                    "unit": {"enum": ["celsius", "fahrenheit"]}},
                   "required": ["city", "unit"], "additionalProperties": False}}}


TIME = {"type": "function", "function": {
    "name": "get_time", "description": "The time in a timezone.",
    "parameters": {"type": "object", "properties": {"timezone": {"type": "string", "maxLength": 30}},
                   "required": ["timezone"], "additionalProperties": False}}}


def write_hermes_model(source: Path, dest: Path, files: tuple[str, ...] | None = None) -> Path:
    """A copy of a model folder (or just its tokenizer `files`) whose chat template is HERMES_TEMPLATE."""
    if files is None:
        shutil.copytree(source, dest, dirs_exist_ok=True)
    else:
        dest.mkdir(parents=True, exist_ok=True)
        for name in files:
            shutil.copy(source / name, dest / name)
    config_path = dest / "tokenizer_config.json"
    config = json.loads(config_path.read_text())
    config["chat_template"] = HERMES_TEMPLATE
    config_path.write_text(json.dumps(config))
    return dest


def assembled(client: openai.OpenAI, **body: Any) -> tuple[str | None, list[tuple[str, str]], str | None]:
    """(content, [(name, arguments)], finish_reason) of a streamed chat completion, assembled by the official
    client's stream helper, checked equal to what the chunks add up to by hand."""
    with client.chat.completions.stream(**body) as stream:
        chunks = [event.chunk for event in stream if event.type == "chunk"]
        final = stream.get_final_completion().choices[0]
    calls = [(c.function.name, c.function.arguments) for c in final.message.tool_calls or []]
    assert all(c.id.startswith("call_") for c in final.message.tool_calls or [])
    result = (final.message.content, calls, final.finish_reason)
    assert _stream_calls(chunks) == result
    return result


def _stream_calls(chunks: list[Any]) -> tuple[str | None, list[tuple[str, str]], str | None]:
    """(content, [(name, arguments)], finish_reason) assembled from chat stream chunks."""
    content, calls, reason = None, {}, None
    for chunk in chunks:
        delta = chunk.choices[0].delta
        if delta.content is not None:
            content = (content or "") + delta.content
        for call in delta.tool_calls or []:
            entry = calls.setdefault(call.index, ["", ""])
            if call.function.name:
                assert call.id.startswith("call_") and call.type == "function" and not entry[0]
                entry[0] = call.function.name
            entry[1] += call.function.arguments or ""
        reason = chunk.choices[0].finish_reason or reason
    return content, [tuple(c) for _, c in sorted(calls.items())], reason  # type: ignore[misc]
