"""What the scheduler and the engine ask of speculative decoding: which requests speculate, their drafts each
decode step, and the totals the metrics read."""

from __future__ import annotations

from collections.abc import Callable

from tritium.backend.core.sequence import Sequence
from tritium.backend.sampling_params import SamplingParams
from tritium.backend.spec.acceptance import AdaptiveDraftLength, SpecState
from tritium.backend.spec.config import SpeculativeConfig
from tritium.backend.spec.draft_model import DraftModel
from tritium.backend.spec.ngram import propose_ngram


class Speculator:
    """Drafts tokens for speculating sequences (n-gram prompt lookup, or `drafter`: a draft model) within the
    caps of a step."""

    def __init__(self, config: SpeculativeConfig, max_model_len: int, drafter: DraftModel | None = None) -> None:
        assert (drafter is not None) == (config.method == "draft_model")
        self.config = config
        self.max_model_len = max_model_len
        self.drafter = drafter
        self.num_draft_tokens = 0  # engine totals (Prometheus counters)
        self.num_accepted_tokens = 0

    @staticmethod
    def speculates(params: SamplingParams) -> bool:
        """Whether a request with `params` may speculate: not with structured output (its grammar would have to
        check each draft position; such requests decode one token a step, exactly as without speculation)."""
        return params.structured_output is None

    def new_state(self, params: SamplingParams) -> SpecState | None:
        """The speculation state of a new request (None: it never speculates)."""
        if not self.speculates(params):
            return None
        return SpecState(AdaptiveDraftLength(self.config.num_speculative_tokens))

    def propose(self, seq: Sequence, max_tokens: int, allocate: Callable[[int], bool]) -> list[int]:
        """Draft tokens for decoding `seq` this step: at most `max_tokens` (what the step's token budget leaves
        beyond its one token), the request's current draft length, the tokens it may still generate less the
        one a verification always adds, and what the context still holds. `allocate(n)` gives `seq` blocks for n
        new tokens (False: none free; then no drafts)."""
        state = seq.spec
        if state is None:
            return []
        k = min(max_tokens, seq.params.max_tokens - seq.num_output_tokens - 1,
                self.max_model_len - seq.num_tokens)
        if k < 1 or (k := min(k, state.length.current())) < 1 or not allocate(1 + k):
            return []
        if self.drafter is None:
            c = self.config
            return propose_ngram(seq.token_ids, k, c.prompt_lookup_min, c.prompt_lookup_max)
        if state.draft_preemptions != seq.num_preemptions:  # its blocks, and the draft's KV in them, are gone
            state.draft_seen, state.draft_preemptions = 0, seq.num_preemptions
        drafts = self.drafter.propose(seq, state.draft_seen, k)
        state.draft_reach = seq.num_tokens + k - 1  # it ran the tokens and all drafts but the last
        return drafts

    def record(self, seq: Sequence, drafted: int, accepted: int) -> None:
        """Count a verification step of `seq`: `drafted` tokens, the first `accepted` of them kept."""
        if seq.spec is not None and drafted:
            seq.spec.record(drafted, accepted)
            # Before the run is appended: the draft's KV holds the tokens and the accepted drafts it ran.
            seq.spec.draft_seen = min(seq.spec.draft_reach, seq.num_tokens + accepted)
            self.num_draft_tokens += drafted
            self.num_accepted_tokens += accepted
