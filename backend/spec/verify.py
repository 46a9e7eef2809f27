"""Verification of a step's drafts (why it is exact: docs/speculative-decoding.md, "Exactness")."""

from __future__ import annotations

from dataclasses import dataclass, field

from tritium.backend.core.sequence import Sequence
from tritium.backend.sample.sampler import SamplerOutput


def position_views(seqs: list[Sequence], drafts: list[list[int]]) -> list[Sequence]:
    """The step's sampler rows: per sequence itself, then per draft a view with the drafts before it appended."""
    rows: list[Sequence] = []
    for seq, draft in zip(seqs, drafts, strict=True):
        rows.append(seq)
        for j in range(1, len(draft) + 1):
            rows.append(Sequence(seq.request_id, None, seq.prompt_token_ids, seq.params, seq.arrival,
                                 token_ids=seq.token_ids + draft[:j]))
    return rows


@dataclass
class Verified:
    """Per sequence: its run's last token as a SamplerOutput row, and the accepted drafts before it."""

    sampled: SamplerOutput
    accepted: list[list[int]] = field(default_factory=list)
    accepted_logprobs: list[list[dict[int, float] | None]] = field(default_factory=list)

    def end_run(self, row: int, n: int) -> None:
        """Cut `row`'s run to its first `n` tokens (1 <= n <= its length): its grammar completed at the n-th."""
        token = self.sampled.token_ids[row]
        assert token is not None and 1 <= n <= len(self.accepted[row]) + 1
        run = [*self.accepted[row], token]
        logprobs = [*self.accepted_logprobs[row], self.sampled.logprobs[row]]
        self.sampled.token_ids[row], self.sampled.logprobs[row] = run[n - 1], logprobs[n - 1]
        self.accepted[row], self.accepted_logprobs[row] = run[: n - 1], logprobs[: n - 1]


def accept_runs(drafts: list[list[int]], rows: SamplerOutput) -> Verified:
    """A run per sequence from `position_views` rows; a row without a token ends it (its error, none accepted)."""
    out = Verified(SamplerOutput([], [], []))
    r = 0
    for draft in drafts:
        m = 0
        while m < len(draft) and rows.token_ids[r + m] == draft[m]:
            m += 1
        last = r + m
        error = rows.errors[last]
        out.sampled.token_ids.append(rows.token_ids[last])
        out.sampled.logprobs.append(rows.logprobs[last])
        out.sampled.errors.append(error)
        out.accepted.append(list(draft[:m]) if error is None else [])
        out.accepted_logprobs.append(list(rows.logprobs[r:last]) if error is None else [])
        r += len(draft) + 1
    return out
