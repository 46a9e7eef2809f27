"""What a request to the upstream tritonservers yields and how it fails: the types the router produces and the
OpenAI endpoint consumes, so that the endpoint needs no part of the router to read them."""

from __future__ import annotations

from dataclasses import dataclass, field

# A speculating request's figures (vLLM's spec_decode names); the engine's output tensors carry them as spec_<name>.
SPEC_FIGURES = ("num_drafts", "num_draft_tokens", "num_accepted_tokens")


@dataclass
class Chunk:
    """One streamed response of the engine for one request. `text`: the new text; `final`: the request's
    last chunk, which alone carries `finish_reason` and the token counts; `logprobs`: per generated token,
    token id -> logprob, the sampled token first, then the top-n."""

    text: str
    final: bool
    finish_reason: str | None = None
    num_input_tokens: int | None = None
    num_output_tokens: int | None = None
    logprobs: list[dict[str, float]] = field(default_factory=list)
    # On the final chunk of a request that verified drafts: num_drafts, num_draft_tokens, num_accepted_tokens
    spec_decoding: dict[str, int] | None = None
    # On the final chunk: the prompt tokens served from the engine's prefix cache
    num_cached_tokens: int | None = None


class UpstreamError(Exception):
    """The replica failed the request. `status`: 400 a request it rejected (the message is the engine's, meant
    for the client), 500 the request failed in the model, 502 a transport failure, 503 every replica down or
    overloaded (`overloaded`). The message may name the replica: log it, do not show it to a client."""

    def __init__(self, message: str, status: int = 502, before_first_token: bool = True,
                 overloaded: bool = False) -> None:
        super().__init__(message)
        self.status = status
        self.before_first_token = before_first_token
        self.overloaded = overloaded

    @property
    def retryable(self) -> bool:
        """Safe to send to another replica: nothing streamed yet, and the failure was the replica's."""
        return self.before_first_token and (self.status == 502 or self.overloaded)
