"""The scheduler's waiting queue and its order: first come first served, or by request priority.

`FcfsQueue` is a plain queue: new requests at the back, preempted ones at the front. `PriorityQueue`
orders by each request's virtual arrival, `arrival_time + priority * priority_aging_s`, then by arrival:
lower priorities run first, and a request's effective priority improves by one level per `priority_aging_s`
seconds since it arrived. As the order of two requests never changes while they wait, the queue is kept
sorted once, on insertion. A request of priority p is passed over only by requests whose virtual arrival is
earlier; so once it has waited (p - q) * priority_aging_s, no later request of priority q or worse passes it
(or preempts it): no request starves.
"""

from __future__ import annotations

import bisect
from collections import deque
from collections.abc import Iterable, Iterator
from typing import Protocol

from tritium.backend.config import SCHEDULING_POLICIES
from tritium.backend.core.sequence import Sequence


def priority_key(seq: Sequence, aging_s: float) -> tuple[float, int]:
    """The order of `seq` under the priority policy, smaller first: (virtual arrival, arrival counter)."""
    return seq.arrival_time + seq.priority * aging_s, seq.arrival


def outranks(seq: Sequence, other: Sequence, aging_s: float) -> bool:
    """Whether waiting `seq` may preempt running `other`: a strictly lower (better) priority and an earlier
    virtual arrival. Both are strict orders, so two sequences never preempt each other in turn."""
    return seq.priority < other.priority and priority_key(seq, aging_s) < priority_key(other, aging_s)


class WaitingQueue(Protocol):
    """What the scheduler asks of its waiting queue."""

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
        """Queue `seq` behind the others."""
        self._queue.append(seq)

    def push_front(self, seqs: Iterable[Sequence]) -> None:
        """Put `seqs` in front, in their order."""
        self._queue.extendleft(reversed(list(seqs)))

    def peek(self) -> Sequence:
        """The head."""
        return self._queue[0]

    def pop(self) -> Sequence:
        """Take the head."""
        return self._queue.popleft()

    def remove(self, seq: Sequence) -> None:
        """Drop `seq`."""
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
    """Sorted by `priority_key`: a preempted sequence goes back to its own place, ahead of everything that
    arrived after it with the same priority."""

    def __init__(self, aging_s: float) -> None:
        if not aging_s > 0:
            raise ValueError(f"priority_aging_s must be > 0, got {aging_s}")
        self.aging_s = aging_s
        self._keys: list[tuple[float, int]] = []
        self._seqs: list[Sequence] = []

    def add(self, seq: Sequence) -> None:
        """Insert `seq` at its place."""
        key = priority_key(seq, self.aging_s)
        i = bisect.bisect_right(self._keys, key)
        self._keys.insert(i, key)
        self._seqs.insert(i, seq)

    def push_front(self, seqs: Iterable[Sequence]) -> None:
        """Insert each of `seqs` at its place (their keys put them back where they were)."""
        for seq in seqs:
            self.add(seq)

    def peek(self) -> Sequence:
        """The sequence with the smallest key."""
        return self._seqs[0]

    def pop(self) -> Sequence:
        """Take the sequence with the smallest key."""
        del self._keys[0]
        return self._seqs.pop(0)

    def remove(self, seq: Sequence) -> None:
        """Drop `seq`."""
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
