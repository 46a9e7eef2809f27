"""Incremental detokenization on `tokenizers`' DecodeStream (docs/architecture.md#the-engine-step, text side)."""

from __future__ import annotations

from collections import deque

from tokenizers.decoders import DecodeStream

from tritium.backend.tokenizer import Tokenizer

PROMPT_CONTEXT_TOKENS = 5  # prime the stream, so the first output token keeps its leading space


class IncrementalDetokenizer:
    def __init__(self, tokenizer: Tokenizer, prompt_token_ids: list[int], skip_special_tokens: bool = True) -> None:
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        # The last tokens whose text was released, and the tokens whose text is not complete yet.
        self.context: deque[int] = deque(prompt_token_ids[-PROMPT_CONTEXT_TOKENS:], maxlen=PROMPT_CONTEXT_TOKENS)
        self.held: list[int] = []
        self._stream = DecodeStream(ids=list(self.context), skip_special_tokens=skip_special_tokens)

    def add_token(self, token_id: int) -> str:
        """The text `token_id` completes ("" while a character is incomplete, or for a skipped special token)."""
        self.held.append(token_id)
        text = self._stream.step(self.tokenizer.hf, token_id)
        if text is None:
            return ""
        self._release_held()
        return text

    def flush(self) -> str:
        """At the end of generation: the text of the tokens still held (U+FFFD for a broken character)."""
        if not self.held:
            return ""
        skip, context = self.skip_special_tokens, list(self.context)
        before = self.tokenizer.decode(context, skip_special_tokens=skip)
        after = self.tokenizer.decode(context + self.held, skip_special_tokens=skip)
        self._release_held()
        return after[len(before):] if after.startswith(before) else after

    def _release_held(self) -> None:
        self.context.extend(self.held)
        self.held = []
