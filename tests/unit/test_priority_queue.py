"""Request priority without a model: the waiting queue's order and aging, and the scheduler's admission and
victim choice under scheduling_policy "priority" over a real BlockManager."""

from __future__ import annotations

from itertools import count
from pathlib import Path

import pytest
import torch

from tritium.backend.config import EngineConfig
from tritium.backend.core.batch import SchedulerOutput
from tritium.backend.core.block_manager import BlockManager
from tritium.backend.core.scheduler import Scheduler
from tritium.backend.core.sequence import Sequence, SequenceStatus
from tritium.backend.core.waiting_queue import FcfsQueue, PriorityQueue, make_waiting_queue, outranks
from tritium.backend.lora.manager import LoraManager
from tritium.backend.lora.weights import LoraStacks
from tritium.backend.sampling_params import SamplingParams

from support.lora import SMALL_CONFIG, write_adapter


class Clock:
    """A settable clock for the scheduler."""

    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


_arrivals = count()


def req(rid: str, priority: int = 0, tokens: int = 3, at: float = 0.0) -> Sequence:
    seq = Sequence(rid, None, [1] * tokens, SamplingParams(max_tokens=1000), next(_arrivals), priority=priority)
    seq.arrival_time = at
    return seq


def ids(seqs: object) -> list[str]:
    return [s.request_id for s in seqs]  # type: ignore[attr-defined]


def step(sched: Scheduler) -> SchedulerOutput:
    """One step and the engine's update after it (every sampling sequence gets token 7)."""
    out = sched.schedule()
    sched.update(out, [7] * len(out.sampling))
    return out


def test_fcfs_queue_is_arrival_order_with_preempted_in_front() -> None:
    q = FcfsQueue()
    a, b, c = req("a", 5), req("b", -5), req("c")
    q.add(a)
    q.add(b)
    q.push_front([c])
    assert ids(q) == ["c", "a", "b"] and q.peek() is c and q.pop() is c and len(q) == 2


def test_priority_queue_orders_by_priority_then_arrival() -> None:
    q = PriorityQueue(aging_s=10.0)
    for seq in (req("low", 2), req("mid-1", 1), req("high", 0), req("mid-2", 1), req("neg", -3)):
        q.add(seq)
    assert ids(q) == ["neg", "high", "mid-1", "mid-2", "low"]
    mid = q[2]
    q.remove(mid)
    assert ids(q) == ["neg", "high", "mid-2", "low"] and mid not in q
    q.push_front([mid])  # a preempted sequence goes back to its own place
    assert ids(q) == ["neg", "high", "mid-1", "mid-2", "low"]


def test_priority_ages_one_level_per_aging_period() -> None:
    q = PriorityQueue(aging_s=2.0)
    old_low = req("old-low", priority=3, at=0.0)
    q.add(old_low)
    q.add(req("new-high-early", priority=0, at=5.9))  # virtual arrival 5.9 < 0 + 3 x 2
    q.add(req("new-high-late", priority=0, at=6.1))  # waited 6.1 s: old-low has aged 3 levels, it goes first
    q.add(req("new-better", priority=-1, at=7.0))  # virtual 5.0
    assert ids(q) == ["new-better", "new-high-early", "old-low", "new-high-late"]


def test_outranks_needs_a_strictly_better_priority_and_earlier_virtual_arrival() -> None:
    running, waiting = req("running", priority=1, at=0.0), req("waiting", priority=0, at=5.0)
    assert outranks(waiting, running, aging_s=10.0)
    assert not outranks(waiting, running, aging_s=1.0)  # running arrived more than one aging period earlier
    assert not outranks(running, waiting, aging_s=10.0)
    same = req("same", priority=1, at=-1.0)  # equal priority never preempts, even arriving earlier
    assert not outranks(same, running, aging_s=10.0)


def test_policy_is_validated_naming_the_allowed_values() -> None:
    with pytest.raises(ValueError, match="scheduling_policy must be one of 'fcfs', 'priority', got 'lifo'"):
        EngineConfig(scheduling_policy="lifo")
    with pytest.raises(ValueError, match="priority_aging_s must be a number of seconds > 0"):
        EngineConfig(scheduling_policy="priority", priority_aging_s=0)
    with pytest.raises(ValueError, match="scheduling_policy must be one of fcfs, priority"):
        make_waiting_queue("lifo", 1.0)
    assert isinstance(make_waiting_queue("fcfs", 1.0), FcfsQueue)


def priority_scheduler(num_blocks: int = 64, max_num_seqs: int = 2, aging_s: float = 10.0,
                       budget: int = 64) -> tuple[Scheduler, Clock]:
    clock = Clock()
    sched = Scheduler(BlockManager(num_blocks, 4), max_num_seqs=max_num_seqs, max_num_batched_tokens=budget,
                      scheduling_policy="priority", priority_aging_s=aging_s, clock=clock)
    return sched, clock


