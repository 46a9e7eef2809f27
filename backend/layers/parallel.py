"""Tensor parallelism's collectives and vocabulary split (docs/architecture.md, "Tensor parallelism"): the ranks one
model is sharded over, the sum of row-parallel outputs, the logits gathered to rank 0."""

from __future__ import annotations

import datetime
import time
from dataclasses import dataclass, field
from typing import Protocol

import torch
import torch.distributed as dist
from torch import nn


class Collectives(Protocol):
    """What RankGroup calls of a c10d process group (ProcessGroupGloo, ProcessGroupNCCL)."""

    def allreduce(self, tensors: list[torch.Tensor], opts: dist.AllreduceOptions = ...) -> dist.Work: ...

    def gather(self, output_tensors: list[list[torch.Tensor]], input_tensors: list[torch.Tensor],
               opts: dist.GatherOptions = ...) -> dist.Work: ...


@dataclass
class CollectiveTime:
    """Collectives run and the seconds spent waiting in them (the rank protocol's cost, measured)."""

    calls: int = 0
    seconds: float = 0.0


@dataclass
class RankGroup:
    """This process's rank among `size`; `group` a torch.distributed process group (gloo or NCCL) built for this one
    model, None for one rank. `step_timeout_s`: how long a step's collectives wait for another rank (None: the
    group's own timeout). `timed`: wall time of each collective counted in `time` (synchronizes on CUDA)."""

    rank: int = 0
    size: int = 1
    group: Collectives | None = None
    step_timeout_s: float | None = None
    device: torch.device = field(default_factory=lambda: torch.device("cpu"))  # where the group's tensors live
    timed: bool = False
    time: CollectiveTime = field(default_factory=CollectiveTime)

    def __post_init__(self) -> None:
        self._sum = dist.AllreduceOptions()
        self._gather = dist.GatherOptions()
        self._gather.rootRank = 0
        if self.step_timeout_s is not None:
            self._sum.timeout = self._gather.timeout = datetime.timedelta(seconds=self.step_timeout_s)

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """`x` summed over the ranks, in place (contiguous `x`); `x` itself for one rank."""
        if self.group is None:
            return x
        start = time.perf_counter() if self.timed else 0.0
        self.group.allreduce([x], self._sum).wait()
        self._count(start, x)
        return x

    def gather_columns(self, x: torch.Tensor, width: int) -> torch.Tensor:
        """Rank 0: every rank's `x` `[rows, n]` side by side, cut to `width` columns; other ranks: `x`."""
        if self.group is None:
            return x
        start = time.perf_counter() if self.timed else 0.0
        x = x.contiguous()
        parts = [torch.empty_like(x) for _ in range(self.size)] if self.rank == 0 else []
        self.group.gather([parts] if parts else [], [x], self._gather).wait()
        self._count(start, x)
        return torch.cat(parts, dim=1)[:, :width] if parts else x

    def min_int(self, value: int) -> int:
        """The smallest of the ranks' `value`s (every rank gets it)."""
        return int(self._reduce(torch.tensor([value], dtype=torch.int64, device=self.device), dist.ReduceOp.MIN).item())

    def all_max(self, x: torch.Tensor) -> torch.Tensor:
        """The elementwise largest of the ranks' `x`, in place (contiguous `x`)."""
        return self._reduce(x, dist.ReduceOp.MAX)

    def _reduce(self, x: torch.Tensor, op: dist.ReduceOp.RedOpType) -> torch.Tensor:
        if self.group is not None:
            options = dist.AllreduceOptions()
            options.reduceOp = op  # type: ignore[assignment]  # the stub's enum types differ
            self.group.allreduce([x], options).wait()
        return x

    def _count(self, start: float, x: torch.Tensor) -> None:
        if self.timed:
            if x.is_cuda:
                torch.cuda.synchronize(x.device)
            self.time.calls += 1
            self.time.seconds += time.perf_counter() - start


def vocab_range(vocab_size: int, rank: int, size: int) -> tuple[int, int]:
    """(first token id, rows) of `rank`'s vocabulary part: `size` equal parts, the last padded past the vocabulary."""
    rows = -(-vocab_size // size)
    return rank * rows, rows


class VocabParallelEmbedding(nn.Embedding):
    """An embedding holding `group.rank`'s part of the vocabulary (vocab_range): ids outside it look up zeros, the
    ranks' rows summed. One rank: nn.Embedding."""

    def __init__(self, vocab_size: int, hidden_size: int, group: RankGroup) -> None:
        self.first, rows = vocab_range(vocab_size, group.rank, group.size)
        super().__init__(rows, hidden_size)
        self.ranks = group

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        if self.ranks.size == 1:
            return super().forward(input_ids)
        local = input_ids - self.first
        outside = (local < 0) | (local >= self.num_embeddings)
        hidden = super().forward(local.masked_fill(outside, 0))
        hidden.masked_fill_(outside.unsqueeze(-1), 0.0)
        return self.ranks.all_reduce(hidden)
