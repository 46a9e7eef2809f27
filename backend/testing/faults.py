"""Test-only faults, off unless their environment variable is set (never in production):

- $TRITIUM_TEST_FAULT_MARKER: a model step whose batch holds a prompt containing that text raises, as a
  crashing kernel would (only that step's requests fail).
- $TRITIUM_TEST_LOOP_FAULT_MARKER: admitting a request whose prompt contains that text makes the engine
  loop itself fail, as a bug in the scheduler would (the engine stops serving).
"""

from __future__ import annotations

import logging
import os
from collections.abc import Iterable

FAULT_MARKER_ENV = "TRITIUM_TEST_FAULT_MARKER"
LOOP_FAULT_MARKER_ENV = "TRITIUM_TEST_LOOP_FAULT_MARKER"
logger = logging.getLogger(__name__)


class InjectedFault(RuntimeError):
    pass


class FaultInjector:
    def __init__(self, marker: str | None, loop_marker: str | None = None) -> None:
        self.marker = marker or None
        self.loop_marker = loop_marker or None
        if self.marker:
            logger.warning("fault injection is on: steps with a prompt containing %r will fail", self.marker)
        if self.loop_marker:
            logger.warning("fault injection is on: a prompt containing %r stops the engine", self.loop_marker)

    @classmethod
    def from_env(cls) -> FaultInjector:
        """The faults the environment asks for (none when neither variable is set)."""
        return cls(os.environ.get(FAULT_MARKER_ENV), os.environ.get(LOOP_FAULT_MARKER_ENV))

    def check(self, prompts: Iterable[str | None]) -> None:
        """Raises InjectedFault when one of a step's prompts carries the step marker."""
        if self.marker and any(self.marker in (p or "") for p in prompts):
            raise InjectedFault(f"injected fault (${FAULT_MARKER_ENV})")

    def check_loop(self, prompts: Iterable[str | None]) -> None:
        """Raises InjectedFault when one of the prompts being admitted carries the loop marker."""
        if self.loop_marker and any(self.loop_marker in (p or "") for p in prompts):
            raise InjectedFault(f"injected engine loop fault (${LOOP_FAULT_MARKER_ENV})")
