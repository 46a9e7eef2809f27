"""Which running requests the response thread asks `is_cancelled()` in a sweep, within a budget
(docs/operating.md#cancellation-and-timeouts)."""

from __future__ import annotations

import heapq
from dataclasses import dataclass, field
from operator import attrgetter

from tritium.backend.serving.jobs import Job

CANCEL_CHECKS_PER_S = 50
CANCEL_MIN_INTERVAL_S = 0.1


@dataclass
class CancelPolls:
    """The ask budget of one response thread: `per_s` asks a second, at most one carried over (no idle burst)."""

    per_s: float = CANCEL_CHECKS_PER_S
    min_interval_s: float = CANCEL_MIN_INTERVAL_S
    _credit: float = field(default=1.0, init=False)  # asks earned and not made
    _last: float | None = field(default=None, init=False)  # the clock at the previous sweep

    def pick(self, jobs: list[Job], now: float) -> list[Job]:
        """The jobs to ask at `now`, least recently asked first; they count as asked. Call it every sweep, with
        no jobs too, or the time since the last call earns a burst of asks."""
        if self._last is not None:
            self._credit = min(self._credit, 1.0) + (now - self._last) * self.per_s
        self._last = now
        due = [job for job in jobs if job.next_cancel_check <= now]
        picked = heapq.nsmallest(int(self._credit), due, key=attrgetter("next_cancel_check"))  # ties: `jobs` order
        self._credit -= len(picked)
        for job in picked:
            job.next_cancel_check = now + self.min_interval_s
        return picked
