"""The threads behind a Triton model instance.

`execute()` (Triton's thread) only parses and calls `submit`, which refuses at once when the engine has
failed or too many requests wait (admission control). A tokenizer thread turns prompt text into token ids,
so that a large prompt never stalls running streams. The engine thread owns the engine: it admits jobs,
aborts what the response thread asks it to, steps, and puts the outputs in the outbox. The response thread
owns every call into the server for jobs the engine holds (sending, `is_cancelled`) and the metrics: each
sweep it takes the outbox and sends at most one response per request, merging what a request accumulated
while the previous sweep ran (adaptive coalescing: one response per token while it keeps up).

Every job ends with exactly one final delivery: its last output or an error. What fails for one request
(parsing, tokenizing, admission, formatting its output) fails only that request. An exception that escapes
the engine thread itself leaves the engine in an unknown state: every queued and running job gets an
error, and so does every later request, at once, until the model is reloaded.
"""

from __future__ import annotations

import logging
import os
import sys
import threading
import time
from collections import deque
from collections.abc import Callable
from functools import partial
from typing import Any

from tritium.backend.engine import LLMEngine
from tritium.backend.outputs import RequestOutput
from tritium.backend.serving.heap import heap_trimmer
from tritium.backend.serving.jobs import (
    ENGINE_FAILED,
    Delivery,
    EngineCall,
    ErrorKind,
    Job,
    LoopObserver,
    NoObserver,
    merge_outputs,
)
from tritium.backend.serving.settings import DEFAULT_MAX_PENDING_REQUESTS, DEFAULT_MAX_STREAM_INTERVAL
from tritium.backend.serving.stream_pacer import StreamPacer
from tritium.backend.tokenizer import TOKENIZER_NICE

logger = logging.getLogger(__name__)
IDLE_WAIT_S = 0.5
# is_cancelled() is a round trip to the server: at most this many per second, round robin over the requests,
# and no request more often than every CANCEL_MIN_INTERVAL_S.
CANCEL_CHECKS_PER_S = 50
CANCEL_MIN_INTERVAL_S = 0.1