def test_admission_by_priority_then_arrival() -> None:
    sched, clock = priority_scheduler(max_num_seqs=2)
    for rid, p in (("a", 1), ("b", 0), ("c", 1), ("d", 0)):
        sched.add(req(rid, p))
        clock.now += 0.1
    assert ids(s.seq for s in sched.schedule().scheduled) == ["b", "d"]


def test_high_priority_preempts_the_lowest_then_newest_running_for_a_seat() -> None:
    sched, clock = priority_scheduler(max_num_seqs=3)
    for rid, p in (("p1-old", 1), ("p2", 2), ("p1-new", 1)):
        sched.add(req(rid, p))
        clock.now += 0.1
    step(sched)
    sched.add(req("urgent", 0))
    out = step(sched)
    assert ids(out.preempted) == ["p2"] and "urgent" in ids(s.seq for s in out.scheduled)
    assert ids(sched.waiting) == ["p2"] and sched.waiting[0].status is SequenceStatus.WAITING
    sched.add(req("urgent-2", 0))
    out = step(sched)
    assert ids(out.preempted) == ["p1-new"]  # equal priorities: the newest goes first
    assert ids(sched.waiting) == ["p1-new", "p2"]


def test_equal_or_lower_priority_never_preempts_and_fcfs_never_does() -> None:
    sched, _ = priority_scheduler(max_num_seqs=1)
    sched.add(req("running", 1))
    step(sched)
    sched.add(req("same", 1))
    sched.add(req("lower", 2))
    for _ in range(3):
        assert not step(sched).preempted
    assert ids(sched.running) == ["running"]
    fcfs = Scheduler(BlockManager(64, 4), max_num_seqs=1, max_num_batched_tokens=64)
    fcfs.add(req("first"))
    step(fcfs)
    fcfs.add(req("second"))
    assert not step(fcfs).preempted and ids(fcfs.running) == ["first"]


def test_preempts_for_blocks_only_when_that_makes_enough_room() -> None:
    sched, _ = priority_scheduler(num_blocks=6, max_num_seqs=8)
    sched.add(req("low", priority=1, tokens=8))  # 2 blocks, then a third when it decodes
    sched.add(req("mid", priority=1, tokens=8))
    step(sched)
    step(sched)
    assert sched.blocks.num_free_blocks == 0
    sched.add(req("too-big", priority=0, tokens=40))  # 10 blocks: more than the cache; nothing is preempted
    assert not step(sched).preempted
    sched.waiting.remove(sched.waiting[0])
    sched.add(req("urgent", priority=0, tokens=9))  # 3 blocks: one victim's blocks are enough
    out = step(sched)
    assert ids(out.preempted) == ["mid"] and "urgent" in ids(s.seq for s in out.scheduled)


def test_running_out_of_blocks_preempts_the_lowest_priority_not_the_newest() -> None:
    sched, clock = priority_scheduler(num_blocks=3, max_num_seqs=3)
    low = req("low", priority=5, tokens=3)
    sched.add(low)
    step(sched)  # low: 1 block, 4 tokens
    clock.now += 1
    sched.add(req("high", priority=0, tokens=8))
    out = step(sched)  # high takes the 2 other blocks
    assert not out.preempted and ids(sched.running) == ["low", "high"] and sched.blocks.num_free_blocks == 0
    out = step(sched)  # low's 5th token needs a block: low itself goes, not the newest (high)
    assert ids(out.preempted) == ["low"] and ids(sched.running) == ["high"] and ids(sched.waiting) == ["low"]
    fcfs = Scheduler(BlockManager(3, 4), max_num_seqs=3, max_num_batched_tokens=64)
    fcfs.add(req("first", tokens=3))
    step(fcfs)
    fcfs.add(req("second", tokens=8))
    step(fcfs)
    assert ids(step(fcfs).preempted) == ["second"]  # fcfs: the newest, as before


def test_no_ping_pong_and_preempted_sequences_finish() -> None:
    sched, clock = priority_scheduler(max_num_seqs=1)
    low = req("low", priority=1, tokens=5)
    low.params = SamplingParams(max_tokens=4)
    sched.add(low)
    step(sched)
    high = req("high", priority=0, tokens=5)
    high.params = SamplingParams(max_tokens=3)
    clock.now += 1
    sched.add(high)
    preempted = []
    for _ in range(20):
        clock.now += 100  # however long the victim waits, it never takes the seat back from `high`
        out = step(sched)
        preempted += ids(out.preempted)
        for s in list(sched.running):
            if s.num_output_tokens >= s.params.max_tokens:
                sched.finish(s, "length")
        if not sched.has_unfinished():
            break
    assert preempted == ["low"] and low.num_preemptions == 1
    assert low.finished and high.finished and low.num_output_tokens == 4


