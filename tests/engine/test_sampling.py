"""Sampler and SamplingParams on distributions the tests control."""

from __future__ import annotations

import contextlib
import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from tritium.backend.core.sequence import Sequence
from tritium.backend.sample.logits_ops import penalized
from tritium.backend.sample.penalty_rows import PenaltyRows
from tritium.backend.sample.sampler import Sampler, row_max
from tritium.backend.sample.step_inputs import HostSamplingInputs, SamplingInputs
from tritium.backend.sampling_params import SamplingParams
from tritium.backend.spec.verify import position_views

from support.builders import seq


def sample_many(
    params: SamplingParams, logits: torch.Tensor, n: int = 400, outputs: list[int] | None = None
) -> set[int]:
    sampler = Sampler(eos_token_ids=[0], seed=3)
    seqs = []
    for i in range(n):
        s = seq([5, 6], f"r{i}")
        s.params = params
        s.token_ids.extend(outputs or [])
        seqs.append(s)
    return set(sampler(logits.repeat(n, 1), seqs).token_ids)


LOGITS = torch.log(torch.tensor([0.05, 0.30, 0.25, 0.20, 0.10, 0.06, 0.04]))


def test_greedy_is_argmax() -> None:
    assert sample_many(SamplingParams(temperature=0), LOGITS, n=3) == {1}


def test_top_k_stays_inside_the_k_most_likely() -> None:
    assert sample_many(SamplingParams(top_k=3), LOGITS) == {1, 2, 3}


def test_top_p_stays_inside_the_nucleus() -> None:
    # 0.30 + 0.25 = 0.55 < 0.6, so the nucleus needs the third token and no more.
    assert sample_many(SamplingParams(top_p=0.6), LOGITS) == {1, 2, 3}


def test_min_p_drops_tokens_below_the_fraction_of_the_top() -> None:
    # threshold 0.5 * 0.30 = 0.15 keeps tokens 1 (0.30), 2 (0.25), 3 (0.20)
    assert sample_many(SamplingParams(min_p=0.5), LOGITS) == {1, 2, 3}


def test_unrestricted_sampling_reaches_the_whole_support() -> None:
    assert sample_many(SamplingParams(temperature=1.0), LOGITS, n=2000) == set(range(7))


def test_min_tokens_masks_eos_and_stop_tokens() -> None:
    logits = torch.tensor([10.0, 0.0, 9.0, 1.0])  # eos (0) and token 2 dominate
    got = sample_many(SamplingParams(temperature=0, min_tokens=2, stop_token_ids=[2]), logits, n=2)
    assert got == {3}


def test_repetition_and_presence_penalties_change_the_choice() -> None:
    logits = torch.tensor([0.0, 2.0, 1.9, 0.0])
    assert sample_many(SamplingParams(temperature=0), logits, n=1, outputs=[1]) == {1}
    assert sample_many(SamplingParams(temperature=0, repetition_penalty=1.2), logits, n=1, outputs=[1]) == {2}
    assert sample_many(SamplingParams(temperature=0, presence_penalty=0.5), logits, n=1, outputs=[1]) == {2}
    assert sample_many(SamplingParams(temperature=0, frequency_penalty=0.06), logits, n=1, outputs=[1, 1]) == {2}


def test_seeded_rows_do_not_depend_on_the_batch() -> None:
    logits = torch.randn(1, 50)
    sampler = Sampler([0], seed=0)

    def draw(batch_size: int, row: int) -> int:
        seqs = []
        for i in range(batch_size):
            s = seq([1], f"r{i}")
            s.params = SamplingParams(seed=42 if i == row else None)
            sampler.remove_request(s.request_id)
            sampler.add_request(s.request_id, s.params.seed)
            seqs.append(s)
        return sampler(logits.repeat(batch_size, 1), seqs).token_ids[row]

    assert len({draw(1, 0), draw(5, 3), draw(9, 8)}) == 1


def test_logprobs_are_the_raw_distribution() -> None:
    s = seq([1], "r")
    s.params = SamplingParams(temperature=0, logprobs=2)
    out = Sampler([0])(LOGITS[None, :].clone(), [s])
    lp = out.logprobs[0]
    assert set(lp) == {1, 2}
    assert lp[1] == pytest.approx(math.log(0.30), abs=1e-5)


