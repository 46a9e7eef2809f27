"""A settable clock for what takes one (`clock: Callable[[], float]`): its time moves only when a test moves it."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class Clock:
    """Reads `now`, which a test sets or advances."""

    now: float = 0.0

    def __call__(self) -> float:
        return self.now
