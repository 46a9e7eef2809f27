"""How many tokens a streamed response carries: one while sending keeps up, more when it does not
(docs/architecture.md#threads, "Streaming pace")."""

from __future__ import annotations

from dataclasses import dataclass, field

BUSY_HIGH, BUSY_LOW = 0.5, 0.2
ADJUST_EVERY_S = 0.25


@dataclass
class StreamPacer:
    min_interval: int = 1
    max_interval: int = 16
    interval: int = field(init=False)
    _busy_s: float = field(default=0.0, init=False)
    _window_start: float | None = field(default=None, init=False)

    def __post_init__(self) -> None:
        if self.min_interval < 1:
            raise ValueError(f"stream_interval must be >= 1, got {self.min_interval}")
        if self.max_interval < self.min_interval:
            raise ValueError(f"max_stream_interval ({self.max_interval}) must be >= stream_interval "
                             f"({self.min_interval})")
        self.interval = self.min_interval

    def record(self, send_s: float, now: float) -> None:
        """Account `send_s` seconds spent sending, at `now` (the loop's clock); adjusts `interval`."""
        if self._window_start is None:
            self._window_start = now
        self._busy_s += send_s
        elapsed = now - self._window_start
        if elapsed < ADJUST_EVERY_S:
            return
        share = self._busy_s / elapsed
        if share > BUSY_HIGH:
            self.interval = min(self.max_interval, self.interval * 2)
        elif share < BUSY_LOW:
            self.interval = max(self.min_interval, self.interval // 2)
        self._busy_s, self._window_start = 0.0, now
