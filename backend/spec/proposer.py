"""Drafting in the worker, after a step's sampling (docs/architecture.md, "Speculative decoding")."""

from __future__ import annotations

from collections.abc import Callable

from tritium.backend.config import SpeculativeConfig
from tritium.backend.core.sequence import Sequence
from tritium.backend.spec.draft_length import AdaptiveDraftLength
from tritium.backend.spec.draft_model import DraftModel, DraftRequest
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

    def propose_all(self, rows: list[tuple[Sequence, list[int]]]) -> list[tuple[list[int], int]]:
        """Per (sequence, run): its drafts for the next step once `run` is appended (limits: docs/architecture.md,
        "Speculative decoding") and how many its grammar cut. A draft model drafts for all of them at once."""
        wanted: list[tuple[int, DraftRequest]] = []
        drafts: list[list[int]] = [[] for _ in rows]
        for row, (seq, run) in enumerate(rows):
            k = self._length(seq, run)
            if k < 1:
                continue
            tokens = seq.token_ids + run
            if self.drafter is None:
                c = self.config
                drafts[row] = propose_ngram(tokens, k, c.prompt_lookup_min, c.prompt_lookup_max)
            else:
                wanted.append((row, DraftRequest(seq.request_id, tokens, seq.block_table, k)))
        if self.drafter is not None and wanted:
            for (row, _), proposed in zip(wanted, self.drafter.propose([r for _, r in wanted]), strict=True):
                drafts[row] = proposed
        out: list[tuple[list[int], int]] = []
        for (seq, _), proposed in zip(rows, drafts, strict=True):
            n = len(proposed)
            if proposed and seq.params.structured_output is not None:
                n = self.grammar_prefix(seq.request_id, proposed)  # the blocks held for the rest go back after the step
            out.append((proposed[:n], len(proposed) - n))
        return out

    def _length(self, seq: Sequence, run: list[int]) -> int:
        """How many drafts `seq` may have after `run` (below 1: none)."""
        length = self.lengths.get(seq.request_id)
        if length is None:
            return 0
        tokens = len(seq.token_ids) + len(run)
        k = min(seq.params.max_tokens - (seq.num_output_tokens + len(run)) - 1, self.max_model_len - tokens)
        if self.drafter is not None:  # it writes its KV at the positions of the last token and all drafts but one
            k = min(k, len(seq.block_table) * self.block_size - (tokens - 1))
        return min(k, length.current()) if k >= 1 else 0
