"""The threads behind a Triton model instance (docs/architecture.md: a request's path, threads, failure rules)."""

from __future__ import annotations

import logging
import os
import sys
import threading
import time
from collections import deque
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from functools import partial
from typing import Any

from tritium.backend.engine import LLMEngine
from tritium.backend.outputs import RequestOutput
from tritium.backend.serving.cancel_polls import CANCEL_MIN_INTERVAL_S, CancelPolls
from tritium.backend.serving.heap import heap_trimmer
from tritium.backend.serving.jobs import (
    ENGINE_FAILED,
    Delivery,
    EngineCall,
    ErrorKind,
    Job,
    LoopObserver,
    NoObserver,
    Stage,
    merge_outputs,
)
from tritium.backend.serving.settings import DEFAULT_MAX_PENDING_REQUESTS, DEFAULT_MAX_STREAM_INTERVAL
from tritium.backend.serving.stream_pacer import StreamPacer
from tritium.backend.tokenizer import TOKENIZER_NICE

logger = logging.getLogger(__name__)
IDLE_WAIT_S = 0.5
WAITING = (Stage.TOKENIZING, Stage.COMPILING, Stage.QUEUED)
IN_ENGINE = (Stage.RUNNING, Stage.ABORTING)
SHUTTING_DOWN = ("the model is shutting down", ErrorKind.UNAVAILABLE)


