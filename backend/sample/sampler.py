"""One token per sequence from a step's logits (docs/architecture.md, "The engine step"). Logprobs are of the
raw logits, before penalties, masks and temperature."""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

from tritium.backend.core.sequence import Sequence
from tritium.backend.sample.logits_ops import process_logits, warp_random_rows
from tritium.backend.sample.penalty_rows import PenaltyRows
from tritium.backend.sample.settings import RowSettings
from tritium.backend.sample.step_inputs import HostSamplingInputs, SamplingInputs
from tritium.backend.structured_output.decoding import TokenMasks

logger = logging.getLogger(__name__)
NO_TOKEN = ("no token can be sampled: every token is banned (by the structured_output grammar, or by min_tokens "
            "with stop_token_ids) or the model's logits are not finite")
SAMPLING_FAILED = "internal error while sampling this request's token"


@dataclass
class SamplerOutput:
    """Per sequence: its token and logprobs, or (token None) the error saying why it got none."""

    token_ids: list[int | None]
    logprobs: list[dict[int, float] | None]
    errors: list[str | None]

    def extend(self, other: SamplerOutput) -> None:
        self.token_ids += other.token_ids
        self.logprobs += other.logprobs
        self.errors += other.errors


def row_max(logits: torch.Tensor, chunk: int = 1024) -> tuple[torch.Tensor, torch.Tensor]:
    """`logits.max(dim=-1)` (NaN wins, as there), faster for a batch on a CPU: `amax` over chunks is
    vectorized where `max` with indices is not."""
    rows, vocab = logits.shape
    main = vocab - vocab % chunk
    if rows < 4 or main == 0 or logits.device.type != "cpu":
        values, indices = logits.max(dim=-1)
        return values, indices
    blocks = logits[:, :main].view(rows, main // chunk, chunk)
    best, block = blocks.amax(dim=-1).max(dim=-1)
    tokens = blocks.gather(1, block.view(rows, 1, 1).expand(rows, 1, chunk)).squeeze(1).argmax(dim=-1) + block * chunk
    if main < vocab:
        tail_best, tail_token = logits[:, main:].max(dim=-1)
        better = (tail_best > best) | (tail_best.isnan() & ~best.isnan())
        best = torch.where(better, tail_best, best)
        tokens = torch.where(better, tail_token + main, tokens)
    return best, tokens


class Sampler:
    """Samples a batch's tokens on `device`; keeps the seeded requests' generators (`add_request`) and the
    penalized requests' token counts."""

    def __init__(self, eos_token_ids: list[int], seed: int = 0, device: torch.device | str = "cpu",
                 vocab_size: int | None = None, max_requests: int | None = None) -> None:
        """`vocab_size`: the logits' width (None: learned from the first logits); `max_requests`: the most requests
        sampled at once (what the penalty rows grow to)."""
        self.eos_token_ids = eos_token_ids
        self.device = torch.device(device)
        self.generator = torch.Generator(device=self.device).manual_seed(seed)
        self.generators: dict[str, torch.Generator] = {}  # seeded requests' own, on the device
        self._drawn: dict[int, tuple[torch.Generator, torch.Tensor]] = {}  # the last call's: row -> state after it
        self.penalties = PenaltyRows(self.device, vocab_size, max_requests)

    def add_request(self, request_id: str, seed: int | None) -> None:
        if seed is not None:
            self.generators[request_id] = torch.Generator(device=self.device).manual_seed(seed)

    def remove_request(self, request_id: str) -> None:
        self.generators.pop(request_id, None)
        self.penalties.remove(request_id)

    def host_inputs(self, seqs: list[Sequence], update: bool = True) -> HostSamplingInputs:
        """A call's inputs for `seqs`, to stage with the step's (`update`: see HostSamplingInputs.of)."""
        return HostSamplingInputs.of(seqs, self.penalties, self.eos_token_ids, update)

    @torch.inference_mode()
    def __call__(self, logits: torch.Tensor, seqs: list[Sequence], inputs: SamplingInputs | None = None,
                 masks: TokenMasks | None = None) -> SamplerOutput:
        """One token per sequence from `logits` (`[len(seqs), vocab]` fp32); `inputs` (from `host_inputs(seqs)`)
        None: built here. If the batch raises, each row is sampled alone, seeded generators rewound
        (docs/architecture.md, "Failure rules"). Never raises."""
        gens = [self.generators.get(s.request_id) for s in seqs]
        states = [g.get_state() if g is not None else None for g in gens]
        self._drawn.clear()
        try:
            if inputs is None:
                self.penalties.vocab_size = self.penalties.vocab_size or logits.shape[-1]
                inputs = SamplingInputs.on(logits.device, self.host_inputs(seqs))
            inputs.update_penalties(self.penalties)
            return self._sample_batch(logits, seqs, inputs, masks)
        except Exception:
            logger.exception("sampling a batch of %d failed; sampling each sequence alone", len(seqs))
        out = SamplerOutput([], [], [])
        rewound: set[int] = set()  # a speculating request has several rows on one generator: rewind it once
        for row, (seq, gen, state) in enumerate(zip(seqs, gens, states, strict=True)):
            if gen is not None and state is not None and id(gen) not in rewound:
                gen.set_state(state)
                rewound.add(id(gen))
            try:
                alone = SamplingInputs.on(logits.device, self.host_inputs([seq], update=False))
                one = self._sample_batch(logits[row : row + 1], [seq], alone,
                                         masks.for_row(row) if masks is not None else None, first_row=row)
            except Exception:
                logger.exception("sampling failed for %s", seq.request_id)
                one = SamplerOutput([None], [None], [SAMPLING_FAILED])
            out.extend(one)
        return out

    def rewind_after(self, row: int) -> None:
        """Rewind the seeded generator of the last call's `row` to just after that row's draw."""
        drawn = self._drawn.get(row)
        if drawn is not None:
            drawn[0].set_state(drawn[1])

    def _sample_batch(self, logits: torch.Tensor, seqs: list[Sequence], inputs: SamplingInputs,
                      masks: TokenMasks | None = None, first_row: int = 0) -> SamplerOutput:
        want_logprobs = inputs.host.logprob_rows
        asking = inputs["logprob_rows"].long() if want_logprobs else None
        raw_logprobs = logits.index_select(0, asking).log_softmax(dim=-1) if asking is not None else None
        logits = process_logits(logits, inputs, self.penalties, masks)
        settings = inputs.settings
        # The row maximum is NaN if any logit is (max propagates NaN), +inf for a broken row and -inf when
        # every token is banned: a row whose maximum is not finite has no token to give.
        best, tokens = row_max(logits)
        if settings is not None:
            drawn = self._draw(seqs, settings, logits.index_select(0, settings.index), first_row)
            tokens.index_put_((settings.index,), drawn)
        tokens = torch.where(torch.isfinite(best), tokens, -1)
        top_n = max((seqs[r].params.logprobs or 0 for r in want_logprobs), default=0)
        parts = [tokens.to(torch.float64)]
        if raw_logprobs is not None and asking is not None:
            parts.append(_logprob_table(raw_logprobs, tokens.index_select(0, asking), top_n).flatten())
        fetched = torch.cat(parts).tolist()  # the step's one fetch: the sampled ids and the logprobs asked for
        token_list: list[int | None] = [int(t) if t >= 0 else None for t in fetched[: len(seqs)]]
        errors: list[str | None] = [None if t is not None else NO_TOKEN for t in token_list]
        logprobs: list[dict[int, float] | None] = [None] * len(seqs)
        width = 1 + 2 * top_n
        for j, row in enumerate(want_logprobs):
            token = token_list[row]
            if token is None:
                continue
            values = fetched[len(seqs) + j * width : len(seqs) + (j + 1) * width]
            entry = {token: values[0]}
            k = seqs[row].params.logprobs or 0
            for lp, tid in zip(values[1 : 1 + k], values[1 + top_n : 1 + top_n + k], strict=True):
                entry.setdefault(int(tid), lp)
            logprobs[row] = entry
        return SamplerOutput(token_list, logprobs, errors)

    def _draw(self, seqs: list[Sequence], settings: RowSettings, logits: torch.Tensor, first_row: int) -> torch.Tensor:
        """argmax(p / E) per random row, E exponential noise; keeps each seeded row's state for `rewind_after`."""
        probs = warp_random_rows(logits, settings).softmax(dim=-1)
        noise = torch.empty_like(probs).exponential_(generator=self.generator)
        for i, row in enumerate(settings.rows):
            gen = self.generators.get(seqs[row].request_id)
            if gen is not None:
                noise[i].exponential_(generator=gen)
                self._drawn[first_row + row] = (gen, gen.get_state())
        # A zero draw would turn a zero probability into NaN, which argmax picks.
        return (probs / noise.clamp_(min=1e-20)).argmax(dim=-1)


def _logprob_table(raw: torch.Tensor, tokens: torch.Tensor, top_n: int) -> torch.Tensor:
    """Per row: the sampled token's logprob, then the `top_n` best logprobs and ids (float64: exact ids)."""
    chosen = raw.gather(1, tokens.clamp(min=0)[:, None])
    parts = [chosen.to(torch.float64)]
    if top_n:
        top = raw.topk(top_n, dim=-1)
        parts += [top.values.to(torch.float64), top.indices.to(torch.float64)]
    return torch.cat(parts, dim=1)