class EngineLoop:
    def __init__(self, engine: LLMEngine, observer: LoopObserver | None = None,
                 max_pending_requests: int = DEFAULT_MAX_PENDING_REQUESTS, stream_interval: int = 1,
                 max_stream_interval: int = DEFAULT_MAX_STREAM_INTERVAL) -> None:
        self.engine = engine
        self.observer: LoopObserver = observer or NoObserver()
        self.max_pending_requests = max_pending_requests
        self.pacer = StreamPacer(stream_interval, max_stream_interval)  # tokens per streamed response
        self.failed = False
        self._to_tokenize: deque[Job] = deque()
        self._tokenizing: Job | None = None  # the job the tokenizer thread holds
        self._compiling: set[Job] = set()  # jobs whose structured output is being compiled
        self._queue: deque[Job] = deque()
        self._admitting: deque[Job] = deque()  # taken from the queue by the engine thread, not yet admitted
        self._active: dict[str, Job] = {}  # in the engine (the engine thread's)
        self._calls: deque[EngineCall] = deque()  # lora_admin actions for the engine thread to run between steps
        self._cond = threading.Condition()
        self._stopping = False
        # Engine thread -> response thread: deliveries by request id; response thread -> engine thread: aborts.
        self._outbox: dict[str, Delivery] = {}
        self._outbox_cond = threading.Condition()
        self._engine_done = False
        self._to_abort: set[str] = set()
        self._watched: dict[str, Job] = {}  # jobs whose cancellation the response thread polls
        self._fail_lock = threading.Lock()
        self._trim_heap = heap_trimmer()
        self._thread = threading.Thread(target=self._run, name="tritium-engine", daemon=True)
        self._tokenizer_thread = threading.Thread(target=self._tokenize_loop, name="tritium-tokenize", daemon=True)
        self._response_thread = threading.Thread(target=self._respond_loop, name="tritium-respond", daemon=True)

    def start(self) -> None:
        self._observe(self.observer.on_stream_interval, self.pacer.interval)
        self._thread.start()
        self._tokenizer_thread.start()
        self._response_thread.start()

    @property
    def num_pending(self) -> int:
        """Requests accepted that will not find a seat (`max_num_seqs`) at the next step: all that are being
        tokenized, compiled, queued, admitted or in the engine, less the seats."""
        return max(0, self.num_queued + len(self._active) - self.engine.config.max_num_seqs)

    @property
    def num_queued(self) -> int:
        """Requests accepted but not in the engine yet (being tokenized or compiled, queued or being
        admitted); read without the lock, so a moment's count."""
        return (len(self._to_tokenize) + (self._tokenizing is not None) + len(self._compiling) + len(self._queue)
                + len(self._admitting))

    def submit(self, job: Job) -> None:
        """Accept a job (any thread), or answer it at once with an error: the engine failed, the model is
        shutting down, or `max_pending_requests` requests already wait (overloaded)."""
        with self._cond:
            refusal = self._refusal()
            if refusal is None and self.num_pending >= self.max_pending_requests:
                refusal = (f"overloaded: {self.num_pending} requests are already waiting (max_pending_requests "
                           f"{self.max_pending_requests}); retry later", ErrorKind.OVERLOADED)
            elif refusal is None and (job.prompt_token_ids is None or job.params.structured_output is not None):
                self._to_tokenize.append(job)
            elif refusal is None:
                self._queue.append(job)
            self._cond.notify_all()
        if refusal is not None:
            if refusal[1] is ErrorKind.OVERLOADED:
                self._observe(self.observer.on_refused)
            self._fail(job, *refusal)

    def submit_call(self, call: EngineCall) -> None:
        """Run `call` on the engine thread before its next step (any thread may submit), or answer it at once with
        an error when the engine failed or the model is shutting down."""
        with self._cond:
            refusal = self._refusal()
            if refusal is None:
                self._calls.append(call)
                self._cond.notify_all()
        if refusal is not None:
            self._fail(call, *refusal)

    def stop(self, timeout: float = 30.0) -> None:
        """Stop the threads; every queued or running job gets a final error response."""
        with self._cond:
            self._stopping = True
            self._cond.notify_all()
        for thread in (self._thread, self._tokenizer_thread):
            if thread.ident is not None:  # started
                thread.join(timeout)
        self._close_outbox()
        if self._response_thread.ident is not None:
            self._response_thread.join(timeout)
        pending: list[Job | EngineCall] = [*self._take_all(), *self._take_calls()]
        for job in pending:
            self._fail(job, "the model is shutting down", ErrorKind.UNAVAILABLE)

    def _take_calls(self) -> list[EngineCall]:
        with self._cond:
            calls = list(self._calls)
            self._calls.clear()
        return calls

    def _take_waiting(self) -> list[Job]:
        """The jobs not in the engine yet (being tokenized or compiled, queued, being admitted), taken out of
        the loop. A job the tokenizer thread or a compile still holds is answered here all the same: whatever
        those threads do with it later finds it closed."""
        with self._cond:
            jobs = [*self._to_tokenize, *self._compiling, *self._queue, *self._admitting]
            if self._tokenizing is not None:
                jobs.append(self._tokenizing)
            self._to_tokenize.clear()
            self._compiling.clear()
            self._queue.clear()
            self._admitting.clear()
        return jobs

    def _take_all(self) -> list[Job]:
        jobs = self._take_waiting()
        with self._cond:
            jobs += self._active.values()
            self._active.clear()
        with self._outbox_cond:
            jobs += [d.job for d in self._outbox.values() if d.job not in jobs]
            self._outbox.clear()
        return jobs

    def _tokenize_loop(self) -> None:
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
                self._tokenizing = job
            compile_it = False
            try:
                ids = job.prompt_token_ids
                if ids is None:
                    ids = self.engine.tokenize(job.prompt or "")
                self.engine.check_request(ids, job.params)  # a hopeless prompt never reaches the engine thread
                job.prompt_token_ids = ids
                compile_it = job.params.structured_output is not None
            except ValueError as exc:
                self._fail(job, f"invalid request: {exc}", ErrorKind.INVALID)
            except Exception:
                logger.exception("tokenizing request %s failed", job.request_id)
                self._fail(job, "internal error while tokenizing the prompt", ErrorKind.INTERNAL)
            with self._cond:
                self._tokenizing = None
                if job.closed or job.prompt_token_ids is None:
                    continue
                refusal = self._refusal()
                if refusal is None and compile_it:
                    self._compiling.add(job)
                elif refusal is None:
                    self._enqueue(job)
            if refusal is not None:
                self._fail(job, *refusal)
            elif compile_it:  # on the compiler's threads: a large grammar delays no other request
                self.engine.compile_structured_output(job.params, partial(self._compiled, job))

    def _compiled(self, job: Job, matcher: Any, error: str | None) -> None:
        """A job's grammar is compiled (`matcher`) or cannot be (`error`): queue it or answer it."""
        with self._cond:
            if job not in self._compiling:  # the engine failed or the model stopped meanwhile: answered already
                return
            self._compiling.discard(job)
            if matcher is not None:
                job.matcher = matcher
                self._enqueue(job)
        if matcher is None:
            self._fail(job, f"invalid request: {error}", ErrorKind.INVALID)

    def _enqueue(self, job: Job) -> None:
        """Queue a job for the engine thread (lock held)."""
        self._queue.append(job)
        self._cond.notify_all()

    def _refusal(self) -> tuple[str, ErrorKind] | None:
        """Why a request cannot be taken now (lock held): the engine failed or the model is stopping."""
        if self.failed:
            return ENGINE_FAILED
        if self._stopping:
            return ("the model is shutting down", ErrorKind.UNAVAILABLE)
        return None

    # The engine thread.

    def _run(self) -> None:
        try:
            self._serve()
        except BaseException as exc:  # the engine's state is unknown now: stop serving, loudly
            self._engine_failed(exc)
        finally:
            self._close_outbox()

    def _serve(self) -> None:
        while True:
            if not self._queue and not self._active:  # going idle: free heap pages
                self._trim_heap()
            with self._cond:
                while not self._stopping and not self._queue and not self._active and not self._calls:
                    self._cond.wait(IDLE_WAIT_S)
                if self._stopping:
                    return
                self._admitting.extend(self._queue)
                self._queue.clear()
                calls = list(self._calls)
                self._calls.clear()
            for call in calls:
                self._run_call(call)
            self._admit()
            self._abort_requested()
            if self.engine.has_unfinished_requests():
                self._post(self.engine.step())

    def _engine_failed(self, exc: BaseException) -> None:
        logger.critical("the engine thread failed; every request is refused until the model is reloaded",
                        exc_info=exc)
        print(f"tritium: FATAL: the engine thread failed ({type(exc).__name__}: {exc}); this model refuses "
              "every request until it is reloaded", file=sys.stderr, flush=True)
        with self._cond:
            self.failed = True
            engine_jobs = list(self._active.values())
            self._active.clear()
            self._cond.notify_all()
        self._observe(self.observer.on_engine_failed)
        error = ENGINE_FAILED
        with self._outbox_cond:  # the response thread owns these jobs' senders: it sends their errors
            for job in engine_jobs:
                self._outbox[job.request_id] = Delivery(job, error=error)
            self._outbox_cond.notify_all()
        waiting: list[Job | EngineCall] = [*self._take_waiting(), *self._take_calls()]
        for pending in waiting:
            self._fail(pending, *error)

    def _run_call(self, call: EngineCall) -> None:
        """Run a call on the engine thread and answer it: its text, or its ValueError's message (the request's
        fault, e.g. an adapter that does not fit); anything else is logged and answered as an internal error."""
        try:
            text = call.run(self.engine)
        except ValueError as exc:
            self._fail(call, f"invalid request: {exc}", ErrorKind.INVALID)
            return
        except Exception:
            logger.exception("engine call %s failed", call.request_id)
            self._fail(call, "internal error while running the request", ErrorKind.INTERNAL)
            return
        with self._fail_lock:
            if call.closed:
                return
            call.closed = True
        try:
            call.sink.send_text(text)
        except Exception:
            logger.exception("could not send the response of %s", call.request_id)

    def _admit(self) -> None:
        admitted = []
        while self._admitting:
            job = self._admitting.popleft()
            try:
                self.engine.add_request(job.request_id, job.prompt, job.params, job.prompt_token_ids,
                                        matcher=job.matcher, lora_name=job.lora_name)
            except ValueError as exc:
                self._fail(job, f"invalid request: {exc}", ErrorKind.INVALID)
                continue
            except Exception:
                logger.exception("admitting request %s failed", job.request_id)
                self._fail(job, "internal error while admitting the request", ErrorKind.INTERNAL)
                continue
            self._active[job.request_id] = job
            admitted.append(job)
            if job.lora_name is not None:
                self._observe(self.observer.on_admitted, job)
        if admitted:
            with self._outbox_cond:
                for job in admitted:
                    self._watched[job.request_id] = job

    def _abort_requested(self) -> None:
        if not self._to_abort:
            return
        with self._outbox_cond:
            ids, self._to_abort = self._to_abort, set()
        for request_id in ids:
            self.engine.abort(request_id)

    def _post(self, outputs: list[RequestOutput]) -> None:
        """Hand a step's outputs to the response thread, merged with what it has not sent yet."""
        if not outputs:
            return
        active = self._active
        with self._outbox_cond:
            outbox = self._outbox
            for out in outputs:
                job = active.get(out.request_id)
                if job is None:
                    continue
                if out.finished:
                    del active[out.request_id]
                waiting = outbox.get(out.request_id)
                if waiting is None:
                    outbox[out.request_id] = Delivery(job, out)
                elif waiting.output is not None:
                    waiting.output = merge_outputs(waiting.output, out)
            self._outbox_cond.notify_all()

    def _close_outbox(self) -> None:
        with self._outbox_cond:
            self._engine_done = True
            self._outbox_cond.notify_all()

    # The response thread.

    def _respond_loop(self) -> None:
        busy = False
        while True:
            try:
                busy, done = self._sweep(busy)
            except Exception:  # never leave the running requests without a sender
                logger.exception("the response thread's sweep failed")
                busy, done = False, False
                time.sleep(CANCEL_MIN_INTERVAL_S)
            if done:
                return

    def _sweep(self, busy: bool) -> tuple[bool, bool]:
        """Send what is ready, poll cancellations, push metrics. Returns (sent something, all done)."""
        with self._outbox_cond:
            ready = self._take_ready()
            if not ready and not self._engine_done:  # also wakes to poll cancellations when idle
                self._outbox_cond.wait(CANCEL_MIN_INTERVAL_S)
                ready = self._take_ready()
            done = self._engine_done and not self._outbox
        now = time.monotonic()
        for delivery in ready:
            self._deliver(delivery, now)
        sent = time.monotonic()
        interval = self.pacer.interval
        self.pacer.record(sent - now, sent)
        if self.pacer.interval != interval:
            logger.info("streamed responses now carry up to %d tokens", self.pacer.interval)
            self._observe(self.observer.on_stream_interval, self.pacer.interval)
        self._poll_cancellations(now)
        if ready or busy:  # metrics while serving, and their final values once idle
            self._observe(self.observer.on_step, self.engine, now, not ready, self.num_queued)
        return bool(ready), done

    def _take_ready(self) -> list[Delivery]:
        """The deliveries to send now (outbox lock held): all but outputs that have fewer than the pacer's
        interval of new tokens and are neither a request's first nor its last."""
        interval = self.pacer.interval
        if interval == 1 or self._engine_done:
            ready = list(self._outbox.values())
            self._outbox.clear()
            return ready
        ready = []
        for request_id, d in list(self._outbox.items()):
            out = d.output
            if (out is None or out.finished or d.job.num_responses == 0
                    or len(out.delta_token_ids) >= interval):
                ready.append(d)
                del self._outbox[request_id]
        return ready

    def _deliver(self, delivery: Delivery, now: float) -> None:
        job, out = delivery.job, delivery.output
        if job.closed:
            return
        if out is None or out.finished:
            with self._outbox_cond:
                self._watched.pop(job.request_id, None)
        if delivery.error is not None:
            self._fail(job, *delivery.error)
            return
        assert out is not None
        self._observe(self.observer.on_output, job, out, now)
        if out.finished and out.finish_reason == "error":
            self._fail(job, out.error or "model step failed", ErrorKind.INTERNAL)
            return
        if not out.finished and not (out.delta_text or out.delta_token_ids):
            return
        try:
            job.sink.send_output(out)
            job.num_responses += 1
            job.closed = out.finished
        except Exception:  # formatting this request's response failed: end it alone
            logger.exception("sending the output of %s failed", job.request_id)
            if not out.finished:
                self._request_abort([job])
            self._fail(job, "internal error while formatting the response", ErrorKind.INTERNAL)

    def _poll_cancellations(self, now: float) -> None:
        """Ask the server whether clients cancelled, within CANCEL_CHECKS_PER_S; abort expired requests."""
        with self._outbox_cond:
            watched = list(self._watched.values())
        if not watched:
            return
        interval = max(CANCEL_MIN_INTERVAL_S, len(watched) / CANCEL_CHECKS_PER_S)
        cancelled = []
        for job in watched:
            if job.deadline is not None and now > job.deadline:
                cancelled.append(job)
                continue
            if now < job.next_cancel_check:
                continue
            job.next_cancel_check = now + interval
            try:
                if job.sink.is_cancelled():
                    cancelled.append(job)
            except Exception:  # the server cannot tell: the client is as good as gone
                logger.exception("is_cancelled() failed for %s", job.request_id)
                cancelled.append(job)
        if cancelled:
            self._request_abort(cancelled)

    def _request_abort(self, jobs: list[Job]) -> None:
        """Hand `jobs` to the engine thread to abort (their final outputs come back as usual); stop watching them."""
        with self._outbox_cond:
            for job in jobs:
                self._to_abort.add(job.request_id)
                self._watched.pop(job.request_id, None)
        with self._cond:
            self._cond.notify_all()

    @staticmethod
    def _observe(hook: Callable[..., None], *args: object) -> None:
        """Metrics must never break serving."""
        try:
            hook(*args)
        except Exception:
            logger.exception("metrics hook failed")

    def _fail(self, job: Job | EngineCall, message: str, kind: ErrorKind) -> None:
        """Send the job's final error (once, whichever thread gets there first); the request id lets an
        operator find the details in the log."""
        with self._fail_lock:
            if job.closed:
                return
            job.closed = True
        try:
            job.sink.send_error(f"{message} (request id {job.request_id})", kind)
        except Exception:
            logger.exception("could not send the error response for %s", job.request_id)
