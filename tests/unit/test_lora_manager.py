"""Resident adapter slots (LRU, pinned while running, deferred unload), the scheduler waiting for a slot, and
prefix-cache keys per adapter."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tritium.backend.core.block_manager import BlockManager
from tritium.backend.core.scheduler import Scheduler
from tritium.backend.core.sequence import Sequence
from tritium.backend.lora.adapter import LoraAdapter
from tritium.backend.lora.manager import LoraManager
from tritium.backend.lora.weights import LoraStacks
from tritium.backend.sampling_params import SamplingParams

from support.lora import SMALL_CONFIG, write_adapter


def manager(tmp_path: Path, max_loras: int, names: tuple[str, ...] = ("a", "b", "c")) -> LoraManager:
    stacks = LoraStacks(SMALL_CONFIG, max_loras, 16, torch.float32, torch.device("cpu"))
    m = LoraManager(stacks, SMALL_CONFIG, torch.float32)
    for i, name in enumerate(names):
        m.load(name, write_adapter(tmp_path / name, SMALL_CONFIG, 8, ("q_proj", "up_proj"), seed=i))
    return m


def lora_seq(rid: str, tokens: list[int], adapter: LoraAdapter | None) -> Sequence:
    return Sequence(rid, None, tokens, SamplingParams(max_tokens=100), 0, lora=adapter)


def test_slots_fill_then_evict_the_least_recently_used_unpinned(tmp_path: Path) -> None:
    m = manager(tmp_path, 2)
    a, b, c = (m.get(n) for n in "abc")
    assert m.acquire(a) == 0 and m.acquire(b) == 1
    assert m.acquire(c) is None  # both pinned: c waits
    m.release(a)
    assert m.acquire(c) == 0 and m.resident() == ["c", "b"]  # a was idle: evicted
    assert torch.equal(m.stacks.a[0]["q_proj"][0, :8], c.weights[(0, "q_proj")][0])
    assert not m.stacks.a[0]["k_proj"][0].any()  # a module c does not target holds zeros
    m.release(b)
    m.release(c)
    assert m.acquire(b) == 1  # still resident: no rewrite
    m.release(b)
    assert m.acquire(a) == 0  # c was used less recently than b


def test_unload_waits_for_the_requests_holding_the_adapter(tmp_path: Path) -> None:
    m = manager(tmp_path, 2)
    a = m.get("a")
    m.retain(a)
    assert m.acquire(a) == 0
    m.unload("a")
    with pytest.raises(ValueError, match="unknown LoRA adapter 'a' \\(loaded: b, c\\)"):
        m.get("a")
    assert m.resident() == ["a", None]  # still running on it
    m.release(a)
    m.drop(a)
    assert m.resident() == [None, None] and m.stacks.scaling[0] == 0
    reloaded = m.load("a", write_adapter(tmp_path / "a2", SMALL_CONFIG, 8, ("q_proj",), seed=9))
    assert reloaded is not a and reloaded.content_hash != a.content_hash
    with pytest.raises(ValueError, match="'a' is loaded already"):
        m.load("a", tmp_path / "a2")


def test_the_scheduler_admits_an_adapter_request_only_when_a_slot_is_free(tmp_path: Path) -> None:
    m = manager(tmp_path, 1)
    sched = Scheduler(BlockManager(64, 4), max_num_seqs=8, max_num_batched_tokens=64, lora=m)
    first, second = lora_seq("1", [1, 2, 3], m.get("a")), lora_seq("2", [4, 5, 6], m.get("b"))
    base, same = lora_seq("3", [7, 8], None), lora_seq("4", [9, 9], m.get("a"))
    for s in (first, second, base, same):
        sched.add(s)
    out = sched.schedule()
    assert [s.seq.request_id for s in out.scheduled] == ["1", "3", "4"]  # "2" waits for the one slot
    assert list(sched.waiting) == [second] and first.lora_slot == same.lora_slot == 0 and second.lora_slot == -1
    sched.finish(first, "stop")
    assert sched.schedule().scheduled and list(sched.waiting) == [second]  # "4" still pins "a"
    sched.finish(same, "stop")
    out = sched.schedule()
    assert second in [s.seq for s in out.scheduled] and second.lora_slot == 0 and m.resident() == ["b"]


def test_preemption_releases_the_slot(tmp_path: Path) -> None:
    m = manager(tmp_path, 1)
    sched = Scheduler(BlockManager(2, 4), max_num_seqs=4, max_num_batched_tokens=64, lora=m)
    s = lora_seq("1", [1, 2, 3, 4], m.get("a"))
    sched.add(s)
    sched.schedule()
    sched._preempt(sched.running.pop())
    assert s.lora_slot == -1 and m.acquire(m.get("b")) == 0  # a's slot was free to take


def test_prefix_cache_keys_blocks_by_adapter_content(tmp_path: Path) -> None:
    m = manager(tmp_path, 2)
    bm = BlockManager(num_blocks=16, block_size=4)
    tokens = list(range(9))
    owners: list[LoraAdapter | None] = [None, m.get("a"), m.get("b")]
    for i, adapter in enumerate(owners):
        s = lora_seq(str(i), tokens, adapter)
        assert bm.match_prefix(s) == 0  # nobody shares with another adapter, nor with the base model
        assert bm.allocate(s, 9)
        s.num_computed_tokens = 9
        bm.commit_full_blocks(s)
        bm.free_sequence(s)
    for i, adapter in enumerate(owners):
        again = lora_seq(f"again-{i}", tokens, adapter)
        assert bm.match_prefix(again) == 8  # each finds its own blocks
        bm.free_sequence(again)
