"""Continuous batching: which sequences run this step, and how many tokens each.

Every step has a token budget (`max_num_batched_tokens`). Running sequences go first (decodes
and unfinished prefill chunks), then waiting ones are admitted while seats (`max_num_seqs`),
budget and blocks last; a prompt longer than the remaining budget is split into chunks across
steps. When a running sequence needs a block and none is free, the newest running sequence is
preempted: its blocks are freed and it is recomputed later (its prefix may still be cached).

A sequence on a LoRA adapter is admitted only once its adapter has a device slot (`LoraManager.acquire`);
until then it waits and the sequences behind it may go first. It holds the slot while it runs (preempted or
finished: released), so a resident adapter in use is never evicted.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from tritium.backend.core.block_manager import BlockManager
from tritium.backend.core.sequence import Sequence, SequenceStatus
from tritium.backend.core.stop_checker import StopChecker
from tritium.backend.lora.manager import LoraManager


@dataclass
class ScheduledSequence:
    seq: Sequence
    num_new_tokens: int

    @property
    def samples(self) -> bool:
        """Whether this step reaches the end of the sequence's tokens, so a token is sampled."""
        return self.seq.num_computed_tokens + self.num_new_tokens == self.seq.num_tokens


@dataclass
class SchedulerOutput:
    scheduled: list[ScheduledSequence] = field(default_factory=list)
    preempted: list[Sequence] = field(default_factory=list)
    sampling: list[Sequence] = field(default_factory=list)  # the scheduled sequences that sample a token

    @property
    def num_tokens(self) -> int:
        """Tokens this step runs through the model."""
        return sum(s.num_new_tokens for s in self.scheduled)


class Scheduler:
    def __init__(
        self,
        block_manager: BlockManager,
        max_num_seqs: int,
        max_num_batched_tokens: int,
        enable_chunked_prefill: bool = True,
        stop_checker: StopChecker | None = None,
        lora: LoraManager | None = None,
    ) -> None:
        self.blocks = block_manager
        self.stop_checker = stop_checker or StopChecker([])
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.enable_chunked_prefill = enable_chunked_prefill
        self.lora = lora
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.num_preemptions = 0

    def add(self, seq: Sequence) -> None:
        """Queue `seq` behind the waiting ones."""
        self.waiting.append(seq)

    def has_unfinished(self) -> bool:
        """Whether a sequence waits or runs."""
        return bool(self.waiting or self.running)

    def schedule(self) -> SchedulerOutput:
        """This step's sequences and their new tokens (blocks allocated), running ones first, and the
        sequences preempted to make room; nothing scheduled when nothing can run."""
        out = SchedulerOutput()
        budget = self.max_num_batched_tokens
        i = 0
        while i < len(self.running) and budget > 0:
            seq = self.running[i]
            num_new = min(seq.num_tokens - seq.num_computed_tokens, budget)
            while not self.blocks.allocate(seq, num_new):
                victim = self.running.pop()
                self._preempt(victim)
                out.preempted.append(victim)
                if victim is seq:
                    break
            else:
                out.scheduled.append(ScheduledSequence(seq, num_new))
                budget -= num_new
                i += 1
                continue
            break
        if out.preempted:
            return self._with_sampling(out)
        no_slot: list[Sequence] = []  # waiting for an adapter slot: they keep their place in the queue
        while self.waiting and len(self.running) < self.max_num_seqs and budget > 0:
            seq = self.waiting[0]
            if not self._acquire_adapter(seq):
                no_slot.append(self.waiting.popleft())
                continue
            if seq.num_computed_tokens == 0:
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
            self.waiting.popleft()
            seq.status = SequenceStatus.RUNNING
            self.running.append(seq)
            out.scheduled.append(ScheduledSequence(seq, num_new))
            budget -= num_new
        self.waiting.extendleft(reversed(no_slot))
        return self._with_sampling(out)

    @staticmethod
    def _with_sampling(out: SchedulerOutput) -> SchedulerOutput:
        out.sampling = [s.seq for s in out.scheduled if s.samples]
        return out

    def update(self, out: SchedulerOutput, tokens: list[int | None]) -> None:
        """After the forward pass of `out`: count the computed tokens and commit the blocks they filled;
        append each sampled token (`tokens` is aligned with `out.sampling`; None: that sequence got no
        token, the engine ends it) and finish the sequences the stop checker stops."""
        for s in out.scheduled:
            s.seq.num_computed_tokens += s.num_new_tokens
            self.blocks.commit_full_blocks(s.seq)
        for seq, token in zip(out.sampling, tokens, strict=True):
            if token is None or seq.finished:
                continue
            seq.token_ids.append(token)
            reason = self.stop_checker.check(seq)
            if reason is not None:
                self.finish(seq, reason)

    def _acquire_adapter(self, seq: Sequence) -> bool:
        """Whether `seq` may run as far as its adapter goes: it has none, or its adapter got a slot."""
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

    def _preempt(self, seq: Sequence) -> None:
        self.blocks.free_sequence(seq)
        self._release_adapter(seq)
        seq.status = SequenceStatus.WAITING
        seq.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(seq)

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
