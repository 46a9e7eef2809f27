"""The grammar compile's time limit counts the compile's CPU time: a compile starved of CPU on a busy host is
not refused for the host's load, one that used its limit is, and the wall-clock cap answers every request."""

from __future__ import annotations

import threading
import time

from tritium.backend.structured_output.compiler import MAX_WAIT_FACTOR, CompileStats, _once_within
from tritium.backend.structured_output.constraint import StructuredOutput

SPEC = StructuredOutput.from_value({"regex": "[a-z]+"})
LIMIT_S = 0.05


def _waiter(cpu_used: float | None) -> tuple[threading.Event, list[str | None], CompileStats, object]:
    done, errors, stats = threading.Event(), [], CompileStats()

    def answered(matcher: object, error: str | None) -> None:
        errors.append(error)
        done.set()

    once = _once_within(LIMIT_S, SPEC, answered, stats, lambda: cpu_used)
    return done, errors, stats, once


def test_a_compile_that_used_its_cpu_limit_is_refused_at_the_limit() -> None:
    started = time.monotonic()
    done, errors, stats, _ = _waiter(cpu_used=LIMIT_S)
    assert done.wait(5)
    assert time.monotonic() - started < MAX_WAIT_FACTOR * LIMIT_S
    assert errors[0] is not None and "did not compile within 0.05 s" in errors[0]
    assert stats.timeouts == 1


def test_a_starved_compile_is_not_refused_before_the_wall_clock_cap() -> None:
    done, errors, stats, once = _waiter(cpu_used=0.001)  # on a busy host: barely any CPU yet
    assert not done.wait(2 * LIMIT_S)
    once(None, "compiled late")  # the compile finishes: its answer is the one the request gets
    assert errors == ["compiled late"] and stats.timeouts == 0


def test_the_wall_clock_cap_answers_a_compile_that_never_gets_the_cpu() -> None:
    started = time.monotonic()
    done, errors, stats, _ = _waiter(cpu_used=None)  # still waiting for a compile thread
    assert done.wait(5)
    assert time.monotonic() - started >= MAX_WAIT_FACTOR * LIMIT_S * 0.99
    assert errors[0] is not None and "did not compile" in errors[0] and stats.timeouts == 1