class EngineLoop:
    def __init__(self, engine: LLMEngine, observer: LoopObserver | None = None,
                 max_pending_requests: int = DEFAULT_MAX_PENDING_REQUESTS, stream_interval: int = 1,
                 max_stream_interval: int = DEFAULT_MAX_STREAM_INTERVAL,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.engine = engine
        self.observer: LoopObserver = observer or NoObserver()
        self.max_pending_requests = max_pending_requests
        self.pacer = StreamPacer(stream_interval, max_stream_interval)  # tokens per streamed response
        self.clock = clock  # arrivals, timeouts, cancellation polls and the pacer's windows
        self.failed = False
        self._stopping = False
        self._lock = threading.Lock()
        self._work = threading.Condition(self._lock)  # the tokenizer and engine threads wait on it
        self._sendable = threading.Condition(self._lock)  # the response thread waits on it
        self._jobs: dict[str, Job] = {}  # every job from submit to its final response, by request id
        # The work of a stage in arrival order, beside the jobs' stages (a job leaves these before it is answered):
        self._to_tokenize: deque[Job] = deque()
        self._to_admit: deque[Job] = deque()
        self._calls: deque[EngineCall] = deque()  # lora_admin actions, run between steps
        self._to_abort: set[str] = set()  # request ids, response thread -> engine thread
        self._outbox: dict[str, Delivery] = {}  # engine thread -> response thread, merged per request
        self._engine_done = False  # nothing more comes into the outbox
        self._polls = CancelPolls()
        self._trim_heap = heap_trimmer()
        self._engine_thread = threading.Thread(target=self._run, name="tritium-engine", daemon=True)
        self._tokenizer_thread = threading.Thread(target=self._tokenize_loop, name="tritium-tokenize", daemon=True)
        self._response_thread = threading.Thread(target=self._respond_loop, name="tritium-respond", daemon=True)

    def start(self) -> None:
        self._observe(self.observer.on_stream_interval, self.pacer.interval)
        self._engine_thread.start()
        self._tokenizer_thread.start()
        self._response_thread.start()

    @property
    def num_queued(self) -> int:
        """Requests accepted but not in the engine yet (being tokenized or compiled, or queued)."""
        with self._lock:
            return self._count(WAITING)

    @property
    def num_pending(self) -> int:
        """Requests accepted that will not find a seat (`max_num_seqs`) at the next step."""
        with self._lock:
            return self._pending()

    def submit(self, job: Job) -> None:
        """Accept a job (any thread), or answer it at once with an error: the engine failed, the model is
        shutting down, or `max_pending_requests` requests already wait (overloaded)."""
        job.arrival = self.clock()
        with self._lock:
            refusal = self._refusal()
            if refusal is None and (pending := self._pending()) >= self.max_pending_requests:
                refusal = (f"overloaded: {pending} requests are already waiting (max_pending_requests "
                           f"{self.max_pending_requests}); retry later", ErrorKind.OVERLOADED)
            elif refusal is None and job.request_id in self._jobs:
                refusal = ("invalid request: its request id is in use", ErrorKind.INVALID)
            elif refusal is None:
                self._jobs[job.request_id] = job
                needs_tokenizer = job.prompt_token_ids is None or job.params.structured_output is not None
                self._queue(job, Stage.TOKENIZING if needs_tokenizer else Stage.QUEUED)
        if refusal is not None:
            if refusal[1] is ErrorKind.OVERLOADED:
                self._observe(self.observer.on_refused)
            self._fail(job, *refusal)

    def submit_call(self, call: EngineCall) -> None:
        """Run `call` on the engine thread before its next step (any thread may submit), or answer it at once with
        an error when the engine failed or the model is shutting down."""
        with self._lock:
            refusal = self._refusal()
            if refusal is None:
                self._calls.append(call)
                self._work.notify_all()
        if refusal is not None:
            self._fail(call, *refusal)

    def stop(self, timeout: float = 30.0) -> None:
        """Stop the threads; every job and call not answered yet gets a final error."""
        with self._lock:
            self._stopping = True
            self._work.notify_all()
        for thread in (self._engine_thread, self._tokenizer_thread):
            if thread.ident is not None:  # started
                thread.join(timeout)
        self._close_outbox()
        if self._response_thread.ident is not None:  # it sends what the outbox holds first
            self._response_thread.join(timeout)
        with self._lock:
            self._outbox.clear()
            unanswered = self._take(lambda job: True)
        self._send_errors(unanswered, SHUTTING_DOWN)

    # Any thread (lock held where said).

    def _queue(self, job: Job, stage: Stage) -> None:
        """Lock held."""
        job.stage = stage
        (self._to_tokenize if stage is Stage.TOKENIZING else self._to_admit).append(job)
        self._work.notify_all()

    def _count(self, stages: tuple[Stage, ...]) -> int:
        """Lock held."""
        return sum(job.stage in stages for job in self._jobs.values())

    def _pending(self) -> int:
        """Accepted jobs beyond the engine's seats (lock held)."""
        return max(0, self._count(WAITING + IN_ENGINE) - self.engine.config.max_num_seqs)

    def _refusal(self) -> tuple[str, ErrorKind] | None:
        """Why no request can be taken now, or None (lock held)."""
        if self.failed:
            return ENGINE_FAILED
        if self._stopping:
            return SHUTTING_DOWN
        return None

    def _take(self, which: Callable[[Job], bool]) -> list[Job | EngineCall]:
        """Close the jobs `which` selects and every call, for the caller to answer (lock held)."""
        self._to_tokenize.clear()
        self._to_admit.clear()
        taken: list[Job | EngineCall] = [job for job in list(self._jobs.values()) if which(job) and self._close(job)]
        taken += [call for call in self._calls if self._close(call)]
        self._calls.clear()
        return taken

    def _close(self, job: Job | EngineCall) -> bool:
        """Mark `job` answered (lock held); False when it was already."""
        if job.closed:
            return False
        job.closed = True
        if isinstance(job, Job) and self._jobs.get(job.request_id) is job:
            del self._jobs[job.request_id]
        return True

    def _fail(self, job: Job | EngineCall, message: str, kind: ErrorKind) -> None:
        """Send the job's final error, once, whichever thread gets there first."""
        with self._lock:
            closed = self._close(job)
        if closed:
            self._send_errors([job], (message, kind))

    @staticmethod
    def _send_errors(jobs: list[Job | EngineCall], error: tuple[str, ErrorKind]) -> None:
        """Send closed jobs their error, with the request id (the log has the details under it)."""
        message, kind = error
        for job in jobs:
            try:
                job.sink.send_error(f"{message} (request id {job.request_id})", kind)
            except Exception:
                logger.exception("could not send the error response for %s", job.request_id)

    @contextmanager
    def _failing_alone(self, job: Job | EngineCall, doing: str) -> Iterator[None]:
        """Fail `job` alone with what the block raises: a ValueError is the request's fault (its message); anything
        else is logged and an internal error while `doing`."""
        try:
            yield
        except ValueError as exc:
            self._fail(job, f"invalid request: {exc}", ErrorKind.INVALID)
        except Exception:
            logger.exception("%s failed (request id %s)", doing, job.request_id)
            self._fail(job, f"internal error while {doing}", ErrorKind.INTERNAL)

    @staticmethod
    def _observe(hook: Callable[..., None], *args: object) -> None:
        """Metrics must never break serving."""
        try:
            hook(*args)
        except Exception:
            logger.exception("metrics hook failed")

    # The tokenizer thread.

    def _tokenize_loop(self) -> None:
        try:  # Linux: a thread's own nice value (raising it needs no privilege)
            os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), TOKENIZER_NICE)
        except (OSError, AttributeError):
            logger.warning("could not lower the tokenizer thread's priority")
        while True:
            with self._lock:
                while not self._stopping and not self.failed and not self._to_tokenize:
                    self._work.wait(IDLE_WAIT_S)
                if self._stopping or self.failed:
                    return
                job = self._to_tokenize.popleft()
            with self._failing_alone(job, "tokenizing the prompt"):  # a hopeless prompt never reaches the engine
                if job.prompt_token_ids is None:
                    job.prompt_token_ids = self.engine.tokenize(job.prompt or "")
                self.engine.check_request(job.prompt_token_ids, job.params)
            with self._lock:
                if job.closed:  # failed here, or answered meanwhile (the engine failed)
                    continue
                if job.params.structured_output is None:
                    self._queue(job, Stage.QUEUED)
                    continue
                job.stage = Stage.COMPILING
            with self._failing_alone(job, "compiling the structured output"):  # a large grammar delays no other
                self.engine.compile_structured_output(job.params, partial(self._compiled, job))

    def _compiled(self, job: Job, matcher: Any, error: str | None) -> None:
        """Queue the job with its `matcher`, or fail it with the compiler's `error`."""
        if matcher is None:
            self._fail(job, f"invalid request: {error}", ErrorKind.INVALID)
            return
        with self._lock:
            if not job.closed:
                job.matcher = matcher
                self._queue(job, Stage.QUEUED)

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
            if not self._to_admit and not self.engine.has_unfinished_requests():  # going idle: free heap pages
                self._trim_heap()
            with self._lock:
                while not (self._stopping or self._to_admit or self._calls or self.engine.has_unfinished_requests()):
                    self._work.wait(IDLE_WAIT_S)
                    self.engine.check_alive()  # a tensor-parallel rank lost while idle fails the engine now
                if self._stopping:
                    return
                admit, calls, aborts = list(self._to_admit), list(self._calls), self._to_abort
                self._to_admit.clear()
                self._calls.clear()
                self._to_abort = set()
            for call in calls:
                self._run_call(call)
            for job in admit:
                self._admit(job)
            for request_id in aborts:
                self.engine.abort(request_id)
            if self.engine.has_unfinished_requests():
                self._post(self.engine.step())

    def _run_call(self, call: EngineCall) -> None:
        text: str | None = None
        with self._failing_alone(call, "running the request"):
            text = call.run(self.engine)
        if text is None:
            return
        with self._lock:
            if not self._close(call):
                return
        try:
            call.sink.send_text(text)
        except Exception:
            logger.exception("could not send the response of %s", call.request_id)

    def _admit(self, job: Job) -> None:
        """A ValueError (e.g. an adapter unloaded since `execute`) fails the job alone."""
        admitted = False
        with self._failing_alone(job, "admitting the request"):
            self.engine.add_request(job.request_id, job.prompt, job.params, job.prompt_token_ids,
                                    matcher=job.matcher, lora_name=job.lora_name)
            admitted = True
        if not admitted:
            return
        with self._lock:
            job.stage = Stage.RUNNING
        if job.lora_name is not None:
            self._observe(self.observer.on_admitted, job)

    def _post(self, outputs: list[RequestOutput]) -> None:
        """Into the outbox, merged with what the response thread has not sent yet."""
        if not outputs:
            return
        with self._lock:
            for out in outputs:
                job = self._jobs.get(out.request_id)
                if job is None:  # answered already (its response could not be formatted)
                    continue
                if out.finished:
                    job.stage = Stage.DONE
                waiting = self._outbox.get(out.request_id)
                if waiting is None:
                    self._outbox[out.request_id] = Delivery(job, out)
                elif waiting.output is not None:
                    waiting.output = merge_outputs(waiting.output, out)
            self._sendable.notify_all()

    def _engine_failed(self, exc: BaseException) -> None:
        logger.critical("the engine thread failed; every request is refused until the model is reloaded",
                        exc_info=exc)
        print(f"tritium: FATAL: the engine thread failed ({type(exc).__name__}: {exc}); this model refuses "
              "every request until it is reloaded", file=sys.stderr, flush=True)
        with self._lock:
            self.failed = True
            self._work.notify_all()
        self._observe(self.observer.on_engine_failed)
        with self._lock:
            for job in self._jobs.values():
                if job.stage in IN_ENGINE:  # the response thread owns these jobs' senders: it sends their errors
                    job.stage = Stage.DONE
                    self._outbox[job.request_id] = Delivery(job, error=ENGINE_FAILED)
            waiting = self._take(lambda job: job.stage in WAITING)
            self._sendable.notify_all()
        self._send_errors(waiting, ENGINE_FAILED)

    def _close_outbox(self) -> None:
        with self._lock:
            self._engine_done = True
            self._sendable.notify_all()

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
        with self._lock:
            ready = self._take_ready()
            if not ready and not self._engine_done:  # also wakes to poll cancellations when idle
                self._sendable.wait(CANCEL_MIN_INTERVAL_S)
                ready = self._take_ready()
            done = self._engine_done and not self._outbox
        now = self.clock()
        for delivery in ready:
            self._deliver(delivery, now)
        sent = self.clock()
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
        """All but outputs with fewer new tokens than the pacer's interval that are neither a request's first nor
        its last (lock held)."""
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
        except Exception:  # formatting this request's response failed: end it alone
            logger.exception("sending the output of %s failed", job.request_id)
            if not out.finished:
                self._request_abort([job])
            self._fail(job, "internal error while formatting the response", ErrorKind.INTERNAL)
            return
        job.num_responses += 1
        if out.finished:
            with self._lock:
                self._close(job)

    def _poll_cancellations(self, now: float) -> None:
        """Abort expired jobs and those whose client is gone. Only running jobs are asked: never one whose final
        response went out (that crashes Triton)."""
        with self._lock:
            running = [job for job in self._jobs.values() if job.stage is Stage.RUNNING]
        expired = [job for job in running if job.expired(now)]
        live = [job for job in running if not job.expired(now)]
        cancelled = [job for job in self._polls.pick(live, now) if self._client_gone(job)]
        if expired or cancelled:
            self._request_abort(expired + cancelled)

    @staticmethod
    def _client_gone(job: Job) -> bool:
        try:
            return job.sink.is_cancelled()
        except Exception:  # the server cannot tell: the client is as good as gone
            logger.exception("is_cancelled() failed for %s", job.request_id)
            return True

    def _request_abort(self, jobs: list[Job]) -> None:
        """To the engine thread; their final outputs come back as usual."""
        with self._lock:
            for job in jobs:
                self._to_abort.add(job.request_id)
                if job.stage is Stage.RUNNING:
                    job.stage = Stage.ABORTING
            self._work.notify_all()