def test_aged_request_is_not_passed_or_preempted_by_newcomers() -> None:
    sched, clock = priority_scheduler(max_num_seqs=1, aging_s=1.0)
    sched.add(req("blocker", priority=0))
    step(sched)
    sched.add(req("patient", priority=3))
    clock.now = 2.5
    sched.add(req("early-high", priority=0))  # virtual arrival 2.5 < 3: passes `patient`
    clock.now = 3.5
    sched.add(req("late-high", priority=0))  # virtual 3.5 > 3: `patient` has waited out its 3 levels
    assert ids(sched.waiting) == ["early-high", "patient", "late-high"]
    sched.finish(sched.running[0], "stop")
    step(sched)
    sched.finish(sched.running[0], "stop")
    step(sched)
    assert ids(sched.running) == ["patient"]
    clock.now = 10.0
    sched.add(req("newest-high", priority=0))  # better priority, but `patient` aged past it: no preemption
    assert not step(sched).preempted and ids(sched.running) == ["patient"]


def one_slot_two_adapters(tmp_path: Path) -> LoraManager:
    """A LoraManager with one device slot and adapters "a" and "b" loaded."""
    stacks = LoraStacks(SMALL_CONFIG, 1, 16, torch.float32, torch.device("cpu"))
    loras = LoraManager(stacks, SMALL_CONFIG, torch.float32)
    for i, name in enumerate("ab"):
        loras.load(name, write_adapter(tmp_path / name, SMALL_CONFIG, 8, ("q_proj",), seed=i))
    return loras


def test_a_request_waiting_for_an_adapter_slot_keeps_its_place_and_preempts_nothing(tmp_path: Path) -> None:
    loras = one_slot_two_adapters(tmp_path)
    clock = Clock()
    sched = Scheduler(BlockManager(64, 4), max_num_seqs=2, max_num_batched_tokens=64, lora=loras,
                      scheduling_policy="priority", clock=clock)
    on_a, base, on_b, high_base = req("on-a", 1), req("base", 1), req("on-b", 0), req("high-base", 0)
    on_a.lora, on_b.lora = loras.get("a"), loras.get("b")
    sched.add(on_a)
    sched.add(base)
    step(sched)
    clock.now += 1
    sched.add(on_b)  # a better priority, but "a" pins the only slot: preempting for it could be in vain
    clock.now += 1
    sched.add(high_base)
    out = step(sched)
    assert ids(out.preempted) == ["base"] and ids(s.seq for s in out.scheduled) == ["on-a", "high-base"]
    assert ids(sched.waiting) == ["on-b", "base"] and on_b.lora_slot == -1
    sched.finish(on_a, "stop")
    out = step(sched)  # the slot is free: on-b (first in the queue) takes the seat and the slot
    assert "on-b" in ids(s.seq for s in out.scheduled) and on_b.lora_slot == 0


def test_a_slot_waiter_past_its_bound_is_passed_by_no_adapter_request(tmp_path: Path) -> None:
    loras = one_slot_two_adapters(tmp_path)
    clock = Clock()
    sched = Scheduler(BlockManager(64, 4), max_num_seqs=5, max_num_batched_tokens=64, lora=loras, clock=clock,
                      priority_aging_s=5.0)
    on_a, on_b, on_a1, on_a2, base = req("on-a"), req("on-b"), req("on-a1"), req("on-a2"), req("base")
    on_a.lora, on_b.lora, on_a1.lora, on_a2.lora = loras.get("a"), loras.get("b"), loras.get("a"), loras.get("a")
    sched.add(on_a)
    step(sched)
    sched.add(on_b)
    sched.add(on_a1)
    assert "on-a1" in ids(s.seq for s in step(sched).scheduled) and ids(sched.waiting) == ["on-b"]  # within bound
    clock.now = 5.0
    for seq in (on_a2, base):
        sched.add(seq)
    out = step(sched)  # "a" is resident and pinned, yet on-a2 now queues behind on-b; the base request passes
    assert ids(s.seq for s in out.scheduled) == ["on-a", "on-a1", "base"]
    assert ids(sched.waiting) == ["on-b", "on-a2"] and on_a2.lora_slot == -1
    sched.finish(on_a, "stop")
    sched.finish(on_a1, "stop")
    out = step(sched)
    assert "on-b" in ids(s.seq for s in out.scheduled) and ids(sched.waiting) == ["on-a2"]
    sched.finish(on_b, "stop")
    assert "on-a2" in ids(s.seq for s in step(sched).scheduled)


def test_a_running_sequence_that_preempts_itself_leaves_the_step_to_those_after_it() -> None:
    sched = Scheduler(BlockManager(2, 4), max_num_seqs=2, max_num_batched_tokens=64, scheduling_policy="priority")
    low, high = req("low", priority=5), req("high", priority=0)
    sched.add(low)
    step(sched)
    sched.add(high)
    step(sched)  # each holds one block (low's full), none is free
    assert ids(sched.running) == ["low", "high"] and sched.blocks.num_free_blocks == 0
    out = step(sched)  # low, first in line, needs a block: it is the lowest priority, so it is the victim
    assert ids(out.preempted) == ["low"] and ids(s.seq for s in out.scheduled) == ["high"]
