"""Chat-specific parts of the OpenAI endpoint: a request's prompt and output constraint, and the model's text
made into a message (tool calls parsed) or into stream deltas. The formats and parsers are in tool_calls.py.

tool_choice (the default is "auto" with tools, "none" without):
- "none": plain chat, the text is the content. As vLLM does, a template that takes `tools` still gets them;
  the generic format (a template without tools) gets no tool prompt, since the model may not call any.
- "auto": the model chooses; its text is parsed for calls in the template's format (`tool_format`).
- "required" / a named function: the engine decodes under a JSON schema of the calls (`required_schema`,
  `named_schema`), so the arguments always match the function's parameters.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from tritium.backend.tokenizer import Tokenizer
from tritium.client.cluster.router import Chunk
from tritium.client.openai.protocol import ChatMessage, ChatRequest
from tritium.client.openai.tool_calls import (
    HermesParser,
    Llama3JsonParser,
    NamedCallParser,
    RequiredCallsParser,
    ToolParser,
    named_schema,
    parse_text,
    required_schema,
    template_messages,
    tool_format,
)


def _tools(body: ChatRequest) -> list[dict[str, Any]]:
    return [t.model_dump(exclude_none=True) for t in body.tools or []]


def chat_constraint(body: ChatRequest, mode: str) -> dict[str, Any] | None:
    """The engine's `structured_output` for a chat request whose tool mode is `mode` (ChatRequest.tool_mode).
    Raises RequestError as ChatRequest.structured_output does."""
    tools = _tools(body)
    if mode == "required":
        return {"json": required_schema(tools, body.parallel_tool_calls)}
    if mode == "named":
        name = body.tool_choice.function.name  # type: ignore[union-attr]
        return {"json": named_schema(next(t for t in tools if t["function"]["name"] == name))}
    return body.structured_output()


def _message_dict(message: ChatMessage) -> dict[str, Any]:
    out = message.model_dump(exclude={"content", "tool_calls", "tool_call_id"}) | {"content": message.text}
    if message.tool_calls:
        out["tool_calls"] = [call.model_dump() for call in message.tool_calls]
    if message.tool_call_id is not None:
        out["tool_call_id"] = message.tool_call_id
    return out


def render_prompt(tokenizer: Tokenizer, body: ChatRequest, mode: str, add_generation_prompt: bool = True) -> str:
    """The prompt: the messages (and tools) through the model's chat template. Raises ValueError when the
    template refuses them or what they hold cannot be sent as UTF-8 (a lone surrogate in an extra field)."""
    tools = _tools(body) or None
    generic = not tokenizer.supports_tools
    messages = template_messages([_message_dict(m) for m in body.messages], generic,
                                 tools if generic and mode != "none" else None)
    prompt = tokenizer.apply_chat_template(messages, add_generation_prompt, tools=None if generic else tools)
    try:
        prompt.encode("utf-8")
    except UnicodeEncodeError:
        raise ValueError("messages: must be valid Unicode text (something in them holds a lone surrogate)") from None
    return prompt


def parser_factory(tokenizer: Tokenizer, body: ChatRequest, mode: str) -> Callable[[], ToolParser] | None:
    """What reads tool calls out of the model's text in this mode; None: the text is all content."""
    if mode == "required":
        return RequiredCallsParser
    if mode == "named":
        name = body.tool_choice.function.name  # type: ignore[union-attr]
        return lambda: NamedCallParser(name)
    if mode == "auto":
        kind = tool_format(tokenizer.chat_template, tokenizer.supports_tools)
        return Llama3JsonParser if kind == "llama3_json" else HermesParser
    return None


def finish_reason(reason: str | None, called: bool) -> str | None:
    """OpenAI's "tool_calls" when the model stopped after calling tools; otherwise the engine's reason."""
    return "tool_calls" if called and reason == "stop" else reason


def chat_message(text: str, reason: str | None, parser: Callable[[], ToolParser] | None
                 ) -> tuple[dict[str, Any], str | None]:
    """(the assistant message, finish_reason) of a whole output."""
    if parser is None:
        return {"role": "assistant", "content": text}, reason
    content, calls = parse_text(parser(), text)
    if not calls:
        return {"role": "assistant", "content": content or ""}, reason
    return ({"role": "assistant", "content": content, "tool_calls": [c.as_openai() for c in calls]},
            finish_reason(reason, True))


@dataclass
class ChatStream:
    """Turns each choice's chunks into chat.completion.chunk choices. Without a parser every chunk is a delta
    of content. With one, deltas carry content only once there is some (a reply of tool calls alone adds up to
    content null, as the whole message has it), a chunk whose text the parser holds back gives no delta (None)
    and its logprobs wait for the next one."""

    parser: Callable[[], ToolParser] | None
    logprobs: Callable[[list[dict[str, float]]], dict[str, Any] | None]
    _parsers: dict[int, ToolParser] = field(default_factory=dict)
    _waiting_logprobs: dict[int, list[dict[str, float]]] = field(default_factory=dict)
    _called: set[int] = field(default_factory=set)
    _said: set[int] = field(default_factory=set)  # choices that got content

    def delta(self, index: int, chunk: Chunk, first: bool) -> dict[str, Any] | None:
        reason = chunk.finish_reason if chunk.final else None
        if self.parser is None:
            d: dict[str, Any] = {"content": chunk.text}
            entries = chunk.logprobs
        else:
            parser = self._parsers.setdefault(index, self.parser())
            parsed = parser.feed(chunk.text)
            if chunk.final:
                parsed += parser.finish()
            entries = self._waiting_logprobs.pop(index, []) + chunk.logprobs
            if not (parsed.content or parsed.tool_calls or first or chunk.final):
                self._waiting_logprobs[index] = entries
                return None
            d = {}
            if parsed.content:
                d["content"] = parsed.content
                self._said.add(index)
            if parsed.tool_calls:
                d["tool_calls"] = [call.as_openai() for call in parsed.tool_calls]
                self._called.add(index)
            if chunk.final and index not in self._said and index not in self._called:
                d["content"] = ""  # an empty reply: content "", as the whole message has it
            reason = finish_reason(reason, index in self._called)
        if first:
            d = {"role": "assistant"} | d
        return {"index": index, "delta": d, "logprobs": self.logprobs(entries), "finish_reason": reason}
