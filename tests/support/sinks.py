"""Tiny random checkpoints written with transformers (llama, mistral, qwen2), with the default model's tokenizer."""

from __future__ import annotations

import math
import threading
import time

from tritium.backend.outputs import RequestOutput
from tritium.backend.serving.jobs import ErrorKind


class RecordingSink:
    """Collects what the loop sends for one job (the loop's side of Triton's response sender)."""

    def __init__(self, fail_on_output: bool = False) -> None:
        self.outputs: list[RequestOutput] = []
        self.errors: list[tuple[str, ErrorKind]] = []
        self.done = threading.Event()
        self.fail_on_output = fail_on_output
        self.first_at = self.done_at = math.inf  # when the first and the final response came (monotonic)

    def send_output(self, output: RequestOutput) -> None:
        if self.fail_on_output:
            raise RuntimeError("cannot format this one")
        self.outputs.append(output)
        self.first_at = min(self.first_at, time.monotonic())
        if output.finished:
            self.done_at = time.monotonic()
            self.done.set()

    def send_error(self, message: str, kind: ErrorKind = ErrorKind.INTERNAL) -> None:
        self.errors.append((message, kind))
        self.first_at = min(self.first_at, time.monotonic())
        self.done_at = time.monotonic()
        self.done.set()

    def is_cancelled(self) -> bool:
        return False
