"""Decode steps as CUDA graphs per batch-size bucket, with LoRA a second one each (docs/architecture.md, "The
engine step", also why mixed steps run eagerly, and "LoRA"). On a CPU the same padded steps run uncaptured."""

from __future__ import annotations

import bisect
from collections.abc import Callable
from typing import Any

import torch

Forward = Callable[[], torch.Tensor]


def graph_buckets(max_num_seqs: int) -> list[int]:
    """1, 2, 4, then every multiple of 8 up to max_num_seqs (and max_num_seqs itself)."""
    buckets = {b for b in (1, 2, 4) if b <= max_num_seqs}
    buckets.update(range(8, max_num_seqs + 1, 8))
    buckets.add(max_num_seqs)
    return sorted(buckets)


def use_decode_graphs(device_type: str, attention_backend: str, enforce_eager: bool | None) -> tuple[bool, str]:
    """Whether decode steps take the graph path, and why (docs/serving.md, `enforce_eager`). On CUDA the torch
    attention backend synchronizes with the host inside the forward, which capture refuses."""
    if enforce_eager:
        return False, "enforce_eager=True"
    if device_type == "cuda":
        if attention_backend != "triton":
            return False, (f"the {attention_backend} attention backend synchronizes with the host, so its "
                           "forward cannot be captured in a CUDA graph")
        return True, "CUDA with the triton attention backend"
    if enforce_eager is False:
        return True, f"enforce_eager=False on {device_type} (padded buffers, run eagerly)"
    return False, f"no CUDA graphs on {device_type}"


class GraphCapture:
    """Every bucket on one side stream (each stream gets its own cuBLAS workspace) into one pool (buckets run one
    at a time). `cuda`: torch.cuda, or a test's stand-in."""

    def __init__(self, device: torch.device, cuda: Any = torch.cuda) -> None:
        self.device = device
        self.cuda = cuda
        self.stream = cuda.Stream(device)
        self.pool = cuda.graph_pool_handle()

    def capture(self, forward: Forward) -> tuple[Callable[[], None], torch.Tensor]:
        """Warm `forward` up on the capture stream, then capture it; returns the replay and the tensor it writes."""
        cuda, stream = self.cuda, self.stream
        stream.wait_stream(cuda.current_stream(self.device))  # warm up off the default stream (torch docs)
        with cuda.stream(stream):
            forward()
        cuda.current_stream(self.device).wait_stream(stream)
        cuda.synchronize(self.device)
        graph = cuda.CUDAGraph()
        with cuda.graph(graph, pool=self.pool, stream=stream):
            out = forward()
        return graph.replay, out


class DecodeGraphs:
    """The decode buckets and, on CUDA, their graphs (`capture` None: built for `device`)."""

    def __init__(self, buckets: list[int], device: torch.device, capture: GraphCapture | None = None) -> None:
        self.buckets = sorted(buckets)
        self.device = device
        self._graphs: dict[tuple[int, bool], tuple[Callable[[], None], torch.Tensor]] = {}  # (bucket, lora)
        if capture is None and device.type == "cuda" and buckets:
            capture = GraphCapture(device)
        self._capture = capture

    def bucket_for(self, num_seqs: int) -> int | None:
        """The bucket a decode step of `num_seqs` sequences pads to; None: run it eagerly."""
        i = bisect.bisect_left(self.buckets, num_seqs)
        return self.buckets[i] if num_seqs and i < len(self.buckets) else None

    def capture(self, bucket: int, forward: Forward, lora: bool = False) -> None:
        """Run `forward` once (compiling its kernels), then capture it where graphs are captured."""
        if self._capture is None:
            forward()
            return
        self._graphs[(bucket, lora)] = self._capture.capture(forward)

    def captured(self) -> list[tuple[int, bool]]:
        return sorted(self._graphs)

    def run(self, bucket: int, forward: Forward, lora: bool = False) -> torch.Tensor:
        """The hidden states of the bucket's padded rows: a replay where captured, else `forward()`."""
        captured = self._graphs.get((bucket, lora))
        if captured is None:
            return forward()
        replay, out = captured
        replay()
        return out
