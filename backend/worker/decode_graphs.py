"""Decode steps as CUDA graphs, one per batch-size bucket, captured at start.

A decode step of n sequences runs padded to the smallest bucket >= n. Its inputs sit at fixed places of
the staging buffer for that bucket, so replaying the captured graph reads them. On a CPU nothing is
captured: `run` calls the same forward on the same padded buffers, which keeps that path tested without a
GPU. Every bucket warms up and is captured on one side stream, into one graph memory pool (GraphCapture).

With LoRA on, each bucket has a second graph, captured with adapters (`lora=True`): its inputs also hold one
adapter slot per row (-1 for none), and it runs the per-row shrink / expand (lora/ops.py `add_lora_rows`,
kernels/lora.py) on every target module. The stacked adapter weights are fixed device buffers
(lora/weights.py), so a replay reads whatever was loaded into a slot after capture. Base-only steps replay
the base graph and pay nothing for LoRA.

Steps that mix decode rows with prefill chunks run eagerly, decode rows included. Running the decode rows
through their bucket's graph and the prefill rows eagerly would not save the eager launches: a forward pass
launches its ~330 kernels per layer op, not per row, so the prefill part alone launches as many as the whole
mixed step does now, plus the graph; every weight matrix would be read twice (the graph's GEMMs and the
prefill's); and the decode rows would have to be staged at their bucket's offsets apart from the prefill
rows. What would cut a mixed step's host time is capturing the forward pass around attention per token
count (piecewise graphs, as vLLM does). gpu-check's step timing (client/checks/engine.py) measures a mixed
step's host time, GPU time and launches next to a decode step's, which says what that would gain.
"""

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


class GraphCapture:
    """Captures decode graphs on CUDA: every bucket warms up and is captured on one side stream (each stream
    gets a cuBLAS workspace of its own, so a stream per bucket would cost a workspace per bucket) into one
    graph memory pool (the buckets run one at a time, so their intermediates can share it). `cuda` is the
    torch.cuda namespace; a test may pass a stand-in with the same calls to check the structure on a CPU."""

    def __init__(self, device: torch.device, cuda: Any = torch.cuda) -> None:
        self.device = device
        self.cuda = cuda
        self.stream = cuda.Stream(device)
        self.pool = cuda.graph_pool_handle()

    def capture(self, forward: Forward) -> tuple[Callable[[], None], torch.Tensor]:
        """Run `forward` once on the capture stream (compiling every kernel it launches and giving cuBLAS its
        workspace there), then capture it. Returns the graph's replay and the output tensor it writes."""
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
    """The decode buckets and, on CUDA, their captured graphs. `capture`: how graphs are captured (built for
    `device` when None; on a CPU nothing is captured)."""

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
        """Run `forward` once (compiling every kernel it launches), then, where graphs are captured, capture it
        for `bucket` (`lora`: as the bucket's graph with adapter rows)."""
        if self._capture is None:
            forward()
            return
        self._graphs[(bucket, lora)] = self._capture.capture(forward)

    def captured(self) -> list[tuple[int, bool]]:
        """The (bucket, lora) graphs captured, in order."""
        return sorted(self._graphs)

    def run(self, bucket: int, forward: Forward, lora: bool = False) -> torch.Tensor:
        """The hidden states of the bucket's padded rows: a graph replay on CUDA, `forward()` elsewhere
        (`lora`: the bucket's graph with adapter rows)."""
        captured = self._graphs.get((bucket, lora))
        if captured is None:
            return forward()
        replay, out = captured
        replay()
        return out
