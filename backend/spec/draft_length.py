"""Per request: the draft length rule (docs/speculative-decoding.md, "Draft length per request")."""

from __future__ import annotations

from dataclasses import dataclass

WINDOW = 8
TURN_OFF_BELOW = 0.1
TURN_DOWN_BELOW = 0.3
TURN_UP_FROM = 0.7
RETRY_AFTER = 32


@dataclass
class AdaptiveDraftLength:
    """The draft length a request uses now (`k`; 0: off)."""

    max_k: int
    k: int = -1
    drafted: int = 0  # in the current window
    accepted: int = 0
    steps: int = 0
    off_steps: int = 0
    retry_after: int = RETRY_AFTER  # plain decode steps before the next retry while off
    retrying: bool = False  # k is 1 because a retry turned speculation back on

    def __post_init__(self) -> None:
        if self.k < 0:
            self.k = self.max_k

    def current(self) -> int:
        """The draft length for this decode step (0: decode plainly). Counts the steps spent off."""
        if self.k == 0:
            self.off_steps += 1
            if self.off_steps > self.retry_after:
                self._set(1)
                self.retrying = True
        return self.k

    def record(self, drafted: int, accepted: int) -> None:
        self.drafted += drafted
        self.accepted += accepted
        self.steps += 1
        if self.steps < WINDOW:
            return
        rate = self.accepted / self.drafted if self.drafted else 0.0
        if rate < TURN_DOWN_BELOW:
            k = 0 if rate < TURN_OFF_BELOW else self.k // 2
            if k == 0 and self.retrying:  # a retry that did not pay: wait longer for the next one
                self.retry_after *= 2
            self._set(k)
            return
        self.retrying = False
        if rate >= TURN_UP_FROM:
            self.retry_after = RETRY_AFTER
        self._set(min(self.k + 1, self.max_k) if rate >= TURN_UP_FROM else self.k)

    def _set(self, k: int) -> None:
        self.k, self.drafted, self.accepted, self.steps, self.off_steps = k, 0, 0, 0, 0
