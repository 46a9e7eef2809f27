"""`/v1/chat/completions`: a chat request run upstream (its prompt and constraint: chat_format.py), and the
model's text made into an assistant message, tool calls parsed out of it, whole or as stream deltas."""

from __future__ import annotations

import asyncio
import functools
import logging
import time
import uuid
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

from fastapi import Request
from fastapi.responses import JSONResponse, StreamingResponse

from tritium.client.cluster.upstream import Chunk
from tritium.client.openai.chat_format import ParserFactory, chat_constraint, parser_factory, render_prompt
from tritium.client.openai.errors import budget_error
from tritium.client.openai.protocol import ChatRequest, RequestError, error_response
from tritium.client.openai.reasoning import ReasoningFactory, ReasoningParser, split_reasoning
from tritium.client.openai.service import ChoiceResult, OpenAIService, TokenEntry, usage
from tritium.client.openai.streaming import stream_response
from tritium.client.openai.tool_calls import Parsed, ToolParser, parse_text

logger = logging.getLogger(__name__)

LogprobsFormatter = Callable[[list[dict[str, float]]], dict[str, Any] | None]
TokenCounter = Callable[[str], int]


def finish_reason(reason: str | None, called: bool) -> str | None:
    """OpenAI's "tool_calls" when the model stopped after calling tools; otherwise the engine's reason."""
    return "tool_calls" if called and reason == "stop" else reason


def chat_message(text: str, reason: str | None, parser: ParserFactory | None,
                 reasoning: ReasoningFactory | None = None) -> tuple[dict[str, Any], str | None]:
    """(the assistant message, finish_reason) of a whole output. With `reasoning`, the reasoning part goes to
    `reasoning_content` and `reasoning` (vLLM's older and newer names, the same text; null without any) and only
    the rest is content, the text read for tool calls (content null when nothing follows the reasoning)."""
    thought: dict[str, Any] = {}
    if reasoning is not None:
        thinking, answer = split_reasoning(reasoning(), text)
        thought = {"reasoning_content": thinking, "reasoning": thinking}
        if answer is None:
            return {"role": "assistant", "content": None} | thought, reason
        text = answer
    if parser is None:
        return {"role": "assistant", "content": text} | thought, reason
    content, calls = parse_text(parser(), text)
    if not calls:
        return {"role": "assistant", "content": content or ""} | thought, reason
    return ({"role": "assistant", "content": content, "tool_calls": [c.as_openai() for c in calls]} | thought,
            finish_reason(reason, True))


def _token_counter(service: OpenAIService) -> TokenCounter:
    """How many tokens the endpoint's tokenizer makes of a text (no special tokens added)."""
    tokenizer = service.tokenizer
    return lambda text: len(tokenizer.encode(text, add_special_tokens=False))


def reasoning_usage(count_tokens: TokenCounter, reasoning_texts: Iterable[str | None]) -> dict[str, Any]:
    """The `usage` entry a reasoning parser adds: `completion_tokens_details.reasoning_tokens`, the tokens of
    the choices' reasoning text (the `<think>` markers not counted) as the tokenizer encodes it."""
    return {"completion_tokens_details": {"reasoning_tokens": sum(count_tokens(t) for t in reasoning_texts if t)}}


def chat_logprobs(rows: list[TokenEntry], top: int) -> dict[str, Any]:
    """OpenAI's chat `logprobs` of generated tokens (`OpenAIService.token_entries`), `top` alternatives each."""
    return {"content": [{"token": tok, "logprob": lp, "bytes": list(tok.encode()),
                         "top_logprobs": [{"token": a, "logprob": alp, "bytes": list(a.encode())}
                                          for a, alp in alts[:top]]}
                        for tok, lp, alts in rows]}


def _logprobs_formatter(service: OpenAIService, body: ChatRequest) -> LogprobsFormatter:
    """What makes a choice's `logprobs` out of the engine's entries: None unless the request asked for them."""
    if not body.logprobs:
        return lambda _entries: None
    top = body.top_logprobs or 0
    return lambda entries: chat_logprobs(service.token_entries(entries), top)


@dataclass
class ChatStream:
    """Turns each choice's chunks into chat.completion.chunk choices. Without a parser every chunk is a delta
    of content. With one, deltas carry content only once there is some (a reply of tool calls alone adds up to
    content null, as the whole message has it), a chunk whose text the parser holds back gives no delta (None)
    and its logprobs wait for the next one. With a `reasoning` parser too, its reasoning part comes as
    `reasoning_content` and `reasoning` deltas (`reasoning_texts` keeps each choice's, for the usage) and only
    the rest goes on as content, through the tool-call parser if any."""

    parser: ParserFactory | None
    logprobs: LogprobsFormatter
    reasoning: ReasoningFactory | None = None
    reasoning_texts: dict[int, str] = field(default_factory=dict)
    _parsers: dict[int, ToolParser] = field(default_factory=dict)
    _reasoners: dict[int, ReasoningParser] = field(default_factory=dict)
    _waiting_logprobs: dict[int, list[dict[str, float]]] = field(default_factory=dict)
    _called: set[int] = field(default_factory=set)
    _said: set[int] = field(default_factory=set)  # choices that got content

    def _split(self, index: int, chunk: Chunk) -> tuple[str, str]:
        """(reasoning, content) of a choice's chunk: all content without a reasoning parser."""
        if self.reasoning is None:
            return "", chunk.text
        reasoner = self._reasoners.setdefault(index, self.reasoning())
        thought, text = reasoner.feed(chunk.text)
        if chunk.final:
            more_thought, more_text = reasoner.finish()
            thought, text = thought + more_thought, text + more_text
        if thought:
            self.reasoning_texts[index] = self.reasoning_texts.get(index, "") + thought
        return thought, text

    def delta(self, index: int, chunk: Chunk, first: bool) -> dict[str, Any] | None:
        """The choice entry for choice `index`'s next chunk (`first`: its first); None when it has nothing to
        show yet (a tool call or a marker being read)."""
        reason = chunk.finish_reason if chunk.final else None
        if self.parser is None and self.reasoning is None:
            d: dict[str, Any] = {"content": chunk.text}
            entries = chunk.logprobs
        else:
            thought, text = self._split(index, chunk)
            if self.parser is None:
                parsed = Parsed(content=text)
            else:
                parser = self._parsers.setdefault(index, self.parser())
                parsed = parser.feed(text)
                if chunk.final:
                    parsed += parser.finish()
            entries = self._waiting_logprobs.pop(index, []) + chunk.logprobs
            if not (thought or parsed.content or parsed.tool_calls or first or chunk.final):
                self._waiting_logprobs[index] = entries
                return None
            d = {"reasoning_content": thought, "reasoning": thought} if thought else {}
            if parsed.content:
                d["content"] = parsed.content
                self._said.add(index)
            if parsed.tool_calls:
                d["tool_calls"] = [call.as_openai() for call in parsed.tool_calls]
                self._called.add(index)
            if chunk.final and index not in self._said and index not in self._called and not (
                    index in self._reasoners and self._reasoners[index].opened):
                d["content"] = ""  # an empty reply: content "", as the whole message has it (null after reasoning)
            reason = finish_reason(reason, index in self._called)
        if first:
            d = {"role": "assistant"} | d
        return {"index": index, "delta": d, "logprobs": self.logprobs(entries), "finish_reason": reason}


