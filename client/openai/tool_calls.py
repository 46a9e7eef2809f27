"""Tool calling for the chat endpoint: prompts, forced-call schemas and parsers of the model's tool calls.

Pure functions and small parsers over text; no server, no pydantic. The endpoint (chat_format.py)
picks a format from the model's chat template (`tool_format`):

- "hermes": the template takes `tools` and shows `<tool_call>` (Qwen2.5, Hermes and many others). The model
  writes `<tool_call>{"name": ..., "arguments": {...}}</tool_call>` blocks.
- "llama3_json": the template mentions `<|python_tag|>` or "Environment: ipython" (Llama 3.1+). The model
  writes `{"name": ..., "parameters": {...}}`, possibly after `<|python_tag|>`, several joined by ";".
- "generic": the template does not take `tools` (SmolLM2, the default model). The endpoint describes the tools
  in a system prompt (`generic_system_prompt`) that asks for Hermes-style `<tool_call>` blocks, and renders
  earlier tool calls and tool results as text in the assistant and user turns (`template_messages`).

tool_choice "required" and a named function are enforced by a JSON schema (`required_schema`,
`named_schema`) that the engine decodes under; "auto" is parsed after the fact. Every parser takes text in
pieces (`feed`, then `finish`) and gives content and tool-call deltas: a stream and a whole text give the same
result (`parse_text`), however the text is split. Text that is not a well-formed tool call stays content.
"""

from __future__ import annotations

import json
import secrets
import string
from dataclasses import dataclass, field
from typing import Any, Protocol

TOOL_CALL_START, TOOL_CALL_END = "<tool_call>", "</tool_call>"
PYTHON_TAG = "<|python_tag|>"
_ID_CHARS = string.ascii_letters + string.digits


def new_call_id() -> str:
    """A fresh tool call id in OpenAI's form: `call_` and 24 random letters and digits."""
    return "call_" + "".join(secrets.choice(_ID_CHARS) for _ in range(24))


def dump_arguments(arguments: Any) -> str:
    """Arguments as the JSON text OpenAI's `function.arguments` holds."""
    return json.dumps(arguments, ensure_ascii=False, separators=(",", ":"))


@dataclass
class ToolCall:
    """A whole tool call: the function's name and its arguments as JSON text."""

    name: str
    arguments: str  # JSON text
    id: str = field(default_factory=new_call_id)

    def as_openai(self) -> dict[str, Any]:
        """The call as an entry of an OpenAI message's `tool_calls`."""
        return {"id": self.id, "type": "function", "function": {"name": self.name, "arguments": self.arguments}}


@dataclass
class ToolCallDelta:
    """A piece of the `index`-th tool call: its first piece carries id and name, later ones more arguments."""

    index: int
    id: str | None = None
    name: str | None = None
    arguments: str = ""

    def as_openai(self) -> dict[str, Any]:
        """The piece as an entry of an OpenAI stream delta's `tool_calls`."""
        out: dict[str, Any] = {"index": self.index}
        if self.id is not None:
            out |= {"id": self.id, "type": "function"}
        function: dict[str, str] = {"arguments": self.arguments}
        if self.name is not None:
            function["name"] = self.name
        return out | {"function": function}


@dataclass
class Parsed:
    """What a parser made of the text it was given so far: content to show and tool-call pieces."""

    content: str = ""
    tool_calls: list[ToolCallDelta] = field(default_factory=list)

    def __iadd__(self, other: Parsed) -> Parsed:
        self.content += other.content
        self.tool_calls += other.tool_calls
        return self


class ToolParser(Protocol):
    """Reads tool calls out of one choice's text as it streams."""

    def feed(self, text: str) -> Parsed:
        """What the next piece of text adds; text that may begin a call is held back until it is known."""
        ...

    def finish(self) -> Parsed:
        """What is left once the text has ended: held text and an unclosed call, if it parses."""
        ...


def parse_text(parser: ToolParser, text: str) -> tuple[str | None, list[ToolCall]]:
    """(content, tool calls) of a whole output; content None when it is empty."""
    parsed = parser.feed(text)
    parsed += parser.finish()
    calls: list[ToolCall] = []
    for delta in parsed.tool_calls:
        if delta.index == len(calls):
            calls.append(ToolCall(delta.name or "", delta.arguments, delta.id or new_call_id()))
        else:
            calls[delta.index].arguments += delta.arguments
    return parsed.content or None, calls


# --- formats and prompts ---------------------------------------------------------------------------------------


