"""The engine's constrained requests: a matcher each; per step `start` computes the masks on a worker thread while
the forward pass runs, `wait` hands them to the sampler, `accept` feeds the sampled tokens back
(docs/architecture.md#structured-output, and #speculative-decoding for drafts)."""

from __future__ import annotations

import logging
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from tritium.backend.core.sequence import Sequence
from tritium.backend.structured_output.compiler import GrammarCompiler
from tritium.backend.structured_output.constraint import StructuredOutput
from tritium.kernels import reference

if TYPE_CHECKING:  # imported when the first constrained request arrives: unconstrained serving never needs it
    import llguidance

logger = logging.getLogger(__name__)


@dataclass
class TokenMasks:
    """The allowed tokens of some rows of a batch: bit t % 32 of word t // 32 of a row allows token t."""

    rows: list[int]
    bitmask: torch.Tensor  # [len(rows), words] int32, on the logits' device
    row_index: torch.Tensor  # [len(rows)] int64, the same rows

    def apply(self, logits: torch.Tensor) -> None:
        """In place: -inf for every token a row's grammar does not allow."""
        if logits.is_cuda:
            from tritium.kernels.token_bitmask import apply_token_bitmask

            apply_token_bitmask(logits, self.bitmask, self.row_index)
        else:
            reference.apply_token_bitmask(logits, self.bitmask, self.row_index)

    def for_row(self, row: int) -> TokenMasks | None:
        """This row's mask alone, as row 0 (sampling one sequence by itself)."""
        if row not in self.rows:
            return None
        i = self.rows.index(row)
        return TokenMasks([0], self.bitmask[i : i + 1], torch.zeros(1, dtype=torch.long, device=self.bitmask.device))


@dataclass
class Verdict:
    """What a constrained request's sampled token did to its grammar."""

    error: str | None = None  # the token broke it (the request ends with this error)
    complete: bool = False  # nothing but EOS may follow: the request stops
    # A speculating row's run completed the grammar before its last token: only its first `cut` tokens stand.
    cut: int | None = None


@dataclass
class PendingMasks:
    rows: list[int]
    job: Future[None]


# A constrained sequence's masks: its matcher, its first row in the host buffer, its drafts (one more row each).
MaskJob = tuple["llguidance.LLMatcher", int, list[int]]


