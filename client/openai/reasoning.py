"""Reasoning parsers for the chat endpoint (`tritium openai --reasoning-parser`): a thinking model's text split into
its reasoning (`message.reasoning_content`) and its answer (`message.content`), under vLLM's parser names.

Both parsers read a `<think>` ... `</think>` block at the start of the output:

- "deepseek_r1": everything before the first `</think>` is reasoning, with or without a `<think>` first (R1's
  chat template opens the block in the prompt, so the model usually writes only the end marker). Without a
  `</think>` (the output was cut by max_tokens) the whole text is reasoning.
- "qwen3": reasoning only when the output opens with `<think>` (after whitespace); text that does not is all
  content (Qwen3 with `enable_thinking` off). With `<think>` but no `</think>`, the text after `<think>` is
  reasoning.

The markers belong to neither part; whitespace before `<think>` is dropped, the rest is kept as written (the
answer after `</think>` keeps its leading newlines, as in vLLM). Text after the block is all content, markers
and all. Each parser takes one choice's text in pieces (`feed`, then `finish`) and holds back only what could
still become a marker, so a stream and a whole text (`split_reasoning`) give the same parts however the text
is split. Pure text, no server, no tokenizer.
"""

from __future__ import annotations

from collections.abc import Callable
from types import MappingProxyType
from typing import ClassVar, NamedTuple

THINK_START, THINK_END = "<think>", "</think>"


class ReasoningDelta(NamedTuple):
    """What a piece of text adds to the reasoning and to the content (either may be empty)."""

    reasoning: str
    content: str


def _marker_prefix(text: str, marker: str) -> int:
    """The length of the longest end of `text` that begins `marker` (and could become it)."""
    for size in range(min(len(text), len(marker) - 1), 0, -1):
        if marker.startswith(text[-size:]):
            return size
    return 0


class ReasoningParser:
    """Splits one choice's text into reasoning and content as it streams. Subclasses set `start_required`: whether
    the reasoning must open with `<think>` (else everything before `</think>` is reasoning). `opened` says
    whether the output has a reasoning part (known once the start of the text is)."""

    start_required: ClassVar[bool] = True

    def __init__(self) -> None:
        self._buf = ""  # text not given out yet: the start being read, or a possible marker's beginning
        self._phase = "start"  # "start" (before the first other than whitespace is known), "reasoning", "content"
        self.opened = False

    def feed(self, text: str) -> ReasoningDelta:
        """What the next piece of text adds; a possible `<think>` at the start or `</think>` in the reasoning is
        held back until it is known."""
        self._buf += text
        return self._advance(final=False)

    def finish(self) -> ReasoningDelta:
        """What is left once the text has ended: held text goes where it stands (an unclosed block is
        reasoning)."""
        return self._advance(final=True)

    def _advance(self, final: bool) -> ReasoningDelta:
        reasoning = ""
        if self._phase == "start":
            head = self._buf.lstrip()
            if head.startswith(THINK_START):
                self._buf, self._phase, self.opened = head[len(THINK_START):], "reasoning", True
            elif not final and THINK_START.startswith(head):  # whitespace, or a beginning of <think>
                return ReasoningDelta("", "")
            elif self.start_required:
                self._phase = "content"
            else:
                self._phase, self.opened = "reasoning", True
        if self._phase == "reasoning":
            end = self._buf.find(THINK_END)
            if end < 0:
                keep = 0 if final else _marker_prefix(self._buf, THINK_END)
                reasoning, self._buf = self._buf[:len(self._buf) - keep], self._buf[len(self._buf) - keep:]
                return ReasoningDelta(reasoning, "")
            reasoning, self._buf, self._phase = self._buf[:end], self._buf[end + len(THINK_END):], "content"
        content, self._buf = self._buf, ""
        return ReasoningDelta(reasoning, content)


class DeepSeekR1ReasoningParser(ReasoningParser):
    """DeepSeek-R1: the text before `</think>` is reasoning, whether or not the output opened with `<think>`."""

    start_required = False


class Qwen3ReasoningParser(ReasoningParser):
    """Qwen3: reasoning only inside `<think>` ... `</think>` at the start; an output without `<think>` is
    content."""

    start_required = True


ReasoningFactory = Callable[[], ReasoningParser]

REASONING_PARSERS: MappingProxyType[str, type[ReasoningParser]] = MappingProxyType({
    "deepseek_r1": DeepSeekR1ReasoningParser,
    "qwen3": Qwen3ReasoningParser,
})


def reasoning_parser(name: str) -> type[ReasoningParser]:
    """The parser class registered under `name` (vLLM's names). Raises ValueError for an unknown one."""
    try:
        return REASONING_PARSERS[name]
    except KeyError:
        raise ValueError(f"unknown reasoning parser {name!r}; known: {', '.join(REASONING_PARSERS)}") from None


def split_reasoning(parser: ReasoningParser, text: str) -> tuple[str | None, str | None]:
    """(reasoning, content) of a whole output, through a fresh `parser`. Reasoning is None when there is none
    (no block, or an empty one); content is None when the output has a reasoning part and nothing after it (cut
    short, or it stopped right after `</think>`); an output without reasoning keeps its content as it is, empty
    or not."""
    first, last = parser.feed(text), parser.finish()
    reasoning, content = first.reasoning + last.reasoning, first.content + last.content
    return reasoning or None, None if parser.opened and not content else content
