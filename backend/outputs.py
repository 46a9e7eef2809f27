"""What the engine returns for a request: `RequestOutput`, plain data."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class SpecDecodingStats:
    """One request's speculative decoding, named as vLLM's per-request metrics and AIPerf's record:
    verification steps, draft tokens proposed and accepted, and how many steps accepted n drafts."""

    num_spec_steps: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    acceptance_histogram: dict[int, int] = field(default_factory=dict)

    @property
    def mean_acceptance_length(self) -> float:
        """Tokens per verification step, the bonus or correction token included (1.0 with no steps)."""
        return 1.0 + self.num_accepted_tokens / self.num_spec_steps if self.num_spec_steps else 1.0

    @property
    def draft_acceptance_rate(self) -> float:
        """Accepted / drafted tokens (0.0 when nothing was drafted)."""
        return self.num_accepted_tokens / self.num_draft_tokens if self.num_draft_tokens else 0.0

    def to_dict(self) -> dict[str, object]:
        """The figures as plain JSON-ready values (derived ones included)."""
        return {"num_spec_steps": self.num_spec_steps, "num_draft_tokens": self.num_draft_tokens,
                "num_accepted_tokens": self.num_accepted_tokens,
                "mean_acceptance_length": self.mean_acceptance_length,
                "draft_acceptance_rate": self.draft_acceptance_rate,
                "acceptance_histogram": dict(sorted(self.acceptance_histogram.items()))}

    def record(self, drafted: int, accepted: int) -> None:
        """Count one verification step of `drafted` tokens of which the first `accepted` were kept."""
        self.num_spec_steps += 1
        self.num_draft_tokens += drafted
        self.num_accepted_tokens += accepted
        self.acceptance_histogram[accepted] = self.acceptance_histogram.get(accepted, 0) + 1


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
