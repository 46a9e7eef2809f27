"""What the engine returns for a request: `RequestOutput`, plain data."""

from __future__ import annotations

from dataclasses import dataclass, field

from tritium.backend.spec.acceptance import SpecDecodingStats


@dataclass
class RequestOutput:
    """What one step changed for one request: delta-only, so the work per output does not grow with the
    length of the generation. `delta_text`, `delta_token_ids` and `delta_logprobs` are new since this
    request's previous output. The final output (`finished`) also carries the totals: `text`, `token_ids`
    and `logprobs` hold the whole generation there and are empty (None for logprobs) on every other output.
    finish_reason: "stop", "length", "abort" or "error" (then `error` says why)."""

    request_id: str
    delta_text: str
    delta_token_ids: list[int]
    finished: bool
    finish_reason: str | None
    num_input_tokens: int
    num_output_tokens: int  # generated so far, this output's included
    num_cached_tokens: int
    delta_logprobs: list[dict[int, float]] | None = None
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[dict[int, float]] | None = None
    prompt: str | None = None
    prompt_token_ids: list[int] = field(default_factory=list)
    error: str | None = None
    # Speculative decoding's figures of this request (vLLM's per-request names), on the final output of a
    # request that could speculate; None otherwise.
    spec_decoding: SpecDecodingStats | None = None
