"""A stand-in for the OpenAI endpoint's router in unit tests: canned model output, no tritonserver."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

from tritium.client.cluster.upstream import Chunk


class CannedUpstream:
    """Stands in for the router: answers every request with `pieces` (finish_reason "stop") and keeps what
    was sent."""

    def __init__(self) -> None:
        self.pieces: list[str] = ["Hello"]
        self.sent: list[tuple[str, dict[str, Any]]] = []

    async def generate(self, prompt: str, sampling: dict[str, Any], want_logprobs: bool = False
                       ) -> AsyncIterator[Chunk]:
        self.sent.append((prompt, sampling))
        for i, piece in enumerate(self.pieces):
            final = i == len(self.pieces) - 1
            yield Chunk(piece, final, "stop" if final else None, 7 if final else None,
                        len(self.pieces) if final else None)
