"""Drafting in the worker, after a step's sampling (docs/architecture.md, "Speculative decoding")."""

from __future__ import annotations

from collections.abc import Callable

from tritium.backend.config import SpeculativeConfig
from tritium.backend.core.sequence import Sequence
from tritium.backend.spec.draft_length import AdaptiveDraftLength
from tritium.backend.spec.draft_model import DraftModel
from tritium.backend.spec.ngram import propose_ngram

# How many leading drafts of a request its grammar takes (`StructuredDecoding.draft_prefix`).
GrammarPrefix = Callable[[str, list[int]], int]


class DraftProposer:
    """Drafts for the requests that speculate (n-gram prompt lookup, or `drafter`: a draft model)."""

    def __init__(self, config: SpeculativeConfig, max_model_len: int, block_size: int, grammar_prefix: GrammarPrefix,
                 drafter: DraftModel | None = None) -> None:
        assert (drafter is not None) == (config.method == "draft_model")
        self.config = config
        self.max_model_len = max_model_len
        self.block_size = block_size
        self.grammar_prefix = grammar_prefix
        self.drafter = drafter
        self.lengths: dict[str, AdaptiveDraftLength] = {}

    def add_request(self, request_id: str) -> None:
        self.lengths[request_id] = AdaptiveDraftLength(self.config.num_speculative_tokens)

    def remove_request(self, request_id: str) -> None:
        self.lengths.pop(request_id, None)
        self.forget_cache(request_id)

    def forget_cache(self, request_id: str) -> None:
        """The request's blocks are gone (finished or preempted), and with them the draft model's KV."""
        if self.drafter is not None:
            self.drafter.forget(request_id)

    def record(self, request_id: str, drafted: int, accepted: int) -> None:
        """Count a verification step of the request: `drafted` tokens, the first `accepted` of them kept."""
        length = self.lengths.get(request_id)
        if length is not None and drafted:
            length.record(drafted, accepted)
            if self.drafter is not None:
                self.drafter.accepted(request_id, accepted)

    def propose(self, seq: Sequence, run: list[int]) -> tuple[list[int], int]:
        """Drafts for `seq`'s next step once `run` is appended (limits: docs/architecture.md, "Speculative
        decoding"), and how many its grammar cut."""
        length = self.lengths.get(seq.request_id)
        if length is None:
            return [], 0
        tokens = seq.token_ids + run
        k = min(seq.params.max_tokens - (seq.num_output_tokens + len(run)) - 1, self.max_model_len - len(tokens))
        if self.drafter is not None:  # it writes its KV at the positions of the last token and all drafts but one
            k = min(k, len(seq.block_table) * self.block_size - (len(tokens) - 1))
        if k < 1 or (k := min(k, length.current())) < 1:
            return [], 0
        if self.drafter is None:
            c = self.config
            drafts = propose_ngram(tokens, k, c.prompt_lookup_min, c.prompt_lookup_max)
        else:
            drafts = self.drafter.propose(seq.request_id, tokens, seq.block_table, k)
        n = len(drafts)
        if drafts and seq.params.structured_output is not None:
            n = self.grammar_prefix(seq.request_id, drafts)  # the blocks held for the rest go back after the step
        return drafts[:n], len(drafts) - n