def _completion_body(model: str, choices: dict[int, ChoiceResult], n: int, parser: ParserFactory | None,
                     logprobs: LogprobsFormatter, reasoning: ReasoningFactory | None = None,
                     count_tokens: TokenCounter | None = None) -> dict[str, Any]:
    """The chat.completion object of a non-streamed request's choices; with `count_tokens` (the endpoint has a
    reasoning parser) its usage counts the reasoning tokens."""
    rows: list[dict[str, Any]] = []
    for index, c in sorted(choices.items()):
        message, reason = chat_message(c.text, c.finish_reason, parser, reasoning)
        if count_tokens is not None and reasoning is None:  # the parser is off for this request: no reasoning
            message |= {"reasoning_content": None, "reasoning": None}
        rows.append({"index": index, "message": message, "logprobs": logprobs(c.logprobs), "finish_reason": reason})
    counts = usage(choices, n)
    if count_tokens is not None:
        counts |= reasoning_usage(count_tokens, [row["message"].get("reasoning_content") for row in rows])
    return {"id": f"chatcmpl-{uuid.uuid4().hex}", "object": "chat.completion", "created": int(time.time()),
            "model": model, "choices": rows, "usage": counts}


async def chat_completion(service: OpenAIService, body: ChatRequest, request: Request
                          ) -> dict[str, Any] | JSONResponse | StreamingResponse:
    """The answer to a chat completion request: the chat.completion object, its stream, or an error
    response (400 a field or the messages, 404 the model, 503 overloaded or no replica, 499 client gone)."""
    lora_name, bad = await service.resolve_model(body.model)
    if bad is not None:
        return bad
    sampling = body.sampling(service.default_max_tokens)
    if lora_name is not None:
        sampling["lora_name"] = lora_name
    if body.max_completion_tokens:
        sampling["max_tokens"] = body.max_completion_tokens
    param = "max_completion_tokens" if body.max_completion_tokens else "max_tokens"
    if (bad := budget_error(body.n, sampling["max_tokens"], param)) is not None:
        return bad
    try:
        mode = body.tool_mode()
        if (constraint := chat_constraint(body, mode)) is not None:
            sampling["structured_output"] = constraint
    except RequestError as exc:
        return error_response(400, exc.message, param=exc.param)
    parser = parser_factory(service.tokenizer, body, mode)
    try:  # a long conversation takes a while to render: off the event loop
        prompt = await asyncio.to_thread(render_prompt, service.tokenizer, body, mode)
    except RequestError as exc:  # chat_template_kwargs the template cannot take
        return error_response(400, exc.message, param=exc.param)
    except ValueError as exc:
        return error_response(400, str(exc), param="messages")
    except Exception as exc:  # the template choked on what the messages hold (odd extra fields)
        logger.info("chat template failed on a request: %r", exc)
        return error_response(400, "invalid request: messages cannot be rendered with the model's chat "
                              "template", param="messages")
    want_lp = body.logprobs
    if want_lp:
        sampling["logprobs"] = body.top_logprobs or 0
    logprobs = _logprobs_formatter(service, body)
    # A constrained output is decoded under its grammar from the first token, so it holds no reasoning: the
    # reasoning parser stays off for it (R1's would take the whole output for reasoning).
    reasoning = None if "structured_output" in sampling else service.reasoning_parser
    count_tokens = None if service.reasoning_parser is None else _token_counter(service)
    if body.stream:
        include = bool(body.stream_options and body.stream_options.include_usage)
        stream = ChatStream(parser, logprobs, reasoning)
        details = None if count_tokens is None else functools.partial(
            reasoning_usage, count_tokens, stream.reasoning_texts.values())
        return await stream_response(service, request, "chat", [prompt], sampling, body.n, want_lp, include,
                                     stream.delta, usage_details=details)
    choices = await service.collect_or_error(request, [prompt], sampling, body.n, want_lp)
    if isinstance(choices, JSONResponse):
        return choices
    build = functools.partial(_completion_body, service.served_name(body.model), choices, body.n, parser, logprobs,
                              reasoning, count_tokens)
    return await asyncio.to_thread(build) if want_lp else build()
