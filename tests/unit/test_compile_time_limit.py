"""The grammar compile's time limit counts the compile's CPU time: a compile starved of CPU on a busy host is
not refused for the host's load, one that used its limit is, and the wall-clock cap answers every request.
The wall clock is a settable one and the CPU used is what each test says: the outcome never hangs on the
host's pace."""

from __future__ import annotations

import threading
from dataclasses import dataclass, field

from tritium.backend.structured_output.compiler import MAX_WAIT_FACTOR, CompileStats, TimedCallback
from tritium.backend.structured_output.constraint import StructuredOutput

from support.clock import Clock
from support.serving import wait_for

SPEC = StructuredOutput.from_value({"regex": "[a-z]+"})
LIMIT_S = 10.0  # no timer fires while a test checks by hand
CAP_S = MAX_WAIT_FACTOR * LIMIT_S


@dataclass
class Compile:
    """A compile as its time limit sees it: the CPU it has used (None: not started yet, waiting for a thread),
    how often that was read, and the answers its request got."""

    cpu_s: float | None = None
    reads: int = 0
    answers: list[str | None] = field(default_factory=list)
    answered: threading.Event = field(default_factory=threading.Event)
    stats: CompileStats = field(default_factory=CompileStats)

    def cpu_used(self) -> float | None:
        self.reads += 1
        return self.cpu_s

    def answer(self, matcher: object, error: str | None) -> None:
        self.answers.append(error)
        self.answered.set()

    def timed(self, clock: Clock, limit_s: float = LIMIT_S) -> TimedCallback:
        return TimedCallback(limit_s, SPEC, self.answer, self.stats, self.cpu_used, clock)


def test_a_compile_that_used_its_cpu_limit_is_refused_at_the_limit() -> None:
    compile_, clock = Compile(), Clock()  # the wall clock stands still: only the CPU used can reach the limit
    timed = compile_.timed(clock)
    for cpu_s in (None, 0.0, LIMIT_S - 0.01):
        compile_.cpu_s = cpu_s
        assert not timed.check()
    assert compile_.answers == [] and compile_.stats.timeouts == 0
    compile_.cpu_s = LIMIT_S
    assert timed.check()
    assert compile_.answers == ["structured_output.regex did not compile within 10 s; simplify it"]
    assert timed.check() and compile_.stats.timeouts == 1  # refused once
    timed.answer(None, "compiled late")  # the compile ends after: its request has had its answer
    assert len(compile_.answers) == 1


def test_a_starved_compile_is_not_refused_before_the_wall_clock_cap() -> None:
    compile_, clock = Compile(cpu_s=0.001), Clock()  # on a busy host: barely any CPU yet
    timed = compile_.timed(clock)
    clock.now = CAP_S - 0.01
    assert not timed.check()
    timed.answer(None, "compiled late")  # the compile finishes: its answer is the one the request gets
    clock.now = CAP_S
    assert timed.check()
    assert compile_.answers == ["compiled late"] and compile_.stats.timeouts == 0


def test_the_wall_clock_cap_answers_a_compile_that_never_gets_the_cpu() -> None:
    compile_, clock = Compile(cpu_s=None), Clock(now=100.0)  # still waiting for a compile thread
    timed = compile_.timed(clock)
    clock.now = 100.0 + CAP_S - 0.01
    assert not timed.check() and compile_.answers == []
    clock.now = 100.0 + CAP_S
    assert timed.check()
    assert compile_.answers[0] is not None and "did not compile" in compile_.answers[0]
    assert compile_.stats.timeouts == 1


def test_the_timer_checks_at_the_limit_and_again_until_answered() -> None:
    compile_, clock = Compile(cpu_s=None), Clock()
    compile_.timed(clock, limit_s=0.05)
    # The timer's first check: not started, not past the cap; it reads the CPU used again to rearm.
    assert wait_for(lambda: compile_.reads >= 2, 60, 0.01)
    assert compile_.answers == [] and compile_.stats.timeouts == 0
    compile_.cpu_s = 0.05
    assert compile_.answered.wait(60)  # a later check, by the timer alone
    assert compile_.answers[0] is not None and "did not compile within 0.05 s" in compile_.answers[0]
    assert compile_.stats.timeouts == 1
