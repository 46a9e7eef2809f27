"""A scheduled step as the engine hands it to the worker: which sequences run, how many tokens each."""

from __future__ import annotations

from dataclasses import dataclass, field

from tritium.backend.core.sequence import Sequence


@dataclass
class ScheduledSequence:
    seq: Sequence
    num_new_tokens: int  # its drafts included
    draft: list[int] = field(default_factory=list)  # speculative tokens run after its last token (backend/spec/)

    @property
    def samples(self) -> bool:
        """Whether this step reaches the end of the sequence's tokens, so a token is sampled."""
        return self.seq.num_computed_tokens + self.num_new_tokens - len(self.draft) == self.seq.num_tokens


@dataclass
class SchedulerOutput:
    scheduled: list[ScheduledSequence] = field(default_factory=list)
    preempted: list[Sequence] = field(default_factory=list)
    sampling: list[Sequence] = field(default_factory=list)  # the scheduled sequences that sample a token
    drafts: list[list[int]] = field(default_factory=list)  # aligned with `sampling`: each one's draft tokens

    @property
    def num_tokens(self) -> int:
        return sum(s.num_new_tokens for s in self.scheduled)