def tool_format(template: str | None, supports_tools: bool) -> str:
    """"llama3_json", "hermes" or "generic" (see the module's docstring) for a chat template."""
    if not supports_tools or not template:
        return "generic"
    if PYTHON_TAG in template or "Environment: ipython" in template:
        return "llama3_json"
    return "hermes"  # what templates that take tools mostly use, `<tool_call>` or not


def generic_system_prompt(tools: list[dict[str, Any]]) -> str:
    """The system prompt that tells a model whose template knows no tools which functions it may call and how.
    `tools` are OpenAI's `{"type": "function", "function": {...}}` objects."""
    listed = "\n".join(json.dumps(t, ensure_ascii=False) for t in tools)
    return ("You may call one or more functions to help with the user's request. The functions, with their "
            "parameters as JSON schemas:\n"
            f"<tools>\n{listed}\n</tools>\n"
            "To call a function, answer with a JSON object holding its name and arguments within "
            f"{TOOL_CALL_START}{TOOL_CALL_END} tags, one call per block:\n"
            f'{TOOL_CALL_START}\n{{"name": "<function name>", "arguments": {{<arguments>}}}}\n{TOOL_CALL_END}\n'
            "The results come back within <tool_response></tool_response> tags.")


def _arguments_object(arguments: str | dict[str, Any]) -> Any:
    """A call's arguments as an object, as chat templates expect (OpenAI clients send JSON text); text that
    is not a JSON object stays as it is."""
    if isinstance(arguments, dict):
        return arguments
    try:
        value = json.loads(arguments)
    except (ValueError, RecursionError):
        return arguments
    return value if isinstance(value, dict) else arguments


def _generic_call_text(call: dict[str, Any]) -> str:
    function = call["function"]
    body = json.dumps({"name": function["name"], "arguments": _arguments_object(function["arguments"])},
                      ensure_ascii=False)
    return f"{TOOL_CALL_START}\n{body}\n{TOOL_CALL_END}"


def template_messages(messages: list[dict[str, Any]], generic: bool,
                      tools: list[dict[str, Any]] | None = None) -> list[dict[str, Any]]:
    """Messages (dicts with role, content as text or None, tool_calls in OpenAI's shape, tool_call_id, extra
    fields) made ready for a chat template.

    For a template that takes tools (`generic` False) only the calls' arguments become objects (transformers'
    convention). For a generic one, assistant tool calls become `<tool_call>` text in the assistant turn, tool
    results `<tool_response>` text in a user turn (consecutive results share one), null content empty text,
    and with `tools` the generic system prompt goes first (before the text of a system message already there).
    """
    out: list[dict[str, Any]] = []
    for message in messages:
        message = dict(message)
        calls = message.pop("tool_calls", None) or []
        if not generic:
            if calls:
                message["tool_calls"] = [call | {"function": call["function"] | {
                    "arguments": _arguments_object(call["function"]["arguments"])}} for call in calls]
            out.append(message)
            continue
        text = message.get("content") or ""
        if message["role"] == "tool":
            response = f"<tool_response>\n{text}\n</tool_response>"
            if out and out[-1].get("_tool_results"):
                out[-1]["content"] += "\n" + response
            else:
                out.append({"role": "user", "content": response, "_tool_results": True})
            continue
        message.pop("tool_call_id", None)
        if calls:
            text = "\n".join([text] * bool(text) + [_generic_call_text(call) for call in calls])
        out.append(message | {"content": text})
    for message in out:
        message.pop("_tool_results", None)
    if generic and tools:
        prompt = generic_system_prompt(tools)
        if out and out[0]["role"] == "system":
            out[0]["content"] = prompt + ("\n\n" + out[0]["content"] if out[0]["content"] else "")
        else:
            out.insert(0, {"role": "system", "content": prompt})
    return out


# --- schemas of forced calls -------------------------------------------------------------------------------------


def parameters_schema(tool: dict[str, Any]) -> dict[str, Any]:
    """The JSON schema of a tool's arguments: its `parameters`, or an empty object without them."""
    return tool["function"].get("parameters") or {"type": "object", "properties": {}, "additionalProperties": False}


def named_schema(tool: dict[str, Any]) -> dict[str, Any]:
    """tool_choice naming a function: the output is that function's arguments object."""
    return parameters_schema(tool)


