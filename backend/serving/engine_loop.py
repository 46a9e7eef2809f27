"""The threads behind a Triton model instance.

`execute()` (Triton's thread) only parses and calls `submit`, which refuses at once when the engine has
failed or too many requests wait (admission control). A tokenizer thread turns prompt text into token ids,
so that a large prompt never stalls running streams. The engine thread owns the engine: it admits jobs,
polls cancellation, steps, and hands every output to the job's sink.

Every job ends with exactly one final delivery: its last output or an error. What fails for one request
(parsing, tokenizing, admission, formatting its output) fails only that request. An exception that escapes
the engine thread itself leaves the engine in an unknown state: every queued and running job gets an
error, and so does every later request, at once, until the model is reloaded.
"""

from __future__ import annotations

import enum
import logging
import os
import sys
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
from tritium.backend.serving.settings import DEFAULT_MAX_PENDING_REQUESTS
from tritium.backend.tokenizer import TOKENIZER_NICE

logger = logging.getLogger(__name__)
IDLE_WAIT_S = 0.5
CANCEL_POLL_S = 0.1  # is_cancelled() is a round trip to the server: ask at most this often


class ErrorKind(enum.Enum):
    """What a final error means to the client (Triton maps them to gRPC / HTTP status codes)."""

    INVALID = "invalid"  # the request's own fault: INVALID_ARG
    OVERLOADED = "overloaded"  # refused, retry later: UNAVAILABLE (the message starts "overloaded:")
    UNAVAILABLE = "unavailable"  # the model is not serving: UNAVAILABLE
    INTERNAL = "internal"  # failed while generating: INTERNAL
    # Triton's HTTP generate endpoints answer every model error with 400, and a gRPC stream carries only the
    # message: the code reaches gRPC unary-style clients only.


class ResponseSink(Protocol):
    """Where a job's results go. `send_output` with a finished output and `send_error` are final."""

    def send_output(self, output: RequestOutput) -> None: ...
    def send_error(self, message: str, kind: ErrorKind = ErrorKind.INTERNAL) -> None: ...
    def is_cancelled(self) -> bool: ...