@pytest.mark.parametrize(
    "field,value,message",
    [
        ("max_tokens", 0, "max_tokens must be >= 1"),
        ("temperature", -0.1, "temperature must be in [0, 100]"),
        ("temperature", float("nan"), "temperature must be in [0, 100]"),
        ("top_p", 0.0, "top_p must be in (0, 1]"),
        ("top_p", 1.5, "top_p must be in (0, 1]"),
        ("top_k", -2, "top_k must be >= -1"),
        ("min_p", 2.0, "min_p must be in [0, 1]"),
        ("seed", -1, "seed must be >= 0"),
        ("logprobs", 21, "logprobs must be <= 20"),
        ("max_tokens", "16", "max_tokens must be an integer"),
    ],
)
def test_invalid_values_name_the_field_and_rule(field: str, value: object, message: str) -> None:
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)").replace("[", r"\[")):
        SamplingParams(**{field: value})


def test_unknown_field_is_rejected() -> None:
    with pytest.raises(ValueError, match=r"unknown sampling field.*bogus"):
        SamplingParams.from_dict({"max_tokens": 4, "bogus": 1})


@settings(max_examples=300, deadline=None)
@given(st.dictionaries(
    st.sampled_from(["max_tokens", "min_tokens", "temperature", "top_p", "top_k", "min_p", "seed",
                     "stop", "logprobs", "presence_penalty", "repetition_penalty", "nope"]),
    st.one_of(st.integers(-5, 50), st.floats(allow_nan=True), st.text(max_size=3), st.none(),
              st.lists(st.text(max_size=3), max_size=3), st.booleans()),
))
def test_from_dict_accepts_or_raises_value_error(values: dict[str, object]) -> None:
    with contextlib.suppress(ValueError):
        SamplingParams.from_dict(values)


@pytest.mark.parametrize("vocab", [49152, 49157, 2100, 300])
def test_row_max_is_max_with_its_first_index(vocab: int) -> None:
    logits = torch.randn(16, vocab)
    logits[1, 7] = float("nan")
    logits[2] = float("-inf")
    logits[3, 100] = float("inf")
    logits[4, :10] = 50.0  # ties: the first index
    logits[5, vocab - 1] = 99.0  # in the tail past the last whole chunk
    logits[6, vocab - 2] = float("nan")
    expected = logits.max(dim=-1)
    values, indices = row_max(logits)
    assert torch.equal(indices, expected.indices)
    assert torch.equal(values.nan_to_num(), expected.values.nan_to_num())


def penalized_by_definition(logits: torch.Tensor, s: Sequence) -> torch.Tensor:
    """One row's logits after its penalties, as the definition says: repetition over prompt + output, presence /
    frequency over the output."""
    want, p, vocab = logits.clone(), s.params, logits.shape[-1]
    for t in set(s.token_ids):
        if t < vocab and p.repetition_penalty != 1.0:
            want[t] = want[t] / p.repetition_penalty if want[t] > 0 else want[t] * p.repetition_penalty
    for t in set(s.output_token_ids):
        if t < vocab:
            want[t] -= p.frequency_penalty * s.output_token_ids.count(t) + p.presence_penalty
    return want


@pytest.mark.parametrize("plain_row", [True, False], ids=["some-rows", "every-row"])
def test_penalty_rows_kept_on_the_device_match_each_row_penalized_alone(plain_row: bool) -> None:
    """The sampler keeps a penalized request's counts on the device and adds only each step's new tokens; every
    step, each row comes out as the definition says for it alone: rows that join late, a freed slot taken by a
    new request, verification rows (drafts appended) and ids beyond the vocabulary; unpenalized rows unchanged."""
    torch.manual_seed(0)
    vocab = 50
    sampler = Sampler(eos_token_ids=[0], vocab_size=vocab)
    settings = [dict(repetition_penalty=1.3), dict(presence_penalty=0.5, frequency_penalty=0.25),
                {} if plain_row else dict(presence_penalty=-0.75), dict(repetition_penalty=0.8, frequency_penalty=-0.5)]
    seqs = [Sequence(f"p{i}", None, [3, 7, 7, 60 + i], SamplingParams(**extra), 0)  # 60+: beyond the vocabulary
            for i, extra in enumerate(settings)]
    for step in range(5):
        if step == 2:  # p0 leaves; a new request takes its slot
            sampler.remove_request("p0")
            seqs[0] = Sequence("q", None, [9, 9], SamplingParams(presence_penalty=1.0), 0)
        rows = list(seqs)
        if step == 3:  # a verification step: p1 with one and two drafts appended, p3 with one
            rows += [r for r in position_views([seqs[1], seqs[3]], [[40, 40], [41]]) if r not in seqs]
        logits = torch.randn(len(rows), vocab) * 3
        inputs = SamplingInputs.on(logits.device, sampler.host_inputs(rows))
        inputs.update_penalties(sampler.penalties)
        got = penalized(logits, inputs, sampler.penalties)
        for row, s in enumerate(rows):
            torch.testing.assert_close(got[row], penalized_by_definition(logits[row], s))
        for i, s in enumerate(seqs):
            s.token_ids += [7, 11 + step, 2 * step + i]
    assert sampler.penalties.slot["q"] == 1 and len(sampler.penalties.slot) == 4 - plain_row  # p0's slot again


def test_penalty_rows_grow_only_to_the_most_requests_at_once() -> None:
    """Requests come and go two at a time: their slots are reused and the rows never outgrow two requests (and
    the empty row), which the memory plan counts."""
    penalties = PenaltyRows(torch.device("cpu"), vocab_size=10, max_requests=2)
    for i in range(6):
        seqs = [Sequence(f"{name}{i}", None, [1, 2, 3], SamplingParams(repetition_penalty=1.2), 0) for name in "rs"]
        SamplingInputs.on(torch.device("cpu"), HostSamplingInputs.of(seqs, penalties, [0])).update_penalties(penalties)
        assert sorted(penalties.slot.values()) == [1, 2]
        assert penalties.seen[1:3, [1, 2, 3]].all() and not penalties.seen[1:3, 4:].any()
        for s in seqs:
            penalties.remove(s.request_id)
    assert tuple(penalties.seen.shape) == (3, 10)
