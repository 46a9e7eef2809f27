"""Continuous batching: which sequences run each step, and how many tokens each (docs/architecture.md, "The
engine step", "Priority", and "LoRA" for admission once an adapter has a slot)."""

from __future__ import annotations

import time
from collections.abc import Callable

from tritium.backend.core.batch import ScheduledSequence, SchedulerOutput
from tritium.backend.core.block_manager import BlockManager
from tritium.backend.core.rotary_rule import RotaryLengthRule
from tritium.backend.core.sequence import Sequence, SequenceStatus
from tritium.backend.core.stop_checker import StopChecker
from tritium.backend.core.waiting_queue import make_waiting_queue, outranks, priority_key
from tritium.backend.lora.manager import LoraManager


class Scheduler:
    def __init__(
        self,
        block_manager: BlockManager,
        max_num_seqs: int,
        max_num_batched_tokens: int,
        enable_chunked_prefill: bool = True,
        stop_checker: StopChecker | None = None,
        lora: LoraManager | None = None,
        scheduling_policy: str = "fcfs",
        priority_aging_s: float = 10.0,
        clock: Callable[[], float] = time.monotonic,
        num_lookahead_tokens: int = 0,
        max_model_len: int | None = None,
        rotary_rule: RotaryLengthRule | None = None,
    ) -> None:
        self.blocks = block_manager
        self.stop_checker = stop_checker or StopChecker([])
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.enable_chunked_prefill = enable_chunked_prefill
        self.lora = lora
        # Blocks past a speculating step for a draft model's KV, written while it drafts (within max_model_len).
        self.num_lookahead_tokens = num_lookahead_tokens
        self.max_model_len = max_model_len
        self.waiting = make_waiting_queue(scheduling_policy, priority_aging_s)
        self.by_priority = scheduling_policy == "priority"
        self.priority_aging_s = priority_aging_s
        self.clock = clock  # stamps each sequence's arrival_time, from which its priority ages
        self.running: list[Sequence] = []
        self.num_preemptions = 0
        self.rotary_rule = rotary_rule
        self.num_recomputes = 0  # sequences recomputed under a new rotary key (rotary_rule.py)

    def add(self, seq: Sequence) -> None:
        seq.arrival_time = self.clock()
        self.waiting.add(seq)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule(self) -> SchedulerOutput:
        """This step's sequences and tokens (blocks allocated), running ones first, and those preempted."""
        out = SchedulerOutput()
        budget = self.max_num_batched_tokens
        made_room = self._make_room(out) if self.by_priority else 0
        i = 0
        while i < len(self.running) and budget > 0:
            seq = self.running[i]
            if self.rotary_rule is not None and self.rotary_rule.must_recompute(seq):
                self._recompute(seq)
            num_new = min(seq.num_tokens - seq.num_computed_tokens, budget)
            draft = self._take_draft(seq, num_new, budget)
            num_new += len(draft)
            if self._allocate_or_preempt(i, num_new, out):
                self._schedule(out, ScheduledSequence(seq, num_new, draft))
                budget -= num_new
                i += 1
            # else `seq` itself was preempted: running[i] is now the sequence after it
        if len(out.preempted) > made_room:
            return self._with_sampling(out)
        no_slot: list[Sequence] = []  # waiting for an adapter slot: they keep their place in the queue
        starved = False  # a slot waiter waited its bound: the adapter sequences behind it wait too
        now = self.clock()
        while self.waiting and len(self.running) < self.max_num_seqs and budget > 0:
            seq = self.waiting.peek()
            if seq.lora is not None and seq.lora_slot < 0 and (starved or not self._acquire_adapter(seq)):
                no_slot.append(self.waiting.pop())
                starved = starved or now - seq.arrival_time >= self.priority_aging_s
                continue
            if seq.num_computed_tokens == 0:
                if self.rotary_rule is not None:
                    seq.kv_key = self.rotary_rule.kv_key(seq)
                seq.num_cached_tokens = self.blocks.match_prefix(seq)
            num_new = seq.num_tokens - seq.num_computed_tokens
            if num_new > budget and not self.enable_chunked_prefill:
                if self.running or out.scheduled:
                    self.blocks.free_sequence(seq)
                    self._release_adapter(seq)
                    break
                # Alone and still too long: let it through whole rather than never run it.
            else:
                num_new = min(num_new, budget)
            if not self.blocks.allocate(seq, num_new):
                self.blocks.free_sequence(seq)
                self._release_adapter(seq)
                break
            self.waiting.pop()
            seq.status = SequenceStatus.RUNNING
            self.running.append(seq)
            self._schedule(out, ScheduledSequence(seq, num_new))
            budget -= num_new
        self.waiting.push_front(no_slot)
        return self._with_sampling(out)

    def _allocate_or_preempt(self, i: int, num_new: int, out: SchedulerOutput) -> bool:
        """Blocks for `running[i]`, preempting until they fit; False when it was itself preempted."""
        seq = self.running[i]
        while not self.blocks.allocate(seq, num_new):
            victim = self._pop_victim(i)
            self._preempt(victim)
            out.preempted.append(victim)
            if victim is seq:
                return False
        return True

    def _pop_victim(self, i: int) -> Sequence:
        """The newest; under "priority" the last by `priority_key` of `running[i:]` (those before are scheduled)."""
        if not self.by_priority:
            return self.running.pop()
        tail = self.running[i:]
        victim = max(tail, key=lambda s: priority_key(s, self.priority_aging_s))
        self.running.remove(victim)
        return victim

    def _make_room(self, out: SchedulerOutput) -> int:
        """Preempt running sequences that waiting ones outrank, when that makes room for them; stop at the first
        waiting one it cannot help (docs/architecture.md, "Priority"). Returns how many it preempted."""
        aging = self.priority_aging_s
        seats = self.max_num_seqs - len(self.running)
        free = self.blocks.num_free_blocks
        budget = self.max_num_batched_tokens - sum(r.num_tokens - r.num_computed_tokens for r in self.running)
        made = 0
        for seq in list(self.waiting):
            if budget <= 0:
                break
            if seq.lora is not None and seq.lora_slot < 0 and \
                    (self.lora is None or self.lora.num_pinned() >= self.lora.max_loras):
                continue  # it may have to wait for an adapter slot: room made for it could stay unused
            tokens = seq.num_tokens - seq.num_computed_tokens
            if self.enable_chunked_prefill:
                tokens = min(tokens, budget)
            elif tokens > budget:
                break
            need = self.blocks.blocks_needed(seq.num_computed_tokens + tokens) - len(seq.block_table)
            victims = sorted((r for r in self.running if outranks(seq, r, aging)),
                             key=lambda r: priority_key(r, aging), reverse=True)
            taken: list[Sequence] = []
            while (seats < 1 or free < need) and len(taken) < len(victims):
                victim = victims[len(taken)]
                taken.append(victim)
                seats += 1
                free += sum(1 for b in victim.block_table if self.blocks.ref_counts[b] == 1)
            if seats < 1 or free < need:
                break
            for victim in taken:
                budget += victim.num_tokens - victim.num_computed_tokens
                self.running.remove(victim)
                self._preempt(victim)
                out.preempted.append(victim)
            made += len(taken)
            seats -= 1
            free -= need
            budget -= tokens
        return made

    @staticmethod
    def _with_sampling(out: SchedulerOutput) -> SchedulerOutput:
        out.sampling = [s.seq for s in out.scheduled if s.samples]
        out.drafts = [s.draft for s in out.scheduled if s.samples]
        return out

    def _take_draft(self, seq: Sequence, num_new: int, budget: int) -> list[int]:
        """The drafts `seq` verifies now: only when it decodes, within the budget, with blocks ([]: plain decode)."""
        room = self.rotary_rule.draft_room(seq) if self.rotary_rule is not None else None
        draft, seq.draft_tokens = seq.draft_tokens[: budget - 1 if room is None else min(budget - 1, room)], []
        if num_new != 1 or not draft or not self.blocks.allocate(seq, 1 + len(draft)):
            return []
        return draft

    def _schedule(self, out: SchedulerOutput, s: ScheduledSequence) -> None:
        out.scheduled.append(s)
        seq = s.seq
        if self.num_lookahead_tokens and seq.spec is not None and s.samples:
            end = seq.num_computed_tokens + s.num_new_tokens
            room = self.max_model_len - end if self.max_model_len is not None else self.num_lookahead_tokens
            self.blocks.allocate(seq, s.num_new_tokens + max(0, min(self.num_lookahead_tokens, room)))

    def update(self, out: SchedulerOutput, tokens: list[int | None], accepted: list[list[int]] | None = None,
               drafts: list[list[int]] | None = None) -> list[int]:
        """After `out`'s forward pass: count computed tokens, append each sampling sequence's kept drafts and token
        through the stop checker, keep its next drafts. `tokens` (None: the engine ends that sequence), `accepted`
        and `drafts` align with `out.sampling`. Returns how many tokens each got."""
        for s in out.scheduled:
            s.seq.num_computed_tokens += s.num_new_tokens - len(s.draft)  # drafts count once accepted
            self.blocks.commit_full_blocks(s.seq)
        appended: list[int] = []
        for row, (seq, token) in enumerate(zip(out.sampling, tokens, strict=True)):
            if token is None or seq.finished:
                appended.append(0)
                continue
            kept = accepted[row] if accepted is not None else []
            n = 0
            for t in (*kept, token):
                seq.token_ids.append(t)
                n += 1
                reason = self.stop_checker.check(seq)
                if reason is not None:
                    self.finish(seq, reason)
                    break
            appended.append(n)
            if seq.spec is not None and not seq.finished:
                seq.num_computed_tokens += len(kept)
                seq.draft_tokens = drafts[row] if drafts is not None else []
                self.blocks.trim(seq, len(seq.draft_tokens))  # what rejected drafts or unused lookahead took
                self.blocks.commit_full_blocks(seq)
        return appended

    def _acquire_adapter(self, seq: Sequence) -> bool:
        """False while `seq`'s adapter has no slot."""
        if seq.lora is None or seq.lora_slot >= 0:
            return True
        assert self.lora is not None, "a sequence on a LoRA adapter needs the scheduler's LoraManager"
        slot = self.lora.acquire(seq.lora)
        if slot is None:
            return False
        seq.lora_slot = slot
        return True

    def _release_adapter(self, seq: Sequence) -> None:
        if seq.lora is not None and seq.lora_slot >= 0:
            assert self.lora is not None
            self.lora.release(seq.lora)
            seq.lora_slot = -1

    def _recompute(self, seq: Sequence) -> None:
        """Compute `seq`'s K/V again under its new rotary key, keeping its place (its old blocks stay cached)."""
        assert self.rotary_rule is not None
        seq.draft_tokens = []
        self.blocks.free_sequence(seq)
        seq.kv_key = self.rotary_rule.kv_key(seq)
        self.blocks.match_prefix(seq)
        self.num_recomputes += 1

    def _preempt(self, seq: Sequence) -> None:
        seq.draft_tokens = []
        self.blocks.free_sequence(seq)
        self._release_adapter(seq)
        seq.status = SequenceStatus.WAITING
        seq.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.push_front([seq])

    def finish(self, seq: Sequence, reason: str) -> None:
        """Mark `seq` finished with `reason`, drop it from the queues and free its blocks."""
        if seq.status is SequenceStatus.RUNNING:
            self.running.remove(seq)
        elif seq.status is SequenceStatus.WAITING and seq in self.waiting:
            self.waiting.remove(seq)
        self.blocks.free_sequence(seq)
        self._release_adapter(seq)
        seq.status = SequenceStatus.FINISHED
        seq.finish_reason = reason
