"""Decode steps as CUDA graphs, one per batch-size bucket, captured at start.

A decode step of n sequences runs padded to the smallest bucket >= n. Its inputs sit at fixed places of
the staging buffer for that bucket, so replaying the captured graph reads them. On a CPU nothing is
captured: `run` calls the same forward on the same padded buffers, which keeps that path tested without a
GPU.
"""

from __future__ import annotations

import bisect
from collections.abc import Callable

import torch

Forward = Callable[[], torch.Tensor]


def graph_buckets(max_num_seqs: int) -> list[int]:
    """1, 2, 4, then every multiple of 8 up to max_num_seqs (and max_num_seqs itself)."""
    buckets = {b for b in (1, 2, 4) if b <= max_num_seqs}
    buckets.update(range(8, max_num_seqs + 1, 8))
    buckets.add(max_num_seqs)
    return sorted(buckets)


def use_decode_graphs(device_type: str, attention_backend: str, enforce_eager: bool | None) -> tuple[bool, str]:
    """Whether decode steps run through the graph path, and why. `attention_backend` is the resolved name.

    Graphs are captured only where the forward can be: on CUDA with the triton backend. The torch backend
    (kernels/reference.py) synchronizes with the host inside the forward (boolean masks, `.max()` read on
    the host), which a CUDA graph capture refuses, so on CUDA it always runs eagerly, whatever
    `enforce_eager` says. On a CPU nothing is captured: enforce_eager=False runs the same padded static
    buffers eagerly (which keeps that path tested), None or True plain eager steps."""
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


class DecodeGraphs:
    def __init__(self, buckets: list[int], device: torch.device) -> None:
        self.buckets = sorted(buckets)
        self.device = device
        self._graphs: dict[int, tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        self._pool = torch.cuda.graph_pool_handle() if device.type == "cuda" and buckets else None

    def bucket_for(self, num_seqs: int) -> int | None:
        """The bucket a decode step of `num_seqs` sequences pads to; None: run it eagerly."""
        i = bisect.bisect_left(self.buckets, num_seqs)
        return self.buckets[i] if num_seqs and i < len(self.buckets) else None

    def capture(self, bucket: int, forward: Forward) -> None:
        """Run `forward` once (compiling every kernel it launches), then on CUDA capture it for `bucket`."""
        if self.device.type != "cuda":
            forward()
            return
        side = torch.cuda.Stream(self.device)  # warm up off the default stream, as capture will run (torch docs)
        side.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(side):
            forward()
        torch.cuda.current_stream(self.device).wait_stream(side)
        torch.cuda.synchronize(self.device)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self._pool):
            out = forward()
        self._graphs[bucket] = (graph, out)

    def run(self, bucket: int, forward: Forward) -> torch.Tensor:
        """The hidden states of the bucket's padded rows: a graph replay on CUDA, `forward()` elsewhere."""
        captured = self._graphs.get(bucket)
        if captured is None:
            return forward()
        graph, out = captured
        graph.replay()
        return out
