"""The engine's state for one request."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

import torch

from tritium.backend.detokenizer import IncrementalDetokenizer
from tritium.backend.sampling_params import SamplingParams


class SequenceStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass(eq=False)
class Sequence:
    """Token ids (prompt then output), how many of them have K/V in the cache, and the blocks
    holding them. `num_computed_tokens` goes back to 0 when the sequence is preempted."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    params: SamplingParams
    detokenizer: IncrementalDetokenizer
    arrival: int
    token_ids: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0
    num_cached_tokens: int = 0  # prompt tokens served from the prefix cache at the last admission
    block_table: list[int] = field(default_factory=list)
    block_hashes: list[bytes] = field(default_factory=list)  # chained hashes of the full blocks
    status: SequenceStatus = SequenceStatus.WAITING
    finish_reason: str | None = None
    max_tokens: int = 0  # params.max_tokens capped by the model's context
    generator: torch.Generator | None = None
    logprobs: list[dict[int, float]] = field(default_factory=list)
    num_preemptions: int = 0
    num_sent_tokens: int = 0  # output tokens already reported in a RequestOutput

    def __post_init__(self) -> None:
        if not self.token_ids:
            self.token_ids = list(self.prompt_token_ids)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens :]

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - len(self.prompt_token_ids)

    @property
    def finished(self) -> bool:
        return self.status is SequenceStatus.FINISHED
