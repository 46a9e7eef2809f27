"""Every decode bucket warms up and is captured on one stream, into one graph memory pool.

CUDA cannot run here, so GraphCapture gets a stand-in for the torch.cuda namespace that records which
stream each call ran on; the capture code itself is the engine's.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import AbstractContextManager, contextmanager
from dataclasses import dataclass, field

import torch

from tritium.backend.worker.decode_graphs import DecodeGraphs, GraphCapture, graph_buckets


@dataclass
class FakeStream:
    number: int

    def wait_stream(self, other: FakeStream) -> None:
        pass


@dataclass
class FakeGraph:
    replays: int = 0

    def replay(self) -> None:
        self.replays += 1


@dataclass
class FakeCuda:
    """The calls of torch.cuda that GraphCapture makes, recording what ran on which stream."""

    streams: list[FakeStream] = field(default_factory=list)
    pools: list[object] = field(default_factory=list)
    current: FakeStream = field(default_factory=lambda: FakeStream(0))
    log: list[tuple[str, int, object]] = field(default_factory=list)  # (what, stream number, pool)

    def Stream(self, device: torch.device) -> FakeStream:
        self.streams.append(FakeStream(len(self.streams) + 1))
        return self.streams[-1]

    def graph_pool_handle(self) -> object:
        self.pools.append(object())
        return self.pools[-1]

    def current_stream(self, device: torch.device) -> FakeStream:
        return self.current

    def synchronize(self, device: torch.device) -> None:
        pass

    def CUDAGraph(self) -> FakeGraph:
        return FakeGraph()

    def stream(self, stream: FakeStream) -> AbstractContextManager[None]:
        return self._on(stream, "warm-up", None)

    def graph(self, graph: FakeGraph, pool: object, stream: FakeStream) -> AbstractContextManager[None]:
        return self._on(stream, "capture", pool)

    @contextmanager
    def _on(self, stream: FakeStream, what: str, pool: object) -> Iterator[None]:
        """`stream` is current inside; logs what ran on it (and into which pool)."""
        before, self.current = self.current, stream
        self.log.append((what, stream.number, pool))
        try:
            yield
        finally:
            self.current = before


def test_every_bucket_captures_on_one_stream_into_one_pool() -> None:
    cuda = FakeCuda()
    buckets = graph_buckets(64)  # 1, 2, 4, 8, ..., 64: eleven graphs
    graphs = DecodeGraphs(buckets, torch.device("cpu"), GraphCapture(torch.device("cpu"), cuda))
    ran_on: list[int] = []

    def forward(bucket: int) -> torch.Tensor:
        ran_on.append(cuda.current.number)
        return torch.full((bucket,), float(bucket))

    for bucket in sorted(buckets, reverse=True):
        graphs.capture(bucket, lambda b=bucket: forward(b))
    assert len(cuda.streams) == 1 and len(cuda.pools) == 1
    assert [what for what, _, _ in cuda.log] == ["warm-up", "capture"] * len(buckets)
    assert {number for _, number, _ in cuda.log} == {1} and set(ran_on) == {1}  # never the default stream (0)
    assert {id(pool) for what, _, pool in cuda.log if what == "capture"} == {id(cuda.pools[0])}
    # A step replays its bucket's graph and reads the output the capture wrote.
    out = graphs.run(8, lambda: torch.zeros(1))
    assert torch.equal(out, torch.full((8,), 8.0))


def test_a_cpu_captures_nothing() -> None:
    graphs = DecodeGraphs([1, 2], torch.device("cpu"))
    calls: list[int] = []

    def forward() -> torch.Tensor:
        calls.append(2)
        return torch.zeros(2)

    graphs.capture(2, forward)
    assert calls == [2]
    assert graphs.run(2, lambda: torch.ones(2)).tolist() == [1.0, 1.0]  # eager: the forward itself


def test_verification_shapes_pad_to_a_bucket_and_a_width_within_the_token_budget() -> None:
    graphs = DecodeGraphs([1, 2, 4], torch.device("cpu"), widths=[2, 3], max_tokens=10)
    assert graphs.verify_shapes() == [(4, 2), (2, 2), (2, 3), (1, 2), (1, 3)]  # 4 x 3 = 12 rows: over 10
    assert graphs.verify_shape_for(3, 2) == (4, 2) and graphs.verify_shape_for(2, 3) == (2, 3)
    assert graphs.verify_shape_for(3, 3) is None and graphs.verify_shape_for(1, 4) is None
    assert graphs.verify_shape_for(5, 2) is None  # no bucket holds 5 rows
    assert graphs.largest_tokens == 8  # the graph pool is sized for the largest graph's rows
    assert DecodeGraphs([], torch.device("cpu"), widths=[2, 3], max_tokens=10).verify_shapes() == []
