"""The scheduler's waiting queue: fcfs, or by priority (docs/architecture.md, "Priority"; docs/priority.md)."""

from __future__ import annotations

import bisect
from collections import deque
from collections.abc import Iterable, Iterator
from typing import Protocol

from tritium.backend.config import SCHEDULING_POLICIES
from tritium.backend.core.sequence import Sequence


def priority_key(seq: Sequence, aging_s: float) -> tuple[float, int]:
    """Smaller first: (virtual arrival, arrival counter)."""
    return seq.arrival_time + seq.priority * aging_s, seq.arrival


def outranks(seq: Sequence, other: Sequence, aging_s: float) -> bool:
    """Whether waiting `seq` may preempt running `other`: a strictly lower priority and an earlier virtual arrival."""
    return seq.priority < other.priority and priority_key(seq, aging_s) < priority_key(other, aging_s)


class WaitingQueue(Protocol):

    def add(self, seq: Sequence) -> None:
        """Queue a new request."""

    def push_front(self, seqs: Iterable[Sequence]) -> None:
        """Put back sequences taken from the head (preempted, or waiting for an adapter slot), in their order."""

    def peek(self) -> Sequence:
        """The sequence to admit next (the queue is not empty)."""

    def pop(self) -> Sequence:
        """Take the sequence `peek` returns."""

    def remove(self, seq: Sequence) -> None:
        """Drop `seq` (it is queued)."""

    def __len__(self) -> int: ...

    def __getitem__(self, index: int) -> Sequence: ...

    def __iter__(self) -> Iterator[Sequence]: ...

    def __contains__(self, seq: object) -> bool: ...


class FcfsQueue:
    """Arrival order; preempted sequences go back to the front."""

    def __init__(self) -> None:
        self._queue: deque[Sequence] = deque()

    def add(self, seq: Sequence) -> None:
        self._queue.append(seq)

    def push_front(self, seqs: Iterable[Sequence]) -> None:
        self._queue.extendleft(reversed(list(seqs)))

    def peek(self) -> Sequence:
        return self._queue[0]

    def pop(self) -> Sequence:
        return self._queue.popleft()

    def remove(self, seq: Sequence) -> None:
        self._queue.remove(seq)

    def __len__(self) -> int:
        return len(self._queue)

    def __getitem__(self, index: int) -> Sequence:
        return self._queue[index]

    def __iter__(self) -> Iterator[Sequence]:
        return iter(self._queue)

    def __contains__(self, seq: object) -> bool:
        return seq in self._queue


class PriorityQueue:
    """Sorted by `priority_key`, so a preempted sequence goes back to its own place."""

    def __init__(self, aging_s: float) -> None:
        if not aging_s > 0:
            raise ValueError(f"priority_aging_s must be > 0, got {aging_s}")
        self.aging_s = aging_s
        self._keys: list[tuple[float, int]] = []
        self._seqs: list[Sequence] = []

    def add(self, seq: Sequence) -> None:
        key = priority_key(seq, self.aging_s)
        i = bisect.bisect_right(self._keys, key)
        self._keys.insert(i, key)
        self._seqs.insert(i, seq)

    def push_front(self, seqs: Iterable[Sequence]) -> None:
        for seq in seqs:
            self.add(seq)

    def peek(self) -> Sequence:
        return self._seqs[0]

    def pop(self) -> Sequence:
        del self._keys[0]
        return self._seqs.pop(0)

    def remove(self, seq: Sequence) -> None:
        i = bisect.bisect_left(self._keys, priority_key(seq, self.aging_s))
        while self._seqs[i] is not seq:
            i += 1
        del self._keys[i]
        del self._seqs[i]

    def __len__(self) -> int:
        return len(self._seqs)

    def __getitem__(self, index: int) -> Sequence:
        return self._seqs[index]

    def __iter__(self) -> Iterator[Sequence]:
        return iter(self._seqs)

    def __contains__(self, seq: object) -> bool:
        return any(s is seq for s in self._seqs)


def make_waiting_queue(policy: str, aging_s: float) -> FcfsQueue | PriorityQueue:
    """The queue of scheduling `policy` ("fcfs" or "priority"). Raises ValueError naming the allowed values."""
    if policy == "fcfs":
        return FcfsQueue()
    if policy == "priority":
        return PriorityQueue(aging_s)
    raise ValueError(f"scheduling_policy must be one of {', '.join(SCHEDULING_POLICIES)}, got {policy!r}")
