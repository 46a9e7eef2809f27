"""An EngineLoop on a clock the test advances, its engine stepping once per tick of it: what the loop does
with time (cancellation polls, timeouts) is then a matter of counts, not of how fast a host runs."""

from __future__ import annotations

import threading
from types import TracebackType
from typing import Any

import pytest

from tritium.backend.engine import LLMEngine
from tritium.backend.outputs import RequestOutput
from tritium.backend.serving.engine_loop import EngineLoop
from tritium.backend.serving.jobs import Job, NoObserver


class FakeClock:
    """A clock that moves only when the test advances it (keep steps exact in binary, such as 1/32 s)."""

    def __init__(self, start: float = 100.0) -> None:
        self.now = start

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += seconds


class SweepObserver(NoObserver):
    """Tells when the response thread finished a sweep (sends, cancellation polls, metrics) that delivered
    outputs at a given reading of the clock."""

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._delivered_at: float | None = None
        self._swept_at: float | None = None

    def on_output(self, job: Job, output: RequestOutput, now: float) -> None:
        self._delivered_at = now

    def on_step(self, engine: LLMEngine, now: float, force: bool = False, queued: int = 0) -> None:
        if now == self._delivered_at:
            with self._cond:
                self._swept_at = now
                self._cond.notify_all()

    def wait_swept(self, at: float, timeout: float) -> bool:
        with self._cond:
            return self._cond.wait_for(lambda: self._swept_at == at, timeout)


class Lockstep:
    """`with Lockstep(engine, monkeypatch) as run:` an EngineLoop (`run.loop`) on `run.clock`, started; each
    `run.tick(dt)` advances the clock, lets the engine take one step and returns once the response thread has
    swept that step's outputs at the new time. Needs running requests (a step that outputs nothing never
    comes back). On leaving, what the stopped loop left in the engine is aborted: the next test finds it empty."""

    def __init__(self, engine: LLMEngine, monkeypatch: pytest.MonkeyPatch, clock: FakeClock | None = None,
                 **loop_args: Any) -> None:
        self.engine = engine
        self.clock = clock or FakeClock()
        self.observer = SweepObserver()
        self.loop = EngineLoop(engine, self.observer, clock=self.clock, **loop_args)
        self.ticks = 0
        self._steps = threading.Semaphore(0)
        self._free = False
        real_step = engine.step

        def step() -> list[RequestOutput]:
            if not self._free:
                self._steps.acquire()
            return real_step()

        monkeypatch.setattr(engine, "step", step)

    def __enter__(self) -> Lockstep:
        self.loop.start()
        return self

    def __exit__(self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None) -> None:
        self._free = True
        self._steps.release()
        self.loop.stop()
        for request_id in list(self.engine.requests):
            self.engine.abort(request_id)
        while self.engine.has_unfinished_requests():
            self.engine.step()

    def tick(self, dt: float) -> None:
        self.clock.advance(dt)
        self.ticks += 1
        self._steps.release()
        assert self.observer.wait_swept(self.clock.now, 60), f"no sweep delivered the outputs of step {self.ticks}"
