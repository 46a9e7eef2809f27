"""What is done to a step's logits before a token is picked (order: docs/architecture.md, "The engine step")."""

from __future__ import annotations

import torch

from tritium.backend.core.sequence import Sequence
from tritium.backend.sample.settings import RowSettings
from tritium.backend.structured_output.decoding import TokenMasks


def _on_device(values: list[int] | list[float] | list[bool], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    return torch.tensor(values, dtype=dtype).to(device, non_blocking=True)


def is_penalized(seq: Sequence) -> bool:
    p = seq.params
    return p.repetition_penalty != 1.0 or p.presence_penalty != 0.0 or p.frequency_penalty != 0.0


def apply_penalties(logits: torch.Tensor, seqs: list[Sequence]) -> None:
    """In place: repetition penalty over all tokens, presence / frequency over output tokens (OpenAI's)."""
    vocab, device = logits.shape[-1], logits.device
    rep_rows: list[int] = []
    rep_tokens: list[int] = []
    out_rows: list[int] = []
    out_tokens: list[int] = []
    for row, seq in enumerate(seqs):
        p = seq.params
        if p.repetition_penalty != 1.0:
            seen = [t for t in set(seq.token_ids) if t < vocab]
            rep_rows += [row] * len(seen)
            rep_tokens += seen
        if p.presence_penalty != 0.0 or p.frequency_penalty != 0.0:
            generated = [t for t in seq.output_token_ids if t < vocab]
            out_rows += [row] * len(generated)
            out_tokens += generated
    if rep_rows:
        rows, tokens = _on_device(rep_rows, torch.long, device), _on_device(rep_tokens, torch.long, device)
        penalty = _on_device([s.params.repetition_penalty for s in seqs], logits.dtype, device)[rows]
        vals = logits[rows, tokens]
        logits[rows, tokens] = torch.where(vals > 0, vals / penalty, vals * penalty)
    if out_rows:
        rows, tokens = _on_device(out_rows, torch.long, device), _on_device(out_tokens, torch.long, device)
        counts = torch.zeros_like(logits).index_put_((rows, tokens), torch.ones_like(rows, dtype=logits.dtype),
                                                     accumulate=True)
        frequency = _on_device([s.params.frequency_penalty for s in seqs], logits.dtype, device)[:, None]
        presence = _on_device([s.params.presence_penalty for s in seqs], logits.dtype, device)[:, None]
        penalized = _on_device([s.params.presence_penalty != 0.0 or s.params.frequency_penalty != 0.0 for s in seqs],
                               torch.bool, device)[:, None]
        logits -= torch.where(penalized, frequency * counts + presence * (counts > 0).to(logits.dtype), 0.0)


def ban_until_min_tokens(logits: torch.Tensor, seqs: list[Sequence], eos_token_ids: list[int]) -> None:
    """In place: -inf for the stop ids (and EOS unless `ignore_eos`) of rows short of their `min_tokens`."""
    ban_rows: list[int] = []
    ban_tokens: list[int] = []
    for row, seq in enumerate(seqs):
        p = seq.params
        if seq.num_output_tokens < p.min_tokens:
            banned = list(p.stop_token_ids) + ([] if p.ignore_eos else eos_token_ids)
            ban_rows += [row] * len(banned)
            ban_tokens += banned
    if ban_rows:
        index = torch.tensor([ban_rows, ban_tokens], dtype=torch.long).to(logits.device, non_blocking=True)
        logits[index[0], index[1]] = float("-inf")


def process_logits(logits: torch.Tensor, seqs: list[Sequence], eos_token_ids: list[int],
                   masks: TokenMasks | None) -> torch.Tensor:
    """Penalties, min_tokens bans and grammar masks applied: `logits` itself when none applies, else a copy
    (the caller's stay intact for a retry)."""
    penalized = any(is_penalized(s) for s in seqs)
    if not (penalized or masks is not None or any(s.num_output_tokens < s.params.min_tokens for s in seqs)):
        return logits
    logits = logits.clone()
    if penalized:
        apply_penalties(logits, seqs)
    ban_until_min_tokens(logits, seqs, eos_token_ids)
    if masks is not None:
        masks.apply(logits)
    return logits


def filter_top_k_top_p(logits: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """-inf outside each row's top-k and top-p nucleus (top_k <= 0, top_p >= 1: off); the top token survives."""
    vocab = logits.shape[-1]
    sorted_logits, order = logits.sort(dim=-1, descending=True)
    k = torch.where(top_k <= 0, torch.full_like(top_k, vocab), top_k.clamp(max=vocab))
    ranks = torch.arange(vocab, device=logits.device)
    sorted_logits = sorted_logits.masked_fill(ranks[None, :] >= k[:, None], float("-inf"))
    probs = sorted_logits.softmax(dim=-1)
    before = probs.cumsum(dim=-1) - probs  # probability mass strictly above each token
    outside = (before >= top_p[:, None]) & (top_p[:, None] < 1.0)
    outside[:, 0] = False
    sorted_logits = sorted_logits.masked_fill(outside, float("-inf"))
    return torch.empty_like(logits).scatter_(-1, order, sorted_logits)


def filter_min_p(logits: torch.Tensor, min_p: torch.Tensor) -> torch.Tensor:
    """`logits` with -inf for tokens less likely than `min_p` x the row's most likely token (min_p 0: off)."""
    probs = logits.softmax(dim=-1)
    threshold = min_p[:, None] * probs.max(dim=-1, keepdim=True).values
    return logits.masked_fill(probs < threshold, float("-inf"))


def warp_random_rows(logits: torch.Tensor, settings: RowSettings) -> torch.Tensor:
    """A new tensor: the random rows' logits (`settings.rows` order) over temperature, then filtered."""
    logits = logits / settings["temperature"][:, None]
    if settings.uses("top_k", "top_p"):
        logits = filter_top_k_top_p(logits, settings["top_k"], settings["top_p"])
    if settings.uses("min_p"):
        logits = filter_min_p(logits, settings["min_p"])
    return logits
