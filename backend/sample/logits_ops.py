"""What is done to a step's logits before a token is picked (order: docs/architecture.md, "The engine step")."""

from __future__ import annotations

import torch

from tritium.backend.sample.penalty_rows import PenaltyRows
from tritium.backend.sample.settings import RowSettings
from tritium.backend.sample.step_inputs import SamplingInputs
from tritium.backend.structured_output.decoding import TokenMasks


def penalized(logits: torch.Tensor, inputs: SamplingInputs, penalties: PenaltyRows) -> torch.Tensor:
    """A new tensor: `logits` with, on the penalized rows, the repetition penalty over all their tokens and presence
    / frequency over their output tokens (OpenAI's); the counts are their `penalties` rows plus the tokens those
    lack (a verification row's drafts)."""
    host = inputs.host
    rows, slots = inputs["penalized"].long(), inputs["penalty_slots"].long()
    extras = (inputs["extra_rows"].long(), inputs["extra_tokens"].long()) if host.ints["extra_rows"] else None
    at = host.ints["penalty_slots"]
    picked = logits if host.every_row_penalized else logits.index_select(0, rows)
    if host.uses("repetition"):
        seen = penalties.read(slots, at, seen=True, copy=extras is not None)
        if extras is not None:
            seen[extras] = True
        repetition = inputs["repetition"].to(logits.dtype)[:, None]
        picked = torch.where(seen, torch.where(picked > 0, picked / repetition, picked * repetition), picked)
    if host.uses("frequency") or host.uses("presence"):
        counts = penalties.read(slots, at, seen=False, copy=extras is not None)
        if extras is not None:
            counts.index_put_(extras, inputs["extra_outputs"].to(torch.float32), accumulate=True)
        if host.uses("frequency"):
            picked = torch.addcmul(picked, counts, inputs["frequency"].to(logits.dtype)[:, None], value=-1)
        if host.uses("presence"):
            picked = torch.addcmul(picked, counts.sign(), inputs["presence"].to(logits.dtype)[:, None], value=-1)
    if host.every_row_penalized:
        return picked if picked is not logits else logits.clone()
    return logits.index_copy(0, rows, picked)


def ban_until_min_tokens(logits: torch.Tensor, inputs: SamplingInputs) -> None:
    """In place: -inf for the stop ids (and EOS unless `ignore_eos`) of rows short of their `min_tokens`."""
    if inputs.host.ints["ban_rows"]:
        logits[inputs["ban_rows"].long(), inputs["ban_tokens"].long()] = float("-inf")


def process_logits(logits: torch.Tensor, inputs: SamplingInputs, penalties: PenaltyRows,
                   masks: TokenMasks | None) -> torch.Tensor:
    """Penalties, min_tokens bans and grammar masks applied: `logits` itself when none applies, else a copy
    (the caller's stay intact for a retry)."""
    host = inputs.host
    if not (host.penalized or masks is not None or host.ints["ban_rows"]):
        return logits
    logits = penalized(logits, inputs, penalties) if host.penalized else logits.clone()
    ban_until_min_tokens(logits, inputs)
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
