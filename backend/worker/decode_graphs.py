"""Decode steps as CUDA graphs per batch-size bucket, with LoRA a second one each, and with speculative decoding
verification steps per bucket and width (1 + drafts per row) (docs/architecture.md, "The engine step", also why
mixed steps run eagerly, "LoRA" and "Speculative decoding"). On a CPU the same padded steps run uncaptured."""

from __future__ import annotations

import bisect
from collections.abc import Callable
from typing import Any

import torch

from tritium.backend.config import EngineConfig, SpeculativeConfig

Forward = Callable[[], torch.Tensor]


def graph_buckets(max_num_seqs: int) -> list[int]:
    """1, 2, 4, then every multiple of 8 up to max_num_seqs (and max_num_seqs itself)."""
    buckets = {b for b in (1, 2, 4) if b <= max_num_seqs}
    buckets.update(range(8, max_num_seqs + 1, 8))
    buckets.add(max_num_seqs)
    return sorted(buckets)


def verify_widths(num_speculative_tokens: int) -> list[int]:
    """The query widths of verification graphs: 2 (one draft) up to 1 + the most drafts a row may carry."""
    return list(range(2, num_speculative_tokens + 2))


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


GraphKey = tuple[int, int, bool]  # (bucket, width, lora): width 1 for decode steps


class DecodeGraphs:
    """The decode buckets and, on CUDA, their graphs (`capture` None: built for `device`). `widths`: the
    verification widths (verify_widths) captured per bucket whose padded rows (bucket x width) fit `max_tokens`."""

    def __init__(self, buckets: list[int], device: torch.device, capture: GraphCapture | None = None,
                 widths: list[int] | None = None, max_tokens: int = 0) -> None:
        self.buckets = sorted(buckets)
        self.device = device
        self.widths = sorted(widths or []) if buckets else []
        self.max_tokens = max_tokens
        self._graphs: dict[GraphKey, tuple[Callable[[], None], torch.Tensor]] = {}
        if capture is None and device.type == "cuda" and buckets:
            capture = GraphCapture(device)
        self._capture = capture

    def bucket_for(self, num_seqs: int) -> int | None:
        """The bucket a decode step of `num_seqs` sequences pads to; None: run it eagerly."""
        i = bisect.bisect_left(self.buckets, num_seqs)
        return self.buckets[i] if num_seqs and i < len(self.buckets) else None

    @property
    def largest_tokens(self) -> int:
        """Rows of the largest graph (the pool is as big as its forward pass): a bucket, or a bucket x width."""
        return max([*self.buckets, *(b * w for b, w in self.verify_shapes())], default=0)

    def verify_shapes(self) -> list[tuple[int, int]]:
        """Every (bucket, width) a verification step may pad to, largest buckets first."""
        return [(b, w) for b in reversed(self.buckets) for w in self.widths if b * w <= self.max_tokens]

    def verify_shape_for(self, num_seqs: int, width: int) -> tuple[int, int] | None:
        """The (bucket, width) a verification step of `num_seqs` rows of at most `width` tokens pads to; None: run
        it eagerly (no such width, or too many padded rows)."""
        bucket = self.bucket_for(num_seqs)
        i = bisect.bisect_left(self.widths, width)
        if bucket is None or i == len(self.widths) or bucket * self.widths[i] > self.max_tokens:
            return None
        return bucket, self.widths[i]

    def capture(self, bucket: int, forward: Forward, lora: bool = False, width: int = 1) -> None:
        """Run `forward` once (compiling its kernels), then capture it where graphs are captured."""
        if self._capture is None:
            forward()
            return
        self._graphs[(bucket, width, lora)] = self._capture.capture(forward)

    def captured(self) -> list[GraphKey]:
        return sorted(self._graphs)

    def run(self, bucket: int, forward: Forward, lora: bool = False, width: int = 1) -> torch.Tensor:
        """The hidden states of the bucket's padded rows: a replay where captured, else `forward()`."""
        captured = self._graphs.get((bucket, width, lora))
        if captured is None:
            return forward()
        replay, out = captured
        replay()
        return out


def engine_graphs(config: EngineConfig, buckets: list[int], device: torch.device) -> DecodeGraphs:
    """An engine's graphs: the decode `buckets` and, with speculative decoding, their verification widths up to the
    step token budget."""
    spec = SpeculativeConfig.parse(config.speculative_config)
    widths = verify_widths(spec.num_speculative_tokens) if spec is not None else []
    return DecodeGraphs(buckets, device, widths=widths, max_tokens=config.max_num_batched_tokens)
