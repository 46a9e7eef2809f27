"""Tiny random checkpoints written with transformers (llama, mistral, qwen2), with the default model's tokenizer."""

from __future__ import annotations

import math
import threading
import time
from collections.abc import Callable

from tritium.backend.outputs import RequestOutput
from tritium.backend.serving.jobs import ErrorKind


class RecordingSink:
    """Collects what the loop sends for one job (the loop's side of Triton's response sender)."""

    def __init__(self, fail_on_output: bool = False, clock: Callable[[], float] = time.monotonic) -> None:
        self.outputs: list[RequestOutput] = []
        self.errors: list[tuple[str, ErrorKind]] = []
        self.done = threading.Event()
        self.fail_on_output = fail_on_output
        self.clock = clock
        self.first_at = self.done_at = math.inf  # when the first and the final response came (`clock`)

    def send_output(self, output: RequestOutput) -> None:
        if self.fail_on_output:
            raise RuntimeError("cannot format this one")
        self.outputs.append(output)
        self.first_at = min(self.first_at, self.clock())
        if output.finished:
            self.done_at = self.clock()
            self.done.set()

    def send_error(self, message: str, kind: ErrorKind = ErrorKind.INTERNAL) -> None:
        self.errors.append((message, kind))
        self.first_at = min(self.first_at, self.clock())
        self.done_at = self.clock()
        self.done.set()

    def is_cancelled(self) -> bool:
        return False


class PolledSink(RecordingSink):
    """A sink whose client cancels when the test says (`cancelled`); records each is_cancelled() ask as
    (`clock` reading, answer)."""

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        super().__init__(clock=clock)
        self.cancelled = False
        self.asks: list[tuple[float, bool]] = []

    def is_cancelled(self) -> bool:
        self.asks.append((self.clock(), self.cancelled))
        return self.cancelled
