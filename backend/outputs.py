"""What the engine returns for a request: `RequestOutput`, plain data."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class SpecDecodingStats:
    """One request's speculative decoding, vLLM's per-request names (docs/speculative-decoding.md)."""

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
    """What one step changed for one request: `delta_*` are new since its previous output; `text`, `token_ids`
    and `logprobs` are set on the final output only (docs/python.md#llmengine)."""

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
    spec_decoding: SpecDecodingStats | None = None  # on the final output, when speculation is on
