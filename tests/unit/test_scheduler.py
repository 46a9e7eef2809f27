"""Scheduler: token budget, seats, chunked prefill and preemption, without a model."""

from __future__ import annotations

from tritium.backend.core.batch import SchedulerOutput
from tritium.backend.core.block_manager import BlockManager
from tritium.backend.core.rotary_rule import RotaryLengthRule
from tritium.backend.core.scheduler import Scheduler
from tritium.backend.core.sequence import SequenceStatus
from tritium.backend.outputs import SpecDecodingStats

from support.builders import seq


def advance(sched: Scheduler, out: SchedulerOutput, next_token: int = 7) -> None:
    """What the engine does after a step: the scheduler's own update, with `next_token` sampled."""
    sched.update(out, [next_token] * len(out.sampling))


def test_budget_and_chunked_prefill() -> None:
    sched = Scheduler(BlockManager(64, 4), max_num_seqs=8, max_num_batched_tokens=10)
    a, b = seq(list(range(7)), "a"), seq(list(range(20)), "b")
    sched.add(a)
    sched.add(b)
    out = sched.schedule()
    assert [(s.seq.request_id, s.num_new_tokens) for s in out.scheduled] == [("a", 7), ("b", 3)]
    assert out.scheduled[0].samples and not out.scheduled[1].samples
    advance(sched, out)
    out = sched.schedule()  # a decodes (1 token), b continues its prefill with the rest of the budget
    assert [(s.seq.request_id, s.num_new_tokens) for s in out.scheduled] == [("a", 1), ("b", 9)]
    advance(sched, out)
    out = sched.schedule()
    assert [(s.seq.request_id, s.num_new_tokens) for s in out.scheduled] == [("a", 1), ("b", 8)]
    assert out.scheduled[1].samples


def test_max_num_seqs_limits_admission() -> None:
    sched = Scheduler(BlockManager(64, 4), max_num_seqs=2, max_num_batched_tokens=100)
    for i in range(3):
        sched.add(seq([1, 2, 3], f"r{i}"))
    out = sched.schedule()
    assert len(out.scheduled) == 2 and len(sched.waiting) == 1
    sched.finish(out.scheduled[0].seq, "stop")
    advance(sched, out)
    out = sched.schedule()
    assert {s.seq.request_id for s in out.scheduled} == {"r1", "r2"}


def test_no_chunking_waits_for_budget() -> None:
    sched = Scheduler(BlockManager(64, 4), max_num_seqs=4, max_num_batched_tokens=8, enable_chunked_prefill=False)
    sched.add(seq([1] * 5, "a"))
    sched.add(seq([2] * 5, "b"))
    out = sched.schedule()
    assert [s.seq.request_id for s in out.scheduled] == ["a"]  # b does not fit whole into 3 tokens
    assert sched.blocks.num_free_blocks == 64 - 2


def test_preempts_newest_when_blocks_run_out() -> None:
    bm = BlockManager(num_blocks=4, block_size=4)
    sched = Scheduler(bm, max_num_seqs=4, max_num_batched_tokens=64)
    a, b = seq([1] * 8, "a"), seq([2] * 7, "b")
    sched.add(a)
    sched.add(b)
    out = sched.schedule()
    assert len(out.scheduled) == 2 and bm.num_free_blocks == 0
    advance(sched, out)
    # a now has 9 tokens and needs a third block: b (newest) is preempted and requeued first.
    out = sched.schedule()
    assert out.preempted == [b] and [s.seq for s in out.scheduled] == [a]
    assert b.status is SequenceStatus.WAITING and b.num_computed_tokens == 0 and sched.waiting[0] is b
    assert sched.num_preemptions == 1
    advance(sched, out)
    sched.finish(a, "stop")
    out = sched.schedule()
    # Recompute prompt + output, less b's first block, which the update committed to the prefix cache.
    assert [(s.seq.request_id, s.num_new_tokens) for s in out.scheduled] == [("b", 4)] and b.num_cached_tokens == 4
    assert out.scheduled[0].samples


def test_a_longrope_sequence_growing_past_the_original_context_is_recomputed_in_place() -> None:
    """Short factors up to 8 tokens: the step after the sequence reaches 9 computes all 9 again (under the long key,
    which a prefix lookup of the short blocks cannot hit), drafts never cross 8 under the short factors."""
    rule = RotaryLengthRule("longrope", original=8)
    sched = Scheduler(BlockManager(16, 4), max_num_seqs=2, max_num_batched_tokens=64, rotary_rule=rule)
    a = seq(list(range(6)), "a")
    a.spec = SpecDecodingStats()
    sched.add(a)
    advance(sched, sched.schedule())  # 7 tokens, 6 computed
    assert a.kv_key == b""
    a.draft_tokens = [1, 2, 3]
    out = sched.schedule()
    assert [(s.num_new_tokens, s.draft) for s in out.scheduled] == [(2, [1])]  # 7 + 1 draft = 8
    sched.update(out, [7], [[1]])  # the draft kept and a token: 9 tokens, 8 computed under the short factors
    assert (a.num_tokens, a.num_computed_tokens) == (9, 8) and rule.must_recompute(a)
    out = sched.schedule()
    assert [(s.num_new_tokens, s.samples) for s in out.scheduled] == [(9, True)]
    assert a.kv_key == b"longrope" and a.num_cached_tokens == 0 and sched.num_recomputes == 1
    assert sched.num_preemptions == 0 and a.status is SequenceStatus.RUNNING


def test_dynamic_ntk_keys_long_prompts_by_their_length() -> None:
    rule = RotaryLengthRule("dynamic", original=8)
    short, long_a, long_b = seq(list(range(8)), "s"), seq(list(range(10)), "a"), seq(list(range(12)), "b")
    assert [rule.kv_key(s) for s in (short, long_a, long_b)] == [b"", b"dynamic:10", b"dynamic:12"]
    long_a.token_ids.extend([1, 2, 3])  # generated tokens rotate for their own p + 1: the key stays
    assert rule.kv_key(long_a) == b"dynamic:10" and rule.draft_room(long_a) is None