def required_schema(tools: list[dict[str, Any]], parallel: bool) -> dict[str, Any]:
    """tool_choice "required": the output is a JSON array of calls `{"name": ..., "arguments": {...}}`, each
    naming one of the tools with arguments of that tool's schema; one call only unless `parallel`."""
    calls = [{"type": "object", "properties": {"name": {"const": t["function"]["name"]},
                                                  "arguments": parameters_schema(t)},
              "required": ["name", "arguments"], "additionalProperties": False} for t in tools]
    schema: dict[str, Any] = {"type": "array", "items": calls[0] if len(calls) == 1 else {"anyOf": calls},
                              "minItems": 1}
    if not parallel:
        schema["maxItems"] = 1
    return schema


# --- parsers ----------------------------------------------------------------------------------------------------


def _call_from_json(value: Any, argument_keys: tuple[str, ...]) -> ToolCall | None:
    """A call from a decoded `{"name": ..., "arguments" (or another of argument_keys): {...}}`; None if it
    is not one."""
    if not isinstance(value, dict) or not isinstance(value.get("name"), str) or not value["name"]:
        return None
    key = next((k for k in argument_keys if k in value), None)
    arguments = {} if key is None else value[key]
    if isinstance(arguments, str):
        arguments = _arguments_object(arguments)
    if not isinstance(arguments, dict):
        return None
    return ToolCall(value["name"], dump_arguments(arguments))


def _partial_prefix(text: str, tag: str) -> int:
    """The length of the longest end of `text` that begins `tag` (and could become it)."""
    for size in range(min(len(text), len(tag) - 1), 0, -1):
        if tag.startswith(text[-size:]):
            return size
    return 0


class _Calls:
    """Numbers the calls a parser finds and turns them into whole deltas."""

    def __init__(self) -> None:
        self.count = 0

    def delta(self, call: ToolCall) -> ToolCallDelta:
        self.count += 1
        return ToolCallDelta(self.count - 1, call.id, call.name, call.arguments)


class HermesParser:
    """`<tool_call>{json}</tool_call>` blocks among text. Text streams as it comes, except an end that could
    begin a `<tool_call>` and whitespace (held until what follows is known). The text around calls is content:
    where text comes before and after a call, the whitespace that stood before the call (else after it)
    separates them; whitespace at the start, at the end and between calls is dropped once a call was found.
    A block that does not parse stays content, as it was written; an unclosed block at the end is a call if
    its text parses."""

    def __init__(self) -> None:
        self._buf = ""
        self._in_call = False
        self._held = ""  # whitespace not shown yet
        self._before_call = ""  # the whitespace before the open block
        self._after_call = False  # a call ended and no text followed yet
        self._after_ws = ""  # the whitespace seen since that call
        self._shown = False  # some content was shown
        self._calls = _Calls()

    def _text(self, text: str) -> str:
        """Content to show now for `text`, holding back its trailing whitespace."""
        if self._after_call:
            rest = text.lstrip()
            if not rest:
                self._after_ws += text
                return ""
            separator = self._held or self._after_ws + text[: len(text) - len(rest)]
            text = (separator if self._shown else "") + rest
            self._held, self._after_call, self._after_ws = "", False, ""
        text = self._held + text
        shown = text.rstrip()
        self._held = text[len(shown):]
        self._shown = self._shown or bool(shown)
        return shown

    def _close(self, body: str, closed: bool) -> Parsed:
        call = _call_from_json(_loads(body), ("arguments", "parameters"))
        if call is not None:  # the whitespace before it waits to separate the text before from what follows
            self._in_call, self._after_call = False, True
            self._held, self._before_call = self._before_call, ""
            return Parsed(tool_calls=[self._calls.delta(call)])
        raw = self._before_call + TOOL_CALL_START + body + (TOOL_CALL_END if closed else "")
        self._in_call, self._before_call = False, ""
        return Parsed(content=self._text(raw))

    def feed(self, text: str) -> Parsed:
        self._buf += text
        out = Parsed()
        while True:
            if self._in_call:
                end = self._buf.find(TOOL_CALL_END)
                if end < 0:
                    return out
                body, self._buf = self._buf[:end], self._buf[end + len(TOOL_CALL_END):]
                out += self._close(body, closed=True)
                continue
            start = self._buf.find(TOOL_CALL_START)
            if start < 0:
                keep = _partial_prefix(self._buf, TOOL_CALL_START)
                out.content += self._text(self._buf[:len(self._buf) - keep])
                self._buf = self._buf[len(self._buf) - keep:]
                return out
            out.content += self._text(self._buf[:start])
            self._before_call, self._held = self._held, ""
            self._buf = self._buf[start + len(TOOL_CALL_START):]
            self._in_call = True

    def finish(self) -> Parsed:
        out = Parsed()
        if self._in_call:
            out += self._close(self._buf, closed=False)
        else:
            out.content += self._text(self._buf)
        self._buf = ""
        if not self._calls.count:
            out.content += self._held
        self._held = ""
        return out


