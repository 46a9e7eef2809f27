"""The engine's constrained requests: a matcher per request, each step's token masks, the sampled tokens fed back.

Per step: `start` computes the masks of the constrained rows on a worker thread (llguidance drops the GIL and
spreads the batch over its own threads) while the engine runs the forward pass; `wait` copies them to the
logits' device; the sampler applies them (`TokenMasks.apply`: the Triton kernel on CUDA, torch elsewhere)
after penalties and bans, before sampling; `accept` advances each matcher with its sampled token and says
which requests' grammars are complete (they stop: EOS is the only token left) or broken.
"""

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
        """In place: every token a row's grammar does not allow gets -inf."""
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


@dataclass
class PendingMasks:
    rows: list[int]
    job: Future[None]


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
        """Give `request_id` `matcher` (at the start of `spec`), or compile one now. Raises ValueError when
        `spec` cannot be enforced."""
        self.matchers[request_id] = matcher if matcher is not None else self.compiler.compile(spec)

    def remove(self, request_id: str) -> None:
        self.matchers.pop(request_id, None)

    def start(self, seqs: list[Sequence]) -> PendingMasks | None:
        """Start computing the masks of the constrained ones among `seqs` (the rows that sample this step)."""
        if not self.matchers:
            return None
        rows = [i for i, s in enumerate(seqs) if s.request_id in self.matchers]
        if not rows:
            return None
        pairs = [(self.matchers[seqs[row].request_id], i) for i, row in enumerate(rows)]
        if self._host is None:  # llguidance's vocabulary decides the width (its tokenizer exists by now)
            words = (self.compiler.vocab_size + 31) // 32
            self._host = torch.zeros(self.max_rows, words, dtype=torch.int32, pin_memory=self.device.type == "cuda")
        host = self._host[: len(rows)]
        host.zero_()  # a row llguidance leaves unwritten (its matcher failed) allows nothing, rather than stale bits
        if self._executor is None:  # a matcher exists, so llguidance is importable
            import llguidance

            self._executor = llguidance.LLExecutor()
        # llguidance.torch has this call too, but importing it runs torch.compile (and imports inductor).
        job = self._worker.submit(self._executor.unsafe_compute_mask_ptr, pairs, host.data_ptr(),
                                  host.shape[1] * host.element_size(), len(rows))
        return PendingMasks(rows, job)

    def wait(self, pending: PendingMasks | None) -> TokenMasks | None:
        """The masks `start` computed, on the device (the host buffer is rewritten only after this step's
        sampled ids were fetched, which waits for this copy)."""
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

    def accept(self, seqs: list[Sequence], tokens: list[int | None]) -> dict[int, Verdict]:
        """Advance the constrained rows' matchers with their sampled tokens; a verdict per constrained row
        that sampled."""
        verdicts: dict[int, Verdict] = {}
        if not self.matchers:
            return verdicts
        for row, (seq, token) in enumerate(zip(seqs, tokens, strict=True)):
            matcher = self.matchers.get(seq.request_id)
            if matcher is None:
                continue
            if matcher.is_error() or (token is not None and not matcher.consume_token(token)):
                verdicts[row] = Verdict(error=f"the structured_output grammar cannot go on: {_reason(matcher)}")
            elif token is not None:
                verdicts[row] = Verdict(complete=matcher.is_stopped())
        return verdicts


def _reason(matcher: llguidance.LLMatcher) -> str:
    """The first line of the matcher's error (the rest is a dump of its state and grammar)."""
    lines = (matcher.get_error() or "").strip().splitlines()
    return lines[0][:300] if lines else "the sampled token is not allowed"
