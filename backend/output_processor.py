"""Sampled tokens -> delta-only `RequestOutput`s: detokenizing, stop strings, the totals of the final output."""

from __future__ import annotations

from dataclasses import dataclass, field

from tritium.backend.core.sequence import Sequence
from tritium.backend.core.stop_checker import StopStrings
from tritium.backend.detokenizer import IncrementalDetokenizer
from tritium.backend.outputs import RequestOutput
from tritium.backend.tokenizer import Tokenizer


@dataclass(eq=False)
class RequestState:
    """The text side of one request."""

    detokenizer: IncrementalDetokenizer
    stop_strings: StopStrings | None
    want_logprobs: bool
    text_parts: list[str] = field(default_factory=list)  # released text, joined once at the end
    unsent_text: list[str] = field(default_factory=list)
    logprobs: list[dict[int, float]] = field(default_factory=list)
    num_sent_logprobs: int = 0
    num_sent_tokens: int = 0  # in Sequence.token_ids, the prompt included

    def release(self, text: str) -> None:
        if self.stop_strings is not None:
            text = self.stop_strings.feed(text)
        if text:
            self.unsent_text.append(text)

    def release_held(self) -> None:
        """At the end, whatever the reason: the held text and a tail that never became a stop string (nothing
        after a stop string)."""
        self.release(self.detokenizer.flush())
        if self.stop_strings is not None and (tail := self.stop_strings.flush()):
            self.unsent_text.append(tail)


class OutputProcessor:
    def __init__(self, tokenizer: Tokenizer) -> None:
        self.tokenizer = tokenizer
        self.states: dict[str, RequestState] = {}

    def add(self, seq: Sequence) -> None:
        p = seq.params
        self.states[seq.request_id] = RequestState(
            detokenizer=IncrementalDetokenizer(self.tokenizer, seq.prompt_token_ids, p.skip_special_tokens),
            stop_strings=StopStrings(p.stop, p.include_stop_str_in_output) if p.stop else None,
            want_logprobs=p.logprobs is not None,
            num_sent_tokens=seq.num_prompt_tokens,
        )

    def append_token(self, seq: Sequence, token: int, logprobs: dict[int, float] | None) -> bool:
        """Detokenize `seq`'s new `token`. Returns True when a stop string appeared in its text."""
        state = self.states[seq.request_id]
        if logprobs is not None:  # the sampler returns them only when asked
            state.logprobs.append(logprobs)
        state.release(state.detokenizer.add_token(token))
        return state.stop_strings is not None and state.stop_strings.stopped

    def error_output(self, seq: Sequence, error: str, reason: str = "error") -> RequestOutput:
        """A final output that touches nothing that may have failed (the detokenizer, the logprobs)."""
        self.states.pop(seq.request_id, None)
        return RequestOutput(
            request_id=seq.request_id, delta_text="", delta_token_ids=[], finished=True, finish_reason=reason,
            num_input_tokens=seq.num_prompt_tokens, num_output_tokens=seq.num_output_tokens,
            num_cached_tokens=seq.num_cached_tokens, token_ids=seq.output_token_ids, prompt=seq.prompt,
            prompt_token_ids=seq.prompt_token_ids, error=error,
        )

    def output(self, seq: Sequence) -> RequestOutput:
        """What changed for `seq` since its previous output; once it finished, the final one (state dropped)."""
        state = self.states[seq.request_id]
        finished = seq.finished
        if finished:
            state.release_held()
        delta_text = "".join(state.unsent_text)
        state.unsent_text.clear()
        if delta_text:
            state.text_parts.append(delta_text)
        delta_ids = seq.token_ids[state.num_sent_tokens :]
        state.num_sent_tokens = len(seq.token_ids)
        delta_logprobs = None
        if state.want_logprobs:
            delta_logprobs = state.logprobs[state.num_sent_logprobs :]
            state.num_sent_logprobs = len(state.logprobs)
        out = RequestOutput(
            request_id=seq.request_id, delta_text=delta_text, delta_token_ids=delta_ids,
            finished=finished, finish_reason=seq.finish_reason, num_input_tokens=seq.num_prompt_tokens,
            num_output_tokens=seq.num_output_tokens, num_cached_tokens=seq.num_cached_tokens,
            delta_logprobs=delta_logprobs,
        )
        if finished:
            self.states.pop(seq.request_id, None)
            out.prompt, out.prompt_token_ids = seq.prompt, seq.prompt_token_ids
            out.text = "".join(state.text_parts)
            out.token_ids = seq.output_token_ids
            out.logprobs = state.logprobs if state.want_logprobs else None
        return out
