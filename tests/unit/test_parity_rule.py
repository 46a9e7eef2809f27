"""gpu-check's greedy parity rule: exact in float32; in bfloat16 a near tie (each side's token in the other's
top-k at the first divergence) passes, as in vLLM's tests."""

from __future__ import annotations

from tritium.client.checks.parity import PARITY_TOP_K, tokens_agree, top_ids


def test_identical_continuations_agree_in_both_modes() -> None:
    for exact in (True, False):
        verdict = tokens_agree([1, 2, 3], [1, 2, 3], None, None, exact)
        assert verdict.ok and verdict.diverged_at is None


def test_float32_requires_exact_parity_even_on_a_near_tie() -> None:
    topk = [{1, 9}, {2, 7}, {3, 8}]
    verdict = tokens_agree([1, 7, 3], [1, 2, 3], topk, topk, exact=True)
    assert not verdict.ok and verdict.diverged_at == 1 and "exact" in verdict.reason


def test_bf16_accepts_a_near_tie_and_compares_nothing_after_it() -> None:
    ours_topk = [{1}, {7, 2}, {5}]
    ref_topk = [{1}, {2, 7}, {6}]
    verdict = tokens_agree([1, 7, 5], [1, 2, 6], ours_topk, ref_topk, exact=False)
    assert verdict.ok and verdict.diverged_at == 1 and "near tie" in verdict.reason


def test_bf16_needs_each_token_in_the_others_top_k() -> None:
    # ours (7) is in the reference's top-k, but the reference's (2) is not in ours
    verdict = tokens_agree([1, 7], [1, 2], [{1}, {7, 4}], [{1}, {2, 7}], exact=False)
    assert not verdict.ok and verdict.diverged_at == 1 and "the reference's in ours" in verdict.reason
    # the reference's (2) is in ours, but ours (7) is not in the reference's
    verdict = tokens_agree([1, 7], [1, 2], [{1}, {7, 2}], [{1}, {2, 4}], exact=False)
    assert not verdict.ok and "ours in the reference's" in verdict.reason


def test_bf16_without_top_k_at_the_divergence_fails() -> None:
    assert not tokens_agree([1, 7], [1, 2], None, [{1}, {2, 7}], exact=False).ok
    assert not tokens_agree([1, 7], [1, 2], [{1}], [{1}, {2, 7}], exact=False).ok


def test_one_side_stopping_early_is_a_divergence() -> None:
    for exact in (True, False):
        verdict = tokens_agree([1, 2], [1, 2, 3], [{1}, {2}], [{1}, {2}, {3}], exact)
        assert not verdict.ok and verdict.diverged_at == 2


def test_top_ids_takes_the_most_likely() -> None:
    logprobs = {5: -0.1, 9: -3.0, 2: -1.0, 4: -2.0, 8: -5.0, 1: -4.0, 3: -9.0}
    assert top_ids(logprobs) == {5, 2, 4, 9, 1}
    assert PARITY_TOP_K == 5
    assert top_ids(logprobs, 2) == {5, 2}