class StructuredDecoding:
    """The matchers of the engine's constrained requests (engine thread only, except the mask worker)."""

    def __init__(self, compiler: GrammarCompiler, device: torch.device, max_rows: int) -> None:
        self.compiler = compiler
        self.device = device
        self.max_rows = max_rows
        self.matchers: dict[str, llguidance.LLMatcher] = {}
        self._host: torch.Tensor | None = None  # [max_rows, vocab / 32] int32, made at the first constrained step
        self._executor: llguidance.LLExecutor | None = None  # made at the first constrained step
        self._worker = ThreadPoolExecutor(1, thread_name_prefix="tritium-masks")

    def add(self, request_id: str, spec: StructuredOutput, matcher: llguidance.LLMatcher | None = None) -> None:
        """`matcher` None: compile one now. Raises ValueError when `spec` cannot be enforced."""
        self.matchers[request_id] = matcher if matcher is not None else self.compiler.compile(spec)

    def remove(self, request_id: str) -> None:
        self.matchers.pop(request_id, None)

    def draft_prefix(self, request_id: str, drafts: list[int]) -> int:
        """How many leading `drafts` the grammar takes (all, unconstrained), stopping before one it refuses or one
        that would complete it (no grammar state to sample under after it); the matcher is left as it was."""
        matcher = self.matchers.get(request_id)
        if matcher is None:
            return len(drafts)
        consumed = 0
        complete = False
        for token in drafts:
            if matcher.try_consume_tokens([token]) != 1:  # refused: the matcher stays as it was (no error)
                break
            consumed += 1
            if complete := matcher.is_stopped():
                break
        if consumed:
            matcher.rollback(consumed)
        return consumed - 1 if complete else consumed

    def start(self, seqs: list[Sequence], drafts: list[list[int]] | None = None) -> PendingMasks | None:
        """Start the masks of the constrained ones among this step's sampling `seqs`. With `drafts` a sequence has
        1 + len(drafts) rows (`verify.position_views` order), row j masked by its grammar after j drafts."""
        if not self.matchers:
            return None
        rows: list[int] = []
        plain: list[tuple[llguidance.LLMatcher, int]] = []
        drafted: list[MaskJob] = []
        row = 0
        for i, seq in enumerate(seqs):
            draft = drafts[i] if drafts is not None else []
            matcher = self.matchers.get(seq.request_id)
            if matcher is not None:
                if draft:
                    drafted.append((matcher, len(rows), list(draft)))
                else:
                    plain.append((matcher, len(rows)))
                rows.extend(range(row, row + 1 + len(draft)))
            row += 1 + len(draft)
        if not rows:
            return None
        if self._host is None:  # llguidance's vocabulary decides the width (its tokenizer exists by now)
            words = (self.compiler.vocab_size + 31) // 32
            self._host = torch.zeros(self.max_rows, words, dtype=torch.int32, pin_memory=self.device.type == "cuda")
        host = self._host[: len(rows)]
        host.zero_()  # a row llguidance leaves unwritten (its matcher failed) allows nothing, rather than stale bits
        if self._executor is None:  # a matcher exists, so llguidance is importable
            import llguidance

            self._executor = llguidance.LLExecutor()
        job = self._worker.submit(self._fill, self._executor, plain, drafted, host)
        return PendingMasks(rows, job)

    @staticmethod
    def _fill(executor: llguidance.LLExecutor, plain: list[tuple[llguidance.LLMatcher, int]],
              drafted: list[MaskJob], host: torch.Tensor) -> None:
        """On the mask thread."""
        # llguidance.torch has these calls too, but importing it runs torch.compile (and imports inductor).
        width, size = host.shape[1] * host.element_size(), host.shape[0]
        if plain:
            executor.unsafe_compute_mask_ptr(plain, host.data_ptr(), width, size)
        if drafted:
            executor.unsafe_compute_mask_ptr_with_draft_token(drafted, host.data_ptr(), width, size)

    def wait(self, pending: PendingMasks | None) -> TokenMasks | None:
        """The masks on the device (the host buffer is rewritten only after this step's sampled ids were fetched,
        which waits for this copy)."""
        if pending is None or self._host is None:
            return None
        host = self._host[: len(pending.rows)]
        try:
            pending.job.result()
        except Exception:  # these rows allow no token now: each of those requests ends with an error
            logger.exception("computing the token masks of %d constrained rows failed", len(pending.rows))
            host.zero_()
        bitmask = host.to(self.device, non_blocking=True) if self.device.type == "cuda" else host.clone()
        index = torch.tensor(pending.rows, dtype=torch.long).to(self.device, non_blocking=True)
        return TokenMasks(pending.rows, bitmask, index)

    def accept(self, seqs: list[Sequence], tokens: list[int | None],
               runs: list[list[int]] | None = None) -> dict[int, Verdict]:
        """Advance the constrained rows' matchers over the kept drafts (`runs`, None: none) and the sampled token;
        a verdict per constrained row that sampled."""
        verdicts: dict[int, Verdict] = {}
        if not self.matchers:
            return verdicts
        for row, (seq, token) in enumerate(zip(seqs, tokens, strict=True)):
            matcher = self.matchers.get(seq.request_id)
            if matcher is None:
                continue
            if matcher.is_error():
                verdicts[row] = Verdict(error=f"the structured_output grammar cannot go on: {_reason(matcher)}")
            elif token is not None:
                verdicts[row] = _advance(matcher, [*(runs[row] if runs is not None else []), token])
        return verdicts


def _advance(matcher: llguidance.LLMatcher, run: list[int]) -> Verdict:
    for i, token in enumerate(run):
        if not matcher.consume_token(token):
            return Verdict(error=f"the structured_output grammar cannot go on: {_reason(matcher)}")
        if matcher.is_stopped():
            return Verdict(complete=True, cut=i + 1 if i + 1 < len(run) else None)
    return Verdict()


def _reason(matcher: llguidance.LLMatcher) -> str:
    """The first line of the matcher's error (the rest dumps its state)."""
    lines = (matcher.get_error() or "").strip().splitlines()
    return lines[0][:300] if lines else "the sampled token is not allowed"
