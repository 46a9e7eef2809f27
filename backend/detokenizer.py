"""Incremental detokenization with stop strings.

Text is decoded over a sliding window of tokens (a few prompt tokens give the first output token
its leading space, as a tokenizer decoding the whole sequence would). A window whose text ends in
U+FFFD is an incomplete UTF-8 character and is held until the next token completes it. Text that
could still grow into a stop string is held back from the stream too.
"""

from __future__ import annotations

from typing import Protocol

PROMPT_CONTEXT_TOKENS = 5


class Decoder(Protocol):
    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str: ...


class IncrementalDetokenizer:
    def __init__(
        self,
        tokenizer: Decoder,
        prompt_token_ids: list[int],
        stop: list[str] | None = None,
        include_stop_str_in_output: bool = False,
        skip_special_tokens: bool = True,
    ) -> None:
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        context = list(prompt_token_ids[-PROMPT_CONTEXT_TOKENS:])
        self.ids = context
        self.prefix_offset = 0
        self.read_offset = len(context)
        self.stop = list(stop or [])
        self.include_stop = include_stop_str_in_output
        self.max_stop_len = max((len(s) for s in self.stop), default=0)
        self.text = ""
        self.emitted = 0
        self.stopped = False

    def _decode(self, start: int, end: int | None = None) -> str:
        return self.tokenizer.decode(self.ids[start:end], skip_special_tokens=self.skip_special_tokens)

    def add_token(self, token_id: int) -> bool:
        """Append a generated token. Returns True when a stop string appeared (the text is then cut
        before it, or after it with include_stop_str_in_output)."""
        if self.stopped:
            return True
        self.ids.append(token_id)
        prefix_text = self._decode(self.prefix_offset, self.read_offset)
        new_text = self._decode(self.prefix_offset)
        if len(new_text) <= len(prefix_text) or new_text.endswith("\ufffd"):
            return False
        self.prefix_offset = self.read_offset
        self.read_offset = len(self.ids)
        return self._append(new_text[len(prefix_text) :])

    def flush(self) -> None:
        """At the end of generation: take whatever the held tokens decode to."""
        if self.stopped or self.read_offset >= len(self.ids):
            return
        prefix_text = self._decode(self.prefix_offset, self.read_offset)
        new_text = self._decode(self.prefix_offset)
        self.read_offset = len(self.ids)
        if len(new_text) > len(prefix_text):
            self._append(new_text[len(prefix_text) :])

    def _append(self, delta: str) -> bool:
        start = max(0, len(self.text) - self.max_stop_len + 1)
        self.text += delta
        if not self.stop:
            return False
        hits = [(i, s) for s in self.stop if (i := self.text.find(s, start)) >= 0]
        if not hits:
            return False
        idx, s = min(hits)
        self.text = self.text[: idx + len(s)] if self.include_stop else self.text[:idx]
        self.stopped = True
        return True

    def _held_back(self) -> int:
        """Length of the longest tail of the text that is a proper prefix of a stop string."""
        for n in range(min(self.max_stop_len - 1, len(self.text)), 0, -1):
            tail = self.text[-n:]
            if any(s.startswith(tail) for s in self.stop):
                return n
        return 0

    def take_delta(self, finished: bool) -> str:
        """New text that is safe to send: everything when finished, else all but a possible
        stop-string prefix at the end."""
        end = len(self.text) if finished or self.stopped else len(self.text) - self._held_back()
        if end <= self.emitted:
            return ""
        delta = self.text[self.emitted : end]
        self.emitted = end
        return delta
