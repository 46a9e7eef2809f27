"""A test-only fault: with $TRITIUM_TEST_FAULT_MARKER set, a model step whose batch holds a prompt
containing that text raises, as a crashing kernel would. Unset (as in production) it does nothing."""

from __future__ import annotations

import logging
import os
from collections.abc import Iterable

from tritium.backend.sequence import Sequence

FAULT_MARKER_ENV = "TRITIUM_TEST_FAULT_MARKER"
logger = logging.getLogger(__name__)


class InjectedFault(RuntimeError):
    pass


class FaultInjector:
    def __init__(self, marker: str | None) -> None:
        self.marker = marker or None
        if self.marker:
            logger.warning("fault injection is on: steps with a prompt containing %r will fail", self.marker)

    @classmethod
    def from_env(cls) -> FaultInjector:
        return cls(os.environ.get(FAULT_MARKER_ENV))

    def check(self, batch: Iterable[Sequence]) -> None:
        """Raises InjectedFault when a sequence of the batch carries the marker."""
        if self.marker and any(self.marker in (seq.prompt or "") for seq in batch):
            raise InjectedFault(f"injected fault (${FAULT_MARKER_ENV})")
