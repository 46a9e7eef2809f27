"""The engine thread behind a Triton model instance.

`execute()` (Triton's thread) only validates and calls `submit`; this thread owns the engine: it admits
queued jobs, polls cancellation, steps, and hands every output to the job's sink. Each job ends with
exactly one final delivery: its last output, an error, or the shutdown error from `stop()`.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Protocol

from tritium.backend.config import RequestOutput
from tritium.backend.engine import LLMEngine
from tritium.backend.sampling_params import SamplingParams
from tritium.backend.serving.heap import heap_trimmer

logger = logging.getLogger(__name__)
IDLE_WAIT_S = 0.5
CANCEL_POLL_S = 0.1  # is_cancelled() is a round trip to the server: ask at most this often


class ResponseSink(Protocol):
    """Where a job's results go. `send_output` with a finished output and `send_error` are final."""

    def send_output(self, output: RequestOutput) -> None: ...
    def send_error(self, message: str) -> None: ...
    def is_cancelled(self) -> bool: ...


class LoopObserver(Protocol):
    """Metrics hooks, called on the engine thread."""

    def on_output(self, job: Job, output: RequestOutput, now: float) -> None: ...
    def on_step(self, engine: LLMEngine, now: float, force: bool = False) -> None: ...


@dataclass(eq=False)
class Job:
    request_id: str
    params: SamplingParams
    sink: ResponseSink
    prompt: str | None = None
    prompt_token_ids: list[int] | None = None
    deadline: float | None = None  # time.monotonic() after which the request is aborted
    arrival: float = field(default_factory=time.monotonic)
    first_token_at: float | None = None
    last_token_at: float | None = None


class EngineLoop:
    def __init__(self, engine: LLMEngine, observer: LoopObserver | None = None) -> None:
        self.engine = engine
        self.observer = observer
        self._queue: deque[Job] = deque()
        self._active: dict[str, Job] = {}
        self._cond = threading.Condition()
        self._stopping = False
        self._last_cancel_poll = 0.0
        self._trim_heap = heap_trimmer()
        self._thread = threading.Thread(target=self._run, name="tritium-engine", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def submit(self, job: Job) -> None:
        """Queue a job (any thread). After stop() it is answered with an error at once."""
        with self._cond:
            if self._stopping:
                job.sink.send_error("the model is shutting down")
                return
            self._queue.append(job)
            self._cond.notify()

    def stop(self, timeout: float = 30.0) -> None:
        """Stop the thread; every queued or running job gets a final error response."""
        with self._cond:
            self._stopping = True
            self._cond.notify()
        self._thread.join(timeout)
        with self._cond:
            pending = list(self._queue) + list(self._active.values())
            self._queue.clear()
            self._active.clear()
        for job in pending:
            self._fail(job, "the model is shutting down")

    def _run(self) -> None:
        while True:
            if not self._queue and not self._active:  # going idle: final metric values, free heap pages
                self._observe(self.observer.on_step if self.observer else None, self.engine, time.monotonic(), True)
                self._trim_heap()
            with self._cond:
                while not self._stopping and not self._queue and not self._active:
                    self._cond.wait(IDLE_WAIT_S)
                if self._stopping:
                    return
                new_jobs = list(self._queue)
                self._queue.clear()
            try:
                self._admit(new_jobs)
                self._poll_cancellations()
                self._step()
            except Exception:  # never let the thread die: fail what is running and go on
                logger.exception("engine loop iteration failed")
                for job in list(self._active.values()):
                    self.engine.abort(job.request_id)
                    self._fail(job, "internal error in the engine loop")
                self._active.clear()
                self.engine.step()  # flush the abort outputs

    def _admit(self, jobs: list[Job]) -> None:
        for job in jobs:
            try:
                self.engine.add_request(job.request_id, job.prompt, job.params, job.prompt_token_ids)
            except ValueError as exc:
                self._fail(job, f"invalid request: {exc}")
                continue
            self._active[job.request_id] = job

    def _poll_cancellations(self) -> None:
        now = time.monotonic()
        if now - self._last_cancel_poll < CANCEL_POLL_S:
            return
        self._last_cancel_poll = now
        for job in list(self._active.values()):
            expired = job.deadline is not None and now > job.deadline
            if expired or job.sink.is_cancelled():
                self.engine.abort(job.request_id)

    def _step(self) -> None:
        if not self.engine.has_unfinished_requests():
            return
        outputs = self.engine.step()
        now = time.monotonic()
        for out in outputs:
            job = self._active.get(out.request_id)
            if job is None:
                continue
            self._observe(self.observer.on_output if self.observer else None, job, out, now)
            if out.finished:
                del self._active[out.request_id]
                if out.finish_reason == "error":
                    job.sink.send_error(out.error or "model step failed")
                else:
                    job.sink.send_output(out)
            elif out.delta_text or out.delta_token_ids:
                job.sink.send_output(out)
        self._observe(self.observer.on_step if self.observer else None, self.engine, now)

    @staticmethod
    def _observe(hook: Callable[..., None] | None, *args: object) -> None:
        """Metrics must never break serving."""
        if hook is None:
            return
        try:
            hook(*args)
        except Exception:
            logger.exception("metrics hook failed")

    def _fail(self, job: Job, message: str) -> None:
        try:
            job.sink.send_error(message)
        except Exception:
            logger.exception("could not send the error response for %s", job.request_id)
