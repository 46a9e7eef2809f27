"""A chat request made into what the engine runs: the prompt (the messages and tools through the model's chat
template), the output constraint, and which parser reads tool calls back out of the model's text. The
formats and parsers themselves are in tool_calls.py.

tool_choice (the default is "auto" with tools, "none" without):
- "none": plain chat, the text is the content. As vLLM does, a template that takes `tools` still gets them;
  the generic format (a template without tools) gets no tool prompt, since the model may not call any.
- "auto": the model chooses; its text is parsed for calls in the template's format (`tool_format`).
- "required" / a named function: the engine decodes under a JSON schema of the calls (`required_schema`,
  `named_schema`), so the arguments always match the function's parameters.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

from tritium.backend.tokenizer import ChatTemplateKwargsError, Tokenizer, check_chat_template_kwargs
from tritium.client.openai.protocol import ChatMessage, ChatRequest, RequestError
from tritium.client.openai.tool_calls import (
    HermesParser,
    Llama3JsonParser,
    NamedCallParser,
    RequiredCallsParser,
    ToolParser,
    named_schema,
    required_schema,
    template_messages,
    tool_format,
)

ParserFactory = Callable[[], ToolParser]
CHAT_TEMPLATE_KWARGS = "chat_template_kwargs"


def _tools(body: ChatRequest) -> list[dict[str, Any]]:
    return [t.model_dump(exclude_none=True) for t in body.tools or []]


def chat_constraint(body: ChatRequest, mode: str) -> dict[str, Any] | None:
    """The engine's `structured_output` for a chat request whose tool mode is `mode` (ChatRequest.tool_mode);
    None for no constraint. Raises RequestError as ChatRequest.structured_output does."""
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


def _template_kwargs(body: ChatRequest) -> dict[str, Any] | None:
    """The request's `chat_template_kwargs`. Raises RequestError naming it when they cannot be passed to a
    template (a name the renderer passes itself, text that is not valid Unicode)."""
    kwargs = body.chat_template_kwargs
    if kwargs is None:
        return None
    try:
        check_chat_template_kwargs(kwargs)
        json.dumps(kwargs, ensure_ascii=False).encode("utf-8")
    except ChatTemplateKwargsError as exc:
        raise RequestError(str(exc), CHAT_TEMPLATE_KWARGS) from None
    except UnicodeEncodeError:
        raise RequestError(f"{CHAT_TEMPLATE_KWARGS}: must be valid Unicode text (it holds a lone surrogate)",
                           CHAT_TEMPLATE_KWARGS) from None
    return kwargs


def render_prompt(tokenizer: Tokenizer, body: ChatRequest, mode: str, add_generation_prompt: bool = True) -> str:
    """The prompt: the messages (and tools) through the model's chat template, `chat_template_kwargs` as extra
    variables. Raises RequestError naming `chat_template_kwargs` when the template cannot take them (its own
    words never shown), ValueError when the template refuses the messages or what they hold cannot be sent as
    UTF-8 (a lone surrogate in an extra field); the template may raise anything else on what the messages hold."""
    tools = _tools(body) or None
    generic = not tokenizer.supports_tools
    messages = template_messages([_message_dict(m) for m in body.messages], generic,
                                 tools if generic and mode != "none" else None)
    kwargs = _template_kwargs(body)
    try:
        prompt = tokenizer.apply_chat_template(messages, add_generation_prompt, tools=None if generic else tools,
                                               chat_template_kwargs=kwargs)
    except ChatTemplateKwargsError as exc:
        raise RequestError(str(exc), CHAT_TEMPLATE_KWARGS) from None
    try:
        prompt.encode("utf-8")
    except UnicodeEncodeError:
        raise ValueError("messages: must be valid Unicode text (something in them holds a lone surrogate)") from None
    return prompt


def parser_factory(tokenizer: Tokenizer, body: ChatRequest, mode: str) -> ParserFactory | None:
    """What makes a reader of tool calls out of the model's text in this mode; None: the text is all content."""
    if mode == "required":
        return RequiredCallsParser
    if mode == "named":
        name = body.tool_choice.function.name  # type: ignore[union-attr]
        return lambda: NamedCallParser(name)
    if mode == "auto":
        kind = tool_format(tokenizer.chat_template, tokenizer.supports_tools)
        return Llama3JsonParser if kind == "llama3_json" else HermesParser
    return None