def _loads(text: str) -> Any:
    try:
        return json.loads(text)
    except (ValueError, RecursionError):  # not JSON, or nested deeper than the decoder goes
        return None


class Llama3JsonParser:
    """Llama 3.1's JSON calls: an output that starts (after whitespace) with `{` or `<|python_tag|>` is held
    to the end and is calls if it is one or more `{"name", "parameters"}` objects joined by ";"; anything
    else streams as content."""

    def __init__(self) -> None:
        self._lead = ""  # leading whitespace, until the first other character decides
        self._held: str | None = None  # the output held as a possible call; None when it is content
        self._decided = False
        self._calls = _Calls()

    def feed(self, text: str) -> Parsed:
        if self._decided:
            if self._held is None:
                return Parsed(content=text)
            self._held += text
            return Parsed()
        self._lead += text
        stripped = self._lead.lstrip()
        if not stripped or (len(stripped) < len(PYTHON_TAG) and PYTHON_TAG.startswith(stripped)):
            return Parsed()
        self._decided = True
        if stripped.startswith(("{", PYTHON_TAG)):
            self._held = self._lead
            return Parsed()
        return Parsed(content=self._lead)

    def finish(self) -> Parsed:
        if not self._decided:
            return Parsed(content=self._lead)
        if self._held is None:
            return Parsed()
        calls = _llama3_calls(self._held.strip().removeprefix(PYTHON_TAG))
        if calls is None:
            return Parsed(content=self._held)
        return Parsed(tool_calls=[self._calls.delta(c) for c in calls])


def _llama3_calls(text: str) -> list[ToolCall] | None:
    decoder = json.JSONDecoder()
    calls = []
    while True:
        text = text.lstrip()
        try:
            value, used = decoder.raw_decode(text)
        except (ValueError, RecursionError):
            return None
        call = _call_from_json(value, ("parameters", "arguments"))
        if call is None:
            return None
        calls.append(call)
        text = text[used:].lstrip()
        if not text:
            return calls
        if not text.startswith(";"):
            return None
        text = text[1:]


class NamedCallParser:
    """tool_choice naming a function: the whole output is that function's arguments, streamed as they come."""

    def __init__(self, name: str) -> None:
        self._name = name
        self._started = False

    def feed(self, text: str) -> Parsed:
        if self._started:
            return Parsed(tool_calls=[ToolCallDelta(0, arguments=text)] if text else [])
        self._started = True
        return Parsed(tool_calls=[ToolCallDelta(0, new_call_id(), self._name, text)])

    def finish(self) -> Parsed:
        return Parsed() if self._started else self.feed("")


class RequiredCallsParser:
    """tool_choice "required": the output is a JSON array of `{"name", "arguments"}` objects (the engine
    enforces it); each call is given as soon as its object is complete. What is left unparsed at the end (an
    output cut short) is content."""

    def __init__(self) -> None:
        self._depth = 0
        self._in_string = False
        self._escaped = False
        self._item = ""  # the array element being read
        self._rest = ""  # text outside the calls (the array's own brackets and commas are dropped)
        self._calls = _Calls()

    def feed(self, text: str) -> Parsed:
        out = Parsed()
        for char in text:
            if self._depth >= 2 or (self._depth == 1 and char == "{" and not self._in_string):
                self._item += char
            elif not (char.isspace() or (self._depth == 0 and char == "[") or (self._depth == 1 and char in ",]")):
                self._rest += char
            self._step(char)
            if self._item and self._depth == 1:  # an element just closed
                call = _call_from_json(_loads(self._item), ("arguments",))
                if call is None:
                    self._rest += self._item
                else:
                    out.tool_calls.append(self._calls.delta(call))
                self._item = ""
        return out

    def _step(self, char: str) -> None:
        if self._in_string:
            if self._escaped:
                self._escaped = False
            elif char == "\\":
                self._escaped = True
            elif char == '"':
                self._in_string = False
        elif char == '"':
            self._in_string = True
        elif char in "[{":
            self._depth += 1
        elif char in "]}":
            self._depth -= 1

    def finish(self) -> Parsed:
        left = (self._rest + self._item).strip()
        self._rest = self._item = ""
        return Parsed(content=left)
