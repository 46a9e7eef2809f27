"""The token counts penalties read, kept on the device per penalized request (docs/architecture.md, "The engine
step"): a request's row is written when it joins and then only with the tokens each step adds."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from tritium.backend.core.sequence import Sequence


def is_penalized(seq: Sequence) -> bool:
    p = seq.params
    return p.repetition_penalty != 1.0 or p.presence_penalty != 0.0 or p.frequency_penalty != 0.0


@dataclass
class PenaltyUpdate:
    """What a sampler call adds to the rows: the slots new requests take (zeroed first), and per token not yet
    counted (ids outside the vocabulary left out) its slot, id and whether it is an output token. `counted` and
    `taken`: the bookkeeping once applied."""

    fresh: list[int]
    slots: list[int]
    tokens: list[int]
    outputs: list[int]
    counted: dict[str, int]
    taken: dict[str, int]


class PenaltyRows:
    """Per penalized request a slot: `seen [slots, vocab]` (its prompt and output tokens) and `counts` (its output
    tokens, float32). Slot 0 stays empty: a request without a slot reads it."""

    def __init__(self, device: torch.device, vocab_size: int | None = None, max_requests: int | None = None) -> None:
        """`vocab_size` None: set before the first update. `max_requests`: the most requests that hold a slot at
        once (the rows grow up to that many, and the empty row); None: no bound."""
        self.device = device
        self.vocab_size = vocab_size
        self.max_rows = max_requests + 1 if max_requests is not None else None
        self.slot: dict[str, int] = {}
        self.counted: dict[str, int] = {}  # per request: the leading tokens its row holds
        self.seen = torch.zeros(0, 0, dtype=torch.bool, device=device)
        self.counts = torch.zeros(0, 0, dtype=torch.float32, device=device)

    def remove(self, request_id: str) -> None:
        self.slot.pop(request_id, None)
        self.counted.pop(request_id, None)

    def tokens_after(self, seq: Sequence, start: int) -> tuple[list[int], list[int]]:
        """`seq`'s tokens from position `start` on that the logits have, and for each whether it is an output
        token (1) or a prompt token (0)."""
        vocab = self.vocab_size
        assert vocab is not None, "PenaltyRows.vocab_size is set before any update"
        kept = [i for i in range(start, seq.num_tokens) if 0 <= seq.token_ids[i] < vocab]
        return [seq.token_ids[i] for i in kept], [int(i >= seq.num_prompt_tokens) for i in kept]

    def update_for(self, seqs: list[Sequence]) -> PenaltyUpdate:
        """The tokens of `seqs`' penalized requests that their rows lack (a request with several rows, a
        verification step's, is counted up to its shortest). Changes nothing until `apply`."""
        shortest: dict[str, Sequence] = {}
        for s in seqs:
            if is_penalized(s) and (s.request_id not in shortest or s.num_tokens < shortest[s.request_id].num_tokens):
                shortest[s.request_id] = s
        used = set(self.slot.values())
        free = (i for i in range(1, len(self.slot) + len(shortest) + 2) if i not in used)
        update = PenaltyUpdate([], [], [], [], {}, {})
        for rid, s in shortest.items():
            start = self.counted.get(rid, 0)
            slot = self.slot.get(rid)
            if slot is None or start > s.num_tokens:  # a new request, or one whose tokens were cut back: recounted
                slot = slot if slot is not None else next(free)
                update.fresh.append(slot)
                start = 0
            update.taken[rid] = slot
            update.counted[rid] = s.num_tokens
            tokens, outputs = self.tokens_after(s, start)
            update.slots += [slot] * len(tokens)
            update.tokens += tokens
            update.outputs += outputs
        return update

    def apply(self, update: PenaltyUpdate, fresh: torch.Tensor, values: torch.Tensor) -> None:
        """Write `update` into the rows: `fresh` its fresh slots and `values` its `slots`, `tokens` and `outputs` one
        after the other, on the device. The rows grow as slots are taken."""
        self._reserve(max([*self.slot.values(), *update.taken.values()], default=0) + 1)
        if update.fresh:
            fresh = fresh.long()
            self.seen.index_fill_(0, fresh, False)
            self.counts.index_fill_(0, fresh, 0.0)
        if update.tokens:
            slots, tokens, outputs = values.long().view(3, -1)
            self.seen[slots, tokens] = True
            self.counts.index_put_((slots, tokens), outputs.to(torch.float32), accumulate=True)
        self.slot.update(update.taken)  # once written: a failed write leaves the rows to be counted again
        self.counted.update(update.counted)

    def read(self, slots: torch.Tensor, at: list[int], seen: bool, copy: bool) -> torch.Tensor:
        """The `seen` (else `counts`) rows of `slots` (`at` on the host), `[len(slots), vocab]`: a view when they
        are consecutive and `copy` is not asked for."""
        self._reserve(1)
        rows = self.seen if seen else self.counts
        if not copy and at == list(range(at[0], at[0] + len(at))):
            return rows.narrow(0, at[0], len(at))
        return rows.index_select(0, slots)

    def _reserve(self, rows: int) -> None:
        if self.seen.shape[0] >= rows:
            return
        grown = max(rows, 2 * self.seen.shape[0], 4)
        rows = min(grown, max(rows, self.max_rows)) if self.max_rows is not None else grown
        assert self.vocab_size is not None, "PenaltyRows.vocab_size is set before any update"
        seen = torch.zeros(rows, self.vocab_size, dtype=torch.bool, device=self.device)
        counts = torch.zeros(rows, self.vocab_size, dtype=torch.float32, device=self.device)
        if self.seen.shape[0]:
            seen[: self.seen.shape[0]] = self.seen
            counts[: self.counts.shape[0]] = self.counts
        self.seen, self.counts = seen, counts
