"""What the serving threads pass around, without the loop that runs them: sinks and metrics import this module,
never serving/engine_loop.py."""

from __future__ import annotations

import enum
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

from tritium.backend.outputs import RequestOutput
from tritium.backend.sampling_params import SamplingParams

if TYPE_CHECKING:
    from tritium.backend.engine import LLMEngine


class ErrorKind(enum.Enum):
    """What a final error means to the client (Triton maps them to gRPC / HTTP status codes)."""

    INVALID = "invalid"  # the request's own fault: INVALID_ARG
    OVERLOADED = "overloaded"  # refused, retry later: UNAVAILABLE (the message starts "overloaded:")
    UNAVAILABLE = "unavailable"  # the model is not serving: UNAVAILABLE
    INTERNAL = "internal"  # failed while generating: INTERNAL
    FORBIDDEN = "forbidden"  # lora_admin without the right admin_key: UNAVAILABLE (Triton has no PERMISSION_DENIED)
    # HTTP generate answers every model error with 400 (docs/operating.md#overload).


ENGINE_FAILED = ("the engine stopped after an internal error; this model is not serving until it is reloaded",
                 ErrorKind.UNAVAILABLE)


class ResponseSink(Protocol):
    """Where a job's results go. `send_output` with a finished output and `send_error` are final."""

    def send_output(self, output: RequestOutput) -> None:
        """Send what `output` adds (final when `output.finished`); may raise (that request alone then fails)."""

    def send_error(self, message: str, kind: ErrorKind = ErrorKind.INTERNAL) -> None: ...
    def is_cancelled(self) -> bool: ...


class LoopObserver(Protocol):
    """Metrics hooks: `on_admitted` and `on_engine_failed` are called on the engine thread, `on_refused` on the
    caller of `submit`, the others on the response thread. `now` is a reading of the loop's clock."""

    def on_output(self, job: Job, output: RequestOutput, now: float) -> None: ...
    def on_admitted(self, job: Job) -> None: ...
    def on_step(self, engine: LLMEngine, now: float, force: bool = False, queued: int = 0) -> None: ...
    def on_refused(self) -> None: ...
    def on_engine_failed(self) -> None: ...
    def on_stream_interval(self, interval: int) -> None: ...


class NoObserver:
    def on_output(self, job: Job, output: RequestOutput, now: float) -> None: ...
    def on_admitted(self, job: Job) -> None: ...
    def on_step(self, engine: LLMEngine, now: float, force: bool = False, queued: int = 0) -> None: ...
    def on_refused(self) -> None: ...
    def on_engine_failed(self) -> None: ...
    def on_stream_interval(self, interval: int) -> None: ...


class Stage(enum.Enum):
    """Where a submitted job is in the loop."""

    TOKENIZING = "tokenizing"  # waiting for the tokenizer thread, or in it
    COMPILING = "compiling"  # its structured output's grammar is being compiled
    QUEUED = "queued"  # waiting for the engine thread to admit it
    RUNNING = "running"  # in the engine; the response thread polls its cancellation
    ABORTING = "aborting"  # in the engine, cancelled or expired: the engine thread aborts it
    DONE = "done"  # out of the engine: its last output (or error) waits for the response thread


@dataclass(eq=False)
class Job:
    """One accepted request as the serving threads see it; times are readings of the loop's clock."""

    request_id: str
    params: SamplingParams
    sink: ResponseSink
    prompt: str | None = None
    prompt_token_ids: list[int] | None = None
    lora_name: str | None = None  # the LoRA adapter it runs on (None: the base model)
    timeout_s: float | None = None  # request_timeout_s: aborted when still running this long after `arrival`
    stage: Stage | None = None  # None until submitted
    arrival: float = 0.0  # when it was submitted
    first_token_at: float | None = None
    last_token_at: float | None = None
    next_cancel_check: float = 0.0  # is_cancelled() is not asked before (CancelPolls)
    matcher: Any = None  # its structured output's compiled matcher (llguidance), once compiled
    num_responses: int = 0  # responses sent (the response thread's)
    closed: bool = False  # its final response (or error) went out: nothing more is sent

    def expired(self, now: float) -> bool:
        return self.timeout_s is not None and now - self.arrival > self.timeout_s


class ReplySink(Protocol):
    """Where an EngineCall's one final response goes."""

    def send_text(self, text: str) -> None: ...
    def send_error(self, message: str, kind: ErrorKind = ErrorKind.INTERNAL) -> None: ...


@dataclass(eq=False)
class EngineCall:
    """Runs `run(engine)` on the engine thread between steps (a lora_admin action); answered with the text it
    returns, or its ValueError's message (the request's fault)."""

    request_id: str
    run: Callable[[LLMEngine], str]
    sink: ReplySink
    closed: bool = False


@dataclass(eq=False)
class Delivery:
    """What the response thread has to send for one job: an output (merged deltas) or a final error."""

    job: Job
    output: RequestOutput | None = None
    error: tuple[str, ErrorKind] | None = None


def merge_outputs(older: RequestOutput, newer: RequestOutput) -> RequestOutput:
    """`older` then `newer` as one output: deltas joined, the rest from `newer` (returned, updated in place)."""
    newer.delta_text = older.delta_text + newer.delta_text
    newer.delta_token_ids = older.delta_token_ids + newer.delta_token_ids
    if older.delta_logprobs is not None:
        newer.delta_logprobs = older.delta_logprobs + (newer.delta_logprobs or [])
    return newer
