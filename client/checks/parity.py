"""The rule gpu-check's greedy parity applies to two greedy continuations of the same prompt.

In float32 the two must be identical. In bfloat16 two implementations round differently, so on a near tie
their greedy paths may part: a divergence is accepted when each side's token at that position is among the
other side's top-k tokens there (as vLLM's `check_logprobs_close` does); after an accepted divergence the
continuations are conditioned on different tokens and are not compared further.
"""

from __future__ import annotations

from collections.abc import Collection, Sequence
from dataclasses import dataclass

PARITY_TOP_K = 5  # the customary k (vLLM's tests)


@dataclass(frozen=True)
class Agreement:
    """Whether two greedy continuations agree under the rule, where they first differ (None: identical), and
    why."""

    ok: bool
    diverged_at: int | None
    reason: str


def top_ids(logprobs: dict[int, float], k: int = PARITY_TOP_K) -> set[int]:
    """The `k` most likely token ids of one position's {token id: logprob}."""
    return set(sorted(logprobs, key=lambda t: logprobs[t], reverse=True)[:k])


def tokens_agree(ours: Sequence[int], ref: Sequence[int], ours_topk: Sequence[Collection[int]] | None,
                 ref_topk: Sequence[Collection[int]] | None, exact: bool) -> Agreement:
    """Compare our greedy tokens with the reference's. `exact` (float32): they must be identical. Otherwise
    the first differing position passes when our token is in the reference's top-k there and the
    reference's token in ours (`*_topk[i]`: the top-k token ids at position i); nothing after it is
    compared. A continuation that ends where the other goes on is a divergence that cannot pass."""
    n = min(len(ours), len(ref))
    i = next((j for j in range(n) if ours[j] != ref[j]), n)
    if i == n and len(ours) == len(ref):
        return Agreement(True, None, f"identical ({n} tokens)")
    if i == n:
        longer = "ours" if len(ours) > len(ref) else "the reference"
        return Agreement(False, i, f"{longer} goes on after token {i}, the other stops")
    if exact:
        return Agreement(False, i, f"token {i}: ours {ours[i]}, reference {ref[i]} (exact parity required)")
    if ours_topk is None or ref_topk is None or i >= len(ours_topk) or i >= len(ref_topk):
        return Agreement(False, i, f"token {i}: ours {ours[i]}, reference {ref[i]}, and no top-k to judge it")
    ours_in_ref, ref_in_ours = ours[i] in ref_topk[i], ref[i] in ours_topk[i]
    if ours_in_ref and ref_in_ours:
        return Agreement(True, i, f"token {i}: ours {ours[i]}, reference {ref[i]}: a near tie (each in the "
                                  f"other's top-{len(ref_topk[i])}); not compared further")
    missing = [what for what, present in (("ours in the reference's", ours_in_ref),
                                          ("the reference's in ours", ref_in_ours)) if not present]
    return Agreement(False, i, f"token {i}: ours {ours[i]}, reference {ref[i]}; not in the top-k: "
                               f"{' and '.join(missing)}")
