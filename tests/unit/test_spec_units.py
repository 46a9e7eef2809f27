"""Speculative decoding without a model: the config, prompt lookup, the draft-length rule, the proposer's limits,
the scheduler's budgeting of the worker's drafts (blocks for them, rollback of rejected ones) and the exactness of
verification by sampling."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from tritium.backend.config import SpeculativeConfig
from tritium.backend.core.block_manager import BlockManager
from tritium.backend.core.scheduler import Scheduler
from tritium.backend.core.sequence import Sequence
from tritium.backend.outputs import SpecDecodingStats
from tritium.backend.sample.sampler import Sampler, SamplerOutput
from tritium.backend.sampling_params import SamplingParams
from tritium.backend.serving.settings import load_settings
from tritium.backend.spec.draft_length import RETRY_AFTER, WINDOW, AdaptiveDraftLength
from tritium.backend.spec.ngram import propose_ngram
from tritium.backend.spec.proposer import DraftProposer
from tritium.backend.spec.verify import accept_runs, position_views


def test_config_in_vllm_shape_and_its_errors() -> None:
    c = SpeculativeConfig.parse({"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 5})
    assert c == SpeculativeConfig("ngram", 3, 5, 5)  # one bound alone sets both
    assert SpeculativeConfig.parse({"num_speculative_tokens": 2}) == SpeculativeConfig("ngram", 2, 2, 4)
    assert SpeculativeConfig.parse(None) is None
    assert SpeculativeConfig.parse({"method": "draft_model", "model": "small", "num_speculative_tokens": 3}) == \
        SpeculativeConfig("draft_model", 3, model="small")
    for raw, message in [
        ({"method": "eagle", "num_speculative_tokens": 2}, "method must be one of"),
        ({"method": "draft_model", "num_speculative_tokens": 2}, "model must name the draft model's folder"),
        ({"num_speculative_tokens": 2, "model": "x"}, "for method 'draft_model' only"),
        ({"method": "ngram"}, r"num_speculative_tokens must be an integer in \[1, 16\]"),
        ({"num_speculative_tokens": 2, "prompt_lookup_min": 4, "prompt_lookup_max": 2}, "must be <= prompt_lookup"),
        ({"num_speculative_tokens": 2, "lookahead": 1}, "unknown key"),
        ("ngram", "must be an object"),
    ]:
        with pytest.raises(ValueError, match=message):
            SpeculativeConfig.parse(raw)


def test_prompt_lookup_takes_the_longest_latest_match() -> None:
    tokens = [1, 2, 3, 4, 5, 9, 2, 3, 4, 6, 7, 2, 3, 4]
    # The 3-gram [2, 3, 4] occurs at 1 and 6: the latest one is followed by 6, 7.
    assert propose_ngram(tokens, 2, 1, 3) == [6, 7]
    assert propose_ngram(tokens, 5, 1, 3) == [6, 7, 2, 3, 4]  # runs up to the end of the tokens
    assert propose_ngram([5, 6, 7, 8], 3, 1, 3) == []  # nothing repeats
    assert propose_ngram([5, 6, 7, 8, 7], 3, 2, 3) == []  # only a 1-gram repeats, below min
    assert propose_ngram([5, 6, 7, 8, 7], 3, 1, 3) == [8, 7]
    assert propose_ngram(tokens, 0, 1, 3) == []


def test_draft_length_turns_down_to_off_retries_and_turns_up() -> None:
    rule = AdaptiveDraftLength(4)
    for _ in range(WINDOW):
        rule.record(4, 1)  # 25%: low, not hopeless
    assert rule.current() == 2
    for i in range(WINDOW):
        rule.record(2, i % 2)
    assert rule.current() == 1
    for i in range(WINDOW):
        rule.record(1, i % 4 == 0)
    assert [rule.current() for _ in range(RETRY_AFTER)] == [0] * RETRY_AFTER  # off
    assert rule.current() == 1  # retried
    for _ in range(WINDOW):
        rule.record(1, 1)
    assert rule.current() == 2  # paying again: grows back, one at a time
    for _ in range(WINDOW):
        rule.record(2, 1)  # 50%: neither low nor high
    assert rule.current() == 2


def test_drafts_that_never_land_turn_speculation_off_at_once_and_retries_back_off() -> None:
    rule = AdaptiveDraftLength(4)
    for _ in range(WINDOW):
        rule.record(4, 0 if _ else 1)  # 1 of 32 accepted: below TURN_OFF_BELOW
    assert [rule.current() for _ in range(RETRY_AFTER)] == [0] * RETRY_AFTER and rule.current() == 1
    for _ in range(WINDOW):
        rule.record(1, 0)  # the retry does not pay: off, twice as long
    assert [rule.current() for _ in range(2 * RETRY_AFTER)] == [0] * (2 * RETRY_AFTER) and rule.current() == 1
    for _ in range(WINDOW):
        rule.record(1, 1)  # paying: back up, and the next turn-off waits RETRY_AFTER again
    assert rule.current() == 2 and rule.retry_after == RETRY_AFTER


def speculating(tokens: list[int], rid: str = "r", max_tokens: int = 100) -> Sequence:
    s = Sequence(rid, None, tokens, SamplingParams(max_tokens=max_tokens, temperature=0), 0)
    s.spec = SpecDecodingStats()
    return s


def test_scheduler_runs_the_workers_drafts_and_rolls_back_the_rejected_ones() -> None:
    blocks = BlockManager(16, 4)
    sched = Scheduler(blocks, max_num_seqs=4, max_num_batched_tokens=64)
    a = speculating([1, 2, 3, 4, 5, 1, 2])
    sched.add(a)
    out = sched.schedule()
    sched.update(out, [3], drafts=[[4, 5, 1, 2]])  # the prefill samples 3; the worker drafts 4, 5, 1, 2
    assert a.token_ids[-1] == 3 and a.num_computed_tokens == 7 and a.draft_tokens == [4, 5, 1, 2]
    assert len(a.block_table) == 2  # the drafts' positions 8..11 get blocks when they are scheduled
    out = sched.schedule()
    (s,) = out.scheduled
    assert s.draft == [4, 5, 1, 2] and s.num_new_tokens == 5 and s.samples and out.drafts == [[4, 5, 1, 2]]
    assert len(a.block_table) == 3 and not a.draft_tokens  # 12 positions; the drafts are the step's now
    # The target agreed with 4 and 5, then sampled 9 instead of 1: two drafts kept, 9 appended; no new drafts.
    assert sched.update(out, [9], [[4, 5]], [[]]) == [3]
    assert a.token_ids[7:] == [3, 4, 5, 9] and a.num_computed_tokens == 10
    assert len(a.block_table) == 3 and blocks.num_free_blocks == 13
    sched.finish(a, "abort")
    # All rejected: the block only the drafts took is freed.
    b = speculating([7, 8, 9, 7, 8, 9, 7, 8], "b")
    sched.add(b)
    sched.update(sched.schedule(), [9], drafts=[[7, 8, 9, 7]])
    out = sched.schedule()
    (s,) = out.scheduled
    assert s.draft == [7, 8, 9, 7] and len(b.block_table) == 4  # positions 8..12
    assert sched.update(out, [1], [[]], [[]]) == [1]
    assert b.num_computed_tokens == 9 and b.token_ids[8:] == [9, 1] and len(b.block_table) == 3
    assert blocks.num_free_blocks == 13
    sched.finish(b, "abort")
    assert blocks.num_free_blocks == 16


def test_drafts_are_cut_to_the_budget_and_dropped_without_blocks() -> None:
    blocks = BlockManager(3, 4)
    sched = Scheduler(blocks, max_num_seqs=2, max_num_batched_tokens=3)
    a = speculating([1, 2, 3])
    sched.add(a)
    sched.update(sched.schedule(), [4], drafts=[[5, 6, 7, 8]])
    out = sched.schedule()
    assert out.scheduled[0].draft == [5, 6]  # the budget of 3 holds the token and two drafts
    sched.update(out, [9], [[5, 6]], [[1, 2, 3]])  # positions 0..6 hold tokens; the drafts would take 7..9
    other = Sequence("other", None, [1, 2, 3, 4], SamplingParams(), 0)
    assert blocks.allocate(other, 4) and blocks.num_free_blocks == 0
    out = sched.schedule()
    assert out.scheduled[0].draft == [] and out.scheduled[0].num_new_tokens == 1  # no block for position 8
    sched.finish(a, "abort")
    blocks.free_sequence(other)
    assert blocks.num_free_blocks == 3


def test_a_draft_model_gets_lookahead_blocks_within_the_context() -> None:
    blocks = BlockManager(16, 4)
    sched = Scheduler(blocks, max_num_seqs=4, max_num_batched_tokens=64, num_lookahead_tokens=4, max_model_len=10)
    a, plain = speculating([1, 2, 3, 4, 5]), Sequence("p", None, [1, 2, 3], SamplingParams(max_tokens=4), 0)
    sched.add(a)
    sched.add(plain)
    sched.schedule()
    assert len(a.block_table) == 3  # 5 prompt positions and 4 the draft model writes at after sampling
    assert len(plain.block_table) == 1  # it does not speculate
    a.token_ids += [6, 7]
    a.num_computed_tokens = 6
    sched.schedule()
    assert len(a.block_table) == 3  # 7 positions + 4 would pass max_model_len 10: up to 10


def test_the_proposer_keeps_to_the_requests_limits() -> None:
    refused: list[list[int]] = []

    def grammar(request_id: str, drafts: list[int]) -> int:
        refused.append(drafts)
        return 1

    proposer = DraftProposer(SpeculativeConfig("ngram", 4, 1, 3), max_model_len=64, block_size=4,
                             grammar_prefix=grammar)
    a = speculating([1, 2, 3, 1, 2], max_tokens=3)
    proposer.add_request("r")
    assert proposer.propose_all([(a, [3])])[0] == ([1], 0)  # one output after the run, a verification adds up to 2 more
    a.token_ids.append(3)
    assert proposer.propose_all([(a, [1])])[0] == ([], 0)  # the run reaches max_tokens - 1: nothing left to draft
    assert proposer.propose_all([(speculating([1, 2, 3, 1, 2], "other"), [3])])[0] == ([], 0)  # never added
    constrained = Sequence("c", None, [1, 2, 3, 1, 2], SamplingParams(max_tokens=20, structured_output={
        "choice": ["a"]}), 0)
    proposer.add_request("c")
    assert proposer.propose_all([(constrained, [3])])[0] == ([1], 2) and refused == [[1, 2, 3]]


def test_the_stop_checker_cuts_an_accepted_run() -> None:
    blocks = BlockManager(16, 4)
    sched = Scheduler(blocks, max_num_seqs=4, max_num_batched_tokens=64)
    a = speculating([1, 2, 3, 1, 2], max_tokens=10)
    a.params.stop_token_ids = [3]
    sched.add(a)
    sched.update(sched.schedule(), [13], drafts=[[3, 4]])
    out = sched.schedule()
    assert out.drafts == [[3, 4]]
    assert sched.update(out, [5], [[3, 4]], [[6]]) == [1]  # the stop id 3 ends the run: 4 and 5 never appended
    assert a.finished and a.finish_reason == "stop" and a.token_ids[-1] == 3
    assert blocks.num_free_blocks == 16


def test_verification_by_sampling_keeps_the_target_distribution() -> None:
    """Drafts are deterministic, so accepting d when the sample at its position equals d is rejection sampling
    with a one-hot q: the first token is distributed as p0, and given that it is the draft, the second as p1."""
    vocab = 64
    p0 = torch.tensor([0.5, 0.3, 0.15, 0.05])
    p1 = torch.tensor([0.1, 0.2, 0.3, 0.4])
    logits = torch.full((2, vocab), float("-inf"))
    logits[0, :4], logits[1, :4] = p0.log(), p1.log()
    draft = [1]  # drafted with probability 0.3 under the target
    sampler = Sampler([vocab - 1], seed=0)
    seq = Sequence("r", None, [5, 6], SamplingParams(temperature=1.0, seed=7, max_tokens=10), 0)
    sampler.add_request("r", 7)
    n = 4000
    first = torch.zeros(4)
    second = torch.zeros(4)
    for _ in range(n):
        run = accept_runs([draft], sampler(logits, position_views([seq], [draft])))
        tokens = [*run.accepted[0], run.sampled.token_ids[0]]
        first[tokens[0]] += 1
        if tokens[0] == draft[0]:
            second[tokens[1]] += 1
    assert chi_square(first, p0) < 16.3  # 3 degrees of freedom: p = 0.001
    assert chi_square(second, p1) < 16.3
    assert second.sum() > 0.25 * n


def chi_square(counts: torch.Tensor, probs: torch.Tensor) -> float:
    expected = probs * counts.sum()
    return float(((counts - expected) ** 2 / expected).sum())


def test_accept_runs_stops_at_the_first_mismatch_or_error() -> None:
    rows = SamplerOutput([4, 5, 8, 7, 2, None, 1], [None] * 7, [None] * 5 + ["boom", None])
    out = accept_runs([[4, 5, 6], [], [3]], rows)
    assert out.accepted == [[4, 5], [], []] and out.sampled.token_ids == [8, 2, None]
    assert out.sampled.errors == [None, None, "boom"]


def test_model_json_takes_speculative_config(tmp_path: Path) -> None:
    (tmp_path / "draft").mkdir()
    config = {"method": "draft_model", "model": "draft", "num_speculative_tokens": 2}
    (tmp_path / "model.json").write_text(json.dumps({"speculative_config": config}))
    spec = load_settings(tmp_path).engine.speculative_config
    assert isinstance(spec, dict) and spec["model"] == str((tmp_path / "draft").resolve())
    (tmp_path / "model.json").write_text(json.dumps({"speculative_config": {"method": "ngram"}}))
    with pytest.raises(ValueError, match=r"speculative_config\.num_speculative_tokens"):
        load_settings(tmp_path)
