"""Verification of a step's drafts against the target model.

A speculating sequence runs its last token and its k drafts through the model in one step (a prefill chunk of
k + 1 tokens over its cached KV) and gets logits at each of those k + 1 positions. `position_views` turns it
into k + 1 sampler rows: row j sees the sequence's tokens followed by the first j drafts, so penalties and
min_tokens bans at j count exactly the tokens before j; each row is sampled as any row is (temperature,
top-k/p, min-p, logprobs, the request's seeded generator, one draw per row in order). `accept_runs` keeps the
drafts while each equals the token sampled at its position, and then the sampled token of the first position
that differs (the correction) or of the last one (the bonus).

Why that is exact: drafts are deterministic given the tokens so far (prompt lookup), so the draft distribution
q is one-hot on d. Rejection sampling accepts d with probability min(1, p(d) / q(d)) = p(d) and otherwise
draws from norm(max(p - q, 0)) = p without d. Drawing t ~ p and accepting d when t == d has the same
probability p(d), and on a mismatch t is p conditioned on t != d: the same distribution. Greedy rows are the
argmax at each position, so greedy output is token-identical to decoding one token at a time.

Structured output: a constrained sequence's drafts are those its grammar takes (`DraftProposer.propose`), and row
j is sampled under its grammar's mask after the first j drafts, the mask it would have decoding one token at
a time, so the same argument holds under the grammar; the matcher then advances over the kept run, and a run
that completes the grammar ends at that token (`Verified.end_run`).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from tritium.backend.core.sequence import Sequence
from tritium.backend.sample.sampler import SamplerOutput


def position_views(seqs: list[Sequence], drafts: list[list[int]]) -> list[Sequence]:
    """The sampler rows of a step: per sequence itself, then per draft a view of it with the drafts before
    that position appended (same request id and params; only the sampler reads them)."""
    rows: list[Sequence] = []
    for seq, draft in zip(seqs, drafts, strict=True):
        rows.append(seq)
        for j in range(1, len(draft) + 1):
            rows.append(Sequence(seq.request_id, None, seq.prompt_token_ids, seq.params, seq.arrival,
                                 token_ids=seq.token_ids + draft[:j]))
    return rows


@dataclass
class Verified:
    """Per sequence (`SchedulerOutput.sampling` order): the last token of its run (correction or bonus; the
    only token of a row that did not speculate), its logprobs and error as a SamplerOutput row has them, and
    the accepted drafts before it with their logprobs."""

    sampled: SamplerOutput
    accepted: list[list[int]] = field(default_factory=list)
    accepted_logprobs: list[list[dict[int, float] | None]] = field(default_factory=list)

    def end_run(self, row: int, n: int) -> None:
        """Keep only the first `n` tokens (1 <= n <= its length) of `row`'s run, its n-th becoming its last
        (a grammar that completed there takes nothing after it)."""
        token = self.sampled.token_ids[row]
        assert token is not None and 1 <= n <= len(self.accepted[row]) + 1
        run = [*self.accepted[row], token]
        logprobs = [*self.accepted_logprobs[row], self.sampled.logprobs[row]]
        self.sampled.token_ids[row], self.sampled.logprobs[row] = run[n - 1], logprobs[n - 1]
        self.accepted[row], self.accepted_logprobs[row] = run[: n - 1], logprobs[: n - 1]


def accept_runs(drafts: list[list[int]], rows: SamplerOutput) -> Verified:
    """Collapse the sampler's rows (`position_views` order) into one run per sequence: the drafts kept while
    each equals the token sampled at its position, then the token sampled at the first position that differs
    (or after the last draft). A position with no token (its error) ends the sequence's run there with that
    error and nothing accepted."""
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
