"""Test-only faults, installed only when one of their variables is set (docs/operating.md#crashes)."""

from __future__ import annotations

import logging
import os
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from tritium.backend.engine import LLMEngine

FAULT_MARKER_ENV = "TRITIUM_TEST_FAULT_MARKER"
LOOP_FAULT_MARKER_ENV = "TRITIUM_TEST_LOOP_FAULT_MARKER"
logger = logging.getLogger(__name__)


class InjectedFault(RuntimeError):
    pass


def _carries(marker: str, prompts: Iterable[str | None]) -> bool:
    return any(marker in (p or "") for p in prompts)


@dataclass(frozen=True)
class FaultInjector:
    marker: str | None = None  # a model step holding a prompt with it raises, as a crashing kernel would
    loop_marker: str | None = None  # `LLMEngine.step` raises while such a prompt is in the engine (a scheduler bug)

    @classmethod
    def from_env(cls) -> FaultInjector | None:
        """None when neither variable is set."""
        marker, loop_marker = os.environ.get(FAULT_MARKER_ENV) or None, os.environ.get(LOOP_FAULT_MARKER_ENV) or None
        return cls(marker, loop_marker) if marker or loop_marker else None

    def install(self, engine: LLMEngine) -> None:
        if self.marker:
            logger.warning("fault injection is on: steps with a prompt containing %r will fail", self.marker)
            engine.worker.forward = self._guard(  # type: ignore[method-assign]
                engine.worker.forward, self.marker, FAULT_MARKER_ENV,
                                                lambda batch, *_: (s.seq.prompt for s in batch.scheduled))
        if self.loop_marker:
            logger.warning("fault injection is on: a prompt containing %r stops the engine", self.loop_marker)
            engine.step = self._guard(engine.step, self.loop_marker, LOOP_FAULT_MARKER_ENV,  # type: ignore[method-assign]
                                      lambda: (s.prompt for s in engine.requests.values()))

    @staticmethod
    def _guard(call: Callable[..., Any], marker: str, env: str,
               prompts: Callable[..., Iterable[str | None]]) -> Callable[..., Any]:
        def guarded(*args: Any) -> Any:
            if _carries(marker, prompts(*args)):
                raise InjectedFault(f"injected fault (${env})")
            return call(*args)
        return guarded


def install_from_env(engine: LLMEngine) -> None:
    """Install the faults the environment asks for, if any (the served models call this once at start)."""
    faults = FaultInjector.from_env()
    if faults is not None:
        faults.install(engine)
