"""What the scheduler and the engine ask of speculative decoding: which requests speculate, their drafts each
decode step (a constrained request's cut to what its grammar accepts), and the totals the metrics read."""

from __future__ import annotations

from collections.abc import Callable

from tritium.backend.core.sequence import Sequence
from tritium.backend.sampling_params import SamplingParams
from tritium.backend.spec.acceptance import AdaptiveDraftLength, SpecState
from tritium.backend.spec.config import SpeculativeConfig
from tritium.backend.spec.draft_model import DraftModel
from tritium.backend.spec.ngram import propose_ngram

# How many leading drafts of a request its grammar takes (`StructuredDecoding.draft_prefix`).
GrammarPrefix = Callable[[str, list[int]], int]


class Speculator:
    """Drafts tokens for speculating sequences (n-gram prompt lookup, or `drafter`: a draft model) within the
    caps of a step."""

    def __init__(self, config: SpeculativeConfig, max_model_len: int, drafter: DraftModel | None = None,
                 grammar_prefix: GrammarPrefix | None = None) -> None:
        assert (drafter is not None) == (config.method == "draft_model")
        self.config = config
        self.max_model_len = max_model_len
        self.drafter = drafter
        self.grammar_prefix = grammar_prefix
        self.num_drafts = 0  # engine totals (Prometheus counters): verification steps with drafts, their tokens
        self.num_draft_tokens = 0
        self.num_accepted_tokens = 0
        self.num_refused_tokens = 0  # drafts a grammar cut (refused or completing it; not in num_draft_tokens)

    def speculates(self, params: SamplingParams) -> bool:
        """Whether a request with `params` may speculate: any request, a constrained one when its grammar can
        check the drafts (`grammar_prefix`; without it such a request decodes one token a step)."""
        return params.structured_output is None or self.grammar_prefix is not None

    def new_state(self, params: SamplingParams) -> SpecState | None:
        """The speculation state of a new request (None: it never speculates)."""
        if not self.speculates(params):
            return None
        return SpecState(AdaptiveDraftLength(self.config.num_speculative_tokens))

    def propose(self, seq: Sequence, max_tokens: int, allocate: Callable[[int], bool]) -> list[int]:
        """Draft tokens for decoding `seq` this step: at most `max_tokens` (what the step's token budget leaves
        beyond its one token), the request's current draft length, the tokens it may still generate less the
        one a verification always adds, and what the context still holds. `allocate(n)` gives `seq` blocks for n
        new tokens (False: none free; then no drafts). A constrained request keeps the drafts its grammar takes
        up to (not including) one that would complete it: each verified position then has a grammar state that
        can go on, and a run that completes the grammar ends with the token sampled there."""
        state = seq.spec
        if state is None:
            return []
        k = min(max_tokens, seq.params.max_tokens - seq.num_output_tokens - 1,
                self.max_model_len - seq.num_tokens)
        if k < 1 or (k := min(k, state.length.current())) < 1 or not allocate(1 + k):
            return []
        if self.drafter is None:
            c = self.config
            drafts = propose_ngram(seq.token_ids, k, c.prompt_lookup_min, c.prompt_lookup_max)
        else:
            if state.draft_preemptions != seq.num_preemptions:  # its blocks, and the draft's KV in them, are gone
                state.draft_seen, state.draft_preemptions = 0, seq.num_preemptions
            drafts = self.drafter.propose(seq, state.draft_seen, k)
            state.draft_reach = seq.num_tokens + k - 1  # it ran the tokens and all drafts but the last
        if drafts and seq.params.structured_output is not None and self.grammar_prefix is not None:
            n = self.grammar_prefix(seq.request_id, drafts)
            self.num_refused_tokens += len(drafts) - n
            drafts = drafts[:n]  # the blocks taken for the rest go back after the step (`BlockManager.trim`)
        return drafts

    def record(self, seq: Sequence, drafted: int, accepted: int) -> None:
        """Count a verification step of `seq`: `drafted` tokens, the first `accepted` of them kept."""
        if seq.spec is not None and drafted:
            seq.spec.record(drafted, accepted)
            # Before the run is appended: the draft's KV holds the tokens and the accepted drafts it ran.
            seq.spec.draft_seen = min(seq.spec.draft_reach, seq.num_tokens + accepted)
            self.num_drafts += 1
            self.num_draft_tokens += drafted
            self.num_accepted_tokens += accepted
