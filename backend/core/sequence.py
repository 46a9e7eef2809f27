"""The scheduler's state for one request: its tokens, how many have K/V in the cache, its blocks."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from tritium.backend.outputs import SpecDecodingStats
from tritium.backend.sampling_params import SamplingParams

if TYPE_CHECKING:
    from tritium.backend.lora.adapter import LoraAdapter


class SequenceStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass(eq=False)
class Sequence:
    """`num_computed_tokens` (tokens with K/V in the cache) returns to 0 on preemption; `lora_slot` is -1
    unless the sequence runs on an adapter."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    params: SamplingParams
    arrival: int
    token_ids: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0
    num_cached_tokens: int = 0  # prompt tokens served from the prefix cache at the last admission
    block_table: list[int] = field(default_factory=list)
    block_hashes: list[bytes] = field(default_factory=list)  # chained hashes of the full blocks
    status: SequenceStatus = SequenceStatus.WAITING
    finish_reason: str | None = None
    num_preemptions: int = 0
    lora: LoraAdapter | None = None
    lora_slot: int = -1
    spec: SpecDecodingStats | None = None  # a speculating request's figures (None: it never speculates)
    draft_tokens: list[int] = field(default_factory=list)  # the worker's drafts for its next step
    priority: int = 0  # lower runs first under the "priority" scheduling policy (waiting_queue.py)
    arrival_time: float = 0.0  # the scheduler's clock when it was queued (its priority ages from then)
    kv_key: bytes = b""  # what its K/V depend on besides its tokens and adapter (core/rotary_rule.py)

    def __post_init__(self) -> None:
        if not self.token_ids:
            self.token_ids = list(self.prompt_token_ids)
        self.num_prompt_tokens = len(self.prompt_token_ids)

    @property
    def cache_key(self) -> bytes:
        """The parent of its first block's hash: the adapter's content hash (b"" for the base model), then `kv_key`."""
        return (self.lora.content_hash if self.lora is not None else b"") + self.kv_key

    @property
    def num_tokens(self) -> int:
        """Prompt and generated tokens."""
        return len(self.token_ids)

    @property
    def output_token_ids(self) -> list[int]:
        """A copy."""
        return self.token_ids[self.num_prompt_tokens :]

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def finished(self) -> bool:
        return self.status is SequenceStatus.FINISHED