class LoopObserver(Protocol):
    """Metrics hooks, called on the engine thread (`on_refused` on the caller of `submit`)."""

    def on_output(self, job: Job, output: RequestOutput, now: float) -> None: ...
    def on_step(self, engine: LLMEngine, now: float, force: bool = False) -> None: ...
    def on_refused(self) -> None: ...
    def on_engine_failed(self) -> None: ...


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
    def __init__(self, engine: LLMEngine, observer: LoopObserver | None = None,
                 max_pending_requests: int = DEFAULT_MAX_PENDING_REQUESTS) -> None:
        self.engine = engine
        self.observer = observer
        self.max_pending_requests = max_pending_requests
        self.failed = False
        self._to_tokenize: deque[Job] = deque()
        self._tokenizing = 0
        self._queue: deque[Job] = deque()
        self._admitting: deque[Job] = deque()  # taken from the queue by the engine thread, not yet admitted
        self._active: dict[str, Job] = {}
        self._cond = threading.Condition()
        self._stopping = False
        self._last_cancel_poll = 0.0
        self._trim_heap = heap_trimmer()
        self._thread = threading.Thread(target=self._run, name="tritium-engine", daemon=True)
        self._tokenizer_thread = threading.Thread(target=self._tokenize_loop, name="tritium-tokenize", daemon=True)

    def start(self) -> None:
        self._thread.start()
        self._tokenizer_thread.start()

    @property
    def num_pending(self) -> int:
        """Requests accepted that will not find a seat (`max_num_seqs`) at the next step: all that are being
        tokenized, queued, admitted or in the engine, less the seats."""
        accepted = len(self._to_tokenize) + self._tokenizing + len(self._queue) + len(self._admitting)
        return max(0, accepted + len(self._active) - self.engine.config.max_num_seqs)

    def submit(self, job: Job) -> None:
        """Accept a job (any thread), or answer it at once with an error: the engine failed, the model is
        shutting down, or `max_pending_requests` requests already wait (overloaded)."""
        refusal: tuple[str, ErrorKind] | None = None
        with self._cond:
            if self.failed:
                refusal = ("the engine stopped after an internal error; this model is not serving until it "
                           "is reloaded", ErrorKind.UNAVAILABLE)
            elif self._stopping:
                refusal = ("the model is shutting down", ErrorKind.UNAVAILABLE)
            elif self.num_pending >= self.max_pending_requests:
                refusal = (f"overloaded: {self.num_pending} requests are already waiting (max_pending_requests "
                           f"{self.max_pending_requests}); retry later", ErrorKind.OVERLOADED)
            elif job.prompt_token_ids is None:
                self._to_tokenize.append(job)
            else:
                self._queue.append(job)
            self._cond.notify_all()
        if refusal is not None:
            if refusal[1] is ErrorKind.OVERLOADED:
                self._observe(self.observer.on_refused if self.observer else None)
            self._fail(job, *refusal)

    def stop(self, timeout: float = 30.0) -> None:
        """Stop the threads; every queued or running job gets a final error response."""
        with self._cond:
            self._stopping = True
            self._cond.notify_all()
        for thread in (self._thread, self._tokenizer_thread):
            if thread.ident is not None:  # started
                thread.join(timeout)
        for job in self._take_all():
            self._fail(job, "the model is shutting down", ErrorKind.UNAVAILABLE)

    def _take_all(self) -> list[Job]:
        with self._cond:
            jobs = [*self._to_tokenize, *self._queue, *self._admitting, *self._active.values()]
            self._to_tokenize.clear()
            self._queue.clear()
            self._admitting.clear()
            self._active.clear()
        return jobs

    def _tokenize_loop(self) -> None:
        tokenizer, max_len = self.engine.tokenizer, self.engine.max_model_len
        try:  # Linux: a thread's own nice value (raising it needs no privilege)
            os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), TOKENIZER_NICE)
        except (OSError, AttributeError):
            logger.warning("could not lower the tokenizer thread's priority")
        while True:
            with self._cond:
                while not self._stopping and not self.failed and not self._to_tokenize:
                    self._cond.wait(IDLE_WAIT_S)
                if self._stopping or self.failed:
                    return
                job = self._to_tokenize.popleft()
                self._tokenizing = 1
            try:
                if not job.prompt:
                    raise ValueError("prompt must not be empty")
                tokenizer.check_can_fit(job.prompt, max_len)
                ids = tokenizer.encode(job.prompt)
                self.engine.check_request(ids, job.params)  # a hopeless prompt never reaches the engine thread
                job.prompt_token_ids = ids
            except ValueError as exc:
                self._fail(job, f"invalid request: {exc}", ErrorKind.INVALID)
            except Exception:
                logger.exception("tokenizing request %s failed", job.request_id)
                self._fail(job, "internal error while tokenizing the prompt", ErrorKind.INTERNAL)
            with self._cond:
                self._tokenizing = 0
                if job.prompt_token_ids is not None:
                    self._queue.append(job)
                    self._cond.notify_all()

    def _run(self) -> None:
        try:
            self._serve()
        except BaseException as exc:  # the engine's state is unknown now: stop serving, loudly
            self._engine_failed(exc)

    def _serve(self) -> None:
        while True:
            if not self._queue and not self._active:  # going idle: final metric values, free heap pages
                self._observe(self.observer.on_step if self.observer else None, self.engine, time.monotonic(), True)
                self._trim_heap()
            with self._cond:
                while not self._stopping and not self._queue and not self._active:
                    self._cond.wait(IDLE_WAIT_S)
                if self._stopping:
                    return
                self._admitting.extend(self._queue)
                self._queue.clear()
            self.engine.faults.check_loop(job.prompt for job in self._admitting)
            self._admit()
            self._poll_cancellations()
            self._step()

    def _engine_failed(self, exc: BaseException) -> None:
        logger.critical("the engine thread failed; every request is refused until the model is reloaded",
                        exc_info=exc)
        print(f"tritium: FATAL: the engine thread failed ({type(exc).__name__}: {exc}); this model refuses "
              "every request until it is reloaded", file=sys.stderr, flush=True)
        with self._cond:
            self.failed = True
            self._cond.notify_all()
        self._observe(self.observer.on_engine_failed if self.observer else None)
        for job in self._take_all():
            self._fail(job, "the engine stopped after an internal error; this model is not serving until it is "
                       "reloaded", ErrorKind.UNAVAILABLE)

    def _admit(self) -> None:
        while self._admitting:
            job = self._admitting.popleft()
            try:
                self.engine.add_request(job.request_id, job.prompt, job.params, job.prompt_token_ids)
            except ValueError as exc:
                self._fail(job, f"invalid request: {exc}", ErrorKind.INVALID)
                continue
            except Exception:
                logger.exception("admitting request %s failed", job.request_id)
                self._fail(job, "internal error while admitting the request", ErrorKind.INTERNAL)
                continue
            self._active[job.request_id] = job

    def _poll_cancellations(self) -> None:
        now = time.monotonic()
        if now - self._last_cancel_poll < CANCEL_POLL_S:
            return
        self._last_cancel_poll = now
        for job in list(self._active.values()):
            expired = job.deadline is not None and now > job.deadline
            try:
                cancelled = expired or job.sink.is_cancelled()
            except Exception:  # the server cannot tell: the client is as good as gone
                logger.exception("is_cancelled() failed for %s", job.request_id)
                cancelled = True
            if cancelled:
                self.engine.abort(job.request_id)

    def _step(self) -> None:
        if self.engine.has_unfinished_requests():
            outputs = self.engine.step()
            now = time.monotonic()
            for out in outputs:
                job = self._active.get(out.request_id)
                if job is not None:
                    self._deliver(job, out, now)
            self._observe(self.observer.on_step if self.observer else None, self.engine, now)

    def _deliver(self, job: Job, out: RequestOutput, now: float) -> None:
        self._observe(self.observer.on_output if self.observer else None, job, out, now)
        if out.finished:
            del self._active[out.request_id]
            if out.finish_reason == "error":
                self._fail(job, out.error or "model step failed", ErrorKind.INTERNAL)
                return
        elif not (out.delta_text or out.delta_token_ids):
            return
        try:
            job.sink.send_output(out)
        except Exception:  # formatting this request's response failed: end it alone
            logger.exception("sending the output of %s failed", job.request_id)
            if not out.finished:
                del self._active[out.request_id]
                self.engine.abort(out.request_id)
            self._fail(job, "internal error while formatting the response", ErrorKind.INTERNAL)

    @staticmethod
    def _observe(hook: Callable[..., None] | None, *args: object) -> None:
        """Metrics must never break serving."""
        if hook is None:
            return
        try:
            hook(*args)
        except Exception:
            logger.exception("metrics hook failed")

    def _fail(self, job: Job, message: str, kind: ErrorKind) -> None:
        """Send the job's final error; the request id lets an operator find the details in the log."""
        try:
            job.sink.send_error(f"{message} (request id {job.request_id})", kind)
        except Exception:
            logger.exception("could not send the error response for %s", job.request_id)
